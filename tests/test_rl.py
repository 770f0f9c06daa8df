"""BiC-RL pieces: trace replay, advantages, the clipped objective, and a tiny end-to-end run."""
import dataclasses
import importlib.util
import json
import random
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from dice import load_model
import dice.model.packing
from dice.config import TrainConfig
from dice.model.packing import CompileClock, group_rounds, pack, packed_logprobs
from dice.rl.rollout import group_advantages
from dice.rl.train_rl import train_rl
from dice.rl.update import policy_loss, policy_update, row_weights, trace_rounds, update_plan
from dice.sampling.completion import Completion
from dice.run_folder import RunFolderError
from dice.runtime import Runtime
from dice.sampling.sampler import Engine, Sampling, generate
from dice.tasks.load import Task

from conftest import make_tiny_model_folder, run_bounded

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"


def as_lists(rounds):
    return [(r.masked, r.loss) for r in rounds]


def test_trace_rounds_static_on_grid():
    # prompt of 8 (two full blocks); static, one token per step
    rounds = trace_rounds([1, 3, 2, 4, 5, 8, 6, 7], prompt_len=8, block_size=4)
    assert as_lists(rounds) == [
        ([8, 9, 10, 11, 12, 13, 14, 15], [8, 12]),
        ([9, 10, 11, 13, 14, 15], [10, 14]),
        ([9, 11, 13, 15], [9, 15]),
        ([11, 13], [11, 13]),
    ]


def test_trace_rounds_dynamic_off_grid():
    # prompt of 6: positions 4, 5 are prompt and share the first generated block with 6, 7
    rounds = trace_rounds([1, 2, 3, 3, 4, 3], prompt_len=6, block_size=4)
    assert as_lists(rounds) == [([6, 7, 8, 9, 10, 11], [6, 8, 9, 11]), ([7, 10], [7, 10])]
    # the reference's response-aligned grid would have put 6..9 in one block; ours never mixes
    # the blocks [4, 8) and [8, 12)


def test_trace_rounds_tail_is_context_not_loss():
    # prompt of 6; response positions 6..9 (9 holds the eos, step 5); the sampler's last block
    # [8, 12) goes on with the tail 10 (step 4) and 11 (step 3)
    rounds = trace_rounds([1, 2, 3, 5], prompt_len=6, block_size=4, tail_step_map=[4, 3])
    # step 4 unmasked only the tail: no round; at step 5 the tail is already clean
    assert as_lists(rounds) == [([6, 7, 8, 9, 10, 11], [6, 8]), ([7, 9], [7, 9])]


