"""The README's main job, exactly as shipped: configs/quickstart.yaml must learn on 2 CPU cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_config_learns(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "agent_rl.cli",
        "train",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        "--set",
        f"run.out_dir={tmp_path}",
        "--set",
        "run.progress=false",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "quickstart"
    summary = json.loads((run / "summary.json").read_text())
    before = summary["eval_before"]["eval/success_rate"]
    after = summary["eval_after"]["eval/success_rate"]
    # Measured on the CI machine type: 0.44 -> 0.88. The margin allows other CPUs' float noise.
    assert after >= before + 0.2, (before, after)
    assert after >= 0.6, after
    for plot in ("success.png", "tokens.png", "grad_norm.png"):
        assert (run / "plots" / plot).stat().st_size > 0
