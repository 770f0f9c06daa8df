"""From a kernel task to a generated program: the prompt, batched generation, the code (DESIGN.md §5, §6).

One path for `sample.py`, `evaluate.py`, SFT's prompts and BiC-RL's rollouts (`dice.rl.rollout`): the
prompt comes from `dice.tasks.prompts` in the model's `prompt_format` (the one-shot example style a
model was trained with is recorded in its config.json as `dice_one_shot`; DICE/SDAR folders lack the
key and get KernelBench's load_inline example in DICE's RL chat shape), or from a user's template
(`load_prompt_template`); `complete` generates in batches, and each `Completion` keeps the token ids
and step maps straight from the sampler, never re-tokenised, together with the sampler's last-block
tail after the cut that the TraceRL replay needs (DESIGN.md §7).

The weights generation reads: RL's rollouts sample from `generation_copy`, a bf16 copy of the
float32 master weights on CUDA; under FSDP2 generation (rollouts and evaluation alike) runs inside
`FullParameters`, every parameter gathered, since the sampler calls the layers, not the root forward
(the bf16 copy is then made from the gathered weights).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import DataError, read_text
from ..model.sdar import SDAR, compute_device
from ..tasks.load import Task
from ..tasks.prompts import PromptFormat, extract_code, template_problem
from .sampler import Engine, Generated, Sampling, generate


def one_shot_style(model) -> str | None:
    return model.config.extra.get("dice_one_shot", "load_inline")


def prompt_format(model, template: str | None = None, chat: str | None = None) -> PromptFormat:
    """The prompt a model is asked in: its one-shot style, DICE's RL chat shape for SDAR/DICE folders
    (no `dice_one_shot` in config.json: DICE's checkpoints were reinforced on it) and ChatML for
    models made here, unless `chat` is given; a user's `template` text replaces all of it."""
    default_chat = "dice" if "dice_one_shot" not in model.config.extra else "chatml"
    return PromptFormat(one_shot_style(model), chat or default_chat, template)


def load_prompt_template(path: str, infill: bool, flag: str = "--prompt-template") -> str:
    """The text of a prompt template file (`dice.tasks.prompts.template_problem`): the model's whole input,
    read as it is (a newline is a newline, not `\\n`); one that does not fit is a DataError naming
    the file and the fix."""
    if not Path(path).is_file():
        raise DataError(f"{flag} {path}: no such file; pass a text file holding the whole prompt with "
                        "{{pytorch_code}} where the task goes")
    text = read_text(path)
    problem = template_problem(text, infill)
    if problem:
        raise DataError(f"{flag} {path}: {problem}")
    return text


def task_prompt_ids(tokenizer, task: Task, *, infill: bool = False, fmt: PromptFormat = PromptFormat()) -> list[int]:
    """Prompt ids asking for a ModelNew for `task` (with its skeleton when `infill`) in `fmt`."""
    if infill and task.prefix is None:
        raise ValueError(f"task {task.name} has no prefix/middle/suffix split, so it cannot be an infilling task")
    return tokenizer.encode(fmt.text(task.source, task.prefix if infill else None, task.suffix if infill else None))


@dataclass
class Completion:
    prompt_ids: list[int]
    tokens: list[int]           # generated ids, eos kept when hit
    step_map: list[int]         # denoising step at which each token was unmasked
    text: str                   # decoded response without the eos token
    code: str | None            # the first fenced code block, if any
    # the last block's positions after the cut: never part of the response, but the sampler saw
    # them while it denoised that block (GenerationResult.tail_tokens)
    tail_tokens: list[int] = field(default_factory=list)
    tail_step_map: list[int] = field(default_factory=list)


def _completion(tokenizer, prompt: Sequence[int], g: Generated) -> Completion:
    body = g.tokens[:-1] if g.tokens and g.tokens[-1] in tokenizer.eos_token_ids else g.tokens
    text = tokenizer.decode(body)
    return Completion(list(prompt), g.tokens, g.step_map, text, extract_code(text), g.tail_tokens, g.tail_step_map)


def complete(model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), engine: Engine = Engine(), batch_size: int = 64,
             seed: int | Sequence[int] = 0, progress: Callable[[int], None] | None = None,
             lengths: Sequence[int] | None = None, on_done: Callable[[int, Completion], None] | None = None,
             stop_at_eos: bool = True) -> list[Completion]:
    """Generate for every prompt in batches of `batch_size` (prompts sorted by length for tighter
    batches; the sampler is batch-invariant and prompt i always uses its own seed, seed + i or
    seed[i], so the grouping does not change any result). max_new_tokens, sampling, engine,
    progress: `generate`'s. lengths: per prompt, the sampler's forced response length (`generate`).
    on_done(i, completion): called as prompt i finishes, before that block's `progress` call.
    stop_at_eos=False: every prompt runs to max_new_tokens (DICE's evaluation scripts,
    `evaluate.py --dice-scripts`)."""
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed + i for i in range(len(prompts))]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Completion | None] = [None] * len(prompts)
    done = 0
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        report = None if progress is None else (lambda n, base=done: progress(base + n))

        def finished(row: int, generated: Generated, chunk=chunk) -> None:
            out[chunk[row]] = _completion(tokenizer, prompts[chunk[row]], generated)
            if on_done is not None:
                on_done(chunk[row], out[chunk[row]])

        eos = tokenizer.eos_token_ids if stop_at_eos else ()
        result = generate(model, [prompts[i] for i in chunk], max_new_tokens=max_new_tokens, sampling=sampling,
                          eos_token_ids=eos, seed=[seeds[i] for i in chunk], engine=engine,
                          lengths=None if lengths is None else [lengths[i] for i in chunk], progress=report,
                          on_finish=finished)
        done += result.num_tokens
    return out


