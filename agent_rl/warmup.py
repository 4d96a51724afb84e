"""Supervised warm-up on scripted tool-use demonstrations.

Why: RL can only reinforce behaviour the policy already shows sometimes. A tiny model from random
weights never emits a well-formed tool call, so a few supervised steps on scripted episodes give
RL a policy that calls the tool occasionally. Demonstrations are played through the real
environment (real tool output), then tokenised the same piecewise way the rollout does: prompt and
tool deltas with mask 0, assistant turns (content + end-of-turn) with mask 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from agent_rl.config import WarmupConfig

Message = dict[str, str]


@dataclass
class Example:
    ids: list[int]
    mask: list[int]


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> Example:
    """Piecewise: each assistant message's own tokens get mask 1, everything else mask 0.

    `tools`: the env's schemas when it listed them natively (reset ``info["tools"]``), passed as
    `tools=` to every render as the rollout does; `template_kwargs` likewise (model.chat_template_kwargs).
    """
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        extra["tools"] = [dict(t) for t in tools]
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(
            list(messages[:i]), add_generation_prompt=True, tokenize=False, **extra
        )
        _append(tokenizer, before[len(rendered) :], 0, ids, mask)
        with_turn = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False, **extra)
        turn = with_turn[len(before) :]
        end = turn.find(tokenizer.eos_token)
        policy_part = turn[: end + len(tokenizer.eos_token)] if end >= 0 else turn
        _append(tokenizer, policy_part, 1, ids, mask)
        _append(tokenizer, turn[len(policy_part) :], 0, ids, mask)
        rendered = with_turn
    full = tokenizer.apply_chat_template(list(messages), tokenize=False, **extra)
    _append(tokenizer, full[len(rendered) :], 0, ids, mask)
    return Example(ids, mask)


def _append(tokenizer: Any, text: str, m: int, ids: list[int], mask: list[int]) -> None:
    if text:
        new = tokenizer.encode(text, add_special_tokens=False)
        ids.extend(new)
        mask.extend([m] * len(new))


def sft_loss(model: torch.nn.Module, batch: Sequence[Example], pad_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over masked (assistant) tokens."""
    device = next(model.parameters()).device
    length = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    attn = torch.zeros((len(batch), length), dtype=torch.long)
    for row, e in enumerate(batch):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        mask[row, : len(e.mask)] = torch.tensor(e.mask)
        attn[row, : len(e.ids)] = 1
    ids, mask, attn = ids.to(device), mask.to(device), attn.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (B, T-1, V)
    targets = ids[:, 1:]
    weights = mask[:, 1:].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none")
    return (nll * weights.reshape(-1)).sum() / weights.sum().clamp(min=1)


