"""What the BiC-RL optimiser sees (DESIGN.md §7): which round rows form each optimiser step, the
gradient clip in DICE's effective units, and AdamW's moments restarting every RL step."""
import json
import math
from pathlib import Path

import pytest
import torch

import dice.rl.train_rl
import dice.rl.update
from dice import load_model
from dice.config import RL_GRAD_CLIP, TrainConfig
from dice.rl.train_rl import train_rl
from dice.rl.update import minibatches, policy_update, restart_moments
from dice.sampling.completion import Completion
from dice.runtime import Runtime

from test_rl import TASKS, rl_model_folder

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"


def rows_of(rounds_per_response):
    """Round rows in rollout order, named (response, round)."""
    return [(k, r) for k, n in enumerate(rounds_per_response) for r in range(n)]


def test_minibatches_are_consecutive_runs_of_whole_responses():
    """4 responses x 4 rounds in 4 steps: step u trains response u's 4 rounds (the old every-U-th
    cut gave step u round u of every response); 2 + 3 + 1 rows in 2 steps: 3 and 3, the second
    response split between them; 7 rows in 3 steps: 3, 2, 2."""
    steps = minibatches(rows_of([4, 4, 4, 4]), 4)
    assert steps == [[(u, 0), (u, 1), (u, 2), (u, 3)] for u in range(4)]
    assert minibatches(rows_of([2, 3, 1]), 2) == [[(0, 0), (0, 1), (1, 0)], [(1, 1), (1, 2), (2, 0)]]
    assert [len(s) for s in minibatches(list(range(7)), 3)] == [3, 2, 2]
    assert minibatches(list(range(5)), 1) == [list(range(5))]


def test_shuffled_minibatches_are_a_seeded_partition_that_mixes_responses():
    items = rows_of([4] * 8)
    steps = minibatches(items, 4, "shuffle", seed=3)
    assert sorted(row for step in steps for row in step) == items
    assert [len(s) for s in steps] == [8, 8, 8, 8]
    assert steps == minibatches(items, 4, "shuffle", seed=3) != minibatches(items, 4, "shuffle", seed=4)
    assert all(len({k for k, _ in step}) > 1 and len({r for _, r in step}) > 1 for step in steps)


def test_policy_update_steps_on_whole_responses(monkeypatch):
    """Two responses of 3 round rows each and --rows-per-update 3: two optimiser steps, the first on
    response 0's three rounds, the second on response 1's."""
    seen = []
    real = dice.rl.update.group_rounds
    monkeypatch.setattr(dice.rl.update, "group_rounds", lambda items, *args: seen.append([k for k, _, _ in items])
                        or real(items, *args))
    model = load_model(TINY)
    prompt = list(range(10, 17))
    completions = [Completion(prompt, [5, 6, 7, 8, 9], [1, 2, 2, 3, 4], "", None),
                   Completion(prompt, [9, 8, 7, 6, 5], [1, 1, 2, 3, 3], "", None)]
    cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", rows_per_update=3, dtype="fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    policy_update(model, None, completions, [1.0, -1.0], cfg, Runtime(torch.device("cpu")), optimizer, 0)
    assert seen == [[0, 0, 0], [1, 1, 1]]


def test_dices_gradient_is_a_32nd_of_ours_so_its_clip_of_1_is_32_here():
    """DICE (train/rl_sdar.py): one row per micro-batch, its loss divided by the 32 accumulation steps
    (line 807) and again by DeepSpeed (engine.py `_backward_prologue`: loss / gradient_accumulation_steps),
    summed over 32 micro-batches, averaged over 8 ranks. Rows whose loss has gradient 1 each: DICE's
    gradient is 8 * 32 / (32 * 32) / 8 = 1/32, ours (the mean over the step's rows) 1."""
    ranks, accumulation = 8, 32
    dice_grad = sum(sum(1.0 / accumulation / accumulation for _ in range(accumulation)) for _ in range(ranks)) / ranks
    ours = sum(1.0 for _ in range(ranks * accumulation)) / (ranks * accumulation)
    assert dice_grad == pytest.approx(1 / 32) and ours == 1.0
    assert RL_GRAD_CLIP == pytest.approx(1.0 * ours / dice_grad)


