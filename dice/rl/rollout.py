"""From kernel tasks to generated programs: prompt ids, batched generation, code extraction, and
the BiC-RL rollout machinery that overlaps generation with scoring.

One path used by `sample.py`, `evaluate.py` and BiC-RL rollouts (DESIGN.md §5, §6): the prompt
comes from `dice.tasks.prompts` in the model's `prompt_format` (the one-shot example style a model was
trained with is recorded in its config.json as `dice_one_shot`; DICE/SDAR folders lack the key and
get KernelBench's load_inline example in DICE's RL chat shape), or from a user's template
(`load_prompt_template`), the token ids and step maps come straight from the sampler and are kept, never
re-tokenised, together with the sampler's last-block tail after the cut that the TraceRL replay
needs (DESIGN.md §7).

A rollout step (`generate_and_score`, called by `dice.rl.groups.rollout`) keeps the GPU generating while
the verifier works: every finished sequence goes to the reward at once, from a bf16 copy of the
policy (`generation_copy`) in batches as large as the KV caches leave room for
(`auto_rollout_batch`); `python -m dice.bench rl` measures it.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import DataError, read_text
from ..memory import gpu_memory, kv_cache_bytes
from ..model.sdar import SDAR
from ..sampling.sampler import CachedForward, Engine, Generated, Sampling, generate
from ..tasks.load import Task
from ..tasks.prompts import PromptFormat, extract_code, template_problem

OVERLAP = ("stream", "batch", "none")
# of the free GPU memory that `auto_rollout_batch` plans the sampler into at most; the rest is for
# the allocator's fragments and the judges' reference outputs (cached up to 4 GiB each), beside
# the memory set aside for the verifier's processes themselves
MEMORY_SHARE = 0.8


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


# ---------------------------------------------------------------- BiC-RL rollouts

def generation_copy(model, dtype: str):
    """The model to sample rollouts from. On CUDA, when the update runs under bf16 autocast
    (`--dtype auto` or `bf16`), a bf16 copy of the float32 master weights: a decoding forward
    reads half the bytes, multiplies on bf16 tensor cores (float32 products run several times
    slower) and keeps a bf16 KV cache, so twice the rollouts fit a batch. Only sampling sees the
    rounding: the update recomputes every log-prob with the master weights (DESIGN.md §7).
    Elsewhere (CPU, `--dtype fp32`, weights already bf16, FSDP-sharded parameters) the model itself."""
    first = next(model.parameters())
    if first.device.type != "cuda" or dtype == "fp32" or first.dtype != torch.float32 or _sharded(model):
        return model
    return bf16_copy(model)


def bf16_copy(model) -> SDAR:
    """An inference copy of `model` with every weight in bf16 (tied weights stay one tensor)."""
    with torch.device("meta"):
        copy = SDAR(model.config)
    converted: dict[int, torch.Tensor] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in converted:
            converted[tensor.data_ptr()] = tensor.detach().to(torch.bfloat16)
        state[name] = converted[tensor.data_ptr()]
    copy.load_state_dict(state, assign=True)
    return copy.tie_weights().eval().requires_grad_(False)


def _sharded(model) -> bool:
    """Whether FSDP2 sharded `model` (its parameters are DTensors)."""
    try:   # lazy: a second of start-up for sample.py / train.py, and absent from torch builds without distributed
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


class FullParameters:
    """Generation calls layers directly (not the root forward), so under FSDP2 every module's
    parameters are gathered for the whole rollout and resharded afterwards."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule   # lazy: a second of start-up, and only torchrun runs need it
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        with torch.no_grad():   # FSDP initialises lazily, from a forward of the root module
            model(torch.zeros(1, model.config.block_size, dtype=torch.long, device=next(model.parameters()).device))

    def __enter__(self):
        for m in self.modules:
            m.set_reshard_after_forward(False)
            m.unshard()

    def __exit__(self, *exc):
        for m in self.modules:
            m.reshard()
            m.set_reshard_after_forward(True)


