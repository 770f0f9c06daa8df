"""Train a DICE model: `python train.py --phase init|sft|infill|e2e [--model DIR --data FILE] [--out DIR] ...`.

Every flag is a field of `dice.config.TrainConfig`; README lists them. With neither --model nor
--data, `--phase sft|infill|e2e` runs the embedded default (`dice.config.DEFAULTS`' "PHASE embedded"
rows, on `EMBEDDED_DATA`): the shipped dice-tiny on tasks `dice.taskgen` generates with a fixed seed,
written into the run folder. The run folder defaults to a new `runs/<phase>-<time>/`. Under `torchrun --nproc_per_node N train.py
...` the model is sharded with FSDP2.

Before any work or write, the validation layer checks the flags (`TrainConfig.validate`, then
`check_usage`: exit status 2), the machine (`check_machine`), every input and output path
(`check_paths`: the rules of `dice.inputs` and of run folders, `dice.run_folder.check_run_folder`)
and whether the sizes can fit in memory (`check_memory`, `dice.memory`).
"""
import functools
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from dice.cli import fail_cleanly, usage_error
from dice.config import EMBEDDED_DATA, RL_PHASES, config_from_args, with_embedded_defaults
from dice.errors import UsageError
from dice.inputs import input_path, output_folder
from dice.memory import kv_cache_bytes, micro_batch_bytes, parameter_bytes, planned_verifier_bytes
from dice.model.checkpoint import CheckpointError, read_config
from dice.model.packing import group_bound
from dice.refusals import check_fits, check_update_fits
from dice.rl.train_rl import train_rl
from dice.run_folder import RUN_ENTRIES, check_run_folder, latest_checkpoint
from dice.sampling.completion import load_prompt_template
from dice.sft.train_sft import INIT_ENTRIES, init_model_folder, sft_sizes, train_sft

MODEL_GIVE = "pass --model DIR (a downloaded SDAR/DICE checkpoint, or a folder written by train.py)"
# what names the fixes when the RL update cannot fit (`dice.refusals.check_update_fits`)
UPDATE_FLAGS = {"state": "train a smaller --model, keep its float32 state in host memory (--offload cpu), or spread "
                         "it over more GPUs (torchrun --nproc_per_node N: FSDP2 shards the weights, gradients and "
                         "moments)",
                "workers": "--verifier-workers", "tokens": "--update-tokens", "checkpointing": "--gradient-checkpointing",
                "length": "--max-new-tokens"}


def check_usage(cfg, embedded: bool) -> None:
    """Missing or conflicting flags: one line, exit status 2."""
    if cfg.phase == "init":
        for flag in ("data", "out"):
            if not getattr(cfg, flag):
                usage_error("train.py", f"--phase init needs --{flag}")
        return
    if not embedded:
        for flag in ("model", "data"):
            if not getattr(cfg, flag):
                usage_error("train.py", f"--{flag} is required with --{'data' if flag == 'model' else 'model'} "
                                        "(give neither to run the embedded default)")
        if cfg.phase == "sft" and not (cfg.steps or cfg.epochs):
            usage_error("train.py", "--phase sft needs --steps N or --epochs E")
        if cfg.phase != "sft" and not cfg.steps:
            usage_error("train.py", f"--phase {cfg.phase} needs --steps N (RL steps to run)")
    if cfg.steps and cfg.epochs:
        usage_error("train.py", "--steps N and --epochs E both set the run's length; pass one of them")
    if cfg.resume and not cfg.out:
        usage_error("train.py", "--resume needs --out DIR, the run folder to continue")
    if cfg.phase in RL_PHASES and cfg.group_size < 2:
        usage_error("train.py", "--group-size 1 gives every group one reward, so no group has an advantage and RL "
                                "learns nothing; pass --group-size 2 or more (DICE: 16)")
    if cfg.phase in RL_PHASES and bool(cfg.eval_every) != bool(cfg.eval_data):
        usage_error("train.py", "--eval-every N and --eval-data FILE go together (the held-out tasks, and how "
                                "often to evaluate on them); give both or neither")


