"""What `evaluate.py --protocol` fixes, so our numbers can stand beside DICE's table or KernelBench's
(DESIGN.md §8.6): how solutions are generated, how the verifier judges them, and how the rates count.

    default      ours: one greedy sample (temperature 0, the softmax confidence), dynamic remasking,
                 2,048 tokens; the strict kernel rule and the strict precision (fp32 outputs at
                 1e-4, scaled to the reference's own error, TF32 off: `verifier/precision.py`),
                 5 trials, 120 s; a task whose own reference fails is left out of the rates.
    dice         DICE's published evaluation (deadlykitten4/DICE `evaluation/`, README "Evaluation"):
                 generate_samples.py -> src/utils.py `create_local_inference` (weights in float16,
                 the SDAR chat template's ChatML prompt) -> scripts/sdar_utils.py
                 `block_diffusion_generate` with gen_length 4096, blocks of 4, 4 denoising steps,
                 temperature 1.0, top_k 1, low_confidence_static. The confidence is read after the
                 top-k filter, so every masked position has 1.0 and `torch.topk` on CUDA (the first
                 of equal values) unmasks left to right; our sampler reproduces it with
                 confidence="filtered" and its lower-position tie rule. Verification as
                 KernelBench's `eval_kernel_against_ref` there: allclose atol = rtol = 1e-2 and no
                 other error bound, 5 correctness trials, `timeout=300` (README); rates over every
                 problem of the level, one without a result counting as a failure
                 (benchmark_eval_analysis.py `patch`); fast_p at 0, 0.5, 0.8, 1, 1.5, 2.
    kernelbench  KernelBench main (ScalingIntelligence/KernelBench `src/kernelbench/eval.py`:
                 `get_tolerance_for_precision`, fp32 1e-4; scripts/eval_from_generations.py: 5
                 correctness trials, timeout 180 s; benchmark_eval_analysis.py: the same `patch` and
                 fast_p thresholds). It fixes no decoder: generation follows the flags (default's).

Both reference protocols judge with rules="kernelbench": KernelBench itself has no kernel rule at
all, and "one own kernel launched" is the least of ours (a ModelNew that only calls PyTorch passes
KernelBench and not this). Timing stays ours (both candidate and eager baseline on this GPU, DESIGN.md
§8.3): KernelBench times 100 calls with CUDA events against a baseline file measured separately.

DICE's scripts alone (`--dice-scripts`, with `--protocol dice`): the sampler runs all 4,096 tokens
without stopping at an end token and the code is read from everything generated with special tokens
dropped (src/utils.py: no stopping criterion, `decode(..., skip_special_tokens=True)`), and a prompt
is cut to its first 4,096 tokens (`max_length=4096, truncation=True`). Not a quirk: DICE generates
and scores every problem of a level (generate_samples.py and eval_from_generations.py iterate to
`problem_id_range.stop + 1`, "end index is inclusive").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

KERNELBENCH_FAST_P = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)
DICE_PROMPT_TOKENS = 4096   # src/utils.py `max_length=4096, truncation=True`


@dataclass(frozen=True)
class Protocol:
    generation: dict                 # evaluate.py flags it fixes (a different value given is an error)
    decoding: dict = field(default_factory=dict)   # sampler settings without a flag of their own
    verify: dict = field(default_factory=dict)     # `dice.verifier.VerifyOptions` fields it fixes
    broken_tasks: str = "failed"     # a task whose reference fails: "failed" (counted) or "left out"
    fast_p: tuple[float, ...] = KERNELBENCH_FAST_P


DEFAULT_GENERATION = {"samples": 1, "max_new_tokens": 2048, "steps_per_block": 4,
                      "remasking": "low_confidence_dynamic"}
DEFAULT_DECODING = {"top_k": 0, "confidence": "softmax", "cuda_dtype": "bfloat16", "chat": None}
DEFAULT_VERIFY = {"rules": "strict", "precision": "strict", "trials": 5, "timeout_s": 120.0}

PROTOCOLS = {
    "default": Protocol(generation={}, broken_tasks="left out", fast_p=(0.0, 1.0, 2.0)),
    "dice": Protocol(
        generation={"samples": 1, "max_new_tokens": 4096, "steps_per_block": 4, "remasking": "low_confidence_static",
                    "temperature": 1.0},
        decoding={"top_k": 1, "confidence": "filtered", "cuda_dtype": "float16", "chat": "chatml"},
        verify={"rules": "kernelbench", "precision": "dice", "trials": 5, "timeout_s": 300.0, "atol": 1e-2,
                "rtol": 1e-2, "rel_l2": math.inf}),
    "kernelbench": Protocol(
        generation={},
        # KernelBench's fp32 tolerance for every output, on a true fp32 reference (TF32 off)
        verify={"rules": "kernelbench", "precision": "strict", "trials": 5, "timeout_s": 180.0, "atol": 1e-4,
                "rtol": 1e-4, "rel_l2": math.inf}),
}
# DICE's RL reward (`train.py --reward-rules dice`): its check is KernelBench's `eval_kernel_against_ref`
# as --protocol dice judges, with one correctness trial (training/RL/reward/rl_execute_kernel.py
# `num_correct_trials=1`, `measure_performance=False`; reward/eval.py: allclose atol = rtol = 1e-2 on
# get_inputs() as drawn, no kernel rule) and 300 s for the build and the check together (`timeout = 300`
# around its evaluation subprocess). The attacks of the verifier's tests pass it (DESIGN.md §8.6).
DICE_REWARD = {**PROTOCOLS["dice"].verify, "rules": "dice", "trials": 1, "timeout_s": 300.0}
# the evaluate.py flag of each VerifyOptions field a protocol sets
VERIFY_FLAGS = {"rules": "rules", "trials": "trials", "timeout_s": "timeout"}


def decoding(name: str) -> dict:
    """The sampler settings of --protocol `name` (default's where it sets none)."""
    return {**DEFAULT_DECODING, **PROTOCOLS[name].decoding}


def verify_options(name: str) -> dict:
    """The VerifyOptions fields of --protocol `name` (default's where it sets none)."""
    return {**DEFAULT_VERIFY, **PROTOCOLS[name].verify}
