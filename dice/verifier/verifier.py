"""Kernel verifier: the RL reward and the KernelBench evaluator (DESIGN.md §8).

    from dice.verifier import verify, Verifier, VerifyResult
    result = verify(task_src, candidate_src)                 # one candidate, shared default pool
    with Verifier(workers=8) as verifier:                     # many candidates, warm workers
        results = verifier.map(pairs, timing=False, progress=lambda i, r: ...)

A task is KernelBench source (`Model`, `get_inputs`, `get_init_inputs`); a candidate is source
defining `ModelNew` with the same constructor, computing with its own CUDA kernels: CuPy
(`cupy.RawModule`, NVRTC) or `torch.utils.cpp_extension.load_inline` (built once per distinct
source, see `cache.BuildCache`). Candidate code only ever runs in worker processes (`process`,
`worker`); reference outputs live in a separate trusted judge process (`judge`). The rules are
plain functions in `rules` and `outputs`; what crosses the pipes is in `wire`.

Stages, first failure wins:
1. static, in the parent: the source parses (else compile_error); it defines ModelNew, contains
   a `__global__` kernel (CUDA only), and no `try` whose except branch calls PyTorch (invalid);
2. load: import the module (compile_error), ModelNew is an nn.Module not derived from the task's
   Model (invalid), ModelNew(*get_init_inputs()) after the same manual_seed as the reference, one
   warm-up forward;
3. `trials` correctness trials, each with its own seed and input structure (`harness`; a
   structure the task's own reference cannot take falls back, `plans.TrialPlans`), every one under
   the profiler (trial 1 calls forward twice), the inputs written into the previous call's
   tensors. Invalid (`verdicts.trial_verdict`): the kernels break `rules.kernel_problem` under
   `rules`, inputs modified or aliased, an output in an earlier call's memory or changed by a
   later call, work still running after forward returned, the profiler's recording switched
   (`records`: launches without their device records, a missing canary copy), threads or processes
   left running, an output equal to an earlier trial's while the references differ, the harness
   changed or a refused hook (`guard`). Incorrect: `outputs.compare_outputs` fails at the `precision`
   rule's tolerances on any trial or repeated call, or an input the reference modifies in place
   does not end as the reference leaves it;
4. timing (if `timing`), the GPU lock held exclusively (DESIGN.md §8.3): the judge owns the call
   slots and writes every call's inputs from the secret timing seed while the candidate's worker
   is stopped; each call (a CUDA-graph replay when both capture faithfully, else an eager call:
   `timing.CallRunner`) is timed by the trainer's clock with the worker stopped but for its own
   call, the GPU seen idle after it (`sealed.SealedCalls`); baseline and candidate calls alternate
   until the speedup is stable (`speedup`); a random share of the calls' outputs compared in the
   judge after each call; the timed path's kernels obey the same rule.
Crashes and CUDA faults give runtime_error, hangs timeout (`calls`); only that worker is replaced (the
judge too, when a task's own reference faults: its task gets a TaskError, later tasks a sound judge).

Seeds: `seed=None` draws the base seed once per Verifier (unknown to candidates, shared by all
candidates of one Verifier so reference outputs are computed once per task and seed), except the
timing seed, drawn fresh for every candidate. Task modules are imported under a fixed seed in
every process, so tensors a task draws at import time are the same for reference and candidate.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..tasks.load import check_task_source
from .inline_build.pool import BuildPool
from .calls import JUDGE_TIMEOUT_S, Clock, ask, failed, judge_call
from .kernel_names import default_library_paths, library_kernel_names
from .process import WORKER_ENV, WorkerDied, WorkerProcess, WorkerTimeout, close_all
from .pool_costs import PoolStats, default_judges, pool_gpu_bytes
from .zygote import Zygote
from .isolation import reuse_problem
from .plans import TrialPlans
from .results import TaskError, VerifyOptions, VerifyResult, static_check
from .sealed import GpuLock, sealed_timing
from .speedup import BUDGET_S, PLAUSIBLE, Timing
from .verdicts import trial_verdict

NO_GPU = ("kernel verification needs a CUDA GPU (torch.cuda.is_available() is False); run on a GPU "
          "machine, or use Verifier(device='cpu') to exercise the pool with pure-PyTorch candidates")
UNLOAD_TIMEOUT_S = 60.0
PREBUILD_SLACK_S = 60.0       # past the prebuild's own time limit: its report is not awaited longer
REFERENCE_AS_CANDIDATE = "\n\nModelNew = Model\n"   # the task's source run by the baseline's worker


# ---------------------------------------------------------------------------------------------
# The pool.

class Verifier:
    """A pool of warm candidate workers plus judges; verifies candidates concurrently.

    Every trial of every candidate passes through a judge (reference outputs, comparison), one
    request at a time per judge, so a large pool gets several: `judges` (default one per
    WORKERS_PER_JUDGE workers), each task always served by the same judge so that its reference
    outputs are computed once and shared by every candidate of the task (an RL group: 16
    candidates of one task; each judge keeps up to `reference_cache_gb` of them on the GPU). `judge_busy_s` is the
    judges' summed time answering requests: near `judges` x the wall time means the judges, not
    the workers, bound the throughput. `timing_budget_s`: the most a candidate's paired timing
    runs before its interval is stable (`speedup`). `build`: how load_inline programs are built
    ("fast": split, precompiled header, generic binding, DESIGN.md §8.5; "torch": torch's own;
    default $DICE_INLINE_BUILD or "fast"); `prebuild`: build them in a CPU pool
    (`pool.BuildPool`) while GPU workers verify others."""

    def __init__(self, workers: int = 4, *, device: str = "cuda", cache_dir: str | Path | None = None,
                 recycle_after: int = 50, reference_cache_gb: float = 4.0, judges: int | None = None,
                 timing_budget_s: float = BUDGET_S, build: str | None = None, prebuild: bool = True):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError(NO_GPU)
        judges = default_judges(workers) if judges is None else judges
        if workers < 1 or judges < 1:
            raise ValueError(f"Verifier(workers={workers}, judges={judges}): need at least one of each")
        self.cache_dir = Path(cache_dir or os.environ.get("DICE_CACHE_DIR") or Path.home() / ".cache" / "dice")
        self.recycle_after, self.timing_budget_s = recycle_after, timing_budget_s
        self._log_dir = Path(tempfile.mkdtemp(prefix="dice-verifier-"))
        config = {"device": device, "cache_dir": str(self.cache_dir), "reference_cache_gb": reference_cache_gb,
                  "build": build}
        self._config = config
        self._judges = [WorkerProcess("judge", config, self._log_dir / f"judge-{i}.log") for i in range(judges)]
        self._baseline: WorkerProcess | None = None   # started with the first timing (`_baseline_worker`)
        # fresh candidate workers forked from a process that has imported their modules (`zygote`)
        self._zygote = Zygote(WORKER_ENV)
        self.stats = PoolStats()   # how the workers started, each candidate's stages (`pool_costs`)
        self._workers = [WorkerProcess("candidate", config, self._log_dir / f"candidate-{i}.log", self._zygote,
                                       self.stats.starts) for i in range(workers)]
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for i, worker in enumerate(self._workers):
            # first recycles staggered over the pool: workers that share the load would all restart
            # (import torch, a CUDA context) at once, leaving the pool without one for seconds
            worker.jobs = i * recycle_after // workers
            self._idle.put(worker)
        self._gpu = GpuLock()
        # looked up at each call: a test may wrap the judge calls
        self._plans = TrialPlans(lambda request: self._judge_call(request), self._gpu)
        self._preparing = ThreadPoolExecutor(2 * judges, thread_name_prefix="dice-prepare")   # `prepare`
        # load_inline candidates are built on the CPUs ahead of the GPU workers, which then load them
        # kernel names torch and the CUDA libraries hold, read in the background (`library_kernel_names`)
        self._library = ThreadPoolExecutor(1).submit(library_kernel_names, default_library_paths()) if self.cuda else None
        self._prebuild = (BuildPool(self.cache_dir, build=build or os.environ.get("DICE_INLINE_BUILD") or "fast")
                          if prebuild and self.cuda else None)
        if self._prebuild is not None:   # the precompiled header, ~30 s, built before the first program needs it
            self._prebuild.warm()

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._preparing.shutdown(wait=True, cancel_futures=True)   # a judge it still talks to is closed next
        close_all([*self._judges, *self._workers, *([self._baseline] if self._baseline is not None else [])])
        self._zygote.close()      # after its keepers: its end ends theirs
        if self._prebuild is not None:
            self._prebuild.close()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def gpu_bytes(self) -> int:
        """The GPU memory its processes hold once they have verified a while: PROCESS_GPU_BYTES each
        (a trainer sizing its rollout batch sets aside what they do not hold yet,
        `dice.memory.auto_rollout_batch`)."""
        return pool_gpu_bytes(len(self._workers), len(self._judges)) if self.cuda else 0

    def prepare(self, task_srcs: Iterable[str], **options) -> list[Future]:
        """Compute the references of these tasks' trials now, in the background, for candidates
        verified later with the same options: an RL step knows its tasks before its first rollout
        ends, so the judges work while the policy generates. One future per distinct task (a broken
        task's TaskError in it, raised again to each of its candidates)."""
        opts = VerifyOptions(**options)
        tasks = list(dict.fromkeys(task_srcs))
        for i, task_src in enumerate(tasks):
            check_task_source(task_src, f"task {i}")
        return [self._preparing.submit(self._plans.plan, task_src, opts) for task_src in tasks]

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
        # threads holding workers, plus those waiting on their task's references or their prebuild
        threads = len(self._workers) + len(self._judges) + (os.cpu_count() or 1 if self._prebuild else 0)
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dice-verify")
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
        static = static_check(candidate_src, need_kernel=self.cuda, rules=opts.rules)
        if static is not None:
            return static
        # its builds in a folder of its own: nothing another candidate built or planted is loaded for it
        programs = (self.cache_dir / "torch_extensions" / "candidates" / secrets.token_hex(16)
                    if "load_inline" in candidate_src else None)
        started = time.perf_counter()
        built = self._prebuild.submit(candidate_src, programs) if self._prebuild is not None and programs else None
        if built is not None:   # timed as it ends: the plan below runs meanwhile
            built.add_done_callback(lambda _: self.stats.add("prebuild", time.perf_counter() - started))
        plan = self._plans.plan(task_src, opts)   # while it builds, and before a worker is taken: a slow judge holds none
        self.stats.add("task plan", time.perf_counter() - started)
        pins = {}   # what the prebuild made in the candidate's folder, all the worker will use from it (`pinned`)
        if built is not None:   # a report only: on a failure, or none in the prebuild's time limit, the worker builds
            with contextlib.suppress(FuturesTimeout):
                pins = built.result(timeout=self._prebuild.timeout_s + PREBUILD_SLACK_S).get("pins") or {}
        waited = time.perf_counter()
        worker = self._idle.get()
        taken = time.perf_counter()
        self.stats.add("waiting for a worker", taken - waited)
        try:
            return self._run_candidate(worker, plan, candidate_src, opts, programs, pins)
        finally:
            self.stats.add("on the worker", time.perf_counter() - taken)
            self._release(worker, fresh=reuse_problem(candidate_src) is not None)
            if programs is not None:
                shutil.rmtree(programs, ignore_errors=True)

    def _run_candidate(self, worker: WorkerProcess, plan: dict, candidate_src: str, opts: VerifyOptions,
                       programs: Path | None, pins: dict) -> VerifyResult:
        task, init_seed, seeds, kinds = plan["task"], plan["init_seed"], plan["seeds"], plan["kinds"]
        timing_seed, warmup_seed = plan["timing_seed"], plan["warmup_seed"]
        # DICE's check: one deadline for the build and the run (its subprocess's timeout)
        clock = Clock(opts.timeout_s) if opts.rules == "dice" else None
        load = {"op": "load", **task, "candidate_src": candidate_src, "init_seed": init_seed,
                "programs": str(programs) if programs else None, "pins": pins,
                "toolchain": None if self._prebuild is None else self._prebuild.toolchain(wait=programs is not None)}
        reply = ask(worker, load, clock or Clock(opts.compile_timeout_s), "loading the candidate module")
        if reply["status"] != "ok":  # the module imported if the failure came after that
            return failed(reply, compiled=reply["status"] in ("invalid", "runtime_error"))
        clock, history = clock or Clock(opts.timeout_s), []
        with self._gpu.shared():
            reply = ask(worker, {"op": "warmup", "seed": warmup_seed, "kind": kinds[0]}, clock, "running forward")
        if reply["status"] != "ok":
            return failed(reply, compiled=True, where="the first forward")
        for i, (seed, kind) in enumerate(zip(seeds, kinds)):
            where = f"trial {i + 1} of {len(seeds)} ({kind} inputs, seed {seed})"
            verdict = self._trial(worker, task, init_seed, seed, kind, where, clock, history, opts, repeat=i == 0)
            if verdict is not None:
                return verdict
        if not opts.timing:
            return VerifyResult("correct", compiled=True, message=f"correct on {len(seeds)} trials")
        # a task that takes no jitter, or no heavy element (`TrialPlans.kinds`)
        inputs = "permuted" if "plain" in kinds else "jittered" if "light" in kinds else "timed"
        timed = self._timing(worker, task, init_seed, timing_seed, clock, opts, inputs)
        if isinstance(timed, Timing) and timed.speedup > PLAUSIBLE:   # measured again by a fresh process
            worker.restart()
            reply = ask(worker, load, Clock(opts.compile_timeout_s), "loading the candidate again")
            again = (self._timing(worker, task, init_seed, timing_seed, clock, opts, inputs)
                     if reply["status"] == "ok" else
                     failed(reply, compiled=True, where="re-measuring a speedup above 10x"))
            timed = again if not isinstance(again, Timing) or again.speedup < timed.speedup else timed
        if isinstance(timed, VerifyResult):
            return timed
        note = f"; above {PLAUSIBLE:g}x, so measured twice (the lower kept)" if timed.speedup > PLAUSIBLE else ""
        return VerifyResult(
            "correct", compiled=True, speedup=timed.speedup, runtime_ms=timed.runtime_ms,
            baseline_ms=timed.baseline_ms, speedup_ci=timed.ci, timing=timed.method,
            message=(f"correct on {len(seeds)} trials; {timed.runtime_ms:.4g} ms vs eager {timed.baseline_ms:.4g} ms "
                     f"({timed.method}, {timed.rounds} paired rounds, speedup {timed.speedup:.3g}x, 95% CI "
                     f"{timed.ci[0]:.3g}-{timed.ci[1]:.3g}){note}"))

    def _trial(self, worker: WorkerProcess, task: dict, init_seed: int, seed: int, kind: str, where: str,
               clock: Clock, history: list, opts: VerifyOptions, repeat: bool) -> VerifyResult | None:
        """One correctness trial (forward in the worker, comparison in the judge): its verdict
        when it fails, else None."""
        with self._gpu.shared():
            ran = ask(worker, {"op": "run", "seed": seed, "kind": kind, "repeat": repeat}, clock, "running forward")
            if ran["status"] != "ok":
                return failed(ran, compiled=True, where=where)
            judged = self._judge_call({"op": "compare", **task, "init_seed": init_seed, "seed": seed, "kind": kind,
                                       "outputs": ran["outputs"], "second": ran["second"], "inputs": ran["inputs"],
                                       **opts.tolerance()}, candidate_outputs=True)
        if judged["status"] != "ok":
            return failed(judged, compiled=True, where=where)
        return trial_verdict(where, ran, judged, history, opts, worker.info.get("marker", ""), self._library_names(),
                             worker.info.get("matched", []))

    def _timing(self, worker: WorkerProcess, task: dict, init_seed: int, seed: int, clock: Clock,
                opts: VerifyOptions, inputs: str) -> Timing | VerifyResult:
        """The paired timing (`speedup`) under the exclusive GPU lock; a verdict if it fails.
        `inputs`: how timed calls get new inputs (`harness.timed_inputs`). The candidate's worker and
        the baseline's are stopped (SIGSTOP) throughout but for their own calls (DESIGN.md §8.3)."""
        judge = self._judge_of(task["task_key"])
        request = {**task, "init_seed": init_seed, "seed": seed, "inputs": inputs, **opts.tolerance()}
        with self._gpu.exclusive(), self._others_stopped(worker):
            baseline = self._baseline_worker()
            loaded = ask(baseline, {"op": "load", **task, "candidate_src": task["task_src"] + REFERENCE_AS_CANDIDATE,
                                    "init_seed": init_seed}, Clock(JUDGE_TIMEOUT_S), "loading the reference")
            if loaded["status"] != "ok":
                raise TaskError(f"task {task['task_key'][:12]}: the reference did not load for timing: "
                                f"{loaded['message']}; fix the task source")
            try:
                return sealed_timing(worker, baseline, judge, request, clock, opts, self._library_names(),
                                     self.timing_budget_s)
            finally:
                worker.resume()
                baseline.resume()
                judge_call(judge, {"op": "timing_close", "task_key": task["task_key"]})
                with contextlib.suppress(WorkerTimeout, WorkerDied):
                    baseline.call({"op": "unload"}, timeout=UNLOAD_TIMEOUT_S)

    @contextlib.contextmanager
    def _others_stopped(self, worker: WorkerProcess):
        """Every other candidate worker stopped (SIGSTOP), with whatever runs below it, while `worker`
        is timed: one still loading its candidate, or running a thread or a helper its candidate
        left, would otherwise share the GPU with the timed calls, slowing them or keeping the GPU
        busy (a candidate deciding another's time)."""
        stopped = [pid for other in self._workers if other is not worker for pid in other.pause_tree()]
        try:
            yield
        finally:
            WorkerProcess.resume_tree(stopped)

    def _baseline_worker(self) -> WorkerProcess:
        """The process that times the eager reference: one per Verifier (timings hold the GPU lock
        exclusively, one at a time), of the candidates' kind, running only task code."""
        if self._baseline is None:
            self._baseline = WorkerProcess("candidate", self._config, self._log_dir / "baseline.log")
        return self._baseline

    # -- talking to workers -------------------------------------------------------------------

    def _judge_call(self, request: dict, candidate_outputs: bool = False) -> dict:
        """A request to the task's judge (`calls.judge_call`)."""
        return judge_call(self._judge_of(request["task_key"]), request, candidate_outputs)

    def _library_names(self) -> frozenset:
        return self._library.result() if self._library is not None else frozenset()

    def _judge_of(self, task_key: str) -> WorkerProcess:
        return self._judges[int(task_key[:8], 16) % len(self._judges)]

    @property
    def judges(self) -> int:
        return len(self._judges)

    @property
    def judge_busy_s(self) -> float:
        return sum(judge.busy_s for judge in self._judges)

    def activity(self) -> tuple[int, float, int, float, int]:
        """(workers, their summed seconds answering so far, judges, theirs, load_inline prebuilds
        submitted and not yet reported): sampled twice, where the pool's time went between."""
        return (len(self._workers), sum(w.busy_s for w in self._workers), len(self._judges), self.judge_busy_s,
                self._prebuild.pending if self._prebuild is not None else 0)

    def busy_by_op(self) -> dict[str, dict[str, float]]:
        """Seconds the judges and the candidate workers spent answering, per request op."""
        total = {"judge": collections.Counter(), "candidate": collections.Counter()}
        for worker in [*self._judges, *self._workers]:
            total[worker.role].update(worker.busy_by_op)
        return {role: dict(ops) for role, ops in total.items()}

    def worker_starts(self, since: int = 0) -> str:
        """The candidate workers' starts after the first `since` (`pool_costs.PoolStats`), and why
        the zygote forks none, if it does not."""
        return self.stats.worker_starts(since, self._zygote.problem)

    def _release(self, worker: WorkerProcess, fresh: bool) -> None:
        """Back to the pool, as a fresh process where the candidate may have left something behind
        (`isolation.reuse_problem`) or after `recycle_after` candidates."""
        worker.jobs += 1
        restarted = False
        try:
            if fresh or worker.jobs >= self.recycle_after:
                worker.restart()
                restarted = True
            elif worker.ready:  # a just-replaced worker has nothing to unload
                try:
                    worker.call({"op": "unload"}, timeout=UNLOAD_TIMEOUT_S)
                except (WorkerTimeout, WorkerDied):
                    pass  # the worker has already been replaced
        finally:    # back in the pool whatever failed: a lost worker would leave later candidates waiting for ever
            if restarted:   # once started up: the next candidate takes a ready worker meanwhile, if there is one
                threading.Thread(target=self._rejoin, args=(worker,), daemon=True, name="dice-restart").start()
            else:
                self._idle.put(worker)

    def _rejoin(self, worker: WorkerProcess) -> None:
        with contextlib.suppress(RuntimeError):   # its next call reports a failed start
            worker.wait_started()
        self._idle.put(worker)