def check_machine(cfg) -> None:
    """What this machine cannot do: one line, exit status 1."""
    if cfg.phase in ("infill", "e2e") and not torch.cuda.is_available():
        sys.exit(f"error: --phase {cfg.phase} rewards kernels with the verifier, which needs a CUDA GPU "
                         "(and cupy) that this machine lacks; run it on a GPU machine")
    if cfg.phase == "sft" and cfg.attention == "flex" and not torch.cuda.is_available():
        sys.exit("error: --attention flex needs a CUDA GPU (FlexAttention has no CPU backward); "
                         "use --attention dense or auto on this machine")


def check_paths(cfg, embedded: bool, out_flag: str = "--out") -> None:
    """Inputs exist, are of their kind and readable, the model's config.json is usable (exit 1);
    outputs follow `dice.inputs` (nothing the user made is overwritten, never inside an input) and
    run folders `check_run_folder` (exit 2; a --resume's files that cannot be read: exit 1). `out_flag`
    names the run folder in a refusal: "--out", or "the default output folder runs/..." when none was given."""
    if cfg.phase == "init":
        input_path(cfg.data, "--data", "file", "give --data a .json or .jsonl file of records to train the tokenizer on")
        output_folder(cfg.out, out_flag, INIT_ENTRIES, overwrite=cfg.overwrite, inputs={"--data": cfg.data})
        check_no_run(Path(cfg.out))
        return
    input_path(cfg.model, "--model", "folder", MODEL_GIVE)
    read_config(cfg.model)
    if not embedded:
        kind = "file" if cfg.phase == "sft" else "any"
        input_path(cfg.data, "--data", kind, "give --data a .json or .jsonl file of records" if kind == "file" else
                   "give --data a DICE .json task file or a KernelBench folder")
    if cfg.eval_data:
        input_path(cfg.eval_data, "--eval-data", "any", "give --eval-data a DICE .json task file or a KernelBench folder")
    if cfg.prompt_template:
        load_prompt_template(cfg.prompt_template, cfg.phase == "infill")
    inputs = {"--model": cfg.model, "--eval-data": cfg.eval_data, "--prompt-template": cfg.prompt_template} | (
        {} if embedded else {"--data": cfg.data})
    check_run_folder(Path(cfg.out), cfg.resume, cfg.overwrite, inputs=inputs, flag=out_flag,
                     also=("tasks.json",) if embedded and not cfg.resume else ())


def check_no_run(out: Path) -> None:
    """--phase init writes a model folder; one that holds a training run (its run.json, metrics.jsonl,
    checkpoints/, ...) is refused even with --overwrite, which would mix a model into the run."""
    found = [name for name in RUN_ENTRIES if (out / name).exists()]
    if found:
        raise UsageError(f"argument --out: {out} holds a training run ({', '.join(found)}); --phase init writes a new "
                         "model folder: choose another --out, e.g. a new folder")


