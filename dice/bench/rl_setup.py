"""What `python -m dice.bench rl` does before its step (`dice.bench.rl_step`): the checks that need no
GPU work, the references the rollouts may replay (checked once by the verifier, their verdicts kept:
`dice.bench.replay.correct_references`), the random policy and the replay tokenizer, the memory the
sampler's KV cache needs, and the header line. Every process of a torchrun makes the same checks, so
all stop together; rank 0 says why (`refuse`)."""
from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..memory import MemoryShortage, kv_cache_bytes, planned_verifier_bytes
from ..refusals import check_fits, check_update_fits
from ..model.sdar import SDAR
from ..model.tokenizer import load_tokenizer
from ..sampling.completion import prompt_format, task_prompt_ids
from ..tasks.load import curriculum, load_tasks
from .common import BudgetSpent
from .replay import CHARS_PER_TOKEN, ReplayTokenizer, correct_references, tokenizer_folder
from .training import model_config

# what names the fixes when the update cannot fit (`dice.refusals.check_update_fits`)
UPDATE_FLAGS = {"state": "pass a smaller --shape, --offload cpu (the float32 state in host memory), --skip-update to "
                         "time its rollouts alone, or spread it over more GPUs (torchrun --nproc_per_node N: FSDP2 "
                         "shards the weights, gradients and moments)",
                "workers": "--workers", "tokens": "--update-tokens", "checkpointing": "--grad-ckpt",
                "length": "--max-new-tokens"}


def build_policy(config, device, grad_ckpt: bool, seed: int) -> SDAR:
    """Random float32 master weights, as `train.py` trains them (bf16 comes from autocast)."""
    with torch.device("meta"):
        model = SDAR(config)
    model = model.to_empty(device=device).tie_weights().init_weights(seed=seed)
    model.gradient_checkpointing = grad_ckpt
    return model.train()


def refuse(rt, message: str) -> None:
    """Exit with `message`, shown once: every process stops alike, rank 0 says why."""
    sys.exit(message if rt.main else 1)


def from_main(rt, value):
    """Rank 0's `value`, on every process."""
    if rt.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checked_inputs(args, rt) -> tuple:
    """(the model config, the tasks with a reference program), after the checks that need no GPU work;
    every process makes them alike, so all stop together."""
    if args.reward == "verifier" and rt.device.type != "cuda":
        refuse(rt, "error: python -m dice.bench rl --reward verifier needs a CUDA GPU; pass --reward python on "
                "this machine")
    if args.tasks_per_step < rt.world:
        refuse(rt, f"error: --tasks-per-step {args.tasks_per_step} is below the {rt.world} processes; pass "
                f"--tasks-per-step {rt.world} or more (every process needs a task)")
    config = model_config(args.shape)
    if rt.device.type == "cuda" and not args.skip_update:   # the responses' lengths: `run_step` plans for them
        try:
            check_update_fits(config, rt.device, tokens=0 if args.update_tokens == "auto" else args.update_tokens,
                              longest=0, gradient_checkpointing=args.grad_ckpt, autocast=True, processes=rt.world,
                              others=planned_verifier_bytes(args.workers, rt.device) if args.reward == "verifier"
                              else 0, flags=UPDATE_FLAGS, offload=args.offload == "cpu")
        except MemoryShortage as e:
            refuse(rt, f"error: --shape {args.shape}: {e}")
    tasks = [t for t in load_tasks(args.solutions) if t.solution and (args.phase == "e2e" or t.prefix is not None)]
    if not tasks:
        refuse(rt, f"error: {args.solutions}: no record has a cuda_code program" + (
            " and a prefix/middle/suffix split" if args.phase == "infill" else "") +
            "; pass a DICE JSON file with reference solutions")
    return config, tasks


