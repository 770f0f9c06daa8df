"""BiC-RL: TraceRL rollouts -> verifier rewards -> policy update, in two phases (DESIGN.md §7).

One RL step (`rl_step`, the function `train.py` runs and `python -m dice.bench rl` times) reads in
the modules of dice/rl/, top to bottom. The rollouts (`dice.rl.rollout`): take `tasks_per_step`
tasks in curriculum order (ascending level, wrapping; or with `--task-order interleaved` every level
in its share each step: `dice.tasks.load.curriculum`), sample `group_size` responses each with the
block-diffusion sampler, reward each (`dice.rl.reward.VerifierReward`: 1 if the kernel compiles and is
correct; in the `infill` phase also only if the program keeps the given prefix and suffix), and form
group z-score advantages A = (R - mean_g) / std_g, dropping groups whose rewards are all equal
(`--dynamic-sampling-rounds N`, DAPO's dynamic sampling, draws the next tasks in their place, up to
N more rounds a step, and a step starts where the one before stopped drawing). The update
(`dice.rl.update`): every kept response's trace rounds, cut into optimiser steps of
`--rows-per-update` round rows and packed into micro-batches (`dice.model.packing`), each optimiser
step's PPO-clip + k3 loss against the rollout policy's log-probs. `train_rl` runs the steps: the
run folder, the metrics.jsonl line (`dice.metrics.rl_step_record`), the checkpoint, and a greedy
evaluation before every `--eval-every`-th step and at the end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import torch

from ..errors import DataError
from ..memory import UpdateTokens
from ..metrics import rl_progress_fields, rl_step_record
from ..model.checkpoint import load_model
from ..model.tokenizer import load_tokenizer
from ..plot import plot_run
from ..run_folder import (MetricsLog, check_resume, check_run_folder, checkpoint_step, make_logger, progress_line,
                          resume, run_settings, save_checkpoint, save_final, start_run)
from ..runtime import build_model, make_optimizer, setup_runtime
from ..sampling.completion import FullParameters, complete, load_prompt_template, prompt_format, task_prompt_ids
from ..tasks.load import Task, load_tasks, phase_tasks
from ..tasks.prompts import PromptFormat
from .reward import Reward, Scores, rl_rewards
from .rollout import RolloutOptions, StepSamples, sample_step
from .update import OldLogprobs, policy_update, restart_moments

# what a resumed RL run must keep (besides the tasks and the model)
RESUME_FIELDS = ("phase", "seed", "tasks_per_step", "group_size", "max_new_tokens", "temperature", "remasking",
                 "threshold", "steps_per_block", "updates_per_step", "rows_per_update", "loss_norm", "clip_eps",
                 "kl_beta", "reference_model", "reward", "reward_rules", "lr", "weight_decay", "adam_beta1",
                 "adam_beta2", "grad_clip", "minibatch_order", "optimizer_state", "prompt_template", "task_order",
                 "dynamic_sampling_rounds")


# ---------------------------------------------------------------- the step

@dataclasses.dataclass
class Learner:
    """What every step of a run uses: the policy, its tokenizer and optimiser, the reward, the update's
    micro-batch budget (`dice.memory.UpdateTokens`; None: no update), the frozen reference
    (--reference-model), the rollouts' prompt format (None: the model's) and the context generation
    runs in (under FSDP every parameter gathered: `dice.sampling.completion.FullParameters`)."""
    model: torch.nn.Module
    tok: object
    optimizer: torch.optim.Optimizer
    reward: Reward
    tokens: UpdateTokens | None
    ref_model: torch.nn.Module | None = None
    fmt: PromptFormat | None = None
    gather: contextlib.AbstractContextManager = dataclasses.field(default_factory=contextlib.nullcontext)


@dataclasses.dataclass
class StepResult:
    """What `rl_step` did: its samples, `policy_update`'s figures ({} without an update) and its seconds."""
    samples: StepSamples
    update: dict
    rollout_s: float            # generation and the reward's tail, the old log-probs beside it included
    update_s: float             # the update, its compiling (update["compile_s"]) included
    logprobs_compile_s: float   # of rollout_s, what the old log-probs' FlexAttention forwards spent compiling


