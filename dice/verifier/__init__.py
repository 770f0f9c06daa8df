"""The kernel verifier: the RL reward and the KernelBench-compatible evaluator (DESIGN.md §8).

    from dice.verifier import verify, Verifier, VerifyResult

| module | |
| --- | --- |
| `verifier` | `Verifier` (the pool and the stages); `verify` (below) uses a shared default one |
| `results` | `VerifyResult`, `VerifyOptions`, the static checks, the trials' seeds |
| `plans` | a candidate's trials: seeds, input structures and the task's references, found once per task |
| `process` | one worker process: spawn, call with a deadline, kill, respawn; the GPU lock |
| `calls` | a stage's calls: a worker's hang, crash or malformed reply as a verdict's reply, a judge's failure as the task's |
| `wire` | everything that crosses a pipe: request and reply schemas, strict decoding, tensor transport |
| `worker` | the workers' main loop and the candidate role |
| `judge` | the trusted judge role: reference outputs, comparisons, the eager baseline |
| `verdicts` | what a trial's and a timed block's replies mean (plain functions, in the trainer) |
| `records` | the GPU's raw records counted and timed outside the candidate's process |
| `precision` | the precision rule: tolerances per output, TF32 switches |
| `guard` | what candidate Python may not touch in its worker: the harness snapshot, the audit hook, the profiler's switches |
| `harness` | modules from source, seeded models and inputs (both roles) |
| `timing` | a timed call on the judge's slots: a CUDA-graph replay or an eager call (both sides) |
| `sealed` | the trusted side of timed calls: their inputs, the trainer's clock, the GPU left idle, comparisons |
| `speedup` | the paired candidate / baseline rounds and their confidence interval |
| `isolation` | which candidates leave a worker the next may use (else a fresh process) |
| `kernels` | what the profiler saw, and which kernels the candidate compiled (machine code) |
| `kernel_names` | kernel names read from machine code (entry points, library kernels) and from the profiler |
| `epilogues` | which library GEMM kernels compute an activation, learnt from the task's own products (judge) |
| `rules` | the source and kernel rules as plain functions; `trusted`, the torch functions captured before any candidate |
| `outputs` | the tensor rules: exact bits, inputs modified, aliasing, fingerprints, the comparison with the reference |
| `keeper` | the process above every worker: child subreaper, parent-death watch, tree kills |
| `zygote` | fresh candidate workers forked from a process that imported their modules once |
| `pool_costs` | a pool's GPU memory and judges; where its time goes (worker starts, each candidate's stages) |
| `inline_build/` | load_inline: the build cache, the fast split build, the CPU prebuild pool (DESIGN.md §8.5; map in its `__init__.py`) |
"""
import atexit
import threading

from .results import STATUSES, TaskError, VerifyOptions, VerifyResult
from .verifier import Verifier


__all__ = ["STATUSES", "TaskError", "Verifier", "VerifyOptions", "VerifyResult", "verify"]

_default_verifier: Verifier | None = None
_default_lock = threading.Lock()


def verify(task_src: str, candidate_src: str, *, trials: int = 5, timing: bool = True, seed: int | None = None,
           timeout_s: float = 120.0, **options) -> VerifyResult:
    """Verify one candidate with a shared default Verifier (started on first use, closed at exit).

    Raises RuntimeError at once when there is no CUDA GPU; other options: see VerifyOptions."""
    global _default_verifier
    with _default_lock:
        if _default_verifier is None:
            _default_verifier = Verifier()
            atexit.register(_default_verifier.close)
    return _default_verifier.verify(task_src, candidate_src, trials=trials, timing=timing, seed=seed,
                                    timeout_s=timeout_s, **options)

