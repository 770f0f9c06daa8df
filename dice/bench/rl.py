"""One BiC-RL step at DICE's settings, timed: `python -m dice.bench rl` (DESIGN.md §7; issue 27).

DICE's RL configs: 64 tasks x 16 samples a step, up to 4,096 new tokens, block 4, 4 steps per block,
dynamic remasking at 0.9, temperature 1, a binary compiled-and-correct reward. The step runs the
training code itself (`dice.rl.rollout`, `group_advantages`, `policy_update`) on a random-weight
SDAR-shaped model (float32 master weights, bf16 autocast, AdamW, as `train.py`), with two stand-ins
for what a random model cannot do:

* programs: rollout j of task k replays a program from `--solutions` (DICE JSON: `pytorch_code`,
  `cuda_code`; the 99 DICE infilling references are load_inline, `python -m dice.taskgen` splits
  CuPy). Every copy gets its own `__device__` variable (a new source to every build cache, as 16
  samples of a task are 16 programs), and a `--broken` share, chosen at random, is broken: half of
  them with an undeclared identifier in the device code (compile_error, after a full build), half
  with 1 added to ModelNew's output (the kernels run, the result is wrong: incorrect). The
  verifier sees these programs through the training reward (`dice.rl.verifier_reward`);
  `--reward python` scores 1 for an unbroken program instead (no GPU needed);
* lengths: a random model never samples an eos, so each rollout stops as if it had sampled one
  right after the program it stands for (`generate(lengths=...)`): the tokens of
  "```python\\n<program>\\n```" plus the eos, capped at --max-new-tokens, counted by `--tokenizer`
  (the SDAR tokenizer for the SDAR shapes) or, without one, estimated at CHARS_PER_TOKEN characters
  a token (then prompt ids are pseudo-random ids of the estimated length). Trace rounds come from the
  sampler's real step maps: with random weights no confidence passes 0.9, so every block takes all
  4 steps (4 rounds a response: the update's worst case; a trained model unmasks more per step).

The optimiser state exists before the step (as in every step after the first). Times: generate
(the generating thread), verify (time with a reward call running, mostly hidden behind generation),
verify exposed (scoring left after the last token), update (the TraceRL update, after `warm_flex`
compiled FlexAttention for its shapes: compile, once per process). The bound is the largest of
generate, verify and update. `--baseline` runs the step as it ran before issue 27 (each rollout
batch scored after it, batches of 64, float32 rollouts, dense update masks); `--compare` runs the
baseline and then the given settings in one process (fresh program salts, so both build cold).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import random
import sys
import time
from pathlib import Path

import torch

from ..config import TrainConfig
from ..model import SDAR
from ..rl import Scores, group_advantages, policy_update, rollout
from ..trace import RoundBatch, flex_shape, round_logprobs
from ..rollout import OVERLAP
from ..tasks import load_tasks

CHARS_PER_TOKEN = 3.8   # the SDAR tokenizer on the 99 DICE infilling references: 71,964 chars, 18,862 tokens
SALT = "__device__ int dice_bench_salt_{tag};"
UNDECLARED = "__device__ int dice_bench_broken_{tag} = dice_bench_undeclared_{tag};"
OFF_BY_ONE = '''


_dice_bench_forward = ModelNew.forward


def _dice_bench_off_by_one(self, *args, **kwargs):   # python -m dice.bench rl: a wrong constant
    return _dice_bench_forward(self, *args, **kwargs) + 1


ModelNew.forward = _dice_bench_off_by_one
'''


def rollout_batch(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(text)
    return int(text)


def add_arguments(p) -> None:
    from .train import train_shape
    p.add_argument("--shape", type=train_shape, default="1.7b",
                   help="1.7b, 4b, 8b, or a model folder (its config.json)")
    p.add_argument("--solutions", required=True, metavar="FILE.json",
                   help="DICE JSON whose cuda_code programs the rollouts replay")
    p.add_argument("--tasks-per-step", type=int, default=64, help="tasks per step (DICE: 64)")
    p.add_argument("--group-size", type=int, default=16, help="samples per task (DICE: 16)")
    p.add_argument("--max-new-tokens", type=int, default=4096,
                   help="cap of a response; sizes the KV cache (DICE: 4096)")
    p.add_argument("--rollout-batch", type=rollout_batch, default="auto",
                   help="sequences generated per batch, or auto: as many as the GPU memory holds")
    p.add_argument("--batch-size", type=int, default=2, help="trace rounds per update micro-batch")
    p.add_argument("--grad-ckpt", action="store_true", help="recompute each layer in the backward pass (4b: needed)")
    p.add_argument("--workers", type=int, default=8, help="verifier worker processes (and concurrent reward calls)")
    p.add_argument("--broken", type=float, default=0.3, help="share of rollouts whose program is broken")
    p.add_argument("--reward", choices=("verifier", "python"), default="verifier",
                   help="verifier: the kernel verifier; python: 1 for an unbroken program (no GPU)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer that counts tokens (default: the --shape folder's; "
                   f"for 1.7b/4b/8b an estimate of {CHARS_PER_TOKEN} chars a token)")
    p.add_argument("--phase", choices=("e2e", "infill"), default="e2e", help="the prompts of BiC-RL phase 2 or 1")
    p.add_argument("--verify-timeout", type=float, default=15.0, help="seconds a kernel may run")
    p.add_argument("--overlap", choices=OVERLAP, default="stream",
                   help="stream: verify each finished rollout at once; batch: each rollout batch; none: after all")
    p.add_argument("--attention", choices=("auto", "flex", "dense"), default="auto",
                   help="update masks; auto: FlexAttention on CUDA")
    p.add_argument("--rollout-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: sample from a bf16 copy of the weights (CUDA)")
    p.add_argument("--baseline", action="store_true", help="the step as before: --overlap batch --rollout-batch 64 "
                   "--rollout-dtype fp32 --attention dense")
    p.add_argument("--compare", action="store_true", help="run --baseline, then the given settings")
    p.add_argument("--skip-update", action="store_true", help="rollouts only (8b: its AdamW state does not fit a GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the broken picks and the sampling")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The levers of issue 27 that a run turns on or off."""
    overlap: str
    rollout_batch: int | str
    rollout_dtype: str
    attention: str


