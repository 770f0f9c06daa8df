"""One BiC-RL step at DICE's settings, timed: `python -m dice.bench rl` (DESIGN.md §7).

DICE's RL configs: 64 tasks x 16 samples a step, up to 4,096 new tokens, block 4, 4 steps per block,
dynamic remasking at 0.9, temperature 1, a binary compiled-and-correct reward; the defaults here are
a smaller step (8 x 8) that finishes within the bench budget, `--tasks-per-step 64 --group-size 16`
is DICE's. The step runs the training code itself (`dice.rl.rollout`, `group_advantages`,
`policy_update`) on a random-weight SDAR-shaped model (float32 master weights, bf16 autocast,
AdamW, as `train.py`), with two stand-ins for what a random model cannot do:

* programs: rollout j of task k replays the reference program of task k from `--solutions`
  (DICE JSON: `pytorch_code`, `cuda_code`; the 99 DICE infilling references are load_inline,
  `python -m dice.taskgen` splits CuPy). Only references the verifier calls `correct` are
  replayed: each is verified once (the reward's options), its verdict kept by the hash of its task
  and program in the verifier's cache folder (REFERENCE_VERDICTS), and tasks are taken in
  curriculum order until enough have a correct one. Every copy gets its own `__device__` variable
  (a new source to every build cache, as 16 samples of a task are 16 programs), and a `--broken`
  share, chosen at random, is broken: half of them with an undeclared identifier in the device
  code (compile_error), half with 1 added to ModelNew's output (the kernels run, the result is
  wrong: incorrect). The verifier sees these programs through the training reward
  (`dice.rl.verifier_reward`); `--reward python` scores 1 for an unbroken program instead (no
  GPU needed; the references are then not checked);
* lengths: a random model never samples an eos, so each rollout stops as if it had sampled one
  right after the program it stands for (`generate(lengths=...)`): the tokens of
  "```python\\n<program>\\n```" plus the eos, capped at --max-new-tokens, counted by `--tokenizer`
  (default: a model folder's own; for the SDAR shapes the SDAR tokenizer where a checkout keeps
  it, SDAR_TOKENIZER) or, without one, estimated at CHARS_PER_TOKEN characters a token (then prompt
  ids are pseudo-random ids of the estimated length). Trace rounds come from the sampler's real
  step maps: with random weights no confidence passes 0.9, so every block takes all 4 steps (4
  rounds a response: the update's worst case; a trained model unmasks more per step).

The optimiser state exists before the step (as in every step after the first). Times: generate
(the generating thread), verify (time with a reward call running, mostly hidden behind generation),
verify exposed (scoring left after the last token), update (the TraceRL update, after `warm_flex`
compiled FlexAttention for its shapes: compile, once per process), with its model FLOPs
(`dice.packing.update_flops`) per second against the H200's measured bf16 rate. The bound is the
largest of generate, verify and update. `--baseline` runs the step as it ran before the rounds of a
response shared one clean stream (`--update-rows round`: one doubled row per round, in the same
token-sized micro-batches); `--compare` runs the baseline and then the given settings in one
process (fresh program salts, so both build cold).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from ..config import TrainConfig
from ..model import SDAR, SDAR_SHAPES
from ..packing import UPDATE_ROWS, flex_shape, packed_logprobs
from ..rl import Scores, curriculum, group_advantages, policy_update, rollout, step_tasks, update_plan
from ..rollout import OVERLAP
from ..tasks import load_tasks
from .common import BF16_FLOPS

CHARS_PER_TOKEN = 3.8   # the SDAR tokenizer on the 99 DICE infilling references: 71,964 chars, 18,862 tokens
SDAR_TOKENIZER = ("shared/sdar-chat", "../shared/sdar-chat")   # where a checkout keeps it, from its root
REFERENCE_VERDICTS = "bench-rl-references.json"
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
    p.add_argument("--tasks-per-step", type=int, default=8, help="tasks per step (DICE: 64)")
    p.add_argument("--group-size", type=int, default=8, help="samples per task (DICE: 16)")
    p.add_argument("--max-new-tokens", type=int, default=4096,
                   help="cap of a response; sizes the KV cache (DICE: 4096)")
    p.add_argument("--rollout-batch", type=rollout_batch, default="auto",
                   help="sequences generated per batch, or auto: as many as the GPU memory holds")
    p.add_argument("--update-tokens", type=int, default=TrainConfig.update_tokens,
                   help="tokens per update micro-batch (train.py --update-tokens)")
    p.add_argument("--update-rows", choices=UPDATE_ROWS, default="response",
                   help="response: a response's rounds share one clean stream; round: one doubled row per round")
    p.add_argument("--grad-ckpt", action="store_true", help="recompute each layer in the backward pass (4b: needed)")
    p.add_argument("--workers", type=int, default=8, help="verifier worker processes (and concurrent reward calls)")
    p.add_argument("--broken", type=float, default=0.3, help="share of rollouts whose program is broken")
    p.add_argument("--reward", choices=("verifier", "python"), default="verifier",
                   help="verifier: the kernel verifier; python: 1 for an unbroken program (no GPU)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer that counts tokens (default: the --shape folder's; "
                   f"for 1.7b/4b/8b the SDAR tokenizer at {' or '.join(SDAR_TOKENIZER)}, else an estimate of "
                   f"{CHARS_PER_TOKEN} chars a token)")
    p.add_argument("--phase", choices=("e2e", "infill"), default="e2e", help="the prompts of BiC-RL phase 2 or 1")
    p.add_argument("--verify-timeout", type=float, default=15.0, help="seconds a kernel may run")
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
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the broken picks and the sampling")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The levers that a run turns on or off."""
    overlap: str
    rollout_batch: int | str
    rollout_dtype: str
    attention: str
    update_rows: str