def rl_step(learner: Learner, cfg, rt, tasks: list[Task], first: int, step: int, *,
            rollouts: RolloutOptions = RolloutOptions(), update: bool = True, update_progress=None) -> StepResult:
    """One BiC-RL step (module docstring): the rollouts of `tasks_per_step` tasks of `tasks` from
    position `first` on, their rewards and advantages (`dice.rl.rollout.sample_step`), with the
    update's old log-probs computed beside the reward's tail (`dice.rl.update.OldLogprobs`); then
    the optimiser steps over the kept responses' trace rounds (`dice.rl.update.policy_update`) and
    AdamW's moments dropped under `--optimizer-state step` (`restart_moments`), now rather than
    before the next update, so that the next step's rollouts get their memory. The rollouts' seed is
    (seed * 100003 + step) * 10007, the plan's seed * 100003 + step. update=False: the rollouts alone
    (bench rl --skip-update); update_progress(done, total) follows the update's micro-batches."""
    model, tok = learner.model, learner.tok
    model.eval()
    old = OldLogprobs(model, cfg, rt, tok.pad_token_id, learner.tokens) if update else None
    start = time.perf_counter()
    with torch.no_grad(), learner.gather:
        samples = sample_step(model, tok, tasks, first, cfg, learner.reward, rt,
                              seed=(cfg.seed * 100_003 + step) * 10_007, infill=cfg.phase == "infill",
                              fmt=learner.fmt, old_logprobs=old, options=rollouts)
    rollout_s = time.perf_counter() - start
    model.train()
    start = time.perf_counter()
    figures = {}
    if update:
        figures = policy_update(model, learner.ref_model, samples.completions, samples.advantages, cfg, rt,
                                learner.optimizer, tok.pad_token_id, seed=cfg.seed * 100_003 + step,
                                progress=update_progress, old_logprobs=old, tokens=learner.tokens)
    restart_moments(learner.optimizer, cfg.optimizer_state)
    if rt.device.type == "cuda":   # the update's seconds are the GPU's
        torch.cuda.synchronize(rt.device)
    return StepResult(samples, figures, rollout_s, time.perf_counter() - start, old.compile_s if old else 0.0)


# ---------------------------------------------------------------- the run

def evaluate_policy(model, tok, tasks: list[Task], cfg, reward: Reward, infill: bool, rt,
                    fmt: PromptFormat | None = None) -> dict:
    """Greedy generation on held-out tasks: the mean reward and, with the verifier, KernelBench's
    compiled / correct / fast_1 rates (dice.metrics) as fractions of all tasks.

    Process r generates tasks r, r + world, ... (task i with seed i, so the split changes no
    result) and the counts are summed over processes: every process must call this, inside the
    full-parameter context under FSDP, since generation gathers no parameters itself. fmt: the
    prompt format (None: the model's)."""
    mine = list(range(rt.rank, len(tasks), rt.world))
    fmt = fmt or prompt_format(model)
    greedy = dataclasses.replace(cfg.sampling(), temperature=0.0)
    completions = complete(model, tok, [task_prompt_ids(tok, tasks[i], infill=infill, fmt=fmt) for i in mine],
                           max_new_tokens=cfg.max_new_tokens, sampling=greedy, batch_size=cfg.rollout_batch, seed=mine)
    scores = reward([tasks[i] for i in mine], completions) if mine else Scores([])
    out = {"eval_reward": rt.all_sum(sum(scores.rewards)) / len(tasks)}
    # a process without eval tasks cannot tell a verifier's reward from a plain one: ask all of them
    if rt.all_max(float(scores.results is not None)):
        results = scores.results or []
        # a result is None where no kernel ran (no code block, broken skeleton, broken task)
        counts = {"eval_compiled": sum(bool(r and r.compiled) for r in results),
                  "eval_correct": sum(bool(r and r.correct) for r in results),
                  "eval_fast_1": sum(bool(r and r.correct and (r.speedup or 0) > 1) for r in results)}
        out.update({key: rt.all_sum(count) / len(tasks) for key, count in counts.items()})
    return out


@dataclasses.dataclass
class RLRun:
    """What `open_run` sets up before a run's first step."""
    out: Path
    ordered: list[Task]                 # the task stream (`dice.tasks.load.phase_tasks`)
    eval_tasks: list[Task] | None
    tok: object
    model: torch.nn.Module
    ref_model: torch.nn.Module | None   # frozen, with --reference-model
    optimizer: torch.optim.Optimizer
    fmt: PromptFormat                   # the rollouts' prompts
    eval_fmt: PromptFormat              # the evaluation's: end to end in the model's format
    start: int                          # the first step to run (resume)
    cursor: int                         # where the next step's tasks start in `ordered`
    metrics: MetricsLog


