"""BiC-RL: TraceRL rollouts -> verifier rewards -> policy update, in two phases (DESIGN.md §7).

Per RL step: take `tasks_per_step` tasks in curriculum order (ascending level, wrapping; or with
`--task-order interleaved` every level in its share each step: `dice.tasks.load.curriculum`), sample
`group_size` responses each with the block-diffusion sampler, reward each (1 if the kernel
compiles and is correct; in the `infill` phase also only if the program keeps the given prefix
and suffix), and form group z-score advantages A = (R - mean_g) / std_g, dropping groups whose
rewards are all equal. `--dynamic-sampling-rounds N` (DAPO's dynamic sampling, `dice.rl.groups.sample_step`)
draws the next tasks in place of the dropped groups, up to N more rounds a step, and a step
starts where the one before stopped drawing. A step's groups: `dice.rl.groups`.

Trace -> training rounds: `dice.rl.trace`; their forwards, a response's rounds beside one clean
stream in micro-batches sized by tokens, per optimiser step: `dice.rl.packing` (`update_plan`). A step
reads top to bottom in `train_rl`; its metrics.jsonl line is `dice.metrics.rl_step_record`.

Objective per loss token (ids kept from generation, never re-tokenised):
    rho = exp(logp_new - logp_old)
    l   = -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + beta * k3,   k3 = e^(lr - ln) - (lr - ln) - 1
with lr the reference log-prob (a frozen reference model, or the rollout policy), ln = logp_new.
Normalisation (`--loss-norm`, DESIGN.md §7): `step` (default; TraceRL's Gen-Verse/dLLM-RL
`train/rl_sdar.py`, as in deadlykitten4/DICE `training/RL/train/rl_sdar.py`:
`surrogate_tok.sum(dim=1) / L1`, then `sum() / B` over the round rows) makes an optimiser step's
loss the mean over its round rows of (the row's token terms summed) / L1, L1 the longest kept
response of the RL step, so every loss token weighs the same; `response` divides each response by
its own length and averages over responses (GRPO-style: 100 tokens weigh as much as 1,000).
DICE takes one optimiser step per 256 round rows (`total_batch_size_lm` = batch_size_lm 1 x 8 GPUs
x 32 accumulation steps, one epoch; `training/RL/configs/rl_sdar_kernel_*.yaml`), the ratio always
against the rollout policy's log-probs from before the first: `--updates-per-step 0` (default)
does the same with `--rows-per-update 256`, so after the first update clipping and KL act.
Which rows form each optimiser step (`dice.rl.packing.minibatches`, DESIGN.md §7): DICE's consecutive chunks of the
rows in rollout order (`--minibatch-order contiguous`), or the same cut after a seeded shuffle.
The gradient is clipped to 32 by default, DICE's clip of 1.0 in these units (its gradient is 1/32
of this one), and AdamW's moments restart every RL step as in DICE (`--optimizer-state step`).
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
from ..memory import out_of_memory
from ..metrics import rl_progress_fields, rl_step_record
from ..model.checkpoint import load_model
from ..model.tokenizer import load_tokenizer
from ..plot import plot_run
from ..runs import (MetricsLog, check_resume, check_run_folder, checkpoint_step, make_logger, progress_line, resume,
                    run_settings, save_checkpoint, save_final, start_run)
from ..runtime import build_model, make_optimizer, setup_runtime
from ..tasks.load import Task, load_tasks, phase_tasks
from ..tasks.prompts import PromptFormat
from .packing import CompileClock, PackedBatch, packed_logprobs, update_flops, update_plan, uses_flex
from .groups import sample_step
from .old_logprobs import RolloutLogprobs
from .rewards import Reward, Scores, rl_rewards
from .rollout import FullParameters, complete, load_prompt_template, prompt_format, task_prompt_ids
from .update_memory import CHECKPOINTING, UpdateTokens

# what a resumed RL run must keep (besides the tasks and the model)
RESUME_FIELDS = ("phase", "seed", "tasks_per_step", "group_size", "max_new_tokens", "temperature", "remasking",
                 "threshold", "steps_per_block", "updates_per_step", "rows_per_update", "loss_norm", "clip_eps",
                 "kl_beta", "reference_model", "reward", "reward_rules", "lr", "weight_decay", "adam_beta1",
                 "adam_beta2", "grad_clip", "minibatch_order", "optimizer_state", "prompt_template", "task_order",
                 "dynamic_sampling_rounds")


def policy_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantage: torch.Tensor, *, clip_eps: float,
                kl_beta: float, logp_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token PPO-clip loss plus beta * k3 KL (module docstring); returns (loss [N], stats)."""
    ratio = torch.exp(logp_new - logp_old)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg = -torch.minimum(ratio * advantage, clipped * advantage)
    ref = logp_old if logp_ref is None else logp_ref
    log_r = ref - logp_new
    k3 = torch.exp(log_r) - log_r - 1
    stats = {"clip_fraction": float(((ratio - clipped).abs() > 0).float().mean()) if ratio.numel() else 0.0,
             "kl": float(k3.detach().mean()) if k3.numel() else 0.0}
    return pg + kl_beta * k3, stats


