"""The metrics log survives a crash mid-append: a half-written last line never breaks a resume."""

from __future__ import annotations

from pathlib import Path

from agent_rl.metrics import MetricsLogger, read_metrics


def test_a_half_written_line_is_dropped_on_read_and_on_resume(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        logger.log(step, {"losses/loss": float(step)})
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "losses/lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]

    resumed = MetricsLogger(tmp_path, tensorboard=False)
    resumed.truncate_after(2)  # the checkpoint was at step 2
    resumed.log(3, {"losses/loss": 30.0})
    assert [(r["step"], r["losses/loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")
