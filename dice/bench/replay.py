"""What the rollouts of `python -m dice.bench rl` replay: real programs at their token counts.

* programs: rollout j of task k replays the reference program of task k from `--solutions`
  (DICE JSON: `pytorch_code`, `cuda_code`; the 99 DICE infilling references are load_inline,
  `python -m dice.taskgen` splits CuPy). Only references the verifier calls `correct` are
  replayed: each is verified once (the reward's options: untimed, so references are checked
  concurrently, not one at a time under the timing lock), its verdict kept by the hash of its task
  and program in the verifier's cache folder (REFERENCE_VERDICTS), and tasks are taken in
  curriculum order until enough have a correct one. Every copy gets its own `__device__` variable
  (a new source to every build cache, as 16 samples of a task are 16 programs), and a `--broken`
  share, chosen at random, is broken: half of them with an undeclared identifier in the device
  code (compile_error), half with 1 added to ModelNew's output (the kernels run, the result is
  wrong: incorrect). The verifier sees these programs through the training reward
  (`ReplayedReward`, a `dice.rl.reward.VerifierReward`); `--reward python` scores 1 for an unbroken program instead (no
  GPU needed; the references are then not checked);
* lengths: a random model never samples an eos, so each rollout stops as if it had sampled one
  right after the program it stands for (`generate(lengths=...)`): the tokens of
  "```python\\n<program>\\n```" plus the eos, capped at --max-new-tokens, counted by `--tokenizer`
  (default: a model folder's own; for the SDAR shapes the SDAR tokenizer where a checkout keeps
  it, SDAR_TOKENIZER) or, without one, estimated at CHARS_PER_TOKEN characters a token (then prompt
  ids are pseudo-random ids of the estimated length). Trace rounds come from the sampler's real
  step maps: with random weights no confidence passes 0.9, so every block takes all 4 steps (4
  rounds a response: the update's worst case; a trained model unmasks more per step).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import random
from pathlib import Path

import torch

from ..model.sdar import SDAR_SHAPES
from ..rl.reward import PythonReward, Reward, Scores, VerifierReward, verifier_options
from ..tasks.load import curriculum

CHARS_PER_TOKEN = 3.8   # the SDAR tokenizer on the 99 DICE infilling references: 71,964 chars, 18,862 tokens
SDAR_TOKENIZER = ("shared/sdar-chat", "../shared/sdar-chat")   # where a checkout keeps it, from its root
REFERENCE_VERDICTS = "bench-rl-references.json"
BROKEN = 0.3   # the share of replayed programs broken (`bench rl --broken`, `bench builds --group`)
SALT = "__device__ int dice_bench_salt_{tag};"
UNDECLARED = "__device__ int dice_bench_broken_{tag} = dice_bench_undeclared_{tag};"
OFF_BY_ONE = '''


_dice_bench_forward = ModelNew.forward


def _dice_bench_off_by_one(self, *args, **kwargs):   # python -m dice.bench rl: a wrong constant
    return _dice_bench_forward(self, *args, **kwargs) + 1


ModelNew.forward = _dice_bench_off_by_one
'''



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


class ReplayedReward(VerifierReward):
    """The training reward (`VerifierReward`, end to end, correct, untimed) on the program each
    rollout's owner task carries as its `solution` in place of the completion's code; as a
    VerifierReward it prepares the tasks' references and reports the verifier's GPU memory, which
    sizes the rollout batch."""

    def program(self, task, completion) -> str | None:
        return task.solution


def make_reward(kind: str, verifier, kinds: dict, timeout_s: float) -> Reward:
    """The step's reward on (owners, completions): the replayed verifier reward, or the Python
    stand-in (`kinds`: program -> its kind)."""
    if kind == "python":
        return PythonReward(lambda owners, _: Scores([float(kinds[t.solution] == "ok") for t in owners]))
    return ReplayedReward(verifier, "e2e", "correct", options=verifier_options(timeout_s=timeout_s))


def reference_key(task) -> str:
    return hashlib.sha256(json.dumps([task.source, task.solution]).encode()).hexdigest()


def correct_references(tasks: list, count: int, verifier, bench, timeout_s: float) -> tuple[list, collections.Counter]:
    """The first `count` tasks, in curriculum order, whose reference program the verifier calls correct
    (module docstring), checked in rounds of a quarter more than still needed (rounded up); verdicts
    are read from and added to REFERENCE_VERDICTS in the verifier's cache folder, so each reference
    is verified once. Returns (those tasks, the verdicts of every task looked at)."""
    path = Path(verifier.cache_dir) / REFERENCE_VERDICTS
    verdicts = json.loads(path.read_text()) if path.is_file() else {}
    ordered, chosen, looked = curriculum(tasks), [], 0
    while len(chosen) < count and looked < len(ordered):
        # a quarter more than still needed: a round lasts as long as its slowest reference (inputs of
        # 2^28 elements take a minute), and about one DICE reference in five fails, so one round, not three
        want = count - len(chosen)
        batch = ordered[looked:looked + want + (want + 3) // 4]
        looked += len(batch)
        todo = [t for t in batch if reference_key(t) not in verdicts]
        if todo:
            broken = set()
            results, _, _ = bench.verify_map(verifier, [(t.source, t.solution) for t in todo], "checking references",
                                             on_broken_task=lambda i, _: broken.add(i), trials=3, timeout_s=timeout_s,
                                             timing=False)
            for i, (t, r) in enumerate(zip(todo, results)):
                if r is not None or i in broken:
                    verdicts[reference_key(t)] = "task_error" if i in broken else r.status
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(verdicts, indent=0, sort_keys=True))
            tmp.replace(path)
            bench.check("the step")
        chosen += [t for t in batch if verdicts.get(reference_key(t)) == "correct"]
    return chosen[:count], collections.Counter(verdicts.get(reference_key(t), "unchecked") for t in ordered[:looked])


def tokenizer_folder(shape: str, given: str | None) -> str | None:
    """The tokenizer that counts tokens (the --tokenizer help), or None for the estimate."""
    if given:
        return given
    def has_tokenizer(folder) -> bool:
        return any((Path(folder) / f).is_file() for f in ("tokenizer.json", "vocab.json"))

    if shape.lower() in SDAR_SHAPES:
        return next((folder for folder in SDAR_TOKENIZER if has_tokenizer(folder)), None)
    return shape if has_tokenizer(shape) else None
