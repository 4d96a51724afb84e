"""Durable checkpoints: fsynced before the rename, the good copy never deleted first, and a fallback
to the previous checkpoint when the newest does not read back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from agent_rl import checkpoint  # noqa: E402
from agent_rl.checkpoint import load_latest_checkpoint, save_checkpoint  # noqa: E402


class Box:
    """The smallest object with a state_dict."""

    def __init__(self, value: float) -> None:
        self.value = torch.tensor(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.value = state["value"]


def test_files_are_fsynced_before_the_folder_is_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self: Path, target: Path) -> Path:
        events.append(("rename", str(self)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    save_checkpoint(tmp_path, 1, box=Box(1.0))
    renamed = events.index(("rename", str(tmp_path / "checkpoints" / ".tmp_step_000001")))
    synced = {Path(path).name for kind, path in events[:renamed] if kind == "fsync"}
    assert {"state.pt", "meta.json", ".tmp_step_000001"} <= synced
    assert ("fsync", str(tmp_path / "checkpoints")) in events[renamed:]  # the rename itself made durable


def test_saving_a_step_again_never_loses_the_good_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, 2, box=Box(1.0))
    real_rename = Path.rename

    def failing_rename(self: Path, target: Path) -> Path:
        if self.name.startswith(".tmp_"):
            raise OSError("disk went away mid-save")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="mid-save"):
        save_checkpoint(tmp_path, 2, box=Box(5.0))
    monkeypatch.setattr(Path, "rename", real_rename)
    box = Box(0.0)
    path, _ = load_latest_checkpoint(tmp_path, box=box)  # type: ignore[misc]
    assert path.name == "step_000002" and float(box.value) == 1.0
    save_checkpoint(tmp_path, 2, box=Box(7.0))  # and a later save of the same step replaces it
    load_latest_checkpoint(tmp_path, box=box)
    assert float(box.value) == 7.0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]


@pytest.mark.parametrize("damage", [b"", b"not a torch file", None])
def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous(
    tmp_path: Path, damage: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint(tmp_path, 1, box=Box(1.0), data={"task_cursor": 8})
    newest = save_checkpoint(tmp_path, 2, box=Box(2.0), data={"task_cursor": 16}) / "state.pt"
    if damage is None:  # torn: the first half of a real checkpoint
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    else:
        newest.write_bytes(damage)
    box = Box(0.0)
    found = load_latest_checkpoint(tmp_path, box=box)
    assert found is not None
    path, rest = found
    assert path.name == "step_000001" and rest["data"] == {"task_cursor": 8} and float(box.value) == 1.0
    assert "step_000002" in caplog.text and "unreadable" in caplog.text


def test_no_checkpoint_means_a_fresh_start(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path, box=Box(0.0)) is None
    assert checkpoint.latest_checkpoint(tmp_path) is None