def run_warmup(
    model: torch.nn.Module,
    examples: Iterable[Example],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    pad_id: int,
    seed: int,
    lr_schedule: str = "linear",
    first: Sequence[int] = (),
    first_steps: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW steps over shuffled demonstrations; returns the loss per step.

    The first `first_steps` batches are drawn from the examples at indices `first` only (a
    curriculum: see WarmupConfig.clean_steps), the rest from all of them.

    `lr_schedule="linear"` decays the rate to 0 at the last step. Why: at a constant rate the
    final weights are whatever the last few noisy steps left, so which skills a tiny model ends
    with (e.g. copying six digits exactly) varies with the seed and even with the CPU's float
    kernels; annealing lets every run settle into the minimum it is in.
    """
    pool = list(examples)
    if not pool:
        raise ValueError("warm-up needs at least one demonstration")
    if first_steps and not first:
        raise ValueError("first_steps needs the examples to draw them from (first=)")
    if lr_schedule not in ("constant", "linear"):
        raise ValueError(f"lr_schedule must be 'constant' or 'linear', got {lr_schedule!r}")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    decay = (lambda step: 1.0 - step / steps) if lr_schedule == "linear" else (lambda step: 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    losses = []
    model.train()
    for step in range(steps):
        source = first if step < first_steps else range(len(pool))
        idx = [source[i] for i in torch.randint(len(source), (batch_size,), generator=gen).tolist()]
        loss = sft_loss(model, [pool[i] for i in idx], pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def turn_spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each assistant turn: the runs of mask 1."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _reproduces(model: torch.nn.Module, e: Example, start: int, end: int, pad_id: int) -> bool:
    """Whether greedy decoding from e.ids[:start] gives exactly e.ids[start:end]."""
    prompt = torch.tensor([e.ids[:start]], device=next(model.parameters()).device)
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=end - start,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out[0, start:].tolist() == e.ids[start:end]


@torch.no_grad()
def turn_accuracies(model: torch.nn.Module, examples: Sequence[Example], pad_id: int) -> dict[str, float]:
    """Greedy reproduction of held-out demonstrations' assistant turns, each given the
    demonstration's own history: `final_turn_accuracy`, the share of last turns reproduced token
    for token, and `turn_accuracy`, the share of all assistant turns.

    Why both: the warm-up's loss averages over every assistant token, so a model that calls the tool
    well but never learned to read its output can look converged. The final turn checks the answer
    (reading the last output, and on multi-turn tasks also knowing that it is time to answer); every
    turn checks reading the tool's output wherever it is used (on a chain of lookups: each call
    copies the previous output), which is the skill RL builds on. A warmed-up chain policy that
    copies every key but loses count scores high on the second and low on the first.
    """
    if not examples:
        raise ValueError("turn_accuracies needs at least one example")
    was_training = model.training
    model.eval()
    final = turns = hits = 0
    for e in examples:
        spans = turn_spans(e.mask)
        results = [_reproduces(model, e, a, b, pad_id) for a, b in spans]
        final += results[-1]
        turns += len(results)
        hits += sum(results)
    model.train(was_training)
    return {"final_turn_accuracy": final / len(examples), "turn_accuracy": hits / turns}


def held_out_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    make_env: Callable[[], Any],
    task_indices: Iterable[int],
    on_demo: Callable[[], None] | None = None,
) -> dict[str, float]:
    """turn_accuracies on correct demonstrations of `task_indices` (WarmupConfig.check_demos):
    whether the warmed-up model has the skill RL will build on."""
    examples = play_demonstrations(tokenizer, make_env, task_indices, 0.0, on_demo=on_demo)
    return turn_accuracies(model, examples, tokenizer.pad_token_id)


def play_demonstrations(
    tokenizer: Any,
    make_env: Callable[[], Any],
    task_indices: Iterable[int],
    hallucinate_fraction: float,
    on_demo: Callable[[], None] | None = None,
) -> list[Example]:
    """Scripted episodes played through a real env (real tool output), tokenised for the warm-up.

    A `hallucinate_fraction` of them, spread evenly, make the tool's output up instead of waiting
    for it (envs.demos.hallucinated_demonstration): deliberately imperfect teaching for RL to fix.
    """
    from envs.demos import demonstration, hallucinated_demonstration

    env = make_env()
    try:
        examples = []
        for k, i in enumerate(task_indices):
            play = hallucinated_demonstration if is_flawed(k, hallucinate_fraction) else demonstration
            episode = play(env, i)
            tools = episode.infos[0].get("tools") if episode.infos else None  # native tool schemas
            examples.append(tokenize_conversation(tokenizer, episode.messages, tools=tools))
            if on_demo is not None:
                on_demo()
        return examples
    finally:
        env.close()


def is_flawed(k: int, fraction: float) -> bool:
    """Whether demonstration k is a flawed one: exactly round(n * fraction) of any first n, spread
    evenly (no run of flawed ones longer than needed), so any prefix of the demos has the mix."""
    return int((k + 1) * fraction) > int(k * fraction)


def clean_indices(examples: Sequence[Example], config: WarmupConfig) -> list[int]:
    """The demonstrations the clean updates draw from: the correct ones, or the shortest
    `clean_shortest` share of them (WarmupConfig.clean_shortest)."""
    clean = [k for k in range(len(examples)) if not is_flawed(k, config.hallucinate_fraction)]
    if config.clean_shortest < 1:
        clean.sort(key=lambda k: len(examples[k].ids))  # stable: ties keep the demo order
        clean = sorted(clean[: max(1, math.ceil(config.clean_shortest * len(clean)))])
    return clean


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    make_env: Callable[[], Any],
    task_indices: Iterable[int],
    config: WarmupConfig,
    seed: int,
    *,
    on_demo: Callable[[], None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """The whole warm-up from its config: play the demonstrations, then train on them.

    `on_demo` is called after each demonstration is played, `on_step(step, loss)` after each
    update (progress bars, the warm-up's loss log)."""
    examples = play_demonstrations(
        tokenizer, make_env, task_indices, config.hallucinate_fraction, on_demo=on_demo
    )
    clean = clean_indices(examples, config)
    return run_warmup(
        model,
        examples,
        steps=config.steps,
        batch_size=config.batch_size,
        lr=config.lr,
        pad_id=tokenizer.pad_token_id,
        seed=seed,
        lr_schedule=config.lr_schedule,
        first=clean,
        first_steps=min(config.clean_steps, config.steps),
        on_step=on_step,
    )