def plain_trace_rounds(step_map, prompt_len, block_size, tail_step_map=()):
    """DESIGN.md §7's rounds, one block and one step at a time."""
    blocks = {}
    for i, step in enumerate([*step_map, *tail_step_map]):
        pos = prompt_len + i
        blocks.setdefault(pos // block_size, []).append((pos, step, i < len(step_map)))
    rounds = []
    for tokens in blocks.values():
        for r, s in enumerate(sorted({step for _, step, in_response in tokens if in_response})):
            if r == len(rounds):
                rounds.append(([], []))
            rounds[r][0].extend(p for p, step, _ in tokens if step >= s)
            rounds[r][1].extend(p for p, step, in_response in tokens if step == s and in_response)
    return [(sorted(m), sorted(l)) for m, l in rounds]


def test_trace_rounds_equal_the_plain_replay_on_random_step_maps():
    import random
    rng = random.Random(0)
    for _ in range(300):
        prompt_len, n, tail = rng.randint(1, 13), rng.randint(1, 30), rng.randint(0, 3)
        step_map = [rng.randint(1, 12) for _ in range(n)]
        tail_map = [rng.randint(1, 12) for _ in range(tail)]
        assert as_lists(trace_rounds(step_map, prompt_len, 4, tail_map)) == \
            plain_trace_rounds(step_map, prompt_len, 4, tail_map)
    assert trace_rounds([], 5, 4, [1, 2]) == []


class Recorder(torch.nn.Module):
    """Wraps a model and records the ids and logits of every uncached sampler forward."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.calls = model, model.config, []

    def forward(self, ids, pos, mask):
        logits = self.inner(ids, pos, mask)
        self.calls.append((ids.clone(), logits.float()))
        return logits


@pytest.mark.parametrize("remasking,threshold,prompt_len,eos_cut,tail_len", [
    ("low_confidence_static", 0.9, 7, False, 3),     # cut by max_new_tokens inside the last block
    ("low_confidence_dynamic", 0.5, 9, False, 1),
    ("low_confidence_dynamic", 0.5, 12, False, 2),
    ("low_confidence_static", 0.9, 10, False, 0),    # cut at the last block's end: no tail
    ("low_confidence_dynamic", 0.5, 7, True, 3),     # cut after an eos at a block's first position
])
def test_rounds_replay_exactly_what_the_sampler_saw(remasking, threshold, prompt_len, eos_cut, tail_len):
    model = load_model(TINY)
    with torch.no_grad():
        model.lm_head.weight *= 8
    prompt = list(range(1, prompt_len + 1))
    kw = dict(max_new_tokens=14, sampling=Sampling(remasking=remasking, threshold=threshold),
              engine=Engine(use_cache=False))
    eos = ()
    if eos_cut:   # the first token whose first occurrence starts a block
        free = generate(model, [prompt], **kw).tokens[0]
        eos = (next(t for i, t in enumerate(free) if (prompt_len + i) % 4 == 0 and t not in free[:i]),)
    rec = Recorder(model)
    out = generate(rec, [prompt], eos_token_ids=eos, **kw)
    tokens, step_map = out.tokens[0], out.step_map[0]
    assert len(out.tail_tokens[0]) == len(out.tail_step_map[0]) == tail_len
    assert (prompt_len + len(tokens) + tail_len) % 4 == 0          # the tail ends the sampler's last block
    assert not eos_cut or (len(tokens) < 14 and tokens[-1] in eos)
    comp = Completion(prompt, tokens, step_map, "", None, out.tail_tokens[0], out.tail_step_map[0])
    rounds = trace_rounds(step_map, prompt_len, 4, comp.tail_step_map)
    batch = pack([group_rounds([(0, comp, r) for r in rounds], [1.0] * len(rounds), "response", 4, 10**6)],
                 model.config.mask_token_id, 0, [1.0])
    # the sampler's forward k (1-based) is denoising step k, over the clean past and the current
    # block; a round's noisy copy must show the model exactly that: the clean stream before the
    # block, the copy's block (tail positions included) in the state of that step
    stream, block = batch.stream[0], batch.position_ids[0] // 4
    clean = batch.ids[0][stream == 0]
    expected = []
    for _, j in batch.loss_at.nonzero().tolist():
        p = int(batch.position_ids[0, j])
        ids, logits = rec.calls[step_map[p - prompt_len] - 1]
        b0 = p // 4 * 4
        assert torch.equal(clean[:b0], ids[0, :b0])
        assert torch.equal(batch.ids[0][(stream == stream[j]) & (block == p // 4)], ids[0, b0:b0 + 4])
        expected.append(logits[0, p].log_softmax(-1)[tokens[p - prompt_len]])
    with torch.no_grad():
        replayed = packed_logprobs(model, batch)
    assert len(replayed) == len(tokens)
    torch.testing.assert_close(replayed, torch.stack(expected), rtol=0, atol=1e-4)


def test_group_advantages():
    adv = group_advantages([1, 0, 0, 1, 1, 1, 1, 1], group_size=4)
    assert adv[:4] == pytest.approx([1, -1, -1, 1])
    assert adv[4:] == [None] * 4


def test_policy_loss_clipping_and_kl_hand_computed():
    new = torch.tensor([0.5, 0.5, -0.5, -0.1])
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = policy_loss(new, old, adv, clip_eps=0.2, kl_beta=0.0)
    e = torch.exp(torch.tensor([0.5, -0.5, -0.1]))
    # rho=1.65,A=+1 -> clipped to 1.2; rho=1.65,A=-1 -> unclipped; rho=0.61,A=+1 -> unclipped;
    # rho=0.905,A=-1 -> inside the range
    torch.testing.assert_close(loss, torch.stack([-torch.tensor(1.2), e[0], -e[1], e[2]]))
    assert stats["clip_fraction"] == pytest.approx(0.75)
    loss_kl, stats = policy_loss(new, old, adv, clip_eps=0.2, kl_beta=0.01)
    k3 = torch.exp(old - new) - (old - new) - 1
    torch.testing.assert_close(loss_kl - loss, 0.01 * k3)
    assert stats["kl"] == pytest.approx(float(k3.mean()))


def test_kl_is_taken_to_the_reference_model_when_there_is_one():
    new, old, ref = torch.tensor([0.2, -0.3]), torch.tensor([0.2, -0.3]), torch.tensor([0.0, 0.1])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(new, old, adv, clip_eps=0.2, kl_beta=0.5, logp_ref=ref)
    k3 = torch.exp(ref - new) - (ref - new) - 1            # on-policy: rho = 1, so pg = -A
    torch.testing.assert_close(loss, -adv + 0.5 * k3)
    assert stats["kl"] == pytest.approx(float(k3.mean())) and stats["kl"] > 0


SHORT = Completion(list(range(10, 17)), [5, 6], [1, 2], "", None, tail_tokens=[7, 8], tail_step_map=[2, 3])
LONG = Completion(list(range(10, 17)), [5, 6, 7, 8], [1, 2, 3, 4], "", None)


def step_items(completions):
    return [(k, c, r) for k, c in enumerate(completions)
            for r in trace_rounds(c.step_map, len(c.prompt_ids), 4, c.tail_step_map)]


def test_loss_token_weights_of_both_normalisations_hand_computed():
    """Prompt 7, block 4: SHORT (2 tokens; the tail after the cut is context) is one round row, LONG
    (4 tokens at steps 1..4, three of them in block [8, 12)) three; L1 = 4. step: every token weighs
    1 / (L1 * 4 rows) = 1/16; response: 1 / (length * 2 responses) = 1/4 and 1/8."""
    items = step_items((SHORT, LONG))
    assert [(k, len(r.loss)) for k, _, r in items] == [(0, 2), (1, 2), (1, 1), (1, 1)]
    step = row_weights(items, "step", width=4, rows=4, responses=2, updates=1)
    response = row_weights(items, "response", width=4, rows=4, responses=2, updates=1)
    assert step == [1 / 16] * 4 and response == [1 / 4, 1 / 8, 1 / 8, 1 / 8]
    batch = pack([group_rounds(items, response, "response", 4, 10**6)], 3, 0, [1.0, -1.0])
    torch.testing.assert_close(batch.token_weight, torch.tensor([1 / 4, 1 / 4, 1 / 8, 1 / 8, 1 / 8, 1 / 8]))
    assert batch.token_weight.sum() == pytest.approx(1.0)    # each response weighs 1 / responses


def test_a_100_and_a_1000_token_response_weigh_9_and_91_percent_under_step():
    """DESIGN.md §7: TraceRL's L1 makes every loss token weigh the same (100/1100 = 9.1%); dividing by
    the response's own length weighs both responses 50%."""
    comps = [Completion([1] * 4, [2] * n, list(range(1, n + 1)), "", None) for n in (100, 1000)]
    items = step_items(comps)
    for norm, short_share in (("step", 100 / 1100), ("response", 0.5)):
        weights = row_weights(items, norm, width=1000, rows=len(items), responses=2, updates=1)
        per_response = [sum(w * len(r.loss) for (k, _, r), w in zip(items, weights) if k == j) for j in (0, 1)]
        assert per_response[0] / sum(per_response) == pytest.approx(short_share)


@pytest.mark.parametrize("norm, expected", [("step", 2 / 16), ("response", 0.0)])
@pytest.mark.parametrize("rows, update_tokens", [("response", 10**6), ("response", 1), ("round", 10**6)])
def test_policy_update_loss_hand_computed(norm, expected, rows, update_tokens):
    """One on-policy update (ratio 1, no KL): each token's term is -A. SHORT (A = +1, 2 tokens) and LONG
    (A = -1, 4 tokens): step (-2 + 4) / 16 = 0.125; response -2/4 + 4/8 = 0; with the rounds of a
    response beside one clean stream or each round in a micro-batch of its own alike."""
    model = load_model(TINY)
    cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", update_tokens=update_tokens, update_rows=rows,
                      kl_beta=0.0, loss_norm=norm, dtype="fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    stats = policy_update(model, None, [SHORT, LONG], [1.0, -1.0], cfg, Runtime(torch.device("cpu")), optimizer, 0)
    assert stats["loss"] == pytest.approx(expected, abs=1e-6) and stats["rounds"] == 4
    assert stats["compile_s"] == 0.0    # dense masks compile nothing


def test_update_progress_starts_at_zero_and_counts_every_micro_batch():
    """progress(done, total) is called once before the first micro-batch (a first compile and the old
    log-probs' pass follow it: `bench rl` shows when the update began) and once after each: with
    one-token micro-batches every round row is a micro-batch of its own (4 rows here)."""
    model = load_model(TINY)
    cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", update_tokens=1, update_rows="round",
                      kl_beta=0.0, dtype="fp32")
    calls = []
    policy_update(model, None, [SHORT, LONG], [1.0, -1.0], cfg, Runtime(torch.device("cpu")),
                  torch.optim.AdamW(model.parameters(), lr=0.0), 0, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]