def open_run(cfg, rt, log, tasks: list[Task] | None, eval_tasks: list[Task] | None) -> RLRun:
    """A run's set-up, the checks that need no model first: the run folder, the tasks (`tasks`, or
    `cfg.data`'s), the model, optimiser and reference, the settings a resume must match
    (RESUME_FIELDS, the tasks' sha256, the model's path), then the checkpoint it resumes from."""
    out, infill = Path(cfg.out), cfg.phase == "infill"
    check_run_folder(out, cfg.resume, cfg.overwrite)
    if cfg.tasks_per_step < rt.world:
        raise DataError(f"--tasks-per-step {cfg.tasks_per_step} is below the {rt.world} processes; pass "
                        f"--tasks-per-step {rt.world} or more (every process needs a task per step)")
    ordered = phase_tasks(tasks if tasks is not None else load_tasks(cfg.data), cfg.data, infill, cfg.task_order)
    if eval_tasks is None and cfg.eval_every:
        eval_tasks = load_tasks(cfg.eval_data)
    template = load_prompt_template(cfg.prompt_template, infill) if cfg.prompt_template else None
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg, rt, log)
    fmt = prompt_format(model, template)
    if template and infill and cfg.eval_every:
        log("--prompt-template holds an infilling prompt: the end-to-end evaluation of --eval-every asks in the "
            "model's own prompt format")
    ref_model = load_model(cfg.model, device=rt.device).eval().requires_grad_(False) if cfg.reference_model else None
    optimizer = make_optimizer(model, cfg)
    tasks_sha = hashlib.sha256(json.dumps([dataclasses.astuple(t) for t in ordered]).encode()).hexdigest()
    # a step's optimiser steps take each process's u-th run of rows (`update_plan`), so a resume on
    # another process count would group the rows differently: refused, not continued inexactly
    settings = run_settings(cfg, RESUME_FIELDS, **{"the tasks' sha256": tasks_sha,
                                                   "the model": str(Path(cfg.model).resolve()),
                                                   "torchrun --nproc_per_node": rt.world})
    start = checkpoint_step(out) if cfg.resume else 0
    if cfg.resume:
        check_resume(out, settings, start, cfg.steps,
                     hashed={"the tasks' sha256": f"--data {cfg.data}" if cfg.data else "the tasks given to train_rl"})
    start_run(out, cfg.overwrite, settings, rt)
    cursor = start * cfg.tasks_per_step
    if cfg.resume:
        cursor = resume(out, model, optimizer, log)[1].get("task_cursor", cursor)
    return RLRun(out, ordered, eval_tasks, tok, model, ref_model, optimizer, fmt,
                 prompt_format(model) if infill else fmt, start, cursor, MetricsLog(out, start, rt.main))


def _evaluate(run: RLRun, cfg, rt, log, reward: Reward, gather, at_step: int, label: str) -> None:
    """`evaluate_policy` on the run's eval tasks, end to end, into metrics.jsonl as step `at_step`."""
    run.model.eval()
    with torch.no_grad(), gather:
        ev = evaluate_policy(run.model, run.tok, run.eval_tasks, cfg, reward, infill=False, rt=rt, fmt=run.eval_fmt)
    run.metrics.write({"step": at_step, **ev})
    log(f"{label}: " + json.dumps(ev))


def train_rl(cfg, reward_fn: Reward | Callable | None = None, tasks: list[Task] | None = None,
             eval_tasks: list[Task] | None = None) -> Path:
    """BiC-RL phase `cfg.phase` ("infill" or "e2e"); `reward_fn` replaces the kernel verifier (tests,
    other rewards): a `dice.rl.reward.Reward`, or any `reward_fn(tasks, completions)` returning a
    list of floats or Scores (a `PythonReward`). Returns the final model folder.

    Each step: `rl_step`, then the log and the checkpoint; a greedy evaluation before every
    `--eval-every`-th step and at the end."""
    rt = setup_runtime(offload=cfg.offload == "cpu")
    log = make_logger(rt)
    run = open_run(cfg, rt, log, tasks, eval_tasks)
    total = cfg.steps
    verifier, reward, eval_reward = rl_rewards(cfg, rt, reward_fn)
    # the update's micro-batch budget, with room for the verifier's processes; planned now for a response
    # of --max-new-tokens, so that one no step could hold is refused before the first rollout
    tokens = UpdateTokens(run.model, run.optimizer, rt, reward.gpu_bytes, log)
    # generation calls the layers, not the root forward: under FSDP every parameter is gathered first
    gather = FullParameters(run.model) if rt.sharded else contextlib.nullcontext()
    learner = Learner(run.model, run.tok, run.optimizer, reward, tokens, run.ref_model, run.fmt, gather)
    evaluate = functools.partial(_evaluate, run, cfg, rt, log, eval_reward, gather)
    log(f"BiC-RL {cfg.phase}: {len(run.ordered)} tasks (levels {sorted({t.level for t in run.ordered}, key=str)}), "
        f"{cfg.tasks_per_step} tasks x {cfg.group_size} samples per step, steps {run.start + 1}..{total}")
    started = time.perf_counter()
    try:
        tokens.before_rollouts(cfg)
        for step in range(run.start, total):
            t0 = time.perf_counter()
            if cfg.eval_every and run.eval_tasks and step % cfg.eval_every == 0:
                evaluate(step, f"eval before step {step + 1}")
            done = rl_step(learner, cfg, rt, run.ordered, run.cursor, step)
            run.cursor += done.samples.drawn
            # log: one metrics.jsonl line, one progress line
            record = rl_step_record(step + 1, done.samples, done.update, rt, cfg.reward, done.update_s, started=t0)
            run.metrics.write(record)
            log(progress_line(step, total, started, run.start,
                              rl_progress_fields(record, bool(cfg.dynamic_sampling_rounds))))
            # save: the model, the optimiser and where the task stream stands
            if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == total):
                save_checkpoint(run.out, step + 1, run.model, run.optimizer, cfg.model, rt, cfg.keep_checkpoints,
                                extra={"task_cursor": run.cursor}, moments=cfg.optimizer_state == "run")
        if cfg.eval_every and run.eval_tasks:
            evaluate(total, "eval after training")
        save_final(run.model, run.optimizer, run.out, cfg.model, rt, log)
        if rt.main:
            log(plot_run(run.out))
    finally:
        if verifier is not None:
            verifier.close()
    return run.out / "final"
