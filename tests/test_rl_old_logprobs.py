"""The update's old log-probs computed beside the reward's tail (`dice.rl.update.OldLogprobs`): each round's
against its own doubled row, stopping once the reward is in, and an update that uses them equal to
one that computes them itself; `generate_and_score` runs the pass after the last token."""
import copy
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dice import load_model
from dice.config import TrainConfig
from dice.rl.rollout import generate_and_score
from dice.rl.update import OldLogprobs, policy_update, trace_rounds
from dice.runtime import Runtime
from dice.sampling.completion import Completion
from dice.sft.diffusion import doubled_logits
from test_packing import COMPLETIONS, MASK, TINY   # tails, blocks of 1 to 4 rounds, a 2-token response

CPU = Runtime(torch.device("cpu"))
GRAD_RTOL = 1e-5    # float32 sums of the same terms in another order, over a few thousand terms


def config(**changes) -> TrainConfig:
    return TrainConfig(phase="e2e", model=str(TINY), out="unused", dtype="fp32", attention="dense", kl_beta=0.0,
                       **changes)


def round_row_logprobs(model, c: Completion, rnd) -> torch.Tensor:
    """The round's own doubled row [x_t ; x_0] through SFT's doubled forward (its golden tests): log p
    of each loss token, in position order."""
    seq = torch.tensor(c.prompt_ids + c.tokens + c.tail_tokens)
    noisy = seq.clone()
    noisy[rnd.masked] = MASK
    loss_at = torch.zeros(len(seq), dtype=torch.bool)
    loss_at[rnd.loss] = True
    logits = doubled_logits(model, noisy[None], seq[None], torch.arange(len(seq))[None],
                            torch.zeros(1, len(seq), dtype=torch.long), loss_at[None], use_flex=False)
    return logits.log_softmax(-1).gather(1, seq[loss_at][:, None])[:, 0]


@pytest.mark.parametrize("budget", [12, 10**6])
def test_each_rounds_old_log_probs_are_its_own_doubled_rows(budget):
    model = load_model(TINY)
    old = OldLogprobs(model, config(update_tokens=budget), CPU, pad_id=0)
    old(COMPLETIONS, lambda: False, offset=5)
    rounds = {(5 + k, rnd.index): (c, rnd) for k, c in enumerate(COMPLETIONS)
              for rnd in trace_rounds(c.step_map, len(c.prompt_ids), 4, c.tail_step_map)}
    assert set(old.values) == set(rounds)
    with torch.no_grad():
        for key, (c, rnd) in rounds.items():
            torch.testing.assert_close(old.values[key], round_row_logprobs(model, c, rnd), atol=1e-5, rtol=0)


def test_the_pass_stops_once_the_reward_is_in():
    model = load_model(TINY)
    done = OldLogprobs(model, config(update_tokens=12), CPU, pad_id=0)
    done(COMPLETIONS, lambda: True)
    assert done.values == {}
    old = OldLogprobs(model, config(update_tokens=12), CPU, pad_id=0)
    answers = iter([False, False, True])   # on entry, before the first micro-batch, before the second
    old(COMPLETIONS, lambda: next(answers))
    computed = len(old.values)
    assert 0 < computed < sum(len(trace_rounds(c.step_map, len(c.prompt_ids), 4, c.tail_step_map))
                              for c in COMPLETIONS)


@pytest.mark.parametrize("budget, stop_after", [(40, None), (40, 1), (10**6, None)])
def test_an_update_on_them_equals_one_that_computes_them(budget, stop_after):
    """Two optimiser steps (the ratio against the rollout policy): the same loss, clip fraction,
    gradient norm and weights whether the old log-probs came from beside the reward (all, or only
    the first micro-batch's, the rest computed by the update) or from the update's own pass.
    The two paths batch the old log-probs differently, so their gradients agree to float32's
    roundoff (GRAD_RTOL), not bit for bit on every CPU (AVX512 sums in another order). SGD's step is
    linear in the gradient, so the weights then agree within lr x steps x GRAD_RTOL x the gradient's
    norm (a bound on every element); AdamW's step divides by sqrt(v) + 1e-8 and would amplify a
    roundoff difference in a near-zero gradient up to lr itself."""
    lr, steps = 1.0, 2
    cfg = config(updates_per_step=steps, update_tokens=budget, clip_eps=0.2)
    advantages = [1.0, -0.5, 0.7, -1.0]
    models = [load_model(TINY) for _ in range(2)]
    out = []
    for model, beside in zip(models, (False, True)):
        old = None
        if beside:
            old = OldLogprobs(model, cfg, CPU, pad_id=0)
            answers = iter([False] * (1 + (stop_after or 99)) + [True] * 99)   # entry, then per micro-batch
            old(COMPLETIONS, lambda: next(answers))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        out.append(policy_update(model, None, copy.deepcopy(COMPLETIONS), advantages, cfg, CPU, optimizer, 0,
                                 old_logprobs=old))
    for key in ("loss", "clip_fraction", "grad_norm", "kl"):
        assert out[1][key] == pytest.approx(out[0][key], rel=GRAD_RTOL, abs=1e-7), key
    assert out[0]["clip_fraction"] > 0   # the second step moved the ratio: the old log-probs mattered
    weights = lr * steps * GRAD_RTOL * out[0]["grad_norm"]
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, atol=weights, rtol=0)


def test_generate_and_score_runs_the_pass_after_the_last_token_beside_the_reward():
    """while_scoring comes once, with every completion, while a scoring call is still running, and
    its finished() turns true once the reward is in; the reward's exposed tail ends there, not when
    the pass does."""
    model = load_model(TINY)
    release, seen = threading.Event(), []

    def score(owners, completions):
        release.wait(30)
        return SimpleNamespace(rewards=[1.0] * len(owners), results=None)

    def beside(completions, finished):
        seen.append((len(completions), all(c is not None for c in completions), finished()))
        release.set()
        while not finished():
            pass
        seen.append(finished())
        time.sleep(2.0)   # the pass overruns the reward: not the reward's tail

    tokenizer = SimpleNamespace(eos_token_ids=(), decode=lambda ids: "")
    *_, timing = generate_and_score(model, tokenizer, [[1, 2, 3]] * 3, [0, 1, 2], [0, 1, 2], score, batch_size=2,
                                    max_new_tokens=8, overlap="batch", while_scoring=beside)
    assert seen == [(3, True, False), True]
    assert timing["verify_wait_s"] < 2.0