def test_an_update_out_of_gpu_memory_says_which_flags_help(monkeypatch):
    """Out of memory (the H100 of 2026-12-06 beside 17 verifier processes) is one line naming the
    levers, not torch's traceback."""
    import dice.rl.update
    from dice.errors import UserError

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 704.00 MiB.")

    monkeypatch.setattr(dice.rl.update, "_train_micro_batch", out_of_memory)
    model = load_model(TINY)
    cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", update_tokens=16384, dtype="fp32")
    with pytest.raises(UserError, match=r"--update-tokens 8192 or turn on gradient checkpointing"):
        policy_update(model, None, [SHORT, LONG], [1.0, -1.0], cfg, Runtime(torch.device("cpu")),
                      torch.optim.AdamW(model.parameters()), 0)
    # with checkpointing on (the 4B on the H100 of 2026-12-06) smaller micro-batches are the one lever left
    cfg = dataclasses.replace(cfg, gradient_checkpointing=True)
    with pytest.raises(UserError, match=r"pass --update-tokens 8192$"):
        policy_update(model, None, [SHORT, LONG], [1.0, -1.0], cfg, Runtime(torch.device("cpu")),
                      torch.optim.AdamW(model.parameters()), 0)


@pytest.mark.parametrize("updates, rows_per_update, steps", [(1, 256, 1), (2, 256, 2), (0, 256, 1), (0, 3, 2)])
def test_later_updates_of_a_step_are_measured_against_the_rollout_policy(updates, rows_per_update, steps):
    """--updates-per-step U (0: one per --rows-per-update rounds; here 6 rounds): every minibatch's ratio
    is to the log-probs the rollout policy gave, taken before the first update; with one update it is
    on-policy (ratio 1, no KL to itself)."""
    torch.manual_seed(0)
    model = load_model(TINY)
    prompt = list(range(10, 17))
    completions = [Completion(prompt, [5, 6, 7, 8, 9], [1, 2, 2, 3, 4], "", None),
                   Completion(prompt, [9, 8, 7, 6, 5], [1, 1, 2, 3, 3], "", None)]
    assert len(step_items(completions)) == 6         # 3 round rows each
    cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", updates_per_step=updates,
                      rows_per_update=rows_per_update, kl_beta=0.01, dtype="fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    taken = []
    optimizer.register_step_post_hook(lambda *_: taken.append(1))
    stats = policy_update(model, None, completions, [1.0, -1.0], cfg, Runtime(torch.device("cpu")), optimizer, 0)
    assert stats["responses_trained"] == 2 and len(taken) == steps
    assert (stats["kl"] > 1e-6) == (steps > 1), stats


