"""The RL update's forwards (dice.model.packing): a response's trace rounds beside one clean stream give
every loss token the log-prob and gradient of its own doubled round row (fp64, CPU)."""
import itertools
from pathlib import Path

import pytest
import torch

from dice import load_model
from dice.model.attention import streams_mask
from dice.model.packing import flex_length, group_rounds, micro_batches, pack, pad_batch, packed_logprobs, update_flops
from dice.rl.update import row_weights, trace_rounds
from dice.sampling.completion import Completion
from dice.sft.diffusion import doubled_logits

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"
MASK = 319

# prompt tails sharing the first block, tails after the cut (one step of A's unmasked only its tail),
# blocks of 1 to 4 rounds, and a response of 2 tokens
COMPLETIONS = [
    Completion(list(range(10, 17)), [40, 41, 42, 43, 44, 45, 46], [1, 2, 2, 3, 5, 6, 8], "", None,
               tail_tokens=[47, 48], tail_step_map=[7, 6]),
    Completion(list(range(20, 29)), [50, 51, 52, 53, 54, 55], [1, 1, 1, 2, 3, 4], "", None,
               tail_tokens=[56], tail_step_map=[5]),
    Completion(list(range(30, 34)), list(range(60, 72)), [1, 3, 2, 4, 5, 8, 6, 7, 9, 10, 12, 11], "", None),
    Completion(list(range(34, 39)), [80, 81], [2, 1], "", None, tail_tokens=[82], tail_step_map=[1]),
]
ADVANTAGES = [1.0, -0.5, 0.7, -1.0]


def round_items(completions=COMPLETIONS):
    return [(k, c, r) for k, c in enumerate(completions)
            for r in trace_rounds(c.step_map, len(c.prompt_ids), 4, c.tail_step_map)]


def test_the_rule_for_r_noisy_copies_against_its_statement():
    """Every (query, key) pair of random (block, stream, sample) descriptors, the rule spelled out."""
    g = torch.Generator().manual_seed(0)
    block, stream, sample = (torch.randint(0, k, (1, 40), generator=g) for k in (4, 4, 2))
    got = streams_mask(block, stream, sample)[0]
    for q, k in itertools.product(range(40), repeat=2):
        bq, bk, sq, sk = int(block[0, q]), int(block[0, k]), int(stream[0, q]), int(stream[0, k])
        if sample[0, q] != sample[0, k]:
            expected = False
        elif sq == 0:                      # the clean stream: block-causal over itself, no noisy copy
            expected = sk == 0 and bk <= bq
        else:                              # noisy copy sq: its own block within the copy, the clean past
            expected = (sk == sq and bk == bq) or (sk == 0 and bk < bq)
        assert bool(got[q, k]) == expected, (q, k)


def test_token_counts_hand_computed():
    """Prompt 7, 4 tokens at steps 1..4, block 4: round 1 trains position 7 (block 1) and 8 (block 2),
    rounds 2 and 3 positions 9 and 10 (block 2, of 3 positions: the sequence has 11). Shared: 11
    clean + (4 + 3) + 3 + 3 = 24 tokens; one doubled row per round: 3 * (11 + 11) = 66."""
    c = Completion(list(range(10, 17)), [5, 6, 7, 8], [1, 2, 3, 4], "", None)
    rounds = trace_rounds(c.step_map, 7, 4)
    assert [r.loss for r in rounds] == [[7, 8], [9], [10]]
    items = [(0, c, r) for r in rounds]
    [shared] = group_rounds(items, [1.0] * 3, "response", 4, budget=10**6)
    assert shared.tokens == 24
    assert sum(g.tokens for g in group_rounds(items, [1.0] * 3, "round", 4, budget=10**6)) == 66
    batch = pack([[shared]], MASK, 0, [1.0])
    assert batch.tokens == 24 and batch.ids.shape == (1, 24)
    # [x_t^1 (block 1, block 2) ; x_t^2 (block 2) ; x_t^3 (block 2) ; x_0]
    assert batch.stream[0].tolist() == [1] * 7 + [2] * 3 + [3] * 3 + [0] * 11
    assert batch.position_ids[0].tolist() == [4, 5, 6, 7, 8, 9, 10] + [8, 9, 10] * 2 + list(range(11))
    assert batch.ids[0, :13].tolist() == [14, 15, 16, MASK, MASK, MASK, MASK, 6, MASK, MASK, 6, 7, MASK]
    assert batch.targets.tolist() == [5, 6, 7, 8]