# ---------------------------------------------------------------- the weights generation reads

def generation_copy(model, dtype: str):
    """The model to sample rollouts from. On CUDA, when the update runs under bf16 autocast
    (`--dtype auto` or `bf16`), a bf16 copy of the float32 master weights: a decoding forward
    reads half the bytes, multiplies on bf16 tensor cores (float32 products run several times
    slower) and keeps a bf16 KV cache, so twice the rollouts fit a batch. Only sampling sees the
    rounding: the update recomputes every log-prob with the master weights (DESIGN.md §7).
    Under FSDP2 (torchrun, `--offload cpu`) the copy is made inside `FullParameters`, from the
    gathered weights. Elsewhere (CPU, `--dtype fp32`, weights already bf16) the model itself."""
    first = next(model.parameters())
    if compute_device(model).type != "cuda" or dtype == "fp32" or first.dtype != torch.float32:
        return model
    return bf16_copy(model)


def bf16_copy(model) -> SDAR:
    """An inference copy of `model` with every weight in bf16, on the device its weights are on now
    (tied weights stay one tensor). Read from the module's registered tensors, which under FSDP2
    are the gathered ones inside `FullParameters` (its state_dict would give the shards)."""
    with torch.device("meta"):
        copy = SDAR(model.config)
    wanted = copy.state_dict().keys()
    tensors = {**dict(model.named_buffers(remove_duplicate=False)),
               **dict(model.named_parameters(remove_duplicate=False))}
    converted: dict[int, torch.Tensor] = {}
    state = {}
    for name in wanted:
        tensor = tensors[name]
        if tensor.data_ptr() not in converted:
            converted[tensor.data_ptr()] = tensor.detach().to(torch.bfloat16)
        state[name] = converted[tensor.data_ptr()]
    copy.load_state_dict(state, assign=True)
    return copy.tie_weights().eval().requires_grad_(False)


class FullParameters:
    """Generation calls layers directly (not the root forward), so under FSDP2 every module's
    parameters are gathered for the whole rollout and resharded afterwards."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule   # lazy: a second of start-up, and only torchrun runs need it
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        with torch.no_grad():   # FSDP initialises lazily, from a forward of the root module
            model(torch.zeros(1, model.config.block_size, dtype=torch.long, device=compute_device(model)))

    def __enter__(self):
        for m in self.modules:
            m.set_reshard_after_forward(False)
            m.unshard()

    def __exit__(self, *exc):
        for m in self.modules:
            m.reshard()
            m.set_reshard_after_forward(True)
