"""Per-sequence KV caches kept between generate() calls, so a multi-turn episode pays per turn for
its new tokens only (the tool reply and the sampled turn), not for re-reading its whole history.

How it stays correct without any protocol change: an entry is the exact token ids whose keys and
values it holds. A later prompt reuses an entry only where the entry's ids are literally a prefix
of the prompt (checked id by id), so a wrong reuse is impossible whatever the caller sends; a
prompt that matches nothing is prefilled from scratch. The cached keys already carry their rotary
positions, so reused tokens keep positions 0..r-1 and the new tokens continue from r.

What invalidates entries: new weights. `HFEngine` clears the store in `update_weights`, and also
whenever the model's parameters changed in place since the entries were made (an optimizer step on
a module the engine shares with the trainer), detected from the parameters' version counters.

What is not covered: sharing one prefix between sequences that diverge later (e.g. the common
prompt of a GRPO group on turn 1); only whole entries are extended. Memory is bounded by
`max_bytes` (least recently used entries go first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class KVEntry:
    """The keys and values of one sequence, per layer (heads, len(tokens), head_dim)."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixKVStore:
    """Finished sequences' KV, looked up by the longest entry that is a prefix of a new prompt."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, KVEntry] = OrderedDict()
        self._next_id = 0
        self.bytes = 0
        self.hits = 0
        """Prompts that reused an entry (since construction; for metrics and tests)."""
        self.reused_tokens = 0
        """Prompt tokens not recomputed thanks to reuse (since construction)."""

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[int, KVEntry] | None:
        """(r, entry): the longest reusable prefix, r <= len(prompt) - 1 (the last prompt token is
        always fed again, since its logits start the turn); None when no entry matches."""
        best: tuple[int, int] | None = None
        for key, entry in self._entries.items():
            r = min(len(entry.tokens), len(prompt) - 1)
            if r <= 0 or (best is not None and r <= best[0]):
                continue
            # Cheap rejections first: the last shared id, then the whole prefix (a C-level compare).
            if entry.tokens[r - 1] != prompt[r - 1] or entry.tokens[:r] != prompt[:r]:
                continue
            best = (r, key)
        if best is None:
            return None
        r, key = best
        self._entries.move_to_end(key)
        self.hits += 1
        self.reused_tokens += r
        return r, self._entries[key]

    def add(self, entry: KVEntry, replaces: Sequence[KVEntry] = ()) -> None:
        """Store `entry`; drop `replaces` (entries it extends, now redundant) and then the least
        recently used ones until the store fits `max_bytes`."""
        gone = {id(e) for e in replaces}
        for key in [k for k, e in self._entries.items() if id(e) in gone]:
            self.bytes -= self._entries.pop(key).nbytes
        size = entry.nbytes
        if size > self.max_bytes:
            return
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


def weights_version(model: Any) -> tuple[tuple[int, int], ...]:
    """A fingerprint that changes when any parameter is replaced or modified in place.

    Every in-place write through the parameter or a `detach()`ed view of it (optimizer steps,
    `load_state_dict`, `state_dict()[k].copy_`) bumps the tensor's version counter. A write through
    `param.data` does not: call `HFEngine.clear_kv_cache()` after one.
    """
    return tuple((p.data_ptr(), p._version) for p in model.parameters())
