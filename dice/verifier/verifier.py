"""Kernel verifier: the RL reward and the KernelBench evaluator (DESIGN.md §8).

    from dice.verifier import verify, Verifier, VerifyResult
    result = verify(task_src, candidate_src)                 # one candidate, shared default pool
    with Verifier(workers=8) as verifier:                     # many candidates, warm workers
        results = verifier.map(pairs, timing=False, progress=lambda i, r: ...)

A task is KernelBench source (`Model`, `get_inputs`, `get_init_inputs`); a candidate is source
defining `ModelNew` with the same constructor, computing with its own CUDA kernels: CuPy
(`cupy.RawModule`, NVRTC) or `torch.utils.cpp_extension.load_inline` (built once per distinct
source, see `build.BuildCache`). Candidate code only ever runs in worker processes
(`process`, `worker`); reference outputs live in a separate trusted judge process.
The rules themselves are plain functions in `checks`; what crosses the pipes is in `protocol`.

Stages, first failure wins:
1. static, in the parent: the source parses (else compile_error); it defines ModelNew, contains
   a `__global__` kernel (CUDA only), and no `try` whose except branch calls PyTorch (invalid);
2. load: import the module (compile_error), ModelNew is an nn.Module not derived from the task's
   Model (invalid), ModelNew(*get_init_inputs()) after the same manual_seed as the reference;
3. `trials` correctness trials, each with its own seed: torch.manual_seed(seed); get_inputs();
   forward (trial 1 calls it twice on the same inputs, the last trial runs under the profiler).
   Invalid: none of the source's `__global__` kernels ran in the profiled call, an input was
   modified or an output shares an input's memory (unless the reference does the same), an output
   changed after torch's current stream was done (work hidden on another stream), threads left
   running, an output exactly equal to an earlier trial's while the references differ (cached
   results), verifier functions replaced. Incorrect: not torch.allclose(atol, rtol) to the
   reference (NaN/Inf only where the reference has them, same shapes/dtypes/device), on any trial
   or on the repeated call;
4. timing (if `timing`): median over timing_trials calls with L2 flushed, on inputs from a seed
   no trial used, with new values every call (`TimedInputs`), CUDA events bracketing a device-wide
   synchronize, then one more trial on new values written into the timed buffers (outputs
   cached by input value or by buffer address fail); the eager reference is timed the same
   way (cached per task, GPU and torch version). speedup = baseline_ms / runtime_ms. Only one
   timing runs at a time and no correctness check runs during it (`GpuLock`). Invalid when the
   host clock over the same bracket exceeds 2 x event time + 0.5 ms: for honest code the two
   agree to launch/sync latency, so a gap means work escaped the event timer.
Crashes and CUDA faults give runtime_error, hangs timeout; only that worker is replaced (the judge
too, when a task's own reference faults: its task gets a TaskError, later tasks a sound judge). Module
loading (compilation is CPU work) is not excluded from timing; time on a quiet host for papers.

Seeds: `seed=None` draws the base seed once per Verifier (unknown to candidates, shared by all
candidates of one Verifier so reference outputs are computed once per task and seed), except for
the timing inputs and the trial after timing, drawn fresh for every candidate: a candidate that
replays outputs another candidate recorded cannot beat the clock or pass that trial. (Fresh seeds
for the correctness trials too would cost the judge a reference per candidate: in the verify bench
the untimed rate fell from 1,144 to 754 kernels/min.) Task
modules are imported under a fixed seed in every process, so tensors a task draws at import time
(`x = torch.randn(...)` returned by get_inputs) are the same for the reference and the candidate.
"""

from __future__ import annotations

import ast
import atexit
import hashlib
import json
import math
import os
import queue
import random
import re
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..tasks import check_task_source
from .checks import fallback_problem, kernel_names, matching_kernels
from .process import GpuLock, WorkerDied, WorkerProcess, WorkerTimeout, describe_exit
from .protocol import STATUSES, malformed_reply
NO_GPU = ("kernel verification needs a CUDA GPU (torch.cuda.is_available() is False); run on a GPU "
          "machine, or use Verifier(device='cpu') to exercise the pool with pure-PyTorch candidates")
