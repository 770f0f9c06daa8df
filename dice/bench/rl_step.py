"""One BiC-RL step at DICE's settings, timed: `python -m dice.bench rl` (DESIGN.md §7).

DICE's RL configs: 64 tasks x 16 samples a step, up to 4,096 new tokens, block 4, 4 steps per block,
dynamic remasking at 0.9, temperature 1, a binary compiled-and-correct reward; the defaults here are
a smaller step (8 x 8) that finishes within the bench budget, `--tasks-per-step 64 --group-size 16`
is DICE's. The step is the function training runs, `dice.rl.train_rl.rl_step`, on a random-weight
SDAR-shaped model (float32 master weights, bf16 autocast, AdamW, as `train.py`), with two stand-ins
for what a random model cannot do (`dice.bench.replay`): each rollout replays a reference program the verifier calls correct (a `--broken` share broken)
and stops at that program's length in tokens, so generation, verification and the update meet
DICE-shaped work.

AdamW's moments do not exist during the rollouts: under DICE's `--optimizer-state step` they live for
one update (`dice.rl.update.restart_moments`), which makes them, as in every `train.py` step. Times:
generate (the generating thread), verify (time with a reward call running, mostly hidden behind
generation), verify exposed (scoring left after the last token), update (the TraceRL update as a later
step runs it: its time less compile s), with its micro-batches' budget (update tokens: `--update-tokens`
auto plans it from the GPU memory free, `dice.memory.UpdateTokens`, after refusing before the first rollout
a step whose update cannot fit) and its model FLOPs (`dice.model.packing.update_flops`) per
second against the H200's measured bf16 rate, and compile s (what the update's first micro-batches took
beyond steady ones, `dice.model.packing.CompileClock`: FlexAttention compiles once per process for the
update's one micro-batch shape, so a `--compare`'s second step compiles nothing and shows 0). The
update's old log-probs are computed beside the reward's tail where it leaves time
(`dice.rl.update.OldLogprobs`): in update s only what was left. The bound
is the largest of generate, verify and update. `--baseline` runs the step as it ran before the rounds
of a response shared one clean stream (`--update-rows round`: one doubled row per round, in the same
token-sized micro-batches); `--compare` runs the baseline and then the given settings in one process
(fresh program salts, so both build cold).

Under `torchrun --nproc_per_node N` the step runs as `train.py`'s RL runs it on N GPUs: the policy
sharded with FSDP2, each process rolling out the groups of its task slots (`dice.rl.rollout.rank_slots`)
and verifying them on its own GPU with its share of `--workers` (`dice.runtime.rank_verifier`), the
update over all processes. Rank 0 checks the references and prints; the time columns are the
slowest process's, and each process's generate, verify and update seconds follow in rank order.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..cli import at_least, in_range
from ..config import UPDATE_ROWS, TrainConfig
from ..memory import UpdateTokens
from ..rl.rollout import OVERLAP, RolloutOptions, rank_slots
from ..rl.train_rl import Learner, rl_step
from ..run_folder import make_logger
from ..runtime import make_optimizer, rank_verifier, setup_runtime, shard
from ..sampling.completion import FullParameters
from ..tasks.load import step_tasks
from ..verifier import Verifier
from .common import BF16_FLOPS
from .replay import BROKEN, CHARS_PER_TOKEN, REFERENCE_VERDICTS, SDAR_TOKENIZER, make_reward, replay_programs
from .rl_setup import check_rollout_memory, checked_inputs, describe, replayable, tokenizer_and_model
from .training import train_shape


def count_or_auto(text: str) -> int | str:
    """An argparse `type`: "auto" or a whole number >= 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be auto or a whole number >= 1, got {text}")
    return int(text)


