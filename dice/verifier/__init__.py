"""The kernel verifier: the RL reward and the KernelBench-compatible evaluator (DESIGN.md §8).

    from dice.verifier import verify, Verifier, VerifyResult

| module | |
| --- | --- |
| `verifier` | `Verifier` (the pool, the stages, verdicts), `verify`, `VerifyResult` |
| `process` | one worker process: spawn, call with a deadline, kill, respawn; the GPU lock |
| `protocol` | everything that crosses a pipe: request and reply schemas, strict decoding, tensor transport |
| `worker` | the workers' main loop and the candidate role |
| `judge` | the trusted judge role: reference outputs, comparisons, the eager baseline |
| `harness` | modules from source, seeded models and inputs (both roles) |
| `timing` | timed forwards |
| `checks` | the rules as plain functions |
| `build` | the load_inline build cache, compiler messages |
"""
from .verifier import STATUSES, TaskError, Verifier, VerifyOptions, VerifyResult, verify

__all__ = ["STATUSES", "TaskError", "Verifier", "VerifyOptions", "VerifyResult", "verify"]
