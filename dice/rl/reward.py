"""BiC-RL's rewards (DESIGN.md §7, §8.6): one small interface, and the kernel verifier as one.

A reward is a `Reward`: `reward(tasks, completions)` scores a batch (`Scores`: one reward per
completion, and the verifier results behind them); `prepare(tasks)` is told a step's tasks before
their rollouts, so a verifier computes their references while the sampler runs; `gpu_bytes()` is the GPU memory its processes
hold once busy, which the rollout batch and the update's micro-batches set aside when they are
sized from the free memory. `PythonReward` turns any function `fn(tasks, completions) -> list of
floats or Scores` into one (it prepares nothing and holds no GPU memory); `VerifierReward` is
DICE's: 1 for a kernel that compiles and is correct (infill: and keeps the task's prefix and
suffix), else 0, judged by our verifier's strict check or (`rules="dice"`) by DICE's own. A reward
that changes what is verified (`python -m dice.bench rl` replays reference programs) subclasses
`VerifierReward` and overrides `program`, so it keeps `prepare` and `gpu_bytes`. `rl_rewards` gives
an RL run its reward and its evaluation's, each process with a Verifier of its own
(`dice.runtime.rank_verifier`).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Callable

from ..protocols import DICE_REWARD
from ..runtime import rank_verifier
from ..sampling.completion import Completion
from ..tasks.load import Task
from ..tasks.prompts import keeps_skeleton


@dataclasses.dataclass
class Scores:
    """What a reward returns: one reward per completion, and the verifier's results behind them
    (None for a completion it never ran: no code block, a dropped skeleton, a broken task), or
    `results=None` for a reward without a verifier."""
    rewards: list[float]
    results: list | None = None


class Reward:
    """What an RL step asks of a reward (module docstring); the base prepares nothing and holds no
    GPU memory."""

    def __call__(self, tasks: list[Task], completions: list[Completion]) -> Scores:
        raise NotImplementedError

    def prepare(self, tasks: list[Task]) -> None:
        """Told a step's tasks before their rollouts: work that needs the tasks alone starts here."""

    def gpu_bytes(self) -> int:
        """The GPU memory this reward's processes hold once busy (set aside when a batch is sized)."""
        return 0


class PythonReward(Reward):
    """A reward computed in this process by `fn(tasks, completions)`, which returns a list of floats
    (Scores without results) or Scores."""

    def __init__(self, fn: Callable[[list[Task], list[Completion]], "Scores | list[float]"]):
        self.fn = fn

    def __call__(self, tasks: list[Task], completions: list[Completion]) -> Scores:
        out = self.fn(tasks, completions)
        return out if isinstance(out, Scores) else Scores([float(r) for r in out])


def as_reward(reward: "Reward | Callable") -> Reward:
    """`reward` as a Reward: a plain function becomes a PythonReward (`train_rl(cfg, reward_fn=...)`)."""
    return reward if isinstance(reward, Reward) else PythonReward(reward)


class VerifierReward(Reward):
    """Reward through the kernel verifier: 1 if compiled and correct (infill: and the program keeps
    the task's prefix and suffix), else 0; kind "speedup" adds 0.5 * clamp(log2 speedup, 0, 2).
    `options` are the verifier's (`verifier_options`), `timing` whether it times."""

    def __init__(self, verifier, phase: str, kind: str = "correct", timing: bool = False,
                 options: dict | None = None):
        self.verifier, self.phase, self.kind = verifier, phase, kind
        self.timing = timing or kind == "speedup"
        self.options = verifier_options() if options is None else options

    def program(self, task: Task, completion: Completion) -> str | None:
        """The program verified for `completion` of `task`: the code it generated."""
        return completion.code

    def __call__(self, tasks: list[Task], completions: list[Completion]) -> Scores:
        pairs, index = [], []
        for i, (t, c) in enumerate(zip(tasks, completions)):
            code = self.program(t, c)
            if code is None or (self.phase == "infill" and not keeps_skeleton(code, t.prefix, t.suffix)):
                continue
            pairs.append((t.source, code))
            index.append(i)
        verified = self.verifier.map(pairs, on_broken_task=_warn_broken_task, timing=self.timing, **self.options)
        by_item = dict(zip(index, verified))
        results = [by_item.get(i) for i in range(len(tasks))]
        rewards = []
        for r in results:
            value = float(r is not None and r.correct)
            if value and self.kind == "speedup" and r.speedup:
                value += 0.5 * min(max(math.log2(r.speedup), 0.0), 2.0)
            rewards.append(value)
        return Scores(rewards, results)

    def prepare(self, tasks: list[Task]) -> None:
        """The tasks' reference outputs, computed by the verifier while the rollouts generate."""
        self.verifier.prepare([t.source for t in tasks], timing=self.timing, **self.options)

    def gpu_bytes(self) -> int:
        """The verifier's workers and judges (`Verifier.gpu_bytes`), asked when a batch is sized."""
        return self.verifier.gpu_bytes()


def verifier_options(rules: str = "strict", trials: int = 3, timeout_s: float = 60.0) -> dict:
    """The verifier's options under the reward's rules: "strict" (ours: `trials` structured trials at
    the strict precision, the strict kernel rule, `timeout_s`) or "dice" (DICE's own check,
    `protocols.DICE_REWARD`: one trial on the inputs as drawn, allclose at 1e-2, no kernel rule,
    300 s with the build; the verifier's attack tests pass it)."""
    return dict(DICE_REWARD) if rules == "dice" else {"trials": trials, "timeout_s": timeout_s}


def verifier_reward(verifier, phase: str, kind: str = "correct", timing: bool = False, trials: int = 3,
                    timeout_s: float = 60.0, rules: str = "strict") -> VerifierReward:
    """The verifier's reward as train.py's flags ask it (--reward, --reward-rules, --verify-timeout)."""
    return VerifierReward(verifier, phase, kind, timing, verifier_options(rules, trials, timeout_s))


def _warn_broken_task(index: int, error: ValueError) -> None:
    """A task whose own reference fails scores 0 for that sample (its result is None)."""
    print(f"warning: skipping a broken task: {error}", file=sys.stderr)


def rl_rewards(cfg, rt, reward_fn: "Reward | Callable | None") -> tuple[object | None, Reward, Reward]:
    """An RL run's (verifier, reward, evaluation reward). A given `reward_fn` is both (`as_reward`),
    without a verifier; otherwise this process's Verifier gives the phase's `--reward` under `--reward-rules`
    and, for `--eval-every`, the end-to-end correct reward timed (fast_1), under the strict rules."""
    if reward_fn is not None:
        reward = as_reward(reward_fn)
        return None, reward, reward
    # read when a run starts: a run with its own reward skips dice.verifier's import (torch.utils.cpp_extension),
    # and the Verifier is the one dice.verifier holds then (tests' fake_verifier swaps it)
    from ..verifier import Verifier
    verifier = Verifier(**rank_verifier(cfg.verifier_workers, rt.device))
    reward = verifier_reward(verifier, cfg.phase, cfg.reward, timing=cfg.reward == "speedup",
                             timeout_s=cfg.verify_timeout, rules=cfg.reward_rules)
    return verifier, reward, verifier_reward(verifier, "e2e", "correct", timing=True, timeout_s=cfg.verify_timeout)