PROFILER_BROKEN = ("the CUDA profiler in the verifier's worker records no kernels (CUPTI unavailable?), so it "
                   "cannot check that candidates launch their own kernels; run where torch.profiler works")
JUDGE_TIMEOUT_S = 900.0       # reference forward + comparison of the largest KernelBench tasks
UNLOAD_TIMEOUT_S = 60.0
WALL_SLACK_MS = 0.5           # see the timing rule in the module docstring
MESSAGE_CHARS = 4000          # of a worker's message kept in a verdict (a candidate controls its text)


@dataclass
class VerifyResult:
    status: str
    compiled: bool = False
    correct: bool = False
    speedup: float | None = None
    runtime_ms: float | None = None
    baseline_ms: float | None = None
    message: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown verification status {self.status!r}; expected one of {STATUSES}")
        self.correct = self.status == "correct"


class TaskError(ValueError):
    """The task itself (not the candidate) is broken: its reference fails or returns non-tensors."""


@dataclass(frozen=True)
class VerifyOptions:
    trials: int = 5
    timing: bool = True
    seed: int | None = None
    timeout_s: float = 120.0           # candidate run time: all trials + timing
    compile_timeout_s: float = 600.0   # module import, including a load_inline build
    atol: float = 1e-2
    rtol: float = 1e-2

    def __post_init__(self):
        if self.trials < 1:
            raise ValueError(f"trials={self.trials}: verification needs at least one correctness trial")


# ---------------------------------------------------------------------------------------------
# Static checks on the candidate source.

def static_check(source: str, need_kernel: bool) -> VerifyResult | None:
    """The verdict when `source` fails a check that needs no execution, else None."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return VerifyResult("compile_error", message=f"candidate.py line {exc.lineno}: SyntaxError: {exc.msg}")
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes; nesting too deep for the parser
        return VerifyResult("compile_error", message=f"candidate.py does not parse: {type(exc).__name__}: "
                            f"{str(exc)[:200]}")
    defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    if "ModelNew" not in defined:
        return VerifyResult("invalid", message="the candidate defines no ModelNew; name the optimized "
                            "nn.Module class ModelNew")
    if need_kernel and not kernel_names(source):
        return VerifyResult("invalid", message="the candidate contains no __global__ CUDA kernel; ModelNew "
                            "must compute with its own kernels, not PyTorch ops or library calls")
    problem = fallback_problem(tree)
    if problem:
        return VerifyResult("invalid", message=problem)
    return None


def trial_seeds(base: int, trials: int) -> tuple[int, list[int], int]:
    """(weight-init seed, one seed per trial, timing seed), all derived from `base`. Timed calls
    use inputs from timing_seed and the trial after timing timing_seed - 1, neither of them a
    correctness trial's."""
    rng = random.Random(base)
    init_seed, seeds = rng.randrange(2**31), [rng.randrange(2**31) for _ in range(trials)]
    timing_seed = rng.randrange(1, 2**31)
    while timing_seed in seeds or timing_seed - 1 in seeds:
        timing_seed = rng.randrange(1, 2**31)
    return init_seed, seeds, timing_seed


# ---------------------------------------------------------------------------------------------
# The pool.