@pytest.mark.parametrize("updates", [1, 2])
def test_shared_clean_stream_update_equals_the_per_round_update_fp64(updates):
    """policy_update with a response's rounds beside one clean stream (update_rows response, in small
    token budgets that split some responses) and with one doubled row per round: the same loss, KL
    and parameters after each plain SGD step (float64; with 2 updates the second step's ratio and
    KL to the rollout log-probs act)."""
    prompt = list(range(10, 17))
    completions = [Completion(prompt, [5, 6, 7, 8, 9, 10], [1, 2, 2, 3, 4, 5], "", None, [3, 4, 5], [6, 5, 5]),
                   Completion(prompt[:5], [9, 8, 7, 6, 5, 4, 3], [1, 1, 2, 3, 3, 5, 4], "", None),
                   Completion(prompt[:2], [4, 4], [1, 2], "", None)]
    results = []
    for rows, budget in (("round", 10**6), ("response", 10**6), ("response", 25)):
        model = load_model(TINY).double()
        cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", updates_per_step=updates, update_rows=rows,
                          update_tokens=budget, kl_beta=0.05, dtype="fp32", grad_clip=1e9)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        stats = policy_update(model, None, completions, [1.0, -0.5, 0.25], cfg, Runtime(torch.device("cpu")),
                              optimizer, 0)
        results.append((stats, [p.detach().clone() for p in model.parameters()]))
    (want, want_params), *others = results
    assert want["rounds"] == 3 + 3 + 2 and (want["kl"] > 1e-9) == (updates > 1)
    for stats, params in others:
        for key in ("loss", "kl", "clip_fraction"):
            assert stats[key] == pytest.approx(want[key], rel=1e-9, abs=1e-15), key
        for a, b in zip(params, want_params):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)
    assert others[0][0]["flops"] < others[1][0]["flops"] < want["flops"]   # split streams cost more, rows most