BASELINE = Settings("stream", "auto", "bf16", "auto", "round")


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


def warm_flex(model, completions, advantages, cfg, rt, pad_id: int) -> tuple[float, int]:
    """Compile FlexAttention, forward and backward, for the padded shapes of the update's own
    micro-batches (`dice.rl.update_plan`), so that the update is timed warm; returns (seconds, shapes)."""
    c = model.config
    plan, _, _ = update_plan(completions, advantages, cfg, rt, c.block_size, c.mask_token_id, pad_id, use_flex=True)
    shapes = {}
    for batch in (b for step in plan for b in step):
        shapes.setdefault(flex_shape(*batch.ids.shape), batch)
    start = time.perf_counter()
    for batch in shapes.values():
        with rt.autocast(cfg.dtype):
            logp = packed_logprobs(model, batch, use_flex=True)
        (0 * logp.sum()).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(rt.device)
    return time.perf_counter() - start, len(shapes)


def reference_key(task) -> str:
    return hashlib.sha256(json.dumps([task.source, task.solution]).encode()).hexdigest()


def correct_references(tasks: list, count: int, verifier, bench, timeout_s: float) -> tuple[list, collections.Counter]:
    """Up to `count` tasks, in curriculum order, whose reference program the verifier calls correct
    (module docstring): verdicts are read from and added to REFERENCE_VERDICTS in the verifier's
    cache folder, so each reference is verified once. Returns (those tasks, the verdicts of every
    task looked at)."""
    path = Path(verifier.cache_dir) / REFERENCE_VERDICTS
    verdicts = json.loads(path.read_text()) if path.is_file() else {}
    ordered, chosen, looked = curriculum(tasks), [], 0
    while len(chosen) < count and looked < len(ordered):
        batch = ordered[looked:looked + count - len(chosen)]
        looked += len(batch)
        todo = [t for t in batch if reference_key(t) not in verdicts]
        broken = set()
        results, _, _ = bench.verify_map(verifier, [(t.source, t.solution) for t in todo], "checking references",
                                         on_broken_task=lambda i, _: broken.add(i), trials=3, timeout_s=timeout_s)
        for i, (t, r) in enumerate(zip(todo, results)):
            if r is not None or i in broken:
                verdicts[reference_key(t)] = "task_error" if i in broken else r.status
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdicts, indent=0, sort_keys=True))
        tmp.replace(path)
        bench.check("the step")
        chosen += [t for t in batch if verdicts.get(reference_key(t)) == "correct"]
    return chosen, collections.Counter(verdicts.get(reference_key(t), "unchecked") for t in ordered[:looked])