def add_arguments(p) -> None:
    p.add_argument("--shape", type=train_shape, default="1.7b",
                   help="1.7b, 4b, 8b, or a model folder (its config.json)")
    p.add_argument("--solutions", required=True, metavar="FILE.json",
                   help="DICE JSON whose cuda_code programs the rollouts replay")
    p.add_argument("--tasks-per-step", type=at_least(1), default=8, help="tasks per step (DICE: 64)")
    p.add_argument("--group-size", type=at_least(2), default=8, help="samples per task (DICE: 16)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=4096,
                   help="cap of a response; sizes the KV cache (DICE: 4096)")
    p.add_argument("--rollout-batch", type=count_or_auto, default="auto",
                   help="sequences generated per batch, or auto: as many as the GPU memory holds")
    p.add_argument("--update-tokens", type=count_or_auto, default="auto",
                   help="tokens per update micro-batch, or auto: as many as the GPU memory free when the update "
                        "starts holds (train.py --update-tokens)")
    p.add_argument("--update-rows", choices=UPDATE_ROWS, default="response",
                   help="response: a response's rounds share one clean stream; round: one doubled row per round")
    p.add_argument("--grad-ckpt", action="store_true", help="recompute each layer in the backward pass (4b: needed)")
    p.add_argument("--offload", choices=("none", "cpu"), default="none",
                   help="cpu: FSDP2 keeps the float32 weights, gradients and AdamW moments in host memory, one "
                   "process too (the 4B on an 80 GB GPU); the optimiser steps on the CPU")
    p.add_argument("--workers", type=at_least(1), default=8, help="verifier worker processes (and concurrent reward calls)")
    p.add_argument("--broken", type=in_range(0, 1), default=BROKEN, help="share of rollouts whose program is broken")
    p.add_argument("--reward", choices=("verifier", "python"), default="verifier",
                   help="verifier: the kernel verifier; python: 1 for an unbroken program (no GPU)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer that counts tokens (default: the --shape folder's; "
                   f"for 1.7b/4b/8b the SDAR tokenizer at {' or '.join(SDAR_TOKENIZER)}, else an estimate of "
                   f"{CHARS_PER_TOKEN} chars a token)")
    p.add_argument("--phase", choices=("e2e", "infill"), default="e2e", help="the prompts of BiC-RL phase 2 or 1")
    p.add_argument("--verify-timeout", type=in_range(0, None, above=True), default=15.0,
                   help="seconds a kernel may run")
    p.add_argument("--overlap", choices=OVERLAP, default="stream",
                   help="stream: verify each finished rollout at once; batch: each rollout batch; none: after all")
    p.add_argument("--attention", choices=("auto", "flex", "dense"), default="auto",
                   help="update masks; auto: FlexAttention on CUDA")
    p.add_argument("--rollout-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: sample from a bf16 copy of the weights (CUDA)")
    p.add_argument("--baseline", action="store_true", help="the step before the shared clean stream: "
                   "--update-rows round")
    p.add_argument("--compare", action="store_true", help="run --baseline, then the given settings")
    p.add_argument("--skip-update", action="store_true", help="rollouts only (8b: its AdamW state does not fit a GPU)")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of the weights, the broken picks and the sampling")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The levers that a run turns on or off."""
    overlap: str
    rollout_batch: int | str
    rollout_dtype: str
    attention: str
    update_rows: str


BASELINE = Settings("stream", "auto", "bf16", "auto", "round")
class PoolLoad:
    """The verifier pool's load for the progress line, over the last `every_s` seconds or more: how
    many workers and judges were busy on average (of how many), the prebuilds not yet reported, the
    workers started so far (`Verifier.worker_starts`) and a candidate's median seconds in its stages
    (`Verifier.stats`); where the reward's time goes while a step runs."""

    def __init__(self, verifier, every_s: float = 5.0):
        self.verifier, self.every_s, self.text = verifier, every_s, ""
        self.last = (time.perf_counter(), verifier.activity()) if verifier is not None else None

    def __call__(self) -> str:
        if self.verifier is None:
            return ""
        now, (workers, workers_s, judges, judges_s, builds) = time.perf_counter(), self.verifier.activity()
        then, (_, workers_s0, _, judges_s0, _) = self.last
        if now - then >= self.every_s:
            self.text = (f"; busy: workers {(workers_s - workers_s0) / (now - then):.1f}/{workers}, judges "
                         f"{(judges_s - judges_s0) / (now - then):.1f}/{judges}; prebuilds pending {builds}; "
                         f"{self.verifier.worker_starts()}; {self.verifier.stats.stage_times() or 'no candidate yet'}")
            self.last = (now, (workers, workers_s, judges, judges_s, builds))
        return self.text