def replayable(args, tasks: list, verifier, bench, rt) -> tuple[list, collections.Counter | None]:
    """(the tasks in curriculum order whose reference the rollouts may replay, the references' verdicts;
    None: not checked, the python reward). Rank 0 checks them (`correct_references`, each reference
    once) and sends the outcome to the others, which would otherwise check the same programs again."""
    if verifier is None:
        return curriculum(tasks), None
    found = None
    if rt.main:
        with contextlib.suppress(BudgetSpent):   # the other processes must hear of it, not wait
            found = correct_references(tasks, args.tasks_per_step, verifier, bench, args.verify_timeout)
    found = from_main(rt, found)
    if found is None:
        raise BudgetSpent("the step")
    correct, verdicts = found
    if not correct:
        refuse(rt, f"error: {args.solutions}: the verifier calls no reference program correct ({dict(verdicts)}); "
                "pass a file whose cuda_code programs verify (python -m dice.bench verify --check FILE)")
    return correct, verdicts


def check_rollout_memory(args, config, rt, tasks: int, prompts) -> None:
    """The sampler's KV cache for the whole length, allocated up front (`dice.memory`; auto on CUDA:
    at least one sequence), must fit in the device's free memory."""
    rollouts, cuda = tasks * args.group_size, rt.device.type == "cuda"
    batch = (1 if cuda else rollouts) if args.rollout_batch == "auto" else min(args.rollout_batch, rollouts)
    kv = kv_cache_bytes(config, batch, max(map(len, prompts)) + args.max_new_tokens,
                        2 if cuda and args.rollout_dtype == "bf16" else 4)
    check_fits({"the rollout KV cache": kv}, rt.device, "lower --max-new-tokens or --rollout-batch")


def tokenizer_and_model(args, config, rt, chosen):
    """(tokenizer folder or None, the replay tokenizer, the policy, the chosen tasks' prompt ids)."""
    tok_dir = tokenizer_folder(args.shape, args.tokenizer)
    tok = ReplayTokenizer(load_tokenizer(tok_dir) if tok_dir else None, config.vocab_size, config.mask_token_id)
    model = build_policy(config, rt.device, args.grad_ckpt, args.seed)
    prompts = [task_prompt_ids(tok, t, infill=args.phase == "infill", fmt=prompt_format(model)) for t in chosen]
    if max(max(p) for p in prompts) >= config.vocab_size:
        refuse(rt, f"error: --tokenizer {tok_dir} has ids beyond the model's vocabulary of {config.vocab_size}; "
                "pass the tokenizer of this shape (the SDAR tokenizer for 1.7b/4b/8b) or none")
    return tok_dir, tok, model, prompts


def describe(args, config, rt, chosen, replay, prompts, lengths, tok_dir, verdicts, kept: Path | None) -> None:
    """The bench's header line: the model, the GPU, the replayed programs and their references' verdicts
    (kept where `kept` says), the lengths, the sampler's and the update's settings."""
    kinds = collections.Counter("load_inline" if "load_inline" in t.solution else "CuPy" if "cupy" in t.solution
                                else "other" for t in chosen)
    where = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "CPU"
    counted = f"tokenizer {tok_dir}" if tok_dir else f"an estimate of {CHARS_PER_TOKEN} chars a token"
    checked = (f"references checked: {', '.join(f'{k} {v}' for k, v in sorted(verdicts.items()))}, their verdicts "
               f"kept in {kept} (delete it to check them again)" if verdicts
               else "references not checked (python reward)")
    print(f"\nrl bench: random SDAR {args.shape} ({config.num_parameters() / 1e9:.2f}B parameters), {where}; "
          f"{len(chosen)} tasks x {args.group_size} = {len(replay)} rollouts of {args.solutions} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} tasks; {checked}), {100 * args.broken:.0f}% "
          f"broken; {args.phase} prompts {sum(map(len, prompts)) / len(prompts):.0f} tokens on average, responses "
          f"{sum(lengths) / len(lengths):.0f} (max {max(lengths)}, cap {args.max_new_tokens}), counted by {counted}; "
          f"block {config.block_size}, 4 steps a block, dynamic remasking at 0.9, T = 1; update micro-batches of "
          f"{'as many tokens as fit (auto)' if args.update_tokens == 'auto' else f'{args.update_tokens} tokens'}"
          f"{', gradient checkpointing' if args.grad_ckpt else ''}; {args.workers} "
          f"verifier workers" + (" (python reward)" if args.reward == "python" else "") +
          (f"; {rt.world} processes (FSDP2), each generating and verifying its share of the tasks with its "
           "share of the workers" if rt.world > 1 else ""), flush=True)
