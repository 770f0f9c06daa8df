"""Rewards of BiC-RL (DESIGN.md §7): what a reward returns, and the kernel verifier as one.

A reward is any `reward_fn(tasks, completions)` returning a list of floats or `Scores` (the rewards
and the verifier results behind them); `verifier_reward` is DICE's: 1 for a kernel that compiles
and is correct (infill: and keeps the task's prefix and suffix), else 0, judged by our verifier's
strict check or (`rules="dice"`) by DICE's own. `rl_rewards` gives an RL run its reward and
its evaluation's, each process with a Verifier of its own (`rank_verifier`).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from ..protocols import DICE_REWARD
from ..tasks.load import Task
from ..tasks.prompts import keeps_skeleton
from .rollout import Completion


@dataclass
class Scores:
    """What a reward returns: one reward per completion, and the verifier's results behind them
    (None for a completion it never ran: no code block, a dropped skeleton, a broken task), or
    `results=None` for a reward without a verifier."""
    rewards: list[float]
    results: list | None = None


RewardFn = Callable[[list[Task], list[Completion]], "Scores | list[float]"]


def score(reward_fn: RewardFn, tasks: list[Task], completions: list[Completion]) -> Scores:
    """`reward_fn` on a batch; a plain Python reward's list of floats becomes Scores without results."""
    out = reward_fn(tasks, completions)
    return out if isinstance(out, Scores) else Scores([float(r) for r in out])


def verifier_reward(verifier, phase: str, kind: str = "correct", timing: bool = False, trials: int = 3,
                    timeout_s: float = 60.0, rules: str = "strict") -> Callable[[list[Task], list[Completion]], Scores]:
    """Reward through the kernel verifier: 1 if compiled and correct (infill: and the program
    keeps the task's prefix and suffix), else 0; kind "speedup" adds 0.5 * clamp(log2 speedup,
    0, 2). `rules`: "strict" (ours: `trials` structured trials at the strict precision, the strict
    kernel rule, `timeout_s`) or "dice" (DICE's own check, `protocols.DICE_REWARD`: one trial on
    the inputs as drawn, allclose at 1e-2, no kernel rule, 300 s with the build; the verifier's
    attack tests pass it)."""
    options = dict(DICE_REWARD) if rules == "dice" else {"trials": trials, "timeout_s": timeout_s}
    def reward(tasks: list[Task], completions: list[Completion]) -> Scores:
        pairs, index = [], []
        for i, (t, c) in enumerate(zip(tasks, completions)):
            if c.code is None or (phase == "infill" and not keeps_skeleton(c.code, t.prefix, t.suffix)):
                continue
            pairs.append((t.source, c.code))
            index.append(i)
        verified = verifier.map(pairs, on_broken_task=_warn_broken_task, timing=timing or kind == "speedup", **options)
        by_item = dict(zip(index, verified))
        results = [by_item.get(i) for i in range(len(tasks))]
        rewards = []
        for r in results:
            value = float(r is not None and r.correct)
            if value and kind == "speedup" and r.speedup:
                value += 0.5 * min(max(math.log2(r.speedup), 0.0), 2.0)
            rewards.append(value)
        return Scores(rewards, results)
    # the step's tasks are known before its rollouts: their references are computed meanwhile (`rollout`)
    reward.prepare = lambda tasks: verifier.prepare([t.source for t in tasks], timing=timing or kind == "speedup",
                                                    **options)
    reward.gpu_bytes = lambda: verifier.gpu_bytes()   # set aside when a rollout batch is sized from the free GPU memory
    return reward


def _warn_broken_task(index: int, error: ValueError) -> None:
    """A task whose own reference fails scores 0 for that sample (its result is None)."""
    print(f"warning: skipping a broken task: {error}", file=sys.stderr)


def rank_verifier(workers: int, device: torch.device) -> dict:
    """This process's Verifier arguments: its own GPU (under torchrun rank r trains on cuda:r, and its
    rollouts' kernels run there too) and its share of `--verifier-workers`, which counts the
    workers of the whole host (LOCAL_WORLD_SIZE processes share its cores)."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return {"workers": max(1, workers // local), "device": str(device) if device.type == "cuda" else "cuda"}


def planned_verifier_bytes(workers: int, device: torch.device) -> int:
    """The GPU memory this process's Verifier (`rank_verifier`'s share of `workers`) will hold once it
    has verified a while (`Verifier.gpu_bytes`: its workers and judges), known before it starts: the
    memory checks of train.py and bench rl set it aside."""
    from ..verifier.verifier import PROCESS_GPU_BYTES, WORKERS_PER_JUDGE   # lazy: as `rl_rewards`
    mine = rank_verifier(workers, device)["workers"]
    return (mine + max(1, mine // WORKERS_PER_JUDGE)) * PROCESS_GPU_BYTES


def rl_rewards(cfg, rt, reward_fn: RewardFn | None) -> tuple[object | None, RewardFn, RewardFn]:
    """An RL run's (verifier, reward, evaluation reward). A given `reward_fn` is both, without a
    verifier; otherwise this process's Verifier gives the phase's `--reward` under `--reward-rules`
    and, for `--eval-every`, the end-to-end correct reward timed (fast_1), under the strict rules."""
    if reward_fn is not None:
        return None, reward_fn, reward_fn
    # read when a run starts: a run with its own reward skips dice.verifier's import (torch.utils.cpp_extension),
    # and the Verifier is the one dice.verifier holds then (tests' fake_verifier swaps it)
    from ..verifier import Verifier
    verifier = Verifier(**rank_verifier(cfg.verifier_workers, rt.device))
    reward = verifier_reward(verifier, cfg.phase, cfg.reward, timing=cfg.reward == "speedup",
                             timeout_s=cfg.verify_timeout, rules=cfg.reward_rules)
    return verifier, reward, verifier_reward(verifier, "e2e", "correct", timing=True, timeout_s=cfg.verify_timeout)
