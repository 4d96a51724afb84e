"""Checkpoints that resume exactly: model, optimiser, scheduler, every RNG, data position, step.

Why all of it: after `kill -9` a resumed CPU run must reproduce the same subsequent losses bit for
bit, which needs the sampler's and the data order's randomness restored, not just the weights.
Durability: files are written into a temporary folder and fsynced before it is renamed into place
(then the parent folder is fsynced), so a crash or power loss never leaves a checkpoint that looks
complete but is not. Re-saving a step moves the good copy aside until the new one is in place, never
deleting it first. Resuming takes the newest checkpoint that reads back and falls back to the one
before when the newest is unreadable.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, **state: Any) -> Path:
    """Save `state` (modules/optimisers via their state_dict, anything else as is) at `step`."""
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    payload = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}
    payload["rng"] = rng_state()
    payload["step"] = step
    with (tmp / STATE_FILE).open("wb") as f:
        torch.save(payload, f)
        _flush(f)
    with (tmp / "meta.json").open("w") as f:
        f.write(json.dumps({"step": step}))
        _flush(f)
    _fsync_dir(tmp)
    _move_into_place(tmp, final)
    return final


def _flush(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (a step saved again) is kept aside until then."""
    stale = final.with_name(f".stale_{final.name}")
    if final.exists():
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
    try:
        tmp.rename(final)
    except BaseException:
        if stale.exists() and not final.exists():
            stale.rename(final)  # the good copy goes back
        raise
    _fsync_dir(final.parent)
    shutil.rmtree(stale, ignore_errors=True)


def checkpoints(run_dir: Path) -> list[Path]:
    """Every complete-looking checkpoint of a run, oldest first."""
    return [p.parent for p in sorted((Path(run_dir) / "checkpoints").glob("step_*/" + STATE_FILE))]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def load_latest_checkpoint(run_dir: Path, **targets: Any) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint that reads back (see `load_checkpoint`); one that does not (a torn
    or corrupted file) is skipped with a warning and the one before it is used."""
    for path in reversed(checkpoints(run_dir)):
        try:
            payload = _read(path)
        except Exception as exc:  # torch.load raises many types for a damaged file
            log.warning(
                "checkpoint %s is unreadable (%s: %s); trying the one before", path, type(exc).__name__, exc
            )
            continue
        return path, _restore(payload, targets)
    return None


def load_checkpoint(path: Path, **targets: Any) -> dict[str, Any]:
    """Load into `targets` (objects with load_state_dict) and restore RNGs; return the rest."""
    return _restore(_read(path), targets)


def _read(path: Path) -> dict[str, Any]:
    payload = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or "rng" not in payload or "step" not in payload:
        raise ValueError(f"{path / STATE_FILE} is not a checkpoint written by save_checkpoint")
    return payload


def _restore(payload: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    for key, target in targets.items():
        target.load_state_dict(payload.pop(key))
    set_rng_state(payload.pop("rng"))
    return payload


def read_policy_weights(path: Path) -> dict[str, Any]:
    """Only the policy's weights from a checkpoint (evaluation needs no optimiser and no RNG state)."""
    payload = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    return payload["learner"]["model"]