def test_visible_pairs_and_tokens_count_the_mask():
    items = round_items()
    groups = group_rounds(items, [1.0] * len(items), "response", 4, budget=10**6)
    batch = pad_batch(pack([groups], MASK, 0, ADVANTAGES), 200)
    real = batch.sample_ids >= 0
    mask = streams_mask(batch.position_ids // 4, batch.stream, batch.sample_ids)
    assert batch.tokens == int(real.sum())
    assert batch.visible_pairs == int((mask & real[:, :, None] & real[:, None, :]).sum())


def test_groups_split_at_the_budget_and_micro_batches_hold_it():
    items = round_items()
    for budget in (30, 45, 80, 10**6):
        groups = group_rounds(items, list(range(len(items))), "response", 4, budget)
        assert sorted(w for g in groups for w in g.weights) == list(range(len(items)))   # every row once
        assert all(g.tokens <= budget or len(g.rounds) == 1 for g in groups)
        chunks = micro_batches(groups, budget)
        assert sorted(id(g) for c in chunks for g in c) == sorted(map(id, groups))
        assert all(sum(g.tokens for g in c) <= budget or len(c) == 1 for c in chunks)
    assert len(group_rounds(items, [0.0] * len(items), "response", 4, 10**6)) == 4
    assert len(group_rounds(items, [0.0] * len(items), "round", 4, 10**6)) == len(items)


def per_round_rows_objective(model, items, weights, coef):
    """The per-round path, built here: one doubled row [x_t ; x_0] per round, through SFT's doubled
    forward (its golden tests), sum of coef * weight * advantage * log p over the loss tokens (weights
    and advantages rounded to float32, as a batch holds them)."""
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    total = torch.zeros((), dtype=torch.float64)
    for (k, c, rnd), w in zip(items, weights):
        seq = torch.tensor(c.prompt_ids + c.tokens + c.tail_tokens)
        n = len(seq)
        noisy = seq.clone()
        noisy[rnd.masked] = MASK
        loss_at = torch.zeros(n, dtype=torch.bool)
        loss_at[rnd.loss] = True
        logits = doubled_logits(model, noisy[None], seq[None], torch.arange(n)[None],
                                torch.zeros(1, n, dtype=torch.long), loss_at[None], use_flex=False)
        logp = logits.log_softmax(-1).gather(1, seq[loss_at][:, None])[:, 0]
        for p, lp in zip(rnd.loss, logp):
            total = total + coef[k, id(rnd), p] * f32(w) * f32(ADVANTAGES[k]) * lp
    return total


def packed_objective(model, chunks, coef, layout: str, budget: int):
    """The same sum over the packed micro-batches; each loss token's key read back from the batch
    ("one padded row": padded as the FlexAttention path pads, to `flex_length`)."""
    total = torch.zeros((), dtype=torch.float64)
    for chunk in chunks:
        rows_of = [chunk] if layout != "one row per group" else [[g] for g in chunk]
        batch = pack(rows_of, MASK, 0, ADVANTAGES)
        if layout == "one padded row":
            batch = pad_batch(batch, flex_length(batch.ids.shape[1], budget))
        logp = packed_logprobs(model, batch, use_flex=False)
        at = batch.loss_at.nonzero().tolist()
        for (b, j), lp, w, a in zip(at, logp, batch.token_weight, batch.advantage):
            group = rows_of[b][int(batch.sample_ids[b, j])]
            rnd = group.rounds[int(batch.stream[b, j]) - 1]
            total = total + coef[group.k, id(rnd), int(batch.position_ids[b, j])] * float(w) * float(a) * lp
    return total


@pytest.mark.parametrize("rows, budget, layout", [
    ("response", 10**6, "one row"), ("response", 10**6, "one row per group"), ("response", 45, "one padded row"),
    ("response", 30, "one row"), ("round", 60, "one padded row")])
def test_shared_clean_stream_loss_and_gradients_equal_the_per_round_rows_fp64(rows, budget, layout):
    model = load_model(TINY).double()
    items = round_items()
    weights = row_weights(items, "step", width=7, rows=len(items), responses=4, updates=1)
    g = torch.Generator().manual_seed(1)
    coef = {(k, id(r), p): float(torch.randn((), generator=g, dtype=torch.float64))
            for k, _, r in items for p in r.loss}
    params = list(model.parameters())
    want = per_round_rows_objective(model, items, weights, coef)
    want_grads = torch.autograd.grad(want, params)
    chunks = micro_batches(group_rounds(items, weights, rows, 4, budget), budget)
    assert len(chunks) > 1 or budget == 10**6
    got = packed_objective(model, chunks, coef, layout, budget)
    got_grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, want_grads):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13, msg=name)