class BaselineCache:
    """Eager baseline times in memory and in a JSON file (merged and replaced atomically on write).

    The file is read once, when the Verifier starts, and only positive finite times are kept;
    within a run the times in memory rule. Candidate workers run as the same user and could
    rewrite the file for a later run: delete it (or use a fresh `cache_dir`) before runs whose
    speedups you publish."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._memory = self._read()

    def _read(self) -> dict:
        try:
            stored = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return {}
        if not isinstance(stored, dict):
            return {}
        return {k: v for k, v in stored.items() if type(v) is float and 0 < v < float("inf")}

    def get(self, key: str) -> float | None:
        with self._lock:
            return self._memory.get(key)

    def put(self, key: str, ms: float) -> None:
        with self._lock:
            self._memory[key] = ms
            merged = {**self._read(), **self._memory}  # keep what other processes wrote meanwhile
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
            os.replace(tmp, self.path)


class _Clock:
    """Seconds left for the candidate; only time spent waiting on its own worker counts."""

    def __init__(self, seconds: float):
        self.left = seconds


class Verifier:
    """A pool of warm candidate workers plus judges; verifies candidates concurrently.

    Every trial of every candidate passes through a judge (reference outputs, comparison), one
    request at a time per judge, so a large pool gets several: `judges` (default one per 8
    workers), each task always served by the same judge so that its reference outputs are cached
    once (each judge keeps up to `reference_cache_gb` of them on the GPU). `judge_busy_s` is the
    judges' summed time answering requests: near `judges` x the wall time means the judges, not
    the workers, bound the throughput."""

    def __init__(self, workers: int = 4, *, device: str = "cuda", cache_dir: str | Path | None = None,
                 recycle_after: int = 50, warmup: int = 5, timing_trials: int = 100,
                 reference_cache_gb: float = 4.0, judges: int | None = None):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError(NO_GPU)
        judges = max(1, workers // 8) if judges is None else judges
        if workers < 1 or judges < 1:
            raise ValueError(f"Verifier(workers={workers}, judges={judges}): need at least one of each")
        self.cache_dir = Path(cache_dir or os.environ.get("DICE_CACHE_DIR") or Path.home() / ".cache" / "dice")
        self.recycle_after = recycle_after
        self._log_dir = Path(tempfile.mkdtemp(prefix="dice-verifier-"))
        config = {"device": device, "cache_dir": str(self.cache_dir), "warmup": warmup,
                  "timing_trials": timing_trials, "reference_cache_gb": reference_cache_gb}
        self._judges = [WorkerProcess("judge", config, self._log_dir / f"judge-{i}.log") for i in range(judges)]
        self._workers = [WorkerProcess("candidate", config, self._log_dir / f"candidate-{i}.log")
                         for i in range(workers)]
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._gpu = GpuLock()
        self._seed_base = secrets.randbits(31)
        self._baselines = BaselineCache(self.cache_dir / "baselines.json")

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        # in parallel: each worker's CUDA teardown takes a second or two. Plain threads, since
        # this also runs from atexit, where a ThreadPoolExecutor refuses new work; Python 3.12.0-1
        # refuse even threads there (gh-113964), and then the workers close one by one
        closers = []
        for worker in [*self._judges, *self._workers]:
            closer = threading.Thread(target=worker.close)
            try:
                closer.start()
            except RuntimeError:
                worker.close()
                continue
            closers.append(closer)
        for closer in closers:
            closer.join()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def verify(self, task_src: str, candidate_src: str, **options) -> VerifyResult:
        """Verify one candidate; options are VerifyOptions fields."""
        return self.map([(task_src, candidate_src)], **options)[0]

    def map(self, pairs: Iterable[tuple[str, str]], *, progress: Callable[[int, VerifyResult], None] | None = None,
            on_broken_task: Callable[[int, TaskError], None] | None = None, **options) -> list[VerifyResult | None]:
        """Verify (task_src, candidate_src) pairs concurrently; results in input order.

        `progress(index, result)` is called as each one finishes. A broken task (not a broken
        candidate) raises TaskError, a ValueError; with `on_broken_task` it is reported as
        `on_broken_task(index, error)` instead, its result is None and the others still run.
        Identical pairs (an RL group often samples the same program several times) are verified
        once and share the verdict."""
        opts = VerifyOptions(**options)
        pairs = list(pairs)
        for i, (task_src, _) in enumerate(pairs):
            check_task_source(task_src, f"task of pair {i}")
        copies: dict[tuple[str, str], list[int]] = {}
        for i, pair in enumerate(pairs):
            copies.setdefault(tuple(pair), []).append(i)
        results: list[VerifyResult | None] = [None] * len(pairs)
        pool = ThreadPoolExecutor(max_workers=len(self._workers), thread_name_prefix="dice-verify")
        try:
            futures = {pool.submit(self._verify_one, task, cand, opts): same for (task, cand), same in copies.items()}
            for future in as_completed(futures):
                try:
                    result = future.result()
                except TaskError as exc:
                    if on_broken_task is None:
                        raise
                    for i in futures[future]:
                        on_broken_task(i, exc)
                    continue
                for i in futures[future]:
                    results[i] = replace(result)
                    if progress is not None:
                        progress(i, results[i])
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return results

    # -- one candidate ------------------------------------------------------------------------

    def _verify_one(self, task_src: str, candidate_src: str, opts: VerifyOptions) -> VerifyResult:
        static = static_check(candidate_src, need_kernel=self.cuda)
        if static is not None:
            return static
        worker = self._idle.get()
        try:
            return self._run_candidate(worker, task_src, candidate_src, opts)
        finally:
            self._release(worker)

    def _run_candidate(self, worker: WorkerProcess, task_src: str, candidate_src: str,
                       opts: VerifyOptions) -> VerifyResult:
        task = {"task_src": task_src, "task_key": hashlib.sha256(task_src.encode()).hexdigest()}
        init_seed, seeds, timing_seed = trial_seeds(self._seed_base if opts.seed is None else opts.seed, opts.trials)
        if opts.seed is None:   # per candidate: outputs another candidate saw cannot serve timing
            timing_seed = 1 + secrets.randbelow(2**31 - 1)
        with self._gpu.shared():  # a broken task fails here, blamed on the task, before any compiling
            self._judge_call({"op": "reference", **task, "init_seed": init_seed, "seed": seeds[0]})
        reply = self._ask(worker, {"op": "load", **task, "candidate_src": candidate_src, "init_seed": init_seed},
                          _Clock(opts.compile_timeout_s), "loading the candidate module")
        if reply["status"] != "ok":  # the module imported if the failure came after that
            return self._failed(reply, compiled=reply["status"] in ("invalid", "runtime_error"))
        clock, history = _Clock(opts.timeout_s), []

        def trial(where: str, seed: int, **run) -> VerifyResult | None:
            return self._trial(worker, task, init_seed, seed, where, clock, history, candidate_src, opts, **run)

        for i, seed in enumerate(seeds):
            # Profiling only the last trial keeps a crashing kernel away from the profiler.
            verdict = trial(f"trial {i + 1} of {len(seeds)} (seed {seed})", seed, profile=i == len(seeds) - 1,
                            repeat=i == 0)
            if verdict is not None:
                return verdict
        if not opts.timing:
            return VerifyResult("correct", compiled=True, message=f"correct on {len(seeds)} trials")
        with self._gpu.exclusive():
            timed = self._ask(worker, {"op": "time", "seed": timing_seed}, clock, "timing forward")
            if timed["status"] != "ok":
                return self._failed(timed, compiled=True)
            baseline_ms = self._baseline_ms(task, init_seed, timing_seed)
        # new values in the very buffers just timed: catches outputs cached by buffer address
        verdict = trial("the trial after timing (new values in the timed input buffers)", timing_seed - 1,
                        profile=False, repeat=False, timed_buffers=True)
        if verdict is not None:
            return verdict
        runtime_ms, wall_ms = timed["runtime_ms"], timed["wall_ms"]
        if wall_ms > 2 * runtime_ms + WALL_SLACK_MS:
            return VerifyResult("invalid", compiled=True, runtime_ms=runtime_ms, message=(
                f"timing clocks disagree: CUDA events measured {runtime_ms:.3f} ms per forward but the host "
                f"clock {wall_ms:.3f} ms over the same bracket; work escaped the event timer (verify on an "
                "otherwise idle GPU if another process shares it)"))
        return VerifyResult("correct", compiled=True, speedup=baseline_ms / max(runtime_ms, 1e-6),
                            runtime_ms=runtime_ms, baseline_ms=baseline_ms,
                            message=f"correct on {len(seeds)} trials; {runtime_ms:.4g} ms vs eager "
                                    f"{baseline_ms:.4g} ms")

    def _trial(self, worker: WorkerProcess, task: dict, init_seed: int, seed: int, where: str, clock: _Clock,
               history: list, candidate_src: str, opts: VerifyOptions, **run) -> VerifyResult | None:
        """One correctness trial (forward in the worker, comparison in the judge): its verdict
        when it fails, else None. `run`: the worker's run flags (profile, repeat, timed_buffers)."""
        with self._gpu.shared():
            ran = self._ask(worker, {"op": "run", "seed": seed, **run}, clock, "running forward")
            if ran["status"] != "ok":
                return self._failed(ran, compiled=True, where=where)
            judged = self._judge_call({"op": "compare", **task, "init_seed": init_seed, "seed": seed,
                                       "outputs": ran["outputs"], "second": ran["second"],
                                       "atol": opts.atol, "rtol": opts.rtol}, candidate_outputs=True)
        if judged["status"] != "ok":
            return self._failed(judged, compiled=True, where=where)
        if ran["kernels"] is not None and not worker.info.get("profiler_works"):
            raise RuntimeError(PROFILER_BROKEN)
        return self._trial_verdict(where, candidate_src, ran, judged, history)

    def _trial_verdict(self, where: str, candidate_src: str, ran: dict, judged: dict,
                       history: list) -> VerifyResult | None:
        def invalid(message):
            return VerifyResult("invalid", compiled=True, message=message)

        if ran["kernels"] is not None:
            defined = kernel_names(candidate_src)
            if not matching_kernels(ran["kernels"], defined):
                launched = ", ".join(k[:60] for k in ran["kernels"][:5]) or "none"
                return invalid(f"none of the candidate's kernels ({', '.join(defined)}) ran during forward "
                               f"(CUDA kernels launched: {launched}); ModelNew must compute with its own "
                               "kernels, not PyTorch ops")
        mutated = sorted(set(ran["mutated"]) - set(judged["reference_mutated"]))
        if mutated:
            return invalid(f"forward modified input {mutated[0]} in place ({where}); inputs must be left unchanged")
        aliased = [pair for pair in ran["aliased"] if pair not in judged["reference_aliased"]]
        if aliased:
            return invalid(f"output {aliased[0][0]} shares memory with input {aliased[0][1]} ({where}); "
                           "return a newly allocated tensor")
        for j, (reference_fp, got_fp) in enumerate(history):
            if got_fp == judged["fingerprints"] and reference_fp != judged["reference_fingerprints"]:
                return invalid(f"{where} returned exactly the output of trial {j + 1} although the reference "
                               "outputs differ: results are cached across calls or constant")
        history.append((judged["reference_fingerprints"], judged["fingerprints"]))
        if judged["mismatch"]:
            return VerifyResult("incorrect", compiled=True, message=f"{where}: {judged['mismatch']}")
        if judged["second_mismatch"]:
            return VerifyResult("incorrect", compiled=True, message=(
                f"a second call on the same inputs ({where}) went wrong: {judged['second_mismatch']}; "
                "forward must not depend on earlier calls"))
        return None

    # -- talking to workers -------------------------------------------------------------------

    def _ask(self, worker: WorkerProcess, request: dict, clock: _Clock, doing: str) -> dict:
        """A candidate-worker request; a hang or crash becomes a reply with status timeout/runtime_error,
        a reply that breaks its op's schema (`malformed_reply`) an `invalid` one (the worker is replaced)."""
        start, limit = time.monotonic(), max(clock.left, 0.0)
        try:
            reply = worker.call(request, timeout=limit)
            problem = malformed_reply(request["op"], reply)
            if problem:
                worker.restart()
                return {"status": "invalid", "message": f"the worker's reply to {request['op']!r} {problem}: "
                        "the candidate tampered with the verifier"}
            reply["message"] = reply.get("message", "")[:MESSAGE_CHARS]
        except WorkerTimeout:
            return {"status": "timeout", "message": f"the candidate did not finish {doing} in the {limit:.0f} s "
                    "left of its time limit (hang, deadlock or very slow kernel); its worker was killed"}
        except WorkerDied as exc:
            tail = f"; last output:\n{_log_summary(exc.log_tail)}" if exc.log_tail else ""
            return {"status": "runtime_error", "message": f"the worker process {describe_exit(exc.exitcode)} "
                    f"while {doing} (segfault, os._exit or abort in the candidate){tail}"}
        finally:
            clock.left -= time.monotonic() - start
        return reply

    @staticmethod
    def _failed(reply: dict, compiled: bool, where: str = "") -> VerifyResult:
        status = reply["status"]
        message = reply["message"] if not where or status == "compile_error" else f"{where}: {reply['message']}"
        return VerifyResult(status, compiled=compiled and status != "compile_error", message=message)

    def _judge_call(self, request: dict, candidate_outputs: bool = False) -> dict:
        """A judge request. Failures are the task's (raised) unless they came from handling a
        candidate's outputs (`candidate_outputs`: returned as a runtime_error reply)."""
        try:
            reply = self._judge_of(request["task_key"]).call(request, timeout=JUDGE_TIMEOUT_S)
        except (WorkerTimeout, WorkerDied) as exc:
            if candidate_outputs:
                return {"status": "runtime_error", "message": f"the judge failed while comparing the outputs ({exc})"}
            raise TaskError(f"task {request['task_key'][:12]}: the reference (judge) worker failed ({exc}); the "
                            "task's Model, get_inputs or get_init_inputs crashes or hangs; fix the task source") from None
        if reply["status"] == "task_error":
            raise TaskError(f"task {request['task_key'][:12]}: the reference failed: {reply['message']}; "
                            "fix the task source")
        if reply["status"] != "ok" and not candidate_outputs:
            raise RuntimeError(reply["message"])
        return reply

    def _judge_of(self, task_key: str) -> WorkerProcess:
        return self._judges[int(task_key[:8], 16) % len(self._judges)]

    @property
    def judges(self) -> int:
        return len(self._judges)

    @property
    def judge_busy_s(self) -> float:
        return sum(judge.busy_s for judge in self._judges)

    def _baseline_ms(self, task: dict, init_seed: int, seed: int) -> float:
        key = f"{task['task_key']}|{self._judge_of(task['task_key']).info.get('device')}|torch {torch.__version__}"
        cached = self._baselines.get(key)
        if cached is None:
            cached = self._judge_call({"op": "baseline", **task, "init_seed": init_seed, "seed": seed})["runtime_ms"]
            self._baselines.put(key, cached)
        return cached

    def _release(self, worker: WorkerProcess) -> None:
        worker.jobs += 1
        if worker.jobs >= self.recycle_after:
            worker.restart()
        elif worker.ready:  # a just-replaced worker has nothing to unload
            try:
                worker.call({"op": "unload"}, timeout=UNLOAD_TIMEOUT_S)
            except (WorkerTimeout, WorkerDied):
                pass  # the worker has already been replaced
        self._idle.put(worker)


def _log_summary(log_tail: str, max_lines: int = 8) -> str:
    """The lines of a dead worker's log that say what happened (errors, candidate frames)."""
    lines = log_tail.splitlines()
    useful = [line for line in lines if re.search(r"candidate\.py|error|Error|CUDA|Fatal|Abort|assert", line)]
    return "\n".join((useful or lines)[-max_lines:])


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
