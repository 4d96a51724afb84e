"""Sequence packing (agent_rl/packing.py): the packed layout, its exactness, and the learner's
gradients with packing on against the padded path.

Tolerances. Packed and padded are the same function: in float64 they agree bit for bit here
(the test allows 1e-10 for kernels that sum in another order), while a packing whose sequences
can see each other is off by O(1) (the negative control: 2.8 in the hidden states). In float32 they then differ only by rounding: packing changes the shapes
the kernels see (GEMM rows, attention lengths and masks), hence their blocking and summation order.
One reduction of K terms in another order moves its result by about sqrt(K) u relative
(u = 2^-24 ~ 6e-8; K <= 512 here: ~1.4e-6), and the gradient passes ~10 such stages forward and
backward (2 layers of projections, attention, MLP, the head). Adding them up without any
cancellation gives ~1.4e-5 relative L2; GRAD_RTOL = 2e-5 is that estimate rounded up. Log-probs are compared with the learner's own
bound, 1e-5 absolute. Measured (2026-12-03, Intel Xeon, default AVX-512 kernels and
ATEN_CPU_CAPABILITY=avx2 alike): gradient rel. L2 1.7e-7..2.3e-7, log-probs 9.5e-7 at most.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agent_rl.batch import RolloutBatch, batch_from_tensors  # noqa: E402
from agent_rl.build import load_model_and_tokenizer  # noqa: E402
from agent_rl.config import AlgoConfig, LoraConfig, TrainConfig  # noqa: E402
from agent_rl.learner import Learner  # noqa: E402
from agent_rl.logprobs import causal_lm_token_stats  # noqa: E402
from agent_rl.packing import first_fit_decreasing, pack_rows, packed_token_stats  # noqa: E402

pytestmark = pytest.mark.numerics  # floating-point results: scripts/test.sh reruns them under AVX2

GRAD_RTOL = 2e-5
"""Relative L2 bound on gradient differences, packed vs padded (derived in the module docstring)."""


def hetero_batch(prompt_lens: list[int], response_lens: list[int], seed: int = 0) -> RolloutBatch:
    """Prompts left-padded, responses right-padded (collate's layout), a tool span in each response."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = len(prompt_lens), max(prompt_lens), max(response_lens)
    ids = torch.randint(10, 300, (b, p + r), generator=g)
    attention = torch.zeros(b, p + r, dtype=torch.long)
    mask = torch.zeros(b, r)
    rewards = torch.zeros(b, r)
    for i, (n_p, n_r) in enumerate(zip(prompt_lens, response_lens)):
        attention[i, p - n_p : p + n_r] = 1
        mask[i, :n_r] = 1
        mask[i, n_r // 3 : n_r // 3 + max(1, n_r // 5)] = 0  # tool output: read, not trained
        rewards[i, n_r - 1] = float(i % 3 == 0)
    ids = torch.where(attention.bool(), ids, torch.zeros_like(ids))  # pad id 0
    return batch_from_tensors(
        ids,
        mask,
        sampler_log_probs=torch.zeros(b, r),
        token_rewards=rewards,
        group_index=torch.tensor([i // 4 for i in range(b)]),
        attention_mask=attention,
    )


EIGHT = hetero_batch([5, 12, 20, 8, 30, 6, 15, 10], [15, 380, 40, 120, 250, 60, 200, 90])
"""8 rows of 20..392 tokens: padded to 30 + 380, they would cost 3,280 tokens for 1,261 real."""


# -- the layout --------------------------------------------------------------------------------


def test_first_fit_decreasing_respects_the_budget_and_places_every_row_once() -> None:
    lengths = [400, 20, 300, 250, 60, 90, 130, 35, 700]
    bins = first_fit_decreasing(lengths, 512)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert bins[0] == [8]  # longer than the budget: a packed row of its own
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins[1:])
    # the real tokens need at least ceil(1285 / 512) = 3 bins beside the long row; FFD finds 3
    assert len(bins) == 4
    with pytest.raises(ValueError, match="budget"):
        first_fit_decreasing([3], 0)


def test_pack_rows_lays_segments_end_to_end_with_restarting_positions() -> None:
    batch = hetero_batch([2, 3, 1], [3, 1, 2])  # P = 3, R = 3
    packed = pack_rows(batch.input_ids, batch.attention_mask, batch.response_length, 7, batch.position_ids)
    assert packed.bins == ((0,), (1, 2))  # lengths 5, 4, 3: 5 alone, then 4 + 3 = 7
    assert packed.processed_tokens == 12  # the real tokens, no filler
    assert [p.tolist() for p in packed.position_ids] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 2]]
    real = [batch.input_ids[i][batch.attention_mask[i].bool()] for i in range(3)]
    assert packed.input_ids[0].tolist() == real[0].tolist()
    assert packed.input_ids[1].tolist() == real[1].tolist() + real[2].tolist()
    # every real response token is predicted by the packed position just before it
    flat = torch.cat(packed.input_ids)
    assert torch.equal(flat[packed.src + 1], packed.targets)
    assert torch.equal(batch.responses.flatten()[packed.dst], packed.targets)
    assert len(packed.targets) == 3 + 1 + 2


def test_pack_rows_rejects_what_it_cannot_lay_out() -> None:
    batch = hetero_batch([2, 3], [3, 2])
    holes = batch.attention_mask.clone()
    holes[0, 3] = 0
    with pytest.raises(ValueError, match="not contiguous"):
        pack_rows(batch.input_ids, holes, batch.response_length, 16)
    shifted = batch.position_ids + batch.attention_mask
    with pytest.raises(ValueError, match="position_ids"):
        pack_rows(batch.input_ids, batch.attention_mask, batch.response_length, 16, shifted)
    no_prompt = batch.attention_mask.clone()
    no_prompt[0, :3] = 0  # row 0 starts at its first response token
    with pytest.raises(ValueError, match="no position predicts it"):
        pack_rows(batch.input_ids, no_prompt, batch.response_length, 16)


# -- exactness ---------------------------------------------------------------------------------


def _stats_both(model: torch.nn.Module, batch: RolloutBatch, budget: int) -> tuple:
    kw = {"response_length": batch.response_length, "position_ids": batch.position_ids}
    padded = causal_lm_token_stats(model, batch.input_ids, batch.attention_mask, **kw)
    packed = packed_token_stats(model, batch.input_ids, batch.attention_mask, budget=budget, **kw)
    return padded, packed


def test_packed_statistics_equal_the_padded_ones_in_float64(tiny_model_dir) -> None:
    """The same function: float64 agreement to rounding (bit for bit here; 1e-10 is ~1e6 float64
    ulps of slack for kernels that sum in another order, and 1e10 under the negative control)."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model = model.double()
    real = EIGHT.attention_mask[:, -EIGHT.response_length :].bool()
    with torch.no_grad():
        padded, packed = _stats_both(model, EIGHT, budget=512)
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        got, want = getattr(packed, name), getattr(padded, name)
        assert (got - want)[real].abs().max() < 1e-10, name
        assert torch.all(got[~real] == 0)  # padding: zeros, never read downstream
    # negative control: the same packed rows with positions that do not restart, so the mask is
    # plain causal and later segments attend to earlier ones, are off by O(1)
    pk = pack_rows(EIGHT.input_ids, EIGHT.attention_mask, EIGHT.response_length, 512)
    k = max(range(len(pk.bins)), key=lambda b: len(pk.bins[b]))  # a packed row of several segments
    ids, pos = pk.input_ids[k][None], pk.position_ids[k][None]
    dec = model.get_decoder()
    with torch.no_grad():
        good = dec(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        mixed = dec(
            input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False
        ).last_hidden_state
    assert len(pk.bins[k]) > 1 and (good - mixed).abs().max() > 1e-2


# -- the learner's gradients -------------------------------------------------------------------


def _learner_gradient(tiny_model_dir, algo: AlgoConfig, train: TrainConfig, lora: bool = False):
    """(flat gradient of the first optimiser step, trainer log-probs) of one Learner.step(EIGHT)."""
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    if lora:
        from agent_rl.lora import apply_lora

        model = apply_lora(model, LoraConfig(rank=4))
    learner = Learner(model, algo, train)
    trainable = [p for p in model.parameters() if p.requires_grad]
    captured: list[torch.Tensor] = []
    learner.optimizer.step = lambda *a, **k: captured.append(  # type: ignore[method-assign]
        torch.cat([p.grad.flatten().clone() for p in trainable])
    )
    scored, metrics = learner.step(EIGHT)
    return captured[0], scored.scores.trainer_log_probs, metrics


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize(
    ("micro", "checkpointing", "budget"),
    [(8, False, 4096), (3, False, 512), (3, True, 400)],
    ids=["one-micro-batch", "accumulated", "accumulated-checkpointed"],
)
def test_learner_gradient_with_packing_equals_the_padded_one(
    tiny_model_dir, micro: int, checkpointing: bool, budget: int
) -> None:
    """Micro-batches of 3 accumulate 3 backward passes; budget 400 splits them into several packed
    rows (the 380-token response alone). Measured rel. L2 ~2e-7 on both kernel paths."""
    train = TrainConfig(lr=1e-3, activation_checkpointing=checkpointing)
    grads, lps, mets = [], [], []
    for pack in (None, budget):
        g, lp, m = _learner_gradient(
            tiny_model_dir, AlgoConfig(micro_batch_size=micro, pack_tokens=pack), train
        )
        grads.append(g)
        lps.append(lp)
        mets.append(m)
    mask = EIGHT.policy_mask
    assert grads[0].norm() > 0
    assert _rel_l2(grads[1], grads[0]) < GRAD_RTOL
    assert (lps[1] - lps[0])[mask].abs().max() < 1e-5
    assert mets[1]["losses/n_tokens"] == mets[0]["losses/n_tokens"]
    assert mets[1]["losses/clipfrac"] == 0.0  # scoring and update both packed: the ratio starts at 1
    assert abs(mets[1]["policy/entropy"] - mets[0]["policy/entropy"]) < 1e-5


def test_learner_gradient_with_packing_under_lora(tiny_model_dir) -> None:
    """Only the adapters train; their gradient is the same through the packed path."""
    pytest.importorskip("peft")
    grads = [
        _learner_gradient(
            tiny_model_dir, AlgoConfig(micro_batch_size=3, pack_tokens=pack), TrainConfig(lr=1e-3), True
        )[0]
        for pack in (None, 512)
    ]
    assert grads[0].norm() > 0
    assert _rel_l2(grads[1], grads[0]) < GRAD_RTOL


def test_packing_refuses_an_attention_that_would_mix_the_sequences(tiny_model_dir) -> None:
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model.config._attn_implementation = "some_custom_kernel"
    with pytest.raises(NotImplementedError, match="pack_tokens"):
        packed_token_stats(
            model, EIGHT.input_ids, EIGHT.attention_mask, response_length=EIGHT.response_length, budget=512
        )


def test_pack_tokens_is_off_by_default() -> None:
    assert AlgoConfig().pack_tokens is None
    with pytest.raises(ValueError):
        AlgoConfig(pack_tokens=0)


@pytest.fixture()
def ray_session():
    """A small local Ray cluster (the distributed tests' settings), or the one already running."""
    from tests.agent_rl.distributed.conftest import import_ray_or_skip

    ray = import_ray_or_skip()
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=4, include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.slow
def test_ray_learner_ranks_pack_through_the_same_path(ray_session, tiny_model_dir) -> None:
    """Data-parallel ranks run `Learner.update(shard=...)`, hence `_stats`, hence packing: two packed
    ranks take the padded single process's gradient. Tolerance: GRAD_RTOL for packing plus the
    ranks' own 1e-5 (derived in tests/agent_rl/distributed/test_ray_learner.py); weights frozen
    (lr 1e-30) so both sides take every optimiser step's gradient at the same weights."""
    from agent_rl.distributed.learner import LearnerSpec, RayLearner

    frozen = TrainConfig(lr=1e-30, seed=0)
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    local = Learner(model, AlgoConfig(micro_batch_size=3, minibatches=2), frozen)
    packed = AlgoConfig(micro_batch_size=3, minibatches=2, pack_tokens=256)
    ranks = RayLearner(
        LearnerSpec(model_path=str(tiny_model_dir), algo=packed, train=frozen, timeout_s=600), 2, state
    )
    try:
        local.step(EIGHT)
        ranks.step(EIGHT)
        want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        got = ranks.gradients()[0]
        assert set(got) == set(want)
        diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
        ref = torch.cat([want[k].flatten() for k in want])
        assert ref.norm() > 0 and _rel_l2(ref + diff, ref) < GRAD_RTOL + 1e-5
    finally:
        ranks.shutdown()
