"""From kernel tasks to generated programs: prompt ids, batched generation, code extraction.

One path used by `sample.py`, `evaluate.py` and BiC-RL rollouts (DESIGN.md §5, §6): the prompt
comes from `dice.prompts` (the one-shot example style a model was trained with is recorded in its
config.json as `dice_one_shot`; DICE/SDAR folders lack the key and get KernelBench's load_inline
example), the token ids and step maps come straight from the sampler and are kept, never
re-tokenised, together with the sampler's last-block tail after the cut that the TraceRL replay
needs (DESIGN.md §7).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .prompts import chat_prompt, extract_code, kernel_prompt
from .sampler import generate
from .tasks import Task


def one_shot_style(model) -> str | None:
    return model.config.extra.get("dice_one_shot", "load_inline")


def task_prompt_ids(tokenizer, task: Task, *, infill: bool = False, one_shot: str | None = "load_inline") -> list[int]:
    """ChatML prompt ids asking for a ModelNew for `task` (with its skeleton when `infill`)."""
    if infill and task.prefix is None:
        raise ValueError(f"task {task.name} has no prefix/middle/suffix split, so it cannot be an infilling task")
    user = kernel_prompt(task.source, prefix=task.prefix if infill else None, suffix=task.suffix if infill else None,
                         one_shot=one_shot)
    return tokenizer.encode(chat_prompt(user))


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


def complete(model, tokenizer, prompts: Sequence[Sequence[int]], *, batch_size: int = 64,
             seed: int | Sequence[int] = 0, progress: Callable[[int], None] | None = None,
             **generate_kwargs) -> list[Completion]:
    """Generate for every prompt in batches of `batch_size` (prompts sorted by length for tighter
    batches; the sampler is batch-invariant and prompt i always uses its own seed, seed + i or
    seed[i], so the grouping does not change any result)."""
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed + i for i in range(len(prompts))]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Completion | None] = [None] * len(prompts)
    done = 0
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        report = None if progress is None else (lambda n, base=done: progress(base + n))
        result = generate(model, [prompts[i] for i in chunk], eos_token_ids=tokenizer.eos_token_ids,
                          seed=[seeds[i] for i in chunk], progress=report, **generate_kwargs)
        for i, tokens, step_map, tail, tail_steps in zip(chunk, result.tokens, result.step_map, result.tail_tokens,
                                                         result.tail_step_map):
            body = tokens[:-1] if tokens and tokens[-1] in tokenizer.eos_token_ids else tokens
            text = tokenizer.decode(body)
            out[i] = Completion(list(prompts[i]), tokens, step_map, text, extract_code(text), tail, tail_steps)
            done += len(tokens)
    return out