def tokenizer_folder(shape: str, given: str | None) -> str | None:
    """The tokenizer that counts tokens (the --tokenizer help), or None for the estimate."""
    if given:
        return given
    has_tokenizer = lambda folder: any((Path(folder) / f).is_file() for f in ("tokenizer.json", "vocab.json"))  # noqa: E731
    if shape.lower() in SDAR_SHAPES:
        return next((folder for folder in SDAR_TOKENIZER if has_tokenizer(folder)), None)
    return shape if has_tokenizer(shape) else None


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
    cfg = dataclasses.replace(base, attention=s.attention, update_rows=s.update_rows,
                              rollout_batch=s.rollout_batch if isinstance(s.rollout_batch, int) else base.rollout_batch)
    cuda = rt.device.type == "cuda"
    name = "baseline" if s == BASELINE else "step"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model.eval()
    with torch.no_grad():   # one-member groups: owner k carries rollout k's program; the seeds equal the grouped ones
        completions, rewards, results, timing = rollout(
            model, tok, owners, list(range(len(owners))), dataclasses.replace(cfg, group_size=1), reward,
            seed=cfg.seed * 100_003 * 10_007, infill=cfg.phase == "infill", overlap=s.overlap,
            low_precision=s.rollout_dtype == "bf16", auto_batch=s.rollout_batch == "auto", lengths=lengths,
            progress=lambda made, scored, n: bench.progress(f"{name}: rollouts generated {made}/{n}, verified",
                                                            scored, n))
    rollout_s = time.perf_counter() - start
    advantages = group_advantages(rewards, cfg.group_size)
    model.train()
    bench.progress(f"{name}: compiling the update's shapes")
    compile_s, shapes = (0.0, 0) if skip_update or not cuda or s.attention == "dense" else \
        warm_flex(model, completions, advantages, cfg, rt, tok.pad_token_id)
    t0 = time.perf_counter()
    update = {} if skip_update else policy_update(
        model, None, completions, advantages, cfg, rt, optimizer, tok.pad_token_id,
        progress=lambda done, total: bench.progress(f"{name}: update micro-batches", done, total))
    if cuda:
        torch.cuda.synchronize()
    update_s = time.perf_counter() - t0
    step_s = rollout_s + update_s
    parts = {"generate": timing["generate_s"], "verify": timing["verify_s"], "update": update_s}
    bound = max(parts, key=parts.get)
    verified = [r for r in results if r is not None]
    tokens = sum(len(c.tokens) for c in completions)
    flops_s = update.get("flops", 0.0) / max(update_s, 1e-9)
    dtype, masks = (s.rollout_dtype, "dense" if s.attention == "dense" else "flex") if cuda else ("fp32", "dense")
    row = {"run": f"{s.overlap} overlap, batch {timing['rollout_batch']}, {dtype} rollouts, {masks} update, "
                  f"{s.update_rows} rows",
           "generate s": f"{timing['generate_s']:.1f}", "verify s": f"{timing['verify_s']:.1f}",
           "verify exposed s": f"{timing['verify_wait_s']:.1f}", "update s": f"{update_s:.1f}",
           "step s": f"{step_s:.1f}", "tokens/s": round(tokens / max(timing["generate_s"], 1e-9)),
           "kernels/s": f"{len(verified) / timing['verify_s']:.2f}" if verified and timing["verify_s"] > 0 else "-",
           "update TFLOP/s": f"{flops_s / 1e12:.3g} ({100 * flops_s / BF16_FLOPS:.0f}% of bf16)" if update else "-",
           "peak GiB": f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if cuda else "-",
           "bound": f"{bound} ({100 * parts[bound] / max(step_s, 1e-9):.0f}%)",
           "compile s (once)": f"{compile_s:.1f} ({shapes} shapes)"}
    verdicts = collections.Counter(r.status for r in verified)
    line = (f"{row['run']}: {len(completions)} rollouts, {tokens} tokens; verdicts "
            f"{' '.join(f'{k}={v}' for k, v in sorted(verdicts.items())) or '(python reward)'}; reward mean "
            f"{sum(rewards) / len(rewards):.2f}; update: {update.get('rounds', 0)} rounds of "
            f"{update.get('responses_trained', 0)} kept responses, {update.get('flops', 0.0) / 1e12:.3g} TFLOP")
    return row, line