def random_completions(seed: int, count: int) -> list[Completion]:
    """Responses of 1 to 40 tokens after prompts of 1 to 20, block 4, each token unmasked at one of
    its block's 4 steps (several at one step: dynamic remasking)."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        prompt_len, n = rng.randint(1, 20), rng.randint(1, 40)
        steps = [4 * ((prompt_len + i) // 4) + rng.randint(1, 4) for i in range(n)]
        out.append(Completion(rng.choices(range(300), k=prompt_len), rng.choices(range(300), k=n), steps, "", None))
    return out


class BesideABusierRank(Runtime):
    """One process of several whose busiest has two more micro-batches a step (and a longer response)."""

    def all_max(self, value: float) -> float:
        return value + 2


def planned(completions, advantages, budget: int, rt=None, rows_per_update: int = 256, use_flex: bool = True):
    """`update_plan`'s micro-batches of every optimiser step (block 4, mask 319) under --update-tokens
    budget, planned for FlexAttention or for dense masks; no forward runs."""
    cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", update_tokens=budget, rows_per_update=rows_per_update,
                      dtype="fp32")
    plan, _, _ = update_plan(completions, advantages, cfg, rt or Runtime(torch.device("cpu")), 4, 319, 0, use_flex)
    return plan


def test_every_flex_micro_batch_of_two_different_steps_has_the_shape_1_by_update_tokens():
    """Two RL steps of different responses, lengths, advantages and optimiser steps, planned for
    FlexAttention (no kernel runs): every micro-batch, the empty ones a busier rank asks for
    included, is one row of exactly --update-tokens, so the compiled kernels meet one shape."""
    first = planned(random_completions(1, 12), [1.0, -1.0, 0.5, None] * 3, 160, rows_per_update=8)
    second = planned(random_completions(2, 7), [-0.3, 0.9, 1.2, -1.1, None, 0.4, -0.2], 160,
                       rt=BesideABusierRank(torch.device("cpu")))
    assert len(first) > 1 and all(len(step) > 1 for step in first)
    assert any(b.tokens == 4 for step in second for b in step)         # an empty micro-batch: one block
    for plan in (first, second):
        assert {tuple(b.ids.shape) for step in plan for b in step} == {(1, 160)}
        assert all(b.tokens <= 160 and int((b.sample_ids >= 0).sum()) == b.tokens for step in plan for b in step)


def test_a_group_over_the_budget_takes_the_fewest_budgets_that_hold_it():
    """--update-tokens 40 under responses of up to 60 tokens: a group of one round passes it (the
    clean stream and one copy); its micro-batch alone has 2 or 3 budgets, every other 1."""
    plan = planned(random_completions(1, 12), [1.0, -1.0, 0.5, None] * 3, 40)
    shapes = [(b.ids.shape, b.tokens) for step in plan for b in step]
    assert all(shape == (1, 40 * -(-tokens // 40)) for shape, tokens in shapes)
    assert {shape[1] for shape, _ in shapes} >= {40, 80}


def test_flex_plan_gives_the_dense_plans_log_probs_in_the_same_order_fp64():
    """The FlexAttention plan (groups in one row padded to the budget) and the dense plan (one unpadded
    row per group) of one step, both evaluated with the dense mask: the same loss tokens in the same
    order, with the same targets, weights, advantages and log-probs (padding changes nothing)."""
    model = load_model(TINY).double()
    completions, advantages = random_completions(3, 8), [1.0, -1.0, 0.5, 0.25, -0.75, None, 2.0, -0.5]
    flex, dense = (planned(completions, advantages, 160, rows_per_update=10, use_flex=use) for use in (True, False))
    assert len(flex) == len(dense) > 1 and [len(step) for step in flex] == [len(step) for step in dense]
    assert any((b.sample_ids < 0).any() for step in flex for b in step)
    assert any(b.ids.shape[0] > 1 for step in dense for b in step)     # several groups in a flex row
    with torch.no_grad():
        for f, d in zip(flex, dense):
            for key in ("targets", "token_weight", "advantage"):
                assert torch.equal(torch.cat([getattr(b, key) for b in f]), torch.cat([getattr(b, key) for b in d]))
            got = torch.cat([packed_logprobs(model, b, use_flex=False) for b in f])
            want = torch.cat([packed_logprobs(model, b, use_flex=False) for b in d])
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


class FakeTime:
    """`time` for dice.model.packing whose clock moves only when a timed micro-batch says how long it took."""
    now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def takes(self, seconds: float):
        return lambda: setattr(self, "now", self.now + seconds)


def test_compile_clock_counts_a_new_shapes_micro_batches_beyond_the_steady_ones(monkeypatch):
    fake, met, cpu = FakeTime(), set(), torch.device("cpu")
    monkeypatch.setattr(dice.model.packing, "time", fake)
    one, two = (SimpleNamespace(ids=torch.zeros(1, n)) for n in (8, 16))
    first = CompileClock(met, cpu)
    for kind, seconds in (("forward", 3.0), ("forward", 1.0), ("train", 9.0), ("train", 2.0), ("train", 2.5)):
        first.run(kind, one, fake.takes(seconds))
    assert first.seconds() == pytest.approx((3.0 - 1.0) + (9.0 - 2.25))       # beyond the median of the others
    later = CompileClock(met, cpu)
    for seconds in (2.0, 2.5, 2.0):
        later.run("train", one, fake.takes(seconds))
    assert later.seconds() == 0.0                                              # nothing new: nothing compiled
    bigger = CompileClock(met, cpu)
    for batch, seconds in ((two, 7.0), (one, 2.0), (one, 2.0)):
        bigger.run("train", batch, fake.takes(seconds))
    bigger.run("forward", two, fake.takes(1.5))
    assert bigger.seconds() == pytest.approx((7.0 - 2 * 2.0) + 1.5)          # scaled by length; alone: all of it
    dense = CompileClock(None, cpu)
    dense.run("train", one, fake.takes(9.0))
    assert dense.seconds() == 0.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_raises_positive_and_lowers_negative_advantage_tokens(sign):
    model = load_model(TINY)
    prompt, tokens = list(range(10, 17)), [5, 6, 7, 8, 9]
    comp = Completion(prompt, tokens, [1, 2, 2, 3, 4], "", None)
    rounds = trace_rounds(comp.step_map, len(prompt), 4)
    batch = pack([group_rounds([(0, comp, r) for r in rounds], [1 / len(tokens)] * len(rounds), "response", 4, 10**6)],
                 model.config.mask_token_id, 0, [sign])
    before = packed_logprobs(model, batch, use_flex=False).detach()
    loss, _ = policy_loss(packed_logprobs(model, batch, False), before, batch.advantage, clip_eps=0.2, kl_beta=0.0)
    (loss * batch.token_weight).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
    after = packed_logprobs(model, batch, use_flex=False).detach()
    assert len(before) == len(tokens)
    assert ((after - before) * sign > 0).all()


TASKS = [Task(name=f"t{i}", level=1 + i % 2, source=f"class Model:\n    scale = {i}\n") for i in range(8)]


def rl_model_folder(folder):
    """A from-scratch model whose tokenizer knows the (one-shot-free) kernel prompts of TASKS."""
    from dice.tasks.prompts import chat_prompt, kernel_prompt
    texts = [chat_prompt(kernel_prompt(t.source, one_shot=None)) for t in TASKS] * 3
    make_tiny_model_folder(folder, texts, vocab_size=400)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dice_one_shot": None}))
    return folder


@pytest.mark.slow
def test_tiny_run_with_python_reward_raises_the_reward(tmp_path):
    tasks = TASKS
    folder = rl_model_folder(tmp_path / "model")
    chosen = set(range(100, 200))      # a quarter of the vocabulary: about 0.25 at the start

    def share_of_target(ts, completions):
        return [sum(t in chosen for t in c.tokens) / max(len(c.tokens), 1) for c in completions]

    cfg = TrainConfig(phase="e2e", model=str(folder), out=str(tmp_path / "out"), steps=8, tasks_per_step=4,
                      group_size=8, max_new_tokens=12, lr=5e-3, rollout_batch=32, seed=0,
                      kl_beta=0.0)
    train_rl(cfg, reward_fn=share_of_target, tasks=tasks)
    records = [json.loads(l) for l in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records]
    assert len(rewards) == 8 and all(r["step_time_s"] > 0 and r["compile_s"] == 0.0 for r in records)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert load_model(tmp_path / "out" / "final").config.extra["dice_one_shot"] is None


@pytest.mark.slow
def test_train_rl_loss_of_the_shared_stream_equals_the_per_round_rows(tmp_path):
    """train.py's RL loop (--phase e2e; infill shares the code) on a fixed seed: one step with a
    response's rounds beside one clean stream and one with a doubled row per round roll out the same
    responses and report the same loss."""
    folder = rl_model_folder(tmp_path / "model")

    def reward(tasks, completions):
        return [sum(t % 3 == 0 for t in c.tokens) / max(len(c.tokens), 1) for c in completions]

    losses = []
    for rows in ("response", "round"):
        cfg = TrainConfig(phase="e2e", model=str(folder), out=str(tmp_path / rows), steps=1, tasks_per_step=2,
                          group_size=4, max_new_tokens=12, rollout_batch=8, update_rows=rows, seed=3)
        train_rl(cfg, reward_fn=reward, tasks=TASKS[:2])
        record = json.loads((tmp_path / rows / "metrics.jsonl").read_text())
        assert record["groups_kept_pct"] == 100
        losses.append(record["loss"])
    assert losses[0] != 0 and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_step_metrics_count_the_results_of_every_rollout_batch(tmp_path, monkeypatch):
    """2 tasks x 4 samples in rollout batches of 4: the reward runs once per block in which samples
    finish (here once per batch: a batch's samples finish together), and every sample is compiled,
    correct and 2x faster, so each rate is 100% (counting only the last batch gave 50%). The step's
    tasks are given to the verifier to prepare their references before the first scoring call."""
    from types import SimpleNamespace

    import dice.sampling.completion
    from dice.rl.reward import verifier_reward

    class AllCorrect:
        calls, prepared = 0, []

        def prepare(self, task_srcs, **opts):
            AllCorrect.prepared.append((AllCorrect.calls, sorted(task_srcs), opts["timing"]))

        def map(self, pairs, **opts):
            AllCorrect.calls += 1
            return [SimpleNamespace(compiled=True, correct=True, speedup=2.0) for _ in pairs]

    monkeypatch.setattr(dice.sampling.completion, "extract_code", lambda text: "code")   # any code block
    cfg = TrainConfig(phase="e2e", model=str(rl_model_folder(tmp_path / "model")), out=str(tmp_path / "out"),
                      steps=1, tasks_per_step=2, group_size=4, rollout_batch=4, max_new_tokens=8, reward="speedup")
    train_rl(cfg, reward_fn=verifier_reward(AllCorrect(), "e2e", kind="speedup"), tasks=TASKS[:2])
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text())
    assert AllCorrect.calls == 2
    assert AllCorrect.prepared == [(0, sorted(t.source for t in TASKS[:2]), True)]
    assert record["compiled_pct"] == record["correct_pct"] == record["fast_1_pct"] == 100
    assert record["reward_mean"] == pytest.approx(1.5)


@pytest.mark.slow
def test_two_process_gloo_rl_matches_one_process(tmp_path):
    """Rollouts are seeded by task slot and eval task i by i, so 1 and 2 processes see the same
    first step and the same evaluations; under FSDP every process joins the evaluation (rank 0
    alone deadlocked in the parameter all-gathers). A resume on another process count is refused in
    one line (a step's optimiser steps group each process's rows, `dice.rl.update.update_plan`)."""
    model = rl_model_folder(tmp_path / "model")
    script = str(Path(__file__).parent / "fixtures" / "rl_run.py")
    one = run_bounded([sys.executable, script, str(model), str(tmp_path / "one")], timeout=300)
    assert one.returncode == 0, one.stderr
    two = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       script, str(model), str(tmp_path / "two")], timeout=300)
    assert two.returncode == 0, two.stderr
    a = [json.loads(l) for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    steps_a, steps_b = ([r for r in x if "reward_mean" in r] for x in (a, b))
    evals_a, evals_b = ([r for r in x if "eval_reward" in r] for x in (a, b))
    assert len(steps_a) == len(steps_b) == 2
    for key in ("reward_mean", "mean_response_len", "groups_kept_pct", "compiled_pct", "correct_pct"):
        assert steps_a[0][key] == pytest.approx(steps_b[0][key])
    assert steps_a[0]["loss"] == pytest.approx(steps_b[0]["loss"], rel=1e-4, abs=1e-6)
    assert [e["step"] for e in evals_a] == [e["step"] for e in evals_b] == [0, 1, 2]
    for ea, eb in zip(evals_a, evals_b):
        assert ea.keys() == eb.keys() == {"step", "eval_reward", "eval_compiled", "eval_correct", "eval_fast_1"}
        assert ea == pytest.approx(eb)
        assert eb["eval_compiled"] == 1.0   # every sample compiles: the 3 tasks of both processes are counted
    load_model(tmp_path / "two" / "final")
    spec = importlib.util.spec_from_file_location("rl_run", script)
    rl_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl_run)
    with pytest.raises(RunFolderError) as refused:   # one process resuming the two processes' run
        rl_run.run(str(model), str(tmp_path / "two"), steps=3, resume=True)
    assert "torchrun --nproc_per_node: the run was started with 2, this one has 1; resume with torchrun " \
           "--nproc_per_node 2, or start a new run in another --out" in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_offload_on_one_process_trains_as_the_plain_run(tmp_path):
    """`--offload cpu`: one process in a process group of its own, the model sharded by FSDP2 with
    its CPUOffloadPolicy (here on the CPU, where the policy moves nothing: the path of the 4B on an
    80 GB GPU, whose copies a GPU test would add), generation inside FullParameters, AdamW on
    DTensors: the same rollouts, rewards and evaluations as the plain run, the same loss, and a
    final model that loads."""
    model = rl_model_folder(tmp_path / "model")
    script = str(Path(__file__).parent / "fixtures" / "rl_run.py")
    runs = {}
    for name, extra in (("plain", []), ("offload", ["offload"])):
        done = run_bounded([sys.executable, script, str(model), str(tmp_path / name), *extra], timeout=300)
        assert done.returncode == 0, done.stderr
        assert ("in host memory" in done.stdout + done.stderr) == (name == "offload"), done.stdout
        runs[name] = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    steps = {k: [r for r in v if "reward_mean" in r] for k, v in runs.items()}
    evals = {k: [r for r in v if "eval_reward" in r] for k, v in runs.items()}
    assert len(steps["plain"]) == len(steps["offload"]) == 2
    for a, b in zip(steps["plain"], steps["offload"]):
        for key in ("reward_mean", "mean_response_len", "groups_kept_pct", "correct_pct"):
            assert a[key] == pytest.approx(b[key])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert len(evals["plain"]) == len(evals["offload"]) == 3
    for a, b in zip(evals["plain"], evals["offload"]):
        assert a.keys() == b.keys() and a == pytest.approx(b)
    load_model(tmp_path / "offload" / "final")


BF16_COPY_UNDER_FSDP = """
import torch, torch.distributed as dist
from dice import load_model
from dice.runtime import shard
from dice.sampling.completion import FullParameters, bf16_copy
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = load_model("dice/assets/dice-tiny", device="cpu", dtype=torch.float32)
ids = torch.randint(0, 900, (2, 8), generator=torch.Generator().manual_seed(0))
plain = bf16_copy(model)(ids)
shard(model, torch.device("cpu"), offload=True)
with FullParameters(model):
    sharded = bf16_copy(model)(ids)
assert torch.equal(plain, sharded), (plain - sharded).abs().max()
print("equal")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_rollouts_bf16_copy_of_an_fsdp_model_is_the_plain_models():
    """Under FSDP2 (torchrun, --offload cpu) the rollouts' bf16 copy is made inside FullParameters
    from the gathered weights (the state_dict would give the shards): the same bits as the copy of
    the unsharded model."""
    done = run_bounded([sys.executable, "-c", BF16_COPY_UNDER_FSDP], timeout=120)
    assert done.returncode == 0 and "equal" in done.stdout, done.stderr


def test_verifier_reward_survives_a_broken_task_and_checks_the_skeleton():
    from types import SimpleNamespace

    from dice.rl.reward import verifier_reward

    class FakeVerifier:
        """map reports a task whose reference crashes as the real one does with on_broken_task."""

        def map(self, pairs, on_broken_task=None, **opts):
            results = []
            for i, (task_src, code) in enumerate(pairs):
                if task_src == "broken":
                    on_broken_task(i, ValueError("task broken: the reference failed"))
                    results.append(None)
                else:
                    results.append(SimpleNamespace(correct=code.startswith("good"), compiled=True, speedup=2.0))
            return results

    tasks = [Task("a", 1, "ok", prefix="good", suffix="end"), Task("b", 1, "broken", prefix="good", suffix="end"),
             Task("c", 1, "ok", prefix="good", suffix="end"), Task("d", 1, "ok", prefix="good", suffix="end")]
    codes = ["good\nx\nend", "good\nx\nend", "bad\nx\nend", None]
    comps = [Completion([1], [2], [1], "", c) for c in codes]
    assert verifier_reward(FakeVerifier(), "e2e")(tasks, comps).rewards == [1.0, 0.0, 0.0, 0.0]
    assert verifier_reward(FakeVerifier(), "e2e", kind="speedup")(tasks, comps).rewards[0] == pytest.approx(1.5)
    comps[0] = Completion([1], [2], [1], "", "good\nx\nchanged end")
    assert verifier_reward(FakeVerifier(), "infill")(tasks, comps).rewards[0] == 0.0   # the suffix was not kept


def test_every_reward_scores_a_batch_prepares_tasks_and_reports_its_gpu_memory():
    """One interface (`dice.rl.reward.Reward`): a plain function's floats become Scores without
    results and its Scores pass as they are, with nothing to prepare and no GPU memory; the
    verifier's reward asks its verifier for both, and a reward that only changes the program it
    verifies (`dice.bench.replay.ReplayedReward`) keeps them."""
    from types import SimpleNamespace

    from dice.bench.replay import ReplayedReward
    from dice.rl.reward import PythonReward, Reward, Scores, VerifierReward, as_reward

    tasks = [Task("a", 1, "SRC", solution="REFERENCE")]
    comps = [Completion([1], [2], [1], "", "GENERATED")]
    plain = as_reward(lambda ts, cs: [1])
    assert isinstance(plain, PythonReward) and plain(tasks, comps) == Scores([1.0], None)
    assert plain.prepare(tasks) is None and plain.gpu_bytes() == 0
    given = Scores([0.5], ["result"])
    assert as_reward(lambda ts, cs: given)(tasks, comps) is given
    assert as_reward(plain) is plain
    with pytest.raises(NotImplementedError):
        Reward()(tasks, comps)

    calls = []
    verifier = SimpleNamespace(gpu_bytes=lambda: 3 * 2**30,
                               prepare=lambda srcs, **kw: calls.append(("prepare", srcs, kw)),
                               map=lambda pairs, **kw: calls.append(("map", pairs)) or [None] * len(pairs))
    for reward, program in ((VerifierReward(verifier, "e2e"), "GENERATED"),
                            (ReplayedReward(verifier, "e2e"), "REFERENCE")):
        calls.clear()
        reward.prepare(tasks)
        assert reward(tasks, comps) == Scores([0.0], [None]) and reward.gpu_bytes() == 3 * 2**30
        assert calls == [("prepare", ["SRC"], {"timing": False, "trials": 3, "timeout_s": 60.0}),
                         ("map", [("SRC", program)])]


def test_each_torchrun_process_verifies_on_its_own_gpu_with_its_share_of_the_workers(monkeypatch):
    from dice.runtime import rank_verifier
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert rank_verifier(14, torch.device("cuda", 2)) == {"workers": 3, "device": "cuda:2"}
    assert rank_verifier(2, torch.device("cuda", 3)) == {"workers": 1, "device": "cuda:3"}
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert rank_verifier(14, torch.device("cuda", 0)) == {"workers": 14, "device": "cuda:0"}
    assert rank_verifier(8, torch.device("cpu")) == {"workers": 8, "device": "cuda"}   # says there is no GPU