BASELINE = Settings("batch", 64, "fp32", "dense")


class ReplayTokenizer:
    """What a rollout needs of a tokenizer for a random-weight model: prompt ids (the real
    tokenizer's, or without one pseudo-random ids, one per CHARS_PER_TOKEN characters), no eos (the
    lengths are forced) and no text (the rewards replay programs). Encodings are memoised: the 16
    rollouts of a task share one prompt."""

    def __init__(self, tokenizer, vocab_size: int, mask_id: int):
        self.inner, self.vocab_size, self.mask_id = tokenizer, vocab_size, mask_id
        self.eos_token_ids = ()
        self.pad_token_id = tokenizer.pad_token_id if tokenizer is not None else 0
        self.memo: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        if text not in self.memo:
            self.memo[text] = self.inner.encode(text) if self.inner is not None else self._estimate(text)
        return self.memo[text]

    def _estimate(self, text: str) -> list[int]:
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        ids = torch.randint(0, self.vocab_size - 1, (math.ceil(len(text) / CHARS_PER_TOKEN),),
                            generator=torch.Generator().manual_seed(seed))
        return (ids + (ids >= self.mask_id).long()).tolist()    # every id but the mask token

    def decode(self, ids) -> str:
        return ""


def with_device_line(program: str, line: str) -> str | None:
    """`program` with `line` inserted before its first kernel (above an `extern "C"` or template
    line that belongs to it), inside the CUDA source string; None when it has no `__global__`."""
    lines = program.split("\n")
    at = next((i for i, text in enumerate(lines) if "__global__" in text), None)
    if at is None:
        return None
    while at > 0 and (lines[at - 1].strip() == 'extern "C"' or lines[at - 1].strip().startswith("template")):
        at -= 1
    return "\n".join(lines[:at] + [line] + lines[at:])