def bench_rl(args, bench) -> None:
    """`python -m dice.bench rl` (module docstring): build, replay, run the step(s), print the table."""
    from ..runtime import Runtime, make_optimizer
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
    verifier = None
    if args.reward == "verifier":
        from ..verifier import Verifier
        verifier = Verifier(workers=args.workers)
    lines = []
    try:
        if verifier is not None:
            correct, verdicts = correct_references(tasks, args.tasks_per_step, verifier, bench, args.verify_timeout)
            if not correct:
                sys.exit(f"{args.solutions}: the verifier calls no reference program correct ({dict(verdicts)}); "
                         "pass a file whose cuda_code programs verify (python -m dice.bench verify --check FILE)")
        else:
            correct, verdicts = curriculum(tasks), None
        chosen = step_tasks(correct, 0, args.tasks_per_step)
        tok_dir, tok, model, prompts = _tokenizer_and_model(args, config, rt, chosen)
        base = TrainConfig(phase=args.phase, tasks_per_step=args.tasks_per_step, group_size=args.group_size,
                           max_new_tokens=args.max_new_tokens, update_tokens=args.update_tokens,
                           gradient_checkpointing=args.grad_ckpt, verifier_workers=args.workers,
                           verify_timeout=args.verify_timeout, seed=args.seed)
        optimizer = make_optimizer(model, base)
        if not args.skip_update:
            allocate_optimizer_state(model, optimizer)
        given = BASELINE if args.baseline else \
            Settings(args.overlap, args.rollout_batch, args.rollout_dtype, args.attention, args.update_rows)
        for i, settings in enumerate([BASELINE, given] if args.compare else [given]):
            bench.check("the baseline step" if settings is BASELINE else "the step")
            replay = replay_programs(chosen, args.group_size, args.broken, args.seed, run=i)
            owners = [t for t, _ in replay]
            lengths = [min(args.max_new_tokens, len(tok.encode(f"```python\n{t.solution}\n```")) + 1) for t in owners]
            if i == 0:
                _describe(args, config, rt, chosen, replay, prompts, lengths, tok_dir, verdicts)
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


def _tokenizer_and_model(args, config, rt, chosen):
    """(tokenizer folder or None, the replay tokenizer, the policy, the chosen tasks' prompt ids)."""
    from ..rollout import task_prompt_ids
    from ..tokenizer import load_tokenizer
    tok_dir = tokenizer_folder(args.shape, args.tokenizer)
    tok = ReplayTokenizer(load_tokenizer(tok_dir) if tok_dir else None, config.vocab_size, config.mask_token_id)
    prompts = [task_prompt_ids(tok, t, infill=args.phase == "infill",
                               one_shot=config.extra.get("dice_one_shot", "load_inline")) for t in chosen]
    if max(max(p) for p in prompts) >= config.vocab_size:
        sys.exit(f"--tokenizer {tok_dir} has ids beyond the model's vocabulary of {config.vocab_size}; pass the "
                 "tokenizer of this shape (the SDAR tokenizer for 1.7b/4b/8b) or none")
    return tok_dir, tok, build_policy(config, rt.device, args.grad_ckpt, args.seed), prompts


def _describe(args, config, rt, chosen, replay, prompts, lengths, tok_dir, verdicts) -> None:
    kinds = collections.Counter("load_inline" if "load_inline" in t.solution else "CuPy" if "cupy" in t.solution
                                else "other" for t in chosen)
    where = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "CPU"
    counted = f"tokenizer {tok_dir}" if tok_dir else f"an estimate of {CHARS_PER_TOKEN} chars a token"
    checked = (f"references checked: {', '.join(f'{k} {v}' for k, v in sorted(verdicts.items()))}" if verdicts
               else "references not checked (python reward)")
    print(f"\nrl bench: random SDAR {args.shape} ({config.num_parameters() / 1e9:.2f}B parameters), {where}; "
          f"{len(chosen)} tasks x {args.group_size} = {len(replay)} rollouts of {args.solutions} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} tasks; {checked}), {100 * args.broken:.0f}% "
          f"broken; {args.phase} prompts {sum(map(len, prompts)) / len(prompts):.0f} tokens on average, responses "
          f"{sum(lengths) / len(lengths):.0f} (max {max(lengths)}, cap {args.max_new_tokens}), counted by {counted}; "
          f"block {config.block_size}, 4 steps a block, dynamic remasking at 0.9, T = 1; update micro-batches of "
          f"{args.update_tokens} tokens{', gradient checkpointing' if args.grad_ckpt else ''}; {args.workers} "
          f"verifier workers" + (" (python reward)" if args.reward == "python" else ""), flush=True)
