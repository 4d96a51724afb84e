"""Checkpoints that resume exactly: model, optimiser, scheduler, every RNG, data position, step.

Why all of it: after `kill -9` a resumed CPU run must reproduce the same subsequent losses bit for
bit, which needs the sampler's and the data order's randomness restored, not just the weights.
Writes go to a temporary folder that is renamed into place, so a crash mid-save never leaves a
checkpoint that looks complete but is not.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"


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
    torch.save(payload, tmp / STATE_FILE)
    (tmp / "meta.json").write_text(json.dumps({"step": step}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((Path(run_dir) / "checkpoints").glob("step_*/" + STATE_FILE))
    return found[-1].parent if found else None


def load_checkpoint(path: Path, **targets: Any) -> dict[str, Any]:
    """Load into `targets` (objects with load_state_dict) and restore RNGs; return the rest."""
    payload = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    for key, target in targets.items():
        target.load_state_dict(payload.pop(key))
    set_rng_state(payload.pop("rng"))
    return payload