def run_step(s: Settings, learner: Learner, owners: list, lengths: list[int], chosen: list, base: TrainConfig, rt,
             prompt_len: int, bench, load=lambda: "") -> tuple[dict, str]:
    """One timed step with the levers `s`: (its table row, a line of verdicts and update counts). The
    step is `dice.rl.train_rl.rl_step`, as `train.py` runs it, on the `chosen` tasks, whose samples
    replay the programs of `owners` (task k's group in order) at `lengths`. learner.tokens: the
    update's budget (`dice.memory.UpdateTokens`), planned before the first rollout for the longest
    replayed response after a prompt of `prompt_len`; None: no update (--skip-update). load(): text
    the progress line ends with (`PoolLoad`). Under torchrun each process rolls out the groups of
    its task slots (`dice.rl.rollout.rank_slots`), and the update runs over all of them."""
    cfg = dataclasses.replace(base, attention=s.attention, update_rows=s.update_rows,
                              rollout_batch=s.rollout_batch if isinstance(s.rollout_batch, int) else base.rollout_batch)
    cuda = rt.device.type == "cuda"
    name = "baseline" if s == BASELINE else "step"
    group = cfg.group_size
    if learner.tokens is not None:   # a step whose update cannot fit is refused now, not after its rollouts
        learner.tokens.before_rollouts(cfg, prompt_len, max(lengths))
    generated = []   # the log keeps the moment the last rollout is generated as a line of its own

    def show(made: int, scored: int, n: int) -> None:
        last = made == n and not generated
        if last:
            generated.append(n)
        bench.progress(f"{name}: rollouts generated {made}/{n}, verified {scored}/{n}{load()}", force=last)

    replay = [list(zip(owners[k * group:(k + 1) * group], lengths[k * group:(k + 1) * group]))
              for k in range(len(chosen))]
    rollouts = RolloutOptions(overlap=s.overlap, low_precision=s.rollout_dtype == "bf16",
                              auto_batch=s.rollout_batch == "auto", replay=replay, progress=show)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    done = rl_step(learner, cfg, rt, chosen, 0, 0, rollouts=rollouts, update=learner.tokens is not None,
                   update_progress=lambda k, total: bench.progress(f"{name}: update micro-batches", k, total))
    update, samples = done.update, done.samples
    # compiling, in the update or in the old log-probs' forward if it came first there, is compile s, not step s
    compile_s = update.get("compile_s", 0.0) + done.logprobs_compile_s
    rollout_s, update_s = done.rollout_s - done.logprobs_compile_s, done.update_s - update.get("compile_s", 0.0)
    timing = samples.timing
    verified = [r for r in samples.results if r is not None]
    ranks = _all_gather(rt, {"generate": timing["generate_s"], "verify": timing["verify_s"],
                             "verify exposed": timing["verify_wait_s"], "update": update_s,
                             "step": rollout_s + update_s, "rollouts": len(samples.completions),
                             "reward": sum(samples.rewards), "tokens": sum(len(c.tokens) for c in samples.completions),
                             "verified": len(verified), "verdicts": collections.Counter(r.status for r in verified),
                             "peak": torch.cuda.max_memory_allocated() if cuda else 0})
    row = _row(s, rt, timing["rollout_batch"], ranks, update, compile_s)
    return row, _summary(row["run"], ranks, update)


def _row(s: Settings, rt, batch: int, ranks: list[dict], update: dict, compile_s: float) -> dict:
    """The table row of a step from every process's times and counts (`ranks`, in rank order): the
    times are the slowest process's (the step waits for it), the rates all processes' work over
    them; under torchrun each process's generate / verify / update seconds follow."""
    cuda = rt.device.type == "cuda"
    top = {key: max(r[key] for r in ranks) for key in ("generate", "verify", "verify exposed", "update", "step")}
    step_s = top["step"]
    parts = {key: top[key] for key in ("generate", "verify", "update")}
    bound = max(parts, key=parts.get)
    verified, tokens = sum(r["verified"] for r in ranks), sum(r["tokens"] for r in ranks)
    flops_s = update.get("flops", 0.0) / max(top["update"], 1e-9)
    # a sharded policy samples from its float32 weights (`dice.sampling.completion.generation_copy`)
    dtype = s.rollout_dtype if cuda and rt.world == 1 else "fp32"
    masks = "dense" if s.attention == "dense" or not cuda else "flex"
    processes = f", {rt.world} processes" if rt.world > 1 else ""
    row = {"run": f"{s.overlap} overlap, batch {batch}, {dtype} rollouts, {masks} update, {s.update_rows} rows"
                  f"{processes}",
           "generate s": f"{top['generate']:.1f}", "verify s": f"{top['verify']:.1f}",
           "verify exposed s": f"{top['verify exposed']:.1f}", "update s": f"{top['update']:.1f}",
           "step s": f"{step_s:.1f}", "tokens/s": round(tokens / max(top["generate"], 1e-9)),
           "kernels/s": f"{verified / top['verify']:.2f}" if verified and top["verify"] > 0 else "-",
           "update tokens": update.get("update_tokens", "-"),
           "update TFLOP/s": f"{flops_s / 1e12:.3g} ({100 * flops_s / BF16_FLOPS:.0f}% of bf16)" if update else "-",
           "peak GiB": f"{max(r['peak'] for r in ranks) / 2**30:.1f}" if cuda else "-",
           "bound": f"{bound} ({100 * parts[bound] / max(step_s, 1e-9):.0f}%)",
           "compile s": f"{compile_s:.1f}"}
    if rt.world > 1:
        row |= {f"{key} s by rank": " ".join(f"{r[key]:.1f}" for r in ranks)
                for key in ("generate", "verify", "update")}
    return row


