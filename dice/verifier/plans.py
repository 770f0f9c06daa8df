"""A candidate's trials as the Verifier plans them (DESIGN.md §8): the seeds, each trial's input
structure ("kind") and the task's reference outputs, which the task's judge computes once per task
and seeds for all its candidates (an RL group: 16 candidates of one task), a failure too.

A structure the task's own reference cannot take (it raises, e.g. on float indices spiked or
jittered past their table, or on a heavy element) falls back to jitter alone ("light"), then to
the inputs as drawn ("plain"), so no candidate is judged outside the task's domain; a reference
that fails on plain inputs too is the task's error (TaskError). A reference that faults on the GPU
costs its judge a restart each time it runs, so the answer is found once and every other candidate
of the task waits for it, holding no GPU worker (`Verifier._verify_one` plans before it takes one).
"""
from __future__ import annotations

import hashlib
import secrets
import threading
from typing import Callable

from .harness import trial_kinds
from .results import TaskError, VerifyOptions, trial_seeds
from .sealed import GpuLock

MAX_TASKS_REMEMBERED = 4096   # tasks whose trial kinds are kept (an RL run sees far fewer at a time)


class TrialPlans:
    """Plans of candidates' trials; `judge_call(request)` asks the task's judge (a failure of the
    task raises TaskError), under `gpu`'s shared lock."""

    def __init__(self, judge_call: Callable[[dict], dict], gpu: GpuLock):
        self.judge_call, self.gpu = judge_call, gpu
        self.seed_base = secrets.randbits(31)
        self._kinds: dict[tuple, _TaskKinds] = {}   # (task, seeds) -> trial kinds its reference takes
        self._lock = threading.Lock()

    def plan(self, task_src: str, opts: VerifyOptions) -> dict:
        """The candidate's task, seeds and trial kinds, with the task's references computed."""
        task = {"task_src": task_src, "task_key": hashlib.sha256(task_src.encode()).hexdigest(),
                "precision": opts.precision}
        init_seed, seeds, timing_seed, warmup_seed = trial_seeds(
            self.seed_base if opts.seed is None else opts.seed, opts.trials)
        if opts.seed is None:   # per candidate: outputs another candidate saw cannot serve timing
            timing_seed = 1 + secrets.randbelow(2**31 - 1)
        with self.gpu.shared():  # a broken task fails here, blamed on the task, before a worker loads anything
            kinds = self.kinds(task, init_seed, seeds, plain=opts.rules == "dice")
        return {"task": task, "init_seed": init_seed, "seeds": seeds, "kinds": kinds, "timing_seed": timing_seed,
                "warmup_seed": warmup_seed}

    def kinds(self, task: dict, init_seed: int, seeds: list[int], plain: bool = False) -> list[str]:
        """Each trial's input structure (`harness.trial_kinds`; with `plain`, DICE's check, the
        inputs as drawn) with every reference computed (module docstring), once per key."""
        key = (task["task_key"], task["precision"], init_seed, tuple(seeds), plain)
        with self._lock:
            entry = self._kinds.get(key)
            if entry is None:
                if len(self._kinds) >= MAX_TASKS_REMEMBERED:
                    self._kinds.pop(next(iter(self._kinds)))
                entry = self._kinds[key] = _TaskKinds()
        with entry.lock:
            if entry.kinds is None and entry.error is None:
                try:
                    entry.kinds = self._reference_kinds(task, init_seed, seeds, plain)
                except TaskError as exc:
                    entry.error = str(exc)
        if entry.error is not None:
            raise TaskError(entry.error)
        return list(entry.kinds)

    def _reference_kinds(self, task: dict, init_seed: int, seeds: list[int], plain: bool) -> list[str]:
        kinds = ["plain"] * len(seeds) if plain else trial_kinds(len(seeds))
        for i, seed in enumerate(seeds):
            request = {"op": "reference", **task, "init_seed": init_seed, "seed": seed}
            for kind in dict.fromkeys([kinds[i], "light", "plain"]):
                try:
                    self.judge_call({**request, "kind": kind})
                    kinds[i] = kind
                    break
                except TaskError:
                    if kind == "plain":
                        raise
        return kinds


class _TaskKinds:
    """One task's trial kinds, or its reference's error, found once under `lock`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.kinds: list[str] | None = None
        self.error: str | None = None