def restart_moments(optimizer, lifetime: str) -> None:
    """`--optimizer-state step` (DICE): forget AdamW's moments and step counts after each RL step's
    update, so the next update's first optimiser step is Adam's first again and the rollouts in
    between have the moments' memory (twice the float32 weights) for a larger batch. DICE runs
    every RL step's update as a new process (`training/RL/rl.py`: `accelerate launch
    train/rl_sdar.py` per step) that builds a new AdamW (`rl_sdar.py` line 206) and saves only the
    model (line 831). `run` keeps them for the whole run."""
    if lifetime == "step":
        optimizer.state.clear()


# ---------------------------------------------------------------- the update

def _train_micro_batch(model, ref_model, batch: PackedBatch, logp_old: torch.Tensor | None, cfg, rt,
                       use_flex: bool) -> tuple[float, dict]:
    """One micro-batch's forward and backward, its gradient added to the parameters': (its loss,
    `policy_loss`'s stats). logp_old None: on-policy, the ratio to its own detached log-probs."""
    with rt.autocast(cfg.dtype):
        logp = packed_logprobs(model, batch, use_flex)
        logp_ref = None
        if ref_model is not None:
            with torch.no_grad():
                logp_ref = packed_logprobs(ref_model, batch, use_flex)
    tok_loss, stats = policy_loss(logp, logp.detach() if logp_old is None else logp_old,
                                  batch.advantage.to(logp.device), clip_eps=cfg.clip_eps, kl_beta=cfg.kl_beta,
                                  logp_ref=logp_ref)
    loss = (tok_loss * batch.token_weight.to(logp.device)).sum()
    (loss * rt.world).backward()   # FSDP averages over ranks; weights already use the global count
    return loss.item(), stats


def policy_update(model, ref_model, completions, advantages, cfg, rt, optimizer, pad_id: int, seed: int = 0,
                  progress=None, rollout_logprobs: RolloutLogprobs | None = None,
                  tokens: UpdateTokens | None = None) -> dict:
    """The optimiser steps of one RL step over the kept responses' trace rounds (`update_plan`), in
    micro-batches of the budget `tokens` gives now (the run's `UpdateTokens`: --update-tokens, or
    planned from the GPU memory free; None: one of this call's own).
    The token weights count rows and responses over all processes, so a micro-batch's backward is
    already its share of the step; with several steps the ratio is to the rollout policy's
    log-probs, taken before the first (those `rollout_logprobs` computed while the reward finished,
    `dice.rl.old_logprobs`, and the rest here). progress(done, total) follows the micro-batches. kl and
    clip_fraction are means over every loss token of all processes; flops is the update's model
    FLOPs (`dice.rl.packing.update_flops`), all processes'; compile_s the seconds it spent compiling
    FlexAttention (`CompileClock`; the slowest process's): a process's first update, 0 after;
    grad_norm the whole gradient's norm before clipping, the mean over the optimiser steps;
    update_tokens the micro-batches' budget."""
    config = model.config
    device = next(model.parameters()).device
    use_flex = uses_flex(cfg, device)
    kept = [c for c, a in zip(completions, advantages) if a is not None]
    budget = (tokens or UpdateTokens(model, optimizer, rt))(cfg, kept)
    cfg = dataclasses.replace(cfg, update_tokens=budget)
    plan, n_responses, n_rows = update_plan(completions, advantages, cfg, rt, config.block_size,
                                            config.mask_token_id, pad_id, use_flex, seed)
    if not plan:   # every group had equal rewards: no signal, and Adam's momentum must not move us
        return {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "responses_trained": 0, "rounds": 0, "flops": 0.0,
                "compile_s": 0.0, "grad_norm": 0.0, "update_tokens": budget}
    try:
        return _run_plan(model, ref_model, plan, n_responses, n_rows, cfg, rt, optimizer, use_flex, progress,
                         rollout_logprobs) | {"update_tokens": budget}
    except torch.OutOfMemoryError:
        fix = f"--update-tokens {max(budget // 2, 1)}"
        if not cfg.gradient_checkpointing:
            fix += f" or {CHECKPOINTING}"
        raise out_of_memory("the RL update", device, f"micro-batches of {budget} tokens", fix) from None


