"""The kernel verifier: the RL reward and the KernelBench-compatible evaluator (DESIGN.md §8).

    from dice.verifier import verify, Verifier, VerifyResult

| module | |
| --- | --- |
| `verifier` | `Verifier` (the pool and the stages), `verify` |
| `results` | `VerifyResult`, `VerifyOptions`, the static checks, the trials' seeds |
| `process` | one worker process: spawn, call with a deadline, kill, respawn; the GPU lock |
| `protocol` | everything that crosses a pipe: request and reply schemas, strict decoding, tensor transport |
| `worker` | the workers' main loop and the candidate role |
| `judge` | the trusted judge role: reference outputs, comparisons, the eager baseline |
| `harness` | modules from source, seeded models and inputs (both roles) |
| `timing` | timed forwards: CUDA-graph replays or eager calls, checked calls |
| `speedup` | the paired candidate / baseline rounds and their confidence interval |
| `kernels` | what the profiler saw, and which kernels the candidate compiled (machine code) |
| `checks` | the rules as plain functions |
| `keeper` | the process above every worker: child subreaper, parent-death watch, tree kills |
| `build`, `inline`, `cxx`, `fastbuild`, `prebuild` | load_inline: the build cache, the fast split build, the CPU prebuild pool |
"""
from .results import STATUSES, TaskError, VerifyOptions, VerifyResult
from .verifier import Verifier, verify

__all__ = ["STATUSES", "TaskError", "Verifier", "VerifyOptions", "VerifyResult", "verify"]
