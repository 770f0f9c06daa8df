"""The rollout side of a BiC-RL step (DESIGN.md §7): the step's tasks, `group_size` samples of each,
their rewards and group advantages, read top to bottom in the order the step runs them; then the
rewards that score them.

`sample_step` draws the step's tasks in rounds (`--dynamic-sampling-rounds`: DAPO's dynamic sampling
draws new tasks in place of groups whose rewards all agree); `sample_groups` turns a round's tasks
into prompts and seeds and asks the reward (`Reward`) to prepare them; then `generate_and_score`
keeps the GPU generating while the reward works: every block's finished sequences go to the reward
at once, on scoring threads (`_Scorer`), from a bf16 copy of the policy
(`dice.sampling.completion.generation_copy`) in batches as large as the KV caches leave room for
(`dice.memory.auto_rollout_batch`). The task -> prompt -> completion path itself is
`dice.sampling.completion`'s; `python -m dice.bench rl` measures this one through
`dice.rl.train_rl.rl_step`.

The rewards: one small interface, and the kernel verifier as one. A reward is a `Reward`:
`reward(tasks, completions)` scores a batch (`Scores`: one reward per completion, and the verifier
results behind them); `prepare(tasks)` is told a step's tasks before their rollouts, so a verifier
computes their references while the sampler runs; `gpu_bytes()` is the GPU memory its processes
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
import functools
import math
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from ..memory import auto_rollout_batch, out_of_memory
from ..model.sdar import compute_device
from ..protocols import DICE_REWARD
from ..runtime import rank_verifier
from ..sampling.completion import Completion, complete, generation_copy, prompt_format, task_prompt_ids
from ..sampling.sampler import Sampling
from ..tasks.load import Task, tasks_at
from ..tasks.prompts import PromptFormat, keeps_skeleton

OVERLAP = ("stream", "batch", "none")
SUMMED = ("generate_s", "verify_s", "verify_wait_s")   # a step's seconds, over its rollout rounds


@dataclasses.dataclass
class RolloutOptions:
    """How a step's rollouts run beyond TrainConfig: train.py runs the defaults, `python -m dice.bench
    rl` measures the others."""
    overlap: str = "stream"         # when the reward scores (`generate_and_score`)
    low_precision: bool = True      # sample from `generation_copy`; False: the model itself
    auto_batch: bool = False        # the batch from the free GPU memory (`auto_rollout_batch`), not --rollout-batch
    # per slot (the d-th task the step draws), each sample's (owner the reward scores, forced response length):
    # the programs `python -m dice.bench rl` replays
    replay: list[list[tuple[Task, int]]] | None = None
    progress: Callable[[int, int, int], None] | None = None   # (generated, scored, total), as sequences finish


@dataclasses.dataclass
class StepSamples:
    """One RL step's samples (`sample_step`): this process's completions, rewards, verifier results
    and advantages in draw order; the counts are all processes'."""
    completions: list
    rewards: list[float]
    results: list
    advantages: list[float | None]
    timing: dict        # SUMMED over the rounds; the last round's rollout_batch
    drawn: int = 0      # tasks rolled out
    dropped: int = 0    # of them, groups whose rewards all agreed (no advantage: they train nothing)
    rounds: int = 0     # rollout rounds run


# ---------------------------------------------------------------- the step's groups and their advantages

def sample_step(model, tok, ordered: list[Task], first: int, cfg, reward: Reward, rt, seed: int, infill: bool,
                fmt: PromptFormat | None = None, old_logprobs=None,
                options: RolloutOptions = RolloutOptions()) -> StepSamples:
    """A step's rollouts: `tasks_per_step` tasks of `ordered` from position `first` on (`sample_groups`),
    then, with `--dynamic-sampling-rounds N`, up to N more rounds, each drawing the next tasks, one
    for every group of the round before whose rewards all agreed, until no group of a round agrees
    (DAPO's dynamic sampling, arXiv 2503.14476 §3.2: keep sampling until the batch holds only groups
    with an advantage; DAPO over-samples a fixed batch and cuts the surplus, here a round draws
    exactly the groups missing, so no group that teaches is thrown away). The d-th task the step
    draws fills slot d (its samples' seeds, `sample_groups`), the slots of a round spread over the
    processes as in the first, so the draws and seeds depend on (seed, step, slot) alone.
    old_logprobs (`dice.rl.update.OldLogprobs`) runs beside each round's reward tail."""
    out = StepSamples([], [], [], [], {})
    count = cfg.tasks_per_step
    while count and out.rounds <= cfg.dynamic_sampling_rounds:
        drawn = tasks_at(ordered, first + out.drawn, count)
        slots = rank_slots(out.drawn, count, rt)
        beside = None if old_logprobs is None else functools.partial(old_logprobs, offset=len(out.completions))
        completions, rewards, results, timing = sample_groups(model, tok, [drawn[k - out.drawn] for k in slots],
                                                              slots, cfg, reward, seed=seed, infill=infill, fmt=fmt,
                                                              while_scoring=beside, options=options)
        advantages = group_advantages(rewards, cfg.group_size)
        count = int(rt.all_sum(advantages[::cfg.group_size].count(None)))
        out.completions += completions
        out.rewards += rewards
        out.results += results
        out.advantages += advantages
        out.timing = ({key: out.timing.get(key, 0.0) + timing[key] for key in SUMMED}
                      | {"rollout_batch": timing["rollout_batch"]})
        out.drawn, out.dropped, out.rounds = out.drawn + len(drawn), out.dropped + count, out.rounds + 1
    return out


def rank_slots(first: int, count: int, rt) -> list[int]:
    """This process's share of the slots first .. first + count - 1 of a step's tasks: every
    world-th from its rank on. A slot fixes its task and its samples' seeds (`sample_groups`), so the
    split changes which process generates a group, never the group."""
    return list(range(first, first + count))[rt.rank::rt.world]


def group_advantages(rewards: Sequence[float], group_size: int) -> list[float | None]:
    """(R - mean_g) / std_g per group of `group_size` consecutive rewards (population std);
    None for every member of a group whose rewards are all equal (the group is dropped)."""
    out: list[float | None] = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g:g + group_size]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        out += [None] * len(group) if std == 0 else [(r - mean) / std for r in group]
    return out


def sample_groups(model, tok, tasks: list[Task], slots: list[int], cfg, reward: Reward, seed: int, infill: bool, *,
                  fmt: PromptFormat | None = None, while_scoring=None, options: RolloutOptions = RolloutOptions()):
    """Generate `group_size` responses per task and reward them while generation goes on
    (`generate_and_score`; overlap "stream": each block's finished responses go to the reward at once,
    up to `verifier_workers` calls at a time). Sample j of the task in slot k of the step uses seed
    seed + k * group_size + j, so rollouts do not depend on how tasks are spread over processes.
    Responses come from `generation_copy` (bf16 on CUDA under bf16 autocast) in batches of
    `rollout_batch`, or as many as fit in memory (`options`, `auto_rollout_batch`); a replayed
    sample (`options.replay`) is scored as its owner and stops at its length. while_scoring runs
    beside the reward's tail (`generate_and_score`; `dice.rl.update.OldLogprobs`). Returns
    (completions, rewards, results, timings): `results` are the verifier results of every
    completion, in order (None where the reward has none, see `Scores`); timings also name the
    rollout batch used. fmt: the prompt format (None: the model's, `prompt_format`)."""
    prompts, owners, seeds, lengths = [], [], [], []
    fmt = fmt or prompt_format(model)
    for t, k in zip(tasks, slots):
        ids = task_prompt_ids(tok, t, infill=infill, fmt=fmt)
        samples = options.replay[k] if options.replay else [(t, None)] * cfg.group_size
        prompts += [ids] * cfg.group_size
        owners += [owner for owner, _ in samples]
        lengths += [length for _, length in samples]
        seeds += [seed + k * cfg.group_size + j for j in range(cfg.group_size)]
    reward.prepare(list(tasks))    # the verifier's reward: the tasks' references computed while generating
    policy = generation_copy(model, cfg.dtype) if options.low_precision else model
    size = cfg.rollout_batch
    if options.auto_batch:   # with room for the verifier's processes beside the sampler
        size = auto_rollout_batch(policy, [len(p) for p in prompts], cfg.max_new_tokens, reward.gpu_bytes())
    try:
        completions, rewards, results, timings = generate_and_score(
            policy, tok, prompts, owners, seeds, reward, batch_size=size, max_new_tokens=cfg.max_new_tokens,
            sampling=cfg.sampling(), overlap=options.overlap, lanes=cfg.verifier_workers,
            lengths=lengths if options.replay else None, progress=options.progress, while_scoring=while_scoring)
    except torch.OutOfMemoryError:
        raise out_of_memory("the rollouts", compute_device(policy),
                            f"a rollout batch of {size} sequences", f"--rollout-batch {max(size // 2, 1)}") from None
    return completions, rewards, results, {**timings, "rollout_batch": size}


# ---------------------------------------------------------------- generation, with the reward scoring beside it

def generate_and_score(model, tokenizer, prompts: Sequence[Sequence[int]], owners: Sequence, seeds: Sequence[int],
                       score: Callable, *, batch_size: int, max_new_tokens: int, sampling: Sampling = Sampling(),
                       overlap: str = "stream", lanes: int = 1, lengths: Sequence[int] | None = None,
                       progress: Callable[[int, int, int], None] | None = None, while_scoring: Callable | None = None):
    """Completions for `prompts` (generated `batch_size` at a time, `max_new_tokens` and `sampling`
    as in `generate`) scored by `score(owners, completions)`, which returns a `Scores`
    for the owners (tasks) and completions it is given.

    overlap: "stream" scores every block's newly finished sequences as one call on a pool of
    `lanes` threads (the verifier's workers) while the batch goes on, so the verifier starts on
    the first finished rollout, not on the batch's last; "batch" scores each rollout batch as one
    call once it is generated, one call at a time, while the next batch generates (the earlier
    way); "none" scores everything after the last batch (no overlap; for measurements).
    progress(generated, scored, total) is called as sequences finish and as scoring calls return
    (from the scoring threads too). while_scoring(completions, finished) runs once the last batch is
    generated, beside the scoring left (`dice.rl.update.OldLogprobs`: finished() is true once it is done).
    Returns (completions, rewards, results, timings), in prompt
    order; timings: generate_s (the generating thread), verify_s (time with a scoring call
    running) and verify_wait_s (scoring left after the last batch: the part generation did not hide)."""
    if overlap not in OVERLAP:
        raise ValueError(f"overlap must be one of {OVERLAP}, got {overlap!r}")
    n = len(prompts)
    completions: list = [None] * n
    counts, lock = [0, 0], threading.Lock()

    def count(which: int, k: int) -> None:
        with lock:
            counts[which] += k
            if progress is not None:
                progress(counts[0], counts[1], n)

    scorer = _Scorer(score, lanes if overlap == "stream" else 1, on_scored=lambda k: count(1, k))
    generate_s = 0.0
    try:
        for start in range(0, n, batch_size):
            batch, pending = list(range(start, min(n, start + batch_size))), []

            def finished(j: int, completion: Completion, batch=batch, pending=pending) -> None:
                completions[batch[j]] = completion
                pending.append(batch[j])
                count(0, 1)

            def flush(_positions: int, pending=pending) -> None:
                if pending:
                    scorer.submit(pending, owners, completions)
                    pending.clear()

            t0 = time.perf_counter()
            complete(model, tokenizer, [prompts[i] for i in batch], max_new_tokens=max_new_tokens, sampling=sampling,
                     batch_size=len(batch), seed=[seeds[i] for i in batch],
                     progress=flush if overlap == "stream" else None,
                     lengths=None if lengths is None else [lengths[i] for i in batch], on_done=finished)
            generate_s += time.perf_counter() - t0
            if overlap == "batch":
                scorer.submit(batch, owners, completions)
        if overlap == "none":
            scorer.submit(list(range(n)), owners, completions)
        t0 = time.perf_counter()
        if while_scoring is not None:
            while_scoring(completions, scorer.finished)
        rewards, results = scorer.collect(n)
        wait_s = max(0.0, scorer.last_end - t0)   # the reward's own tail, not while_scoring's
    finally:
        scorer.close()
    return completions, rewards, results, {"generate_s": generate_s, "verify_s": scorer.busy_s,
                                           "verify_wait_s": wait_s}


class _Scorer:
    """Scoring calls on `lanes` background threads; `busy_s` is the time with at least one running."""

    def __init__(self, score: Callable, lanes: int, on_scored: Callable[[int], None] | None = None):
        self.score, self.calls, self.on_scored = score, [], on_scored
        self.pool = ThreadPoolExecutor(max_workers=max(1, lanes), thread_name_prefix="dice-score")
        self.lock, self.running, self.since, self.busy_s = threading.Lock(), 0, 0.0, 0.0
        self.last_end = 0.0   # when the last scoring call so far returned

    def submit(self, indices: list[int], owners: Sequence, completions: list) -> None:
        args = ([owners[i] for i in indices], [completions[i] for i in indices])
        self.calls.append((list(indices), self.pool.submit(self._run, *args)))

    def _run(self, owners, completions):
        with self.lock:
            if self.running == 0:
                self.since = time.perf_counter()
            self.running += 1
        try:
            scores = self.score(owners, completions)
        finally:
            with self.lock:
                self.running -= 1
                self.last_end = time.perf_counter()
                if self.running == 0:
                    self.busy_s += self.last_end - self.since
        if self.on_scored is not None:
            self.on_scored(len(completions))
        return scores

    def finished(self) -> bool:
        """Whether every scoring call submitted so far has returned."""
        return all(call.done() for _, call in self.calls)

    def collect(self, n: int) -> tuple[list[float], list]:
        rewards, results = [0.0] * n, [None] * n
        for indices, call in self.calls:
            scores = call.result()
            for i, reward, result in zip(indices, scores.rewards, scores.results or [None] * len(indices)):
                rewards[i], results[i] = reward, result
        return rewards, results

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------- the rewards

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