def _run_plan(model, ref_model, plan, n_responses: int, n_rows: int, cfg, rt, optimizer, use_flex: bool, progress,
              rollout_logprobs) -> dict:
    """`policy_update`'s passes over its plan: the old log-probs (with U > 1), then each optimiser
    step's micro-batches, its clip and its step."""
    config, device = model.config, next(model.parameters()).device
    clock = CompileClock.for_masks(use_flex, device)
    U, total = len(plan), sum(map(len, plan))
    flops = sum(update_flops(config, b) for step in plan for b in step)
    old = None
    if U > 1:   # the rollout policy's log-probs, before the first update
        def old_of(b: PackedBatch) -> torch.Tensor:
            nonlocal flops
            kept = rollout_logprobs.old(b) if rollout_logprobs is not None else None
            if kept is not None:
                return kept
            flops += update_flops(config, b, backward=False)
            return clock.run("forward", b, functools.partial(packed_logprobs, model, b, use_flex))

        with torch.no_grad(), rt.autocast(cfg.dtype):
            old = [[old_of(b) for b in step] for step in plan]
    if ref_model is not None:
        flops += sum(update_flops(config, b, backward=False) for step in plan for b in step)
    loss_sum, kl_sum, clipped, n_tokens, done, norm_sum = 0.0, 0.0, 0.0, 0, 0, 0.0
    for u, step in enumerate(plan):
        for i, batch in enumerate(step):
            loss, s = clock.run("train", batch, functools.partial(
                _train_micro_batch, model, ref_model, batch, old[u][i] if old else None, cfg, rt, use_flex))
            n = batch.advantage.numel()
            loss_sum, kl_sum, clipped, n_tokens = (loss_sum + loss / U, kl_sum + s["kl"] * n,
                                                   clipped + s["clip_fraction"] * n, n_tokens + n)
            done += 1
            if progress is not None:
                progress(done, total)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        norm_sum += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)   # FSDP2: a DTensor
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    n_tokens = rt.all_sum(n_tokens)
    return {"loss": rt.all_sum(loss_sum), "kl": rt.all_sum(kl_sum) / max(n_tokens, 1),
            "clip_fraction": rt.all_sum(clipped) / max(n_tokens, 1), "responses_trained": n_responses,
            "rounds": n_rows, "flops": rt.all_sum(flops), "compile_s": rt.all_max(clock.seconds()),
            "grad_norm": norm_sum / U}


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


# ---------------------------------------------------------------- the loop

def train_rl(cfg, reward_fn: Reward | Callable | None = None, tasks: list[Task] | None = None,
             eval_tasks: list[Task] | None = None) -> Path:
    """BiC-RL phase `cfg.phase` ("infill" or "e2e"); `reward_fn` replaces the kernel verifier (tests,
    other rewards): a `dice.rl.rewards.Reward`, or any `reward_fn(tasks, completions)` returning a
    list of floats or Scores (a `PythonReward`). Returns the final model folder.

    A step in its sections (module docstring): rollouts, their rewards and advantages, the update,
    the log, the checkpoint; a greedy evaluation before every `--eval-every`-th step and at the end."""
    rt = setup_runtime()
    log = make_logger(rt)
    run = open_run(cfg, rt, log, tasks, eval_tasks)
    model, optimizer, total = run.model, run.optimizer, cfg.steps
    verifier, reward, eval_reward = rl_rewards(cfg, rt, reward_fn)
    # the update's micro-batch budget, with room for the verifier's processes; planned now for a response
    # of --max-new-tokens, so that one no step could hold is refused before the first rollout
    tokens = UpdateTokens(model, optimizer, rt, reward.gpu_bytes)
    # generation calls the layers, not the root forward: under FSDP every parameter is gathered first
    gather = FullParameters(model) if rt.world > 1 else contextlib.nullcontext()
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
            # rollouts, rewards, advantages: one pass (`sample_step`), the reward scoring each block's finished
            # responses while generation goes on, the advantages deciding which tasks dynamic sampling redraws
            model.eval()
            # the update's old log-probs, computed while the reward's last verdicts come in
            old = RolloutLogprobs(model, cfg, rt, run.tok.pad_token_id, tokens)
            with torch.no_grad(), gather:
                sampled = sample_step(model, run.tok, run.ordered, run.cursor, cfg, reward, rt,
                                      seed=(cfg.seed * 100_003 + step) * 10_007, infill=cfg.phase == "infill",
                                      fmt=run.fmt, rollout_logprobs=old)
            run.cursor += sampled.drawn
            # update: the optimiser steps over the kept responses' trace rounds
            model.train()
            t_update = time.perf_counter()
            upd = policy_update(model, run.ref_model, sampled.completions, sampled.advantages, cfg, rt, optimizer,
                                run.tok.pad_token_id, seed=cfg.seed * 100_003 + step, rollout_logprobs=old,
                                tokens=tokens)
            # dropped now, not before the next update: the next step's rollouts get their memory
            restart_moments(optimizer, cfg.optimizer_state)
            t_update = time.perf_counter() - t_update
            # log: one metrics.jsonl line, one progress line
            record = rl_step_record(step + 1, sampled, upd, rt, cfg.reward, t_update, started=t0)
            run.metrics.write(record)
            log(progress_line(step, total, started, run.start,
                              rl_progress_fields(record, bool(cfg.dynamic_sampling_rounds))))
            # save: the model, the optimiser and where the task stream stands
            if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == total):
                save_checkpoint(run.out, step + 1, model, optimizer, cfg.model, rt, cfg.keep_checkpoints,
                                extra={"task_cursor": run.cursor}, moments=cfg.optimizer_state == "run")
        if cfg.eval_every and run.eval_tasks:
            evaluate(total, "eval after training")
        save_final(model, optimizer, run.out, cfg.model, rt, log)
        if rt.main:
            log(plot_run(run.out))
    finally:
        if verifier is not None:
            verifier.close()
    return run.out / "final"