def _summary(run: str, ranks: list[dict], update: dict) -> str:
    """A line of the step's rollouts, verdicts, rewards and update, over all processes."""
    rollouts, tokens = sum(r["rollouts"] for r in ranks), sum(r["tokens"] for r in ranks)
    verdicts = sum((r["verdicts"] for r in ranks), collections.Counter())
    return (f"{run}: {rollouts} rollouts, {tokens} tokens; verdicts "
            f"{' '.join(f'{k}={v}' for k, v in sorted(verdicts.items())) or '(python reward)'}; reward mean "
            f"{sum(r['reward'] for r in ranks) / rollouts:.2f}; update: {update.get('rounds', 0)} rounds of "
            f"{update.get('responses_trained', 0)} kept responses, loss {update.get('loss', 0.0):.6g}, grad norm "
            f"{update.get('grad_norm', 0.0):.6g}, "
            f"{update.get('flops', 0.0) / 1e12:.3g} TFLOP")


def _all_gather(rt, value) -> list:
    """Every process's `value` in rank order ([value] without torchrun)."""
    if rt.world == 1:
        return [value]
    out = [None] * rt.world
    dist.all_gather_object(out, value)
    return out


def bench_rl(args, bench) -> None:
    """`python -m dice.bench rl` (module docstring): build, replay, run the step(s), print the table.
    Under `torchrun --nproc_per_node N` (one process per GPU, gloo on a CPU: `dice.runtime`) the
    policy is sharded with FSDP2 and each process verifies on its own GPU (`dice.runtime.rank_verifier`),
    as `train.py` runs RL; rank 0 checks the references and prints."""
    rt = setup_runtime(offload=args.offload == "cpu")
    config, tasks = checked_inputs(args, rt)
    verifier = Verifier(**rank_verifier(args.workers, rt.device)) if args.reward == "verifier" else None
    lines = []
    try:
        correct, verdicts = replayable(args, tasks, verifier, bench, rt)
        chosen = step_tasks(correct, 0, args.tasks_per_step)
        tok_dir, tok, model, prompts = tokenizer_and_model(args, config, rt, chosen)
        check_rollout_memory(args, config, rt, len(rank_slots(0, len(chosen), rt)), prompts)
        gather = contextlib.nullcontext()
        if rt.sharded:
            shard(model, rt.device, offload=args.offload == "cpu")
            gather = FullParameters(model)
        base = TrainConfig(phase=args.phase, tasks_per_step=args.tasks_per_step, group_size=args.group_size,
                           max_new_tokens=args.max_new_tokens,
                           update_tokens=0 if args.update_tokens == "auto" else args.update_tokens,
                           gradient_checkpointing=args.grad_ckpt, verifier_workers=args.workers,
                           verify_timeout=args.verify_timeout, seed=args.seed)
        optimizer = make_optimizer(model, base)
        # one budget for every step of the process: its FlexAttention shapes compile once
        tokens = None if args.skip_update else UpdateTokens(model, optimizer, rt, verifier and verifier.gpu_bytes,
                                                            make_logger(rt))
        given = BASELINE if args.baseline else \
            Settings(args.overlap, args.rollout_batch, args.rollout_dtype, args.attention, args.update_rows)
        for i, settings in enumerate([BASELINE, given] if args.compare else [given]):
            bench.check("the baseline step" if settings is BASELINE else "the step", rt)
            replay = replay_programs(chosen, args.group_size, args.broken, args.seed, run=i)
            owners = [t for t, _ in replay]
            lengths = [min(args.max_new_tokens, len(tok.encode(f"```python\n{t.solution}\n```")) + 1) for t in owners]
            if i == 0 and rt.main:
                kept = Path(verifier.cache_dir) / REFERENCE_VERDICTS if verifier is not None else None
                describe(args, config, rt, chosen, replay, prompts, lengths, tok_dir, verdicts, kept)
            reward = make_reward(args.reward, verifier, {t.solution: k for t, k in replay}, args.verify_timeout)
            learner = Learner(model, tok, optimizer, reward, tokens, gather=gather)
            row, line = run_step(settings, learner, owners, lengths, chosen, base, rt, max(map(len, prompts)), bench,
                                 PoolLoad(verifier))
            if rt.main:
                bench.row(row)
                lines.append(line)
                print(line, file=sys.stderr, flush=True)
    finally:
        if verifier is not None:
            lines.append(f"{verifier.worker_starts()}; {verifier.stats.stage_times() or 'no candidate verified'}")
            verifier.close()
        if rt.main:
            print("\n".join(lines))
