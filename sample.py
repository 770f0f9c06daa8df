"""Write a CUDA kernel for a KernelBench-format task with a DICE model.

    python sample.py --prompt task.py [--model DIR] [--out FILE] [--verify] [--max-new-tokens N]
                     [--remasking low_confidence_static|low_confidence_dynamic] [--seed N] ...

Without --model the small model shipped inside the package is used. The extracted `ModelNew`
source is printed (and written to --out, which must not exist yet unless --overwrite); --verify
runs the kernel verifier on it (needs a GPU). Every flag, path and the memory the generation needs
(`dice.memory`) are checked before the model loads.
"""
import re
import sys
import time
from pathlib import Path

import torch

import dice
from dice import load_model, load_tokenizer
from dice.cli import ArgumentParser, ProgressLine, at_least, eta, fail_cleanly, in_range
from dice.errors import UsageError
from dice.inputs import input_path, output_file
from dice.memory import kv_cache_bytes, parameter_bytes
from dice.refusals import check_fits
from dice.model.checkpoint import read_config
from dice.sampling.completion import complete, load_prompt_template, prompt_format, task_prompt_ids
from dice.sampling.sampler import REMASKING, Engine, Sampling
from dice.tasks.load import load_tasks

EMBEDDED_MODEL = Path(dice.__file__).resolve().parent / "assets" / "dice-tiny"


def parse_args(argv=None):
    p = ArgumentParser(prog="sample.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", required=True,
                   help="a KernelBench-format task .py file, or a DICE .json file (its first task)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded dice-tiny)")
    p.add_argument("--out", default=None, help="write the generated ModelNew source here (a new file)")
    p.add_argument("--overwrite", action="store_true", help="replace the --out file if it exists")
    p.add_argument("--verify", action="store_true", help="verify the kernel (needs a CUDA GPU)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=1024, help="tokens generated at most")
    p.add_argument("--steps-per-block", type=at_least(1), default=4, help="denoising steps per block")
    p.add_argument("--remasking", choices=REMASKING, default="low_confidence_dynamic",
                   help="which masked positions a denoising step unmasks")
    p.add_argument("--threshold", type=in_range(0, 1), default=0.9, help="confidence threshold of low_confidence_dynamic")
    p.add_argument("--temperature", type=at_least(0.0, float), default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=at_least(0), default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=in_range(0, 1, above=True), default=1.0, help="nucleus sampling, in (0, 1]")
    p.add_argument("--seed", type=at_least(0), default=0, help="sampling seed")
    p.add_argument("--infill", action="store_true",
                   help="fill in the task's skeleton (DICE .json tasks with a prefix/middle/suffix)")
    p.add_argument("--prompt-template", default=None, metavar="FILE",
                   help="the whole prompt as a text file, chat markup included, with {{pytorch_code}} (and with "
                        "--infill {{prefix}}, {{suffix}}) where the task goes, e.g. DICE's own prompt (default: our "
                        "prompt, in DICE's RL chat format for SDAR/DICE models)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (CUDA; ~2.1x faster for a 1.7B model, compiles first)")
    p.add_argument("--fused", action="store_true",
                   help="run each denoising step as one persistent CUDA kernel (Hopper GPU, bf16)")
    args = p.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"argument --device: use cpu, cuda or cuda:N, not {args.device!r}")
    if args.fused and args.device == "cpu":
        p.error("argument --fused: the fused kernel runs on a CUDA GPU; drop --fused or use --device cuda")
    if args.device != "cpu" and int(args.device.partition(":")[2] or 0) >= torch.cuda.device_count():
        p.error(f"argument --device: this machine has no {args.device} GPU; use --device cpu")
    if args.out:
        try:
            output_file(args.out, "--out", overwrite=args.overwrite,
                        inputs={"--prompt": args.prompt, "--model": args.model or EMBEDDED_MODEL,
                                "--prompt-template": args.prompt_template})
        except UsageError as e:
            p.error(str(e))
    return args


def check_memory(args, model_dir: Path) -> None:
    """The weights in the generation dtype and the sampler's KV cache for the whole length must fit
    in the device's free memory (`dice.memory`; the prompt's length counts one token here)."""
    config, device = read_config(model_dir), torch.device(args.device)
    size = 2 if device.type == "cuda" else 4
    parts = {"weights": parameter_bytes(config, size),
             "the KV cache": kv_cache_bytes(config, 1, args.max_new_tokens + 1, size)}
    check_fits(parts, device, "lower --max-new-tokens")


def main(argv=None) -> None:
    args = parse_args(argv)
    model_dir = input_path(args.model or EMBEDDED_MODEL, "--model", "folder", "pass --model DIR (a downloaded "
                           "SDAR/DICE checkpoint or a folder written by train.py)")
    tasks = load_tasks(args.prompt)
    if not tasks:
        sys.exit(f"error: {args.prompt} holds no task; give --prompt a task .py file or a non-empty DICE .json file")
    task = tasks[0]
    if args.infill and task.prefix is None:
        sys.exit(f"error: --infill needs a task with a prefix/middle/suffix split and {task.name} has none; "
                 "drop --infill or use a DICE .json task that has the split")
    template = load_prompt_template(args.prompt_template, args.infill) if args.prompt_template else None
    check_memory(args, model_dir)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load_model(model_dir, device=args.device, dtype=dtype)
    tok = load_tokenizer(model_dir)
    prompt = task_prompt_ids(tok, task, infill=args.infill, fmt=prompt_format(model, template))
    print(f"model {model_dir} on {args.device}; task {task.name}; prompt {len(prompt)} tokens", file=sys.stderr)
    started, line = time.perf_counter(), ProgressLine()

    def show(n):   # generation stops at the end of the answer, so the total and the ETA are bounds
        rate = n / max(time.perf_counter() - started, 1e-9)
        line.update(f"generating: {n}/{args.max_new_tokens} tokens at most | {rate:.0f} tokens/s | "
                    f"ETA at most {eta(args.max_new_tokens - n, rate)}")

    sampling = Sampling(steps_per_block=args.steps_per_block, remasking=args.remasking, threshold=args.threshold,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    completion = complete(model, tok, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                          engine=Engine(compile=args.compile, fused=args.fused), seed=args.seed, progress=show)[0]
    line.close()
    if completion.code is None:
        print(completion.text)
        sys.exit("error: the model's answer has no fenced code block (printed above)")
    print(completion.code)
    if args.out:
        Path(args.out).write_text(completion.code + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    if args.verify:
        if not torch.cuda.is_available():
            print("verification needs a CUDA GPU (and cupy); this machine has none, so the kernel was not run",
                  file=sys.stderr)
            return
        from dice.verifier import verify   # lazy: ~3 s of start-up, paid only with --verify on a GPU
        result = verify(task.source, completion.code)
        speed = f", speedup {result.speedup:.2f}x" if result.speedup else ""
        print(f"verdict: {result.status}{speed}\n{result.message}".rstrip())


if __name__ == "__main__":
    fail_cleanly(main)