def check_memory(cfg) -> None:
    """Sizes whose lower-bound memory (`dice.memory`) exceeds what this process's device has free:
    exit status 1, before the model loads. SFT: float32 parameters with their gradient and AdamW
    state, and a micro-batch's logits (dense attention on a CPU); RL: the same parameters and the
    rollout KV cache the sampler allocates up front, and on a GPU the update as it will be planned
    beside the verifier's processes (`check_update_fits`: the state, and a micro-batch of one
    response of --max-new-tokens, its clean stream and one noisy copy)."""
    config, world = read_config(cfg.model), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    offload = cfg.offload == "cpu"   # the float32 state in host memory: none of it on the device
    parts = {"float32 parameters, gradients and AdamW state": 0 if offload else parameter_bytes(config, 16, world)}
    if cfg.phase == "sft":
        sized, _ = sft_sizes(cfg, device, world)
        if sized.max_len < config.block_size:
            usage_error("train.py", f"--max-len {sized.max_len} is below the block size {config.block_size} of "
                                    f"{cfg.model} (rows are whole blocks); pass --max-len {config.block_size} or more")
        row = sized.max_len - sized.max_len % config.block_size
        dense = cfg.attention == "dense" or not cuda
        parts["a micro-batch's logits" + (" and dense attention" if dense else "")] = micro_batch_bytes(
            config, sized.batch_size, 2 * row, dense)
        check_fits(parts, device, "lower --batch-size or --max-len (or spread the model over processes with torchrun)")
        return
    batch = min(cfg.rollout_batch, -(-cfg.tasks_per_step * cfg.group_size // world))
    parts["the rollout KV cache"] = kv_cache_bytes(config, batch, cfg.max_new_tokens + 1, 2 if cuda else 4)
    rollouts = "lower --rollout-batch or --max-new-tokens"
    if not cuda:
        check_fits(parts, device, rollouts)
        return
    update = functools.partial(check_update_fits, config, device, tokens=cfg.update_tokens, processes=world,
                               gradient_checkpointing=cfg.gradient_checkpointing, autocast=cfg.dtype != "fp32",
                               others=planned_verifier_bytes(cfg.verifier_workers, device), flags=UPDATE_FLAGS,
                               offload=offload)
    update(longest=0)   # first what no rollout size fixes: the state leaves no room (the 4B on 80 GB)
    check_fits(parts, device, rollouts)
    bs = config.block_size   # then a micro-batch of one response of --max-new-tokens (its prompt not counted)
    update(longest=group_bound(0, -(-cfg.max_new_tokens // bs) * bs, bs, cfg.update_rows))


def interrupted(out: Path, argv) -> str:
    """What Ctrl-C leaves: the command that resumes the run, or why none can."""
    try:
        latest = latest_checkpoint(out)
    except CheckpointError:   # a pointer cut by the interrupt itself
        latest = None
    if latest is None:
        return (f"no checkpoint was written to {out}, so the run cannot be resumed (--save-every N writes them)"
                if out.exists() else "nothing was written")
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--overwrite", "--resume")]
    if "--out" not in args and not any(a.startswith("--out=") for a in args):
        args += ["--out", str(out)]
    return f"{latest.name} is saved; continue the run with: python train.py {shlex.join(args)} --resume"


def write_embedded_data(phase: str, out: Path) -> Path:
    """out/tasks.json: the embedded default's tasks, the same file for the same phase; written through
    a per-process temporary file, so processes under torchrun do not collide. The RL phases' tasks
    are a shipped file (`dice.config.EMBEDDED_RL_TASKS`), SFT's taskgen's train split (fixed seed)."""
    from dice.taskgen import generate_split   # lazy: ~3 s (it reads dice.verifier), only the embedded SFT draws
    source = EMBEDDED_DATA[phase]
    if isinstance(source, Path):
        tasks = json.loads(source.read_text())
    else:
        _, n = source                  # ("train", n): the SFT phase's draw
        tasks = generate_split(n, 0, 0, seed=0)[0]
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tasks.json.{os.getpid()}"
    tmp.write_text(json.dumps(tasks, indent=1))
    os.replace(tmp, out / "tasks.json")
    return out / "tasks.json"


def main(argv=None) -> None:
    cfg, given = config_from_args(argv)
    embedded = cfg.phase != "init" and not cfg.model and not cfg.data
    if embedded:
        cfg = with_embedded_defaults(cfg, given)
    check_usage(cfg, embedded)
    check_machine(cfg)
    out_flag = "--out"
    if not cfg.out:
        cfg.out = f"runs/{cfg.phase}-{time.strftime('%Y%m%d-%H%M%S')}"
        out_flag = f"the default output folder {cfg.out}"
    check_paths(cfg, embedded, out_flag)
    if cfg.phase != "init":
        check_memory(cfg)
    out = Path(cfg.out)
    created = not out.exists()
    try:
        if embedded:
            kept = cfg.resume and (out / "tasks.json").is_file()   # a resumed run keeps its file as it is
            cfg.data = str(out / "tasks.json" if kept else write_embedded_data(cfg.phase, out))
            print(f"embedded default: {cfg.model} on {cfg.data}, run folder {out}", file=sys.stderr, flush=True)
        if cfg.phase == "init":
            init_model_folder(cfg)
        elif cfg.phase == "sft":
            train_sft(cfg)
        else:
            train_rl(cfg)
    except BaseException as e:
        # a run that failed before its first step leaves no folder behind (only rank 0 removes it)
        main_rank = int(os.environ.get("RANK", "0")) == 0
        if created and main_rank and not (out / "metrics.jsonl").exists():
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt) and main_rank:
            raise KeyboardInterrupt(interrupted(out, argv)) from None
        raise


if __name__ == "__main__":
    fail_cleanly(main)
