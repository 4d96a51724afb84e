from __future__ import annotations

import subprocess
import sys

from agent_rl.cli import main


def test_help_lists_real_subcommands(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "doctor" in out and "tiny-model" in out


def test_unknown_subcommand_is_an_error(capsys) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_console_script_runs_doctor() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "agent_rl.cli", "doctor"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "agent-rl doctor" in res.stdout
