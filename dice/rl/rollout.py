"""The rollout side of a BiC-RL step (DESIGN.md §7): the step's tasks, `group_size` samples of each,
their rewards and group advantages, read top to bottom in the order the step runs them. The rewards
that score them are `dice.rl.reward`'s.

`sample_step` draws the step's tasks in rounds (`--dynamic-sampling-rounds`: DAPO's dynamic sampling
draws new tasks in place of groups whose rewards all agree); `sample_groups` turns a round's tasks
into prompts and seeds and asks the reward (`Reward`) to prepare them; then `generate_and_score`
keeps the GPU generating while the reward works: every block's finished sequences go to the reward
at once, on scoring threads (`_Scorer`), from a bf16 copy of the policy
(`dice.sampling.completion.generation_copy`) in batches as large as the KV caches leave room for
(`dice.memory.auto_rollout_batch`). The task -> prompt -> completion path itself is
`dice.sampling.completion`'s; `python -m dice.bench rl` measures this one through
`dice.rl.train_rl.rl_step`.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from ..memory import auto_rollout_batch
from ..refusals import out_of_memory
from ..model.sdar import compute_device
from ..sampling.completion import Completion, complete, generation_copy, prompt_format, task_prompt_ids
from ..sampling.sampler import Sampling
from ..tasks.load import Task, tasks_at
from ..tasks.prompts import PromptFormat
from .reward import Reward

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