def rollout_sequence_bytes(config, prompt_len: int, max_new_tokens: int, element_size: int) -> int:
    """GPU memory one rollout sequence takes in the sampler: every layer's keys and values and the
    sampler's row state (`dice.memory.kv_cache_bytes`) for its prompt + max_new_tokens (the sampler
    allocates the whole length up front, DESIGN.md §5);
    its share of a step's logits work: float32 copies of a block's [block, vocab] logits in the
    token choice, and a logits buffer in each CUDA graph the sampler captures (one per KV_BUCKET
    of cache length); and, while a batch's prompts are prefilled in one forward, a layer's
    activations for its prompt: the MLP's gate, up, their SiLU and product (4 x intermediate)
    and ~6 hidden-sized vectors a token."""
    c, bs = config, config.block_size
    length = (prompt_len // bs + 1 + -(-max_new_tokens // bs)) * bs
    kv = kv_cache_bytes(c, 1, length, element_size)
    logits = bs * c.vocab_size
    scratch = 8 * logits * 4 + (length // CachedForward.KV_BUCKET + 1) * logits * element_size
    prefill = prompt_len * (4 * c.intermediate_size + 6 * c.hidden_size) * element_size
    return kv + scratch + prefill


def auto_rollout_batch(model, prompt_lens: Sequence[int], max_new_tokens: int, others_bytes: int = 0) -> int:
    """The largest rollout batch whose sampler state (`rollout_sequence_bytes` a sequence) fits
    in MEMORY_SHARE of what this process can take on the GPU, and leaves room for what the
    verifier's processes (others_bytes: `dice.verifier.Verifier.gpu_bytes`) do not hold yet: they
    grow from ~0.2 GiB each at start-up to ~1 GiB once they have verified (17 GiB beside a
    14-worker reward). On a CPU: every prompt in one batch."""
    first = next(model.parameters())
    if first.device.type != "cuda":
        return len(prompt_lens)
    per_sequence = rollout_sequence_bytes(model.config, max(prompt_lens), max_new_tokens, first.element_size())
    available, in_use = gpu_memory(first.device)
    budget = min(MEMORY_SHARE * available, available - max(0, others_bytes - in_use))
    return max(1, min(len(prompt_lens), int(budget // per_sequence)))


class _Scorer:
    """Scoring calls on `lanes` background threads; `busy_s` is the time with at least one running."""

    def __init__(self, score: Callable, lanes: int, on_scored: Callable[[int], None] | None = None):
        self.score, self.calls, self.on_scored = score, [], on_scored
        self.pool = ThreadPoolExecutor(max_workers=max(1, lanes), thread_name_prefix="dice-score")
        self.lock, self.running, self.since, self.busy_s = threading.Lock(), 0, 0.0, 0.0
        self.last_end = 0.0   # when the last scoring call so far returned

    def submit(self, indices: list[int], owners: Sequence, completions: list) -> None:
        args = ([owners[i] for i in indices], [completions[i] for i in indices])
        self.calls.append((list(indices), self.pool.submit(self._run, *args)))

    def _run(self, owners, completions):
        with self.lock:
            if self.running == 0:
                self.since = time.perf_counter()
            self.running += 1
        try:
            scores = self.score(owners, completions)
        finally:
            with self.lock:
                self.running -= 1
                self.last_end = time.perf_counter()
                if self.running == 0:
                    self.busy_s += self.last_end - self.since
        if self.on_scored is not None:
            self.on_scored(len(completions))
        return scores

    def finished(self) -> bool:
        """Whether every scoring call submitted so far has returned."""
        return all(call.done() for _, call in self.calls)

    def collect(self, n: int) -> tuple[list[float], list]:
        rewards, results = [0.0] * n, [None] * n
        for indices, call in self.calls:
            scores = call.result()
            for i, reward, result in zip(indices, scores.rewards, scores.results or [None] * len(indices)):
                rewards[i], results[i] = reward, result
        return rewards, results

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def generate_and_score(model, tokenizer, prompts: Sequence[Sequence[int]], owners: Sequence, seeds: Sequence[int],
                       score: Callable, *, batch_size: int, max_new_tokens: int, sampling: Sampling = Sampling(),
                       overlap: str = "stream", lanes: int = 1, lengths: Sequence[int] | None = None,
                       progress: Callable[[int, int, int], None] | None = None, while_scoring: Callable | None = None):
    """Completions for `prompts` (generated `batch_size` at a time, `max_new_tokens` and `sampling`
    as in `generate`) scored by `score(owners, completions)`, which returns a `dice.rl.rewards.Scores`
    for the owners (tasks) and completions it is given.

    overlap: "stream" scores every block's newly finished sequences as one call on a pool of
    `lanes` threads (the verifier's workers) while the batch goes on, so the verifier starts on
    the first finished rollout, not on the batch's last; "batch" scores each rollout batch as one
    call once it is generated, one call at a time, while the next batch generates (the earlier
    way); "none" scores everything after the last batch (no overlap; for measurements).
    progress(generated, scored, total) is called as sequences finish and as scoring calls return
    (from the scoring threads too). while_scoring(completions, finished) runs once the last batch is
    generated, beside the scoring left (`dice.rl.old_logprobs`: finished() is true once it is done).
    Returns (completions, rewards, results, timings), in prompt
    order; timings: generate_s (the generating thread), verify_s (time with a scoring call
    running) and verify_wait_s (scoring left after the last batch: the part generation did not hide)."""
    if overlap not in OVERLAP:
        raise ValueError(f"overlap must be one of {OVERLAP}, got {overlap!r}")
    n = len(prompts)
    completions: list = [None] * n
    counts, lock = [0, 0], threading.Lock()

    def count(which: int, k: int) -> None:
        with lock:
            counts[which] += k
            if progress is not None:
                progress(counts[0], counts[1], n)

    scorer = _Scorer(score, lanes if overlap == "stream" else 1, on_scored=lambda k: count(1, k))
    generate_s = 0.0
    try:
        for start in range(0, n, batch_size):
            batch, pending = list(range(start, min(n, start + batch_size))), []

            def finished(j: int, completion: Completion, batch=batch, pending=pending) -> None:
                completions[batch[j]] = completion
                pending.append(batch[j])
                count(0, 1)

            def flush(_positions: int, pending=pending) -> None:
                if pending:
                    scorer.submit(pending, owners, completions)
                    pending.clear()

            t0 = time.perf_counter()
            complete(model, tokenizer, [prompts[i] for i in batch], max_new_tokens=max_new_tokens, sampling=sampling,
                     batch_size=len(batch), seed=[seeds[i] for i in batch],
                     progress=flush if overlap == "stream" else None,
                     lengths=None if lengths is None else [lengths[i] for i in batch], on_done=finished)
            generate_s += time.perf_counter() - t0
            if overlap == "batch":
                scorer.submit(batch, owners, completions)
        if overlap == "none":
            scorer.submit(list(range(n)), owners, completions)
        t0 = time.perf_counter()
        if while_scoring is not None:
            while_scoring(completions, scorer.finished)
        rewards, results = scorer.collect(n)
        wait_s = max(0.0, scorer.last_end - t0)   # the reward's own tail, not while_scoring's
    finally:
        scorer.close()
    return completions, rewards, results, {"generate_s": generate_s, "verify_s": scorer.busy_s,
                                           "verify_wait_s": wait_s}