def replay_programs(tasks: list, group_size: int, broken: float, seed: int, run: int) -> list[tuple[object, str]]:
    """(owner task carrying the program as its `solution`, kind) per rollout, task k's group in
    order: every program salted, round(broken x rollouts) of them broken (module docstring)."""
    n = len(tasks) * group_size
    picked = sorted(random.Random(seed).sample(range(n), round(broken * n)))
    kinds = {i: ("compile_error", "incorrect")[j % 2] for j, i in enumerate(picked)}
    out = []
    for i in range(n):
        task, tag, kind = tasks[i // group_size], f"{run}_{i}", kinds.get(i, "ok")
        program = with_device_line(task.solution, SALT.format(tag=tag)) or task.solution
        if kind == "compile_error":
            program = with_device_line(program, UNDECLARED.format(tag=tag)) or program + "\n)\n"
        elif kind == "incorrect":
            program += OFF_BY_ONE
        out.append((dataclasses.replace(task, solution=program), kind))
    return out


def make_reward(kind: str, verifier, kinds: dict, timeout_s: float):
    """The step's reward on (owners, completions): the training reward with each completion's
    code replaced by the program its owner carries, or the Python stand-in (`kinds`: program ->
    its kind)."""
    from ..rl import verifier_reward
    if kind == "python":
        return lambda owners, _: Scores([float(kinds[t.solution] == "ok") for t in owners])
    reward = verifier_reward(verifier, "e2e", "correct", timeout_s=timeout_s)
    return lambda owners, cs: reward(owners, [dataclasses.replace(c, code=t.solution) for t, c in zip(owners, cs)])


def warm_flex(model, completions, advantages, cfg, rt) -> tuple[float, int]:
    """Compile FlexAttention, forward and backward, for the shapes the update will meet (a full
    micro-batch's rows at every length bucket the kept rollouts reach), so that the update is
    timed warm; returns (seconds, shapes). A shortened last micro-batch may still compile once."""
    bs = model.config.block_size
    kept = [c for c, a in zip(completions, advantages) if a is not None and c.tokens]
    rows = flex_shape(cfg.batch_size, 1)[0]
    buckets = sorted({flex_shape(1, -(-(len(c.prompt_ids) + len(c.tokens) + len(c.tail_tokens)) // bs) * bs)[1]
                      for c in kept})
    device = next(model.parameters()).device
    start = time.perf_counter()
    for n in buckets:
        ids = torch.zeros(rows, n, dtype=torch.long)
        loss_at = torch.zeros(rows, n, dtype=torch.bool)
        loss_at[:, -1] = True
        batch = RoundBatch(noisy=ids, clean=ids, position_ids=torch.arange(n).expand(rows, n).clone(),
                           sample_ids=torch.zeros_like(ids), loss_at=loss_at, token_weight=torch.zeros(rows),
                           advantage=torch.zeros(rows))
        with rt.autocast(cfg.dtype):
            logp = round_logprobs(model, batch, use_flex=True)
        logp.sum().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start, len(buckets)


def build_policy(config, device, grad_ckpt: bool, seed: int) -> SDAR:
    """Random float32 master weights, as `train.py` trains them (bf16 comes from autocast)."""
    with torch.device("meta"):
        model = SDAR(config)
    model = model.to_empty(device=device).tie_weights().init_weights(seed=seed)
    model.gradient_checkpointing = grad_ckpt
    return model.train()


def allocate_optimizer_state(model, optimizer) -> None:
    """AdamW's moments, made by one step on zero gradients (which moves no weight; weight decay
    would shrink them by lr x decay)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_step(s: Settings, model, tok, owners: list, lengths: list[int], base: TrainConfig, rt, optimizer, reward,
             skip_update: bool, bench) -> tuple[dict, str]:
    """One timed step with the levers `s`: (its table row, a line of verdicts and update counts)."""
    cfg = dataclasses.replace(base, attention=s.attention,
                              rollout_batch=s.rollout_batch if isinstance(s.rollout_batch, int) else base.rollout_batch)
    cuda = rt.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    bench.progress(f"{s.overlap} overlap: generating and verifying {len(owners)} rollouts")
    model.eval()
    with torch.no_grad():   # one-member groups: owner k carries rollout k's program; the seeds equal the grouped ones
        completions, rewards, results, timing = rollout(
            model, tok, owners, list(range(len(owners))), dataclasses.replace(cfg, group_size=1), reward,
            seed=cfg.seed * 100_003 * 10_007, infill=cfg.phase == "infill", overlap=s.overlap,
            low_precision=s.rollout_dtype == "bf16", auto_batch=s.rollout_batch == "auto", lengths=lengths)
    rollout_s = time.perf_counter() - start
    advantages = group_advantages(rewards, cfg.group_size)
    model.train()
    bench.progress(f"{s.overlap} overlap: the update")
    compile_s, shapes = (0.0, 0) if skip_update or not cuda or s.attention == "dense" else \
        warm_flex(model, completions, advantages, cfg, rt)
    t0 = time.perf_counter()
    update = {} if skip_update else policy_update(model, None, completions, advantages, cfg, rt, optimizer,
                                                  tok.pad_token_id)
    if cuda:
        torch.cuda.synchronize()
    update_s = time.perf_counter() - t0
    step_s = rollout_s + update_s
    parts = {"generate": timing["generate_s"], "verify": timing["verify_s"], "update": update_s}
    bound = max(parts, key=parts.get)
    verified = [r for r in results if r is not None]
    tokens = sum(len(c.tokens) for c in completions)
    dtype, masks = (s.rollout_dtype, "dense" if s.attention == "dense" else "flex") if cuda else ("fp32", "dense")
    row = {"run": f"{s.overlap} overlap, batch {timing['rollout_batch']}, {dtype} rollouts, {masks} update",
           "generate s": f"{timing['generate_s']:.1f}", "verify s": f"{timing['verify_s']:.1f}",
           "verify exposed s": f"{timing['verify_wait_s']:.1f}", "update s": f"{update_s:.1f}",
           "step s": f"{step_s:.1f}", "tokens/s": round(tokens / max(timing["generate_s"], 1e-9)),
           "kernels/s": f"{len(verified) / timing['verify_s']:.2f}" if verified and timing["verify_s"] > 0 else "-",
           "peak GiB": f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if cuda else "-",
           "bound": f"{bound} ({100 * parts[bound] / max(step_s, 1e-9):.0f}%)",
           "compile s (once)": f"{compile_s:.1f} ({shapes} shapes)"}
    verdicts = collections.Counter(r.status for r in verified)
    line = (f"{row['run']}: {len(completions)} rollouts, {tokens} tokens; verdicts "
            f"{' '.join(f'{k}={v}' for k, v in sorted(verdicts.items())) or '(python reward)'}; reward mean "
            f"{sum(rewards) / len(rewards):.2f}; update: {update.get('rounds', 0)} rounds of "
            f"{update.get('responses_trained', 0)} kept responses")
    return row, line


def bench_rl(args, bench) -> None:
    """`python -m dice.bench rl` (module docstring): build, replay, run the step(s), print the table."""
    from ..rl import curriculum, step_tasks
    from ..rollout import prompt_format, task_prompt_ids
    from ..runtime import Runtime, make_optimizer
    from ..tokenizer import load_tokenizer
    from .train import model_config
    rt = Runtime(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if args.reward == "verifier" and rt.device.type != "cuda":
        sys.exit("python -m dice.bench rl --reward verifier needs a CUDA GPU; pass --reward python on this machine")
    config = model_config(args.shape)
    if rt.device.type == "cuda" and not args.skip_update:
        need, have = 16 * config.num_parameters(), torch.cuda.get_device_properties(rt.device).total_memory
        if need > 0.9 * have:
            sys.exit(f"--shape {args.shape}: float32 weights, gradients and AdamW moments need {need / 2**30:.0f} GiB "
                     f"of this GPU's {have / 2**30:.0f} GiB; pass --skip-update to time its rollouts alone")
    tasks = [t for t in load_tasks(args.solutions) if t.solution and (args.phase == "e2e" or t.prefix is not None)]
    if not tasks:
        sys.exit(f"{args.solutions}: no record has a cuda_code program" + (" and a prefix/middle/suffix split"
                 if args.phase == "infill" else "") + "; pass a DICE JSON file with reference solutions")
    chosen = step_tasks(curriculum(tasks), 0, args.tasks_per_step)
    folder = Path(args.shape)
    tok_dir = args.tokenizer or (args.shape if any((folder / f).is_file() for f in ("tokenizer.json", "vocab.json"))
                                 else None)
    tok = ReplayTokenizer(load_tokenizer(tok_dir) if tok_dir else None, config.vocab_size, config.mask_token_id)
    model = build_policy(config, rt.device, args.grad_ckpt, args.seed)
    infill = args.phase == "infill"
    prompts = [task_prompt_ids(tok, t, infill=infill, fmt=prompt_format(model)) for t in chosen]
    if max(max(p) for p in prompts) >= config.vocab_size:
        sys.exit(f"--tokenizer {tok_dir} has ids beyond the model's vocabulary of {config.vocab_size}; pass the "
                 "tokenizer of this shape (the SDAR tokenizer for 1.7b/4b/8b) or none")
    base = TrainConfig(phase=args.phase, tasks_per_step=args.tasks_per_step, group_size=args.group_size,
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                       gradient_checkpointing=args.grad_ckpt, verifier_workers=args.workers,
                       verify_timeout=args.verify_timeout, seed=args.seed)
    optimizer = make_optimizer(model, base)
    if not args.skip_update:
        allocate_optimizer_state(model, optimizer)
    given = BASELINE if args.baseline else \
        Settings(args.overlap, args.rollout_batch, args.rollout_dtype, args.attention)
    runs = [BASELINE, given] if args.compare else [given]
    verifier = None
    if args.reward == "verifier":
        from ..verifier import Verifier
        verifier = Verifier(workers=args.workers)
    lines = []
    try:
        for i, settings in enumerate(runs):
            bench.check("the baseline step" if settings is BASELINE else "the step")
            replay = replay_programs(chosen, args.group_size, args.broken, args.seed, run=i)
            owners = [t for t, _ in replay]
            lengths = [min(args.max_new_tokens, len(tok.encode(f"```python\n{t.solution}\n```")) + 1) for t in owners]
            if i == 0:
                _describe(args, config, rt, chosen, replay, prompts, lengths, tok_dir)
            reward = make_reward(args.reward, verifier, {t.solution: k for t, k in replay}, args.verify_timeout)
            row, line = run_step(settings, model, tok, owners, lengths, base, rt, optimizer, reward, args.skip_update,
                                 bench)
            bench.row(row)
            lines.append(line)
            print(line, file=sys.stderr, flush=True)
    finally:
        if verifier is not None:
            verifier.close()
        print("\n".join(lines))


def _describe(args, config, rt, chosen, replay, prompts, lengths, tok_dir) -> None:
    kinds = collections.Counter("load_inline" if "load_inline" in t.solution else "CuPy" if "cupy" in t.solution
                                else "other" for t in chosen)
    where = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "CPU"
    counted = f"tokenizer {tok_dir}" if tok_dir else f"an estimate of {CHARS_PER_TOKEN} chars a token"
    print(f"\nrl bench: random SDAR {args.shape} ({config.num_parameters() / 1e9:.2f}B parameters), {where}; "
          f"{len(chosen)} tasks x {args.group_size} = {len(replay)} rollouts of {args.solutions} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} tasks), {100 * args.broken:.0f}% broken; "
          f"{args.phase} prompts {sum(map(len, prompts)) / len(prompts):.0f} tokens on average, responses "
          f"{sum(lengths) / len(lengths):.0f} (max {max(lengths)}, cap {args.max_new_tokens}), counted by {counted}; "
          f"block {config.block_size}, 4 steps a block, dynamic remasking at 0.9, T = 1; update micro-batches of "
          f"{args.batch_size} rounds{', gradient checkpointing' if args.grad_ckpt else ''}; {args.workers} "
          f"verifier workers" + (" (python reward)" if args.reward == "python" else ""), flush=True)