def test_update_flops_hand_computed():
    """tiny-sdar: 2 layers, hidden 64, 4 heads of 16, MLP 160, vocab 320; one group of the
    24-token hand-computed layout above."""
    model = load_model(TINY)
    c = Completion(list(range(10, 17)), [5, 6, 7, 8], [1, 2, 3, 4], "", None)
    batch = pack([group_rounds([(0, c, r) for r in trace_rounds(c.step_map, 7, 4)], [1.0] * 3, "response", 4, 99)],
                 MASK, 0, [1.0])
    # clean: 4 * 4 + 4 * 8 + 3 * 11 = 81; noisy: 4 * (4 + 4) + 3 * (3 + 8) * 3 = 131
    assert batch.visible_pairs == 81 + 131
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 160 + 2 * 64 + 2 * 16
    forward = 2 * (2 * layer + 64) * 24 + 4 * 2 * 4 * 16 * 212 + 2 * 64 * 320 * 4
    assert update_flops(model.config, batch) == 3 * forward
    assert update_flops(model.config, batch, backward=False) == forward


def test_flex_length_is_the_budget_or_its_smallest_multiple_that_holds_the_batch():
    assert [flex_length(n, 100) for n in (1, 99, 100, 101, 200, 201)] == [100, 100, 100, 200, 200, 300]
    assert flex_length(4, 16384) == 16384


@pytest.mark.slow
def test_padded_flex_batch_gives_the_dense_log_probs():
    """FlexAttention (uncompiled on the CPU) on a micro-batch padded as the update pads it and the
    dense mask on the batch as packed give the same log-probs, in the same order (forward only)."""
    from dice.sampling.sampler import Sampling, generate
    model = load_model(TINY)
    prompts = [list(range(5, 12)), list(range(3, 16)), [9]]
    out = generate(model, prompts, max_new_tokens=13,
                   sampling=Sampling(remasking="low_confidence_dynamic", threshold=0.5, temperature=1.0), seed=3)
    comps = [Completion(p, g.tokens, g.step_map, "", None, g.tail_tokens, g.tail_step_map)
             for p, g in zip(prompts, out.sequences)]
    items = round_items(comps)
    batch = pack([group_rounds(items, [1.0] * len(items), "response", 4, 10**6)], MASK, 0, [1.0, 1.0, 1.0])
    padded = pad_batch(batch, flex_length(batch.ids.shape[1], 128))
    assert padded.ids.shape[1] > batch.ids.shape[1]
    with torch.no_grad():
        dense, flex = packed_logprobs(model, batch, use_flex=False), packed_logprobs(model, padded, use_flex=True)
    assert dense.shape == (sum(len(c.tokens) for c in comps),)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)