def test_grad_clip_defaults_per_phase_and_a_given_clip_wins():
    assert TrainConfig(phase="e2e").grad_clip == 32.0 and TrainConfig(phase="infill").grad_clip == 32.0
    assert TrainConfig(phase="sft").grad_clip == 1.0
    assert TrainConfig(phase="e2e", grad_clip=1.0).grad_clip == 1.0
    assert TrainConfig(phase="e2e", grad_clip=math.inf).grad_clip == math.inf


@pytest.mark.parametrize("clip", [1e-3, 32.0])
def test_the_clip_bounds_the_gradient_of_the_loss_as_defined(clip):
    """SGD with lr 1 moves the weights by the clipped gradient: its norm is min(||g||, clip), g the
    gradient of the step's loss (the mean over its rows), read with no clip."""
    def update_norm(grad_clip):
        model = load_model(TINY)
        before = [p.detach().clone() for p in model.parameters()]
        comp = Completion(list(range(10, 17)), [5, 6, 7, 8, 9], [1, 2, 2, 3, 4], "", None)
        cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", kl_beta=0.0, grad_clip=grad_clip, dtype="fp32")
        policy_update(model, None, [comp, comp], [1.0, -0.5], cfg, Runtime(torch.device("cpu")),
                      torch.optim.SGD(model.parameters(), lr=1.0), 0)
        return float(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm())

    raw = update_norm(math.inf)
    assert 1e-3 < raw < 32
    assert update_norm(clip) == pytest.approx(min(raw, clip), rel=1e-4)


def adam_path(lifetime, grads):
    """One scalar weight (0), AdamW lr 0.1, betas (0.9, 0.999), no decay; one update per RL step."""
    w = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.AdamW([w], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    path = []
    for g in grads:
        restart_moments(optimizer, lifetime)
        w.grad = torch.tensor(g)
        optimizer.step()
        path.append(float(w.detach()))
    return path


def test_step_lifetime_makes_every_rl_steps_update_adams_first():
    """Gradients +1 then -0.5. A first Adam step moves by lr * g / |g|: -0.1, then back +0.1 with
    fresh moments. Kept moments: m = 0.9 * 0.1 - 0.1 * 0.5 = 0.04, v = 0.999 * 0.001 + 0.001 * 0.25
    = 0.001249; bias-corrected 0.04 / 0.19 and 0.001249 / 0.001999, so the second move is
    -0.1 * 0.210526 / 0.790451 = -0.026634."""
    assert adam_path("step", [1.0, -0.5]) == pytest.approx([-0.1, 0.0], abs=1e-6)
    assert adam_path("run", [1.0, -0.5]) == pytest.approx([-0.1, -0.126634], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("lifetime, states", [("step", [0, 0]), ("run", [0, "kept"])])
def test_the_rl_loop_restarts_the_moments_for_each_steps_update(tmp_path, monkeypatch, lifetime, states):
    """Each update starts from fresh moments under `step` (kept under `run`), and `step` frees them
    before the next rollouts: no moments exist while the second step generates."""
    made, at_update, at_rollout = [], [], []
    real_update, real_sample, real_make = (dice.rl.train_rl.policy_update, dice.rl.train_rl.sample_step,
                                           dice.rl.train_rl.make_optimizer)

    def make(*args, **kwargs):
        made.append(real_make(*args, **kwargs))
        return made[-1]

    def update(model, ref, completions, advantages, cfg, rt, optimizer, *args, **kwargs):
        at_update.append(len(optimizer.state))
        return real_update(model, ref, completions, advantages, cfg, rt, optimizer, *args, **kwargs)

    def sample(*args, **kwargs):
        at_rollout.append(len(made[0].state))
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(dice.rl.train_rl, "make_optimizer", make)
    monkeypatch.setattr(dice.rl.train_rl, "policy_update", update)
    monkeypatch.setattr(dice.rl.train_rl, "sample_step", sample)
    cfg = TrainConfig(phase="e2e", model=str(rl_model_folder(tmp_path / "model")), out=str(tmp_path / "out"),
                      steps=2, tasks_per_step=1, group_size=4, rollout_batch=4, max_new_tokens=8,
                      optimizer_state=lifetime)
    train_rl(cfg, reward_fn=lambda tasks, completions: [float(i % 2) for i in range(len(completions))],
             tasks=TASKS[:1])
    assert [("kept" if n else 0) for n in at_update] == states
    assert [("kept" if n else 0) for n in at_rollout] == states
    assert json.loads((tmp_path / "out" / "run.json").read_text())["--optimizer-state"] == lifetime
