"""A step's groups: `group_size` rollouts of each of its tasks, their rewards and group advantages,
and DAPO's dynamic sampling, which draws new tasks in place of groups that teach nothing
(DESIGN.md §7; the loop that uses them: `dice.rl.train_rl`)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Sequence

import torch

from ..memory import out_of_memory
from ..tasks.load import Task, tasks_at
from ..tasks.prompts import PromptFormat
from .rewards import Reward
from .rollout import auto_rollout_batch, generate_and_score, generation_copy, prompt_format, task_prompt_ids


def group_advantages(rewards: Sequence[float], group_size: int) -> list[float | None]:
    """(R - mean_g) / std_g per group of `group_size` consecutive rewards (population std);
    None for every member of a group whose rewards are all equal (the group is dropped)."""
    out: list[float | None] = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g:g + group_size]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        out += [None] * len(group) if std == 0 else [(r - mean) / std for r in group]
    return out


def rank_slots(first: int, count: int, rt) -> list[int]:
    """This process's share of the slots first .. first + count - 1 of a step's tasks: every
    world-th from its rank on. A slot fixes its task and its samples' seeds (`rollout`), so the
    split changes which process generates a group, never the group."""
    return list(range(first, first + count))[rt.rank::rt.world]


def rollout(model, tok, tasks: list[Task], slots: list[int], cfg, reward: Reward, seed: int, infill: bool, *,
            overlap: str = "stream", low_precision: bool = True, auto_batch: bool = False,
            lengths: Sequence[int] | None = None, fmt: PromptFormat | None = None, progress=None, while_scoring=None):
    """Generate `group_size` responses per task and reward them while generation goes on
    (`dice.rl.rollout.generate_and_score`; overlap "stream": each block's finished responses go to
    the reward at once, up to `verifier_workers` calls at a time). Sample j of the task in slot k
    of the step uses seed seed + k * group_size + j, so rollouts do not depend on how tasks are
    spread over processes. Responses come from `generation_copy` (bf16 on CUDA under bf16
    autocast; low_precision=False: the model itself) in batches of `rollout_batch`, or with
    auto_batch as many as fit in memory (`auto_rollout_batch`). lengths: one forced response
    length per response, in that order (`python -m dice.bench rl`); progress(generated, scored,
    total) follows them and while_scoring runs beside the reward's tail (`generate_and_score`;
    `dice.rl.old_logprobs`). Returns (completions,
    rewards, results, timings): `results` are the verifier results of every completion, in order
    (None where the reward has none, see `Scores`); timings also name the rollout batch used.
    fmt: the prompt format (None: the model's, `prompt_format`)."""
    prompts, owners, seeds = [], [], []
    fmt = fmt or prompt_format(model)
    for t, k in zip(tasks, slots):
        ids = task_prompt_ids(tok, t, infill=infill, fmt=fmt)
        prompts += [ids] * cfg.group_size
        owners += [t] * cfg.group_size
        seeds += [seed + k * cfg.group_size + j for j in range(cfg.group_size)]
    reward.prepare(list(tasks))    # the verifier's reward: the tasks' references computed while generating
    policy = generation_copy(model, cfg.dtype) if low_precision else model
    size = cfg.rollout_batch
    if auto_batch:   # with room for the verifier's processes beside the sampler
        size = auto_rollout_batch(policy, [len(p) for p in prompts], cfg.max_new_tokens, reward.gpu_bytes())
    try:
        completions, rewards, results, timings = generate_and_score(
            policy, tok, prompts, owners, seeds, reward, batch_size=size,
            max_new_tokens=cfg.max_new_tokens, sampling=cfg.sampling(), overlap=overlap,
            lanes=cfg.verifier_workers, lengths=lengths, progress=progress, while_scoring=while_scoring)
    except torch.OutOfMemoryError:
        raise out_of_memory("the rollouts", next(policy.parameters()).device,
                            f"a rollout batch of {size} sequences", f"--rollout-batch {max(size // 2, 1)}") from None
    return completions, rewards, results, {**timings, "rollout_batch": size}


@dataclasses.dataclass
class StepRollout:
    """One RL step's rollouts (`sample_step`): this process's completions, rewards, verifier results
    and advantages in draw order; the counts are all processes'."""
    completions: list
    rewards: list[float]
    results: list
    advantages: list[float | None]
    timing: dict        # generate_s and verify_s, summed over the rounds
    drawn: int = 0      # tasks rolled out
    dropped: int = 0    # of them, groups whose rewards all agreed (no advantage: they train nothing)
    rounds: int = 0     # rollout rounds run


def sample_step(model, tok, ordered: list[Task], first: int, cfg, reward: Reward, rt, seed: int, infill: bool,
                fmt: PromptFormat | None = None, rollout_logprobs=None) -> StepRollout:
    """A step's rollouts: `tasks_per_step` tasks of `ordered` from position `first` on (`rollout`),
    then, with `--dynamic-sampling-rounds N`, up to N more rounds, each drawing the next tasks, one
    for every group of the round before whose rewards all agreed, until no group of a round agrees
    (DAPO's dynamic sampling, arXiv 2503.14476 §3.2: keep sampling until the batch holds only groups
    with an advantage; DAPO over-samples a fixed batch and cuts the surplus, here a round draws
    exactly the groups missing, so no group that teaches is thrown away). The d-th task the step
    draws fills slot d (its samples' seeds, `rollout`), the slots of a round spread over the
    processes as in the first, so the draws and seeds depend on (seed, step, slot) alone.
    rollout_logprobs (`dice.rl.old_logprobs.RolloutLogprobs`) runs beside each round's reward tail."""
    out = StepRollout([], [], [], [], {"generate_s": 0.0, "verify_s": 0.0})
    count = cfg.tasks_per_step
    while count and out.rounds <= cfg.dynamic_sampling_rounds:
        drawn = tasks_at(ordered, first + out.drawn, count)
        slots = rank_slots(out.drawn, count, rt)
        beside = None if rollout_logprobs is None else functools.partial(rollout_logprobs, offset=len(out.completions))
        completions, rewards, results, timing = rollout(model, tok, [drawn[k - out.drawn] for k in slots], slots,
                                                        cfg, reward, seed=seed, infill=infill, fmt=fmt,
                                                        while_scoring=beside)
        advantages = group_advantages(rewards, cfg.group_size)
        count = int(rt.all_sum(advantages[::cfg.group_size].count(None)))
        out.completions += completions
        out.rewards += rewards
        out.results += results
        out.advantages += advantages
        out.timing = {key: out.timing[key] + timing[key] for key in out.timing}
        out.drawn, out.dropped, out.rounds = out.drawn + len(drawn), out.dropped + count, out.rounds + 1
    return out
