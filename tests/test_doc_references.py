"""Every docs/ file that the code, the tests or the README points a reader to exists in the repo."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"\bdocs/[\w./-]+?\.md\b")


def test_referenced_docs_exist() -> None:
    sources = [
        ROOT / "README.md",
        *[p for d in ("agent_rl", "envs", "sandbox", "tests") for p in (ROOT / d).rglob("*.py")],
    ]
    referenced = {
        (ref, src.relative_to(ROOT)) for src in sources for ref in REFERENCE.findall(src.read_text())
    }
    assert any(ref == "docs/otb.md" for ref, _ in referenced)  # the OTB maths lives in the repo
    missing = sorted((ref, str(src)) for ref, src in referenced if not (ROOT / ref).is_file())
    assert missing == []
