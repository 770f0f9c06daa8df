"""What a Verifier pool costs: the GPU memory its processes hold and its judges (sizing, before
it starts), and where its time goes (`Verifier.stats`): how its candidate workers started and each
candidate's seconds in its stages, summarised for `bench verify`'s rows and `bench rl`'s progress
line. Every load_inline candidate, and every candidate that is not plain Python, is followed by a
fresh worker (DESIGN.md §8.4): forked from the zygote it costs about a CUDA context, from a new
interpreter ~9 s on a GPU host, which bounds the reward's rate when the zygote cannot fork."""
from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

STAGES = ("prebuild", "task plan", "waiting for a worker", "on the worker")

WORKERS_PER_JUDGE = 4         # a new task costs its judge 5 references; a known one 5 comparisons a candidate
# a worker's or judge's CUDA context, libraries and buffers after verifying a while: 0.6-1.0 GiB each
# (17 processes beside an RL step, one H100, 2026-12-06); ~0.2 GiB just after start-up
PROCESS_GPU_BYTES = 2 ** 30


def pool_gpu_bytes(workers: int, judges: int | None = None) -> int:
    """What a pool's processes hold on the GPU once they have verified a while: PROCESS_GPU_BYTES for
    each worker, each judge (default: one per WORKERS_PER_JUDGE workers) and the baseline's worker."""
    return (workers + (default_judges(workers) if judges is None else judges) + 1) * PROCESS_GPU_BYTES


def default_judges(workers: int) -> int:
    """One judge per WORKERS_PER_JUDGE workers, at least one."""
    return max(1, workers // WORKERS_PER_JUDGE)


@dataclass
class PoolStats:
    """starts: (forked from the zygote, seconds until ready) of every candidate worker's start (a
    list the pool's `WorkerProcess`es share); stages: each candidate's seconds from submission
    until its load_inline prebuild reported and, beside it, until its task's trials were planned
    (the judge's references for a new task), then waiting for a free worker, and on the worker."""
    starts: list[tuple[bool, float]] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=lambda: {stage: [] for stage in STAGES})
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, stage: str, seconds: float) -> None:
        with self.lock:
            self.stages[stage].append(seconds)

    def marks(self) -> tuple[int, dict[str, int]]:
        """How many starts and stage times there are now: `since` for the summaries of what follows."""
        with self.lock:
            return len(self.starts), {stage: len(times) for stage, times in self.stages.items()}

    def worker_starts(self, since: int = 0, problem: str | None = None) -> str:
        """The starts after the first `since`, forked or new interpreters, with their median
        seconds until ready, and `problem`: why the zygote forks none."""
        starts, parts = self.starts[since:], []
        for forked, label in ((True, "forked"), (False, "new interpreters")):
            seconds = [s for f, s in starts if f == forked]
            if seconds:
                parts.append(f"{len(seconds)} {label} (median {statistics.median(seconds):.1f} s)")
        return f"worker starts: {', '.join(parts) or 'none'}" + (f"; {problem}" if problem else "")

    def stage_times(self, since: dict[str, int] | None = None) -> str:
        """The median seconds of each stage after the first `since[stage]`, or "" with none."""
        with self.lock:
            times = {stage: seconds[(since or {}).get(stage, 0):] for stage, seconds in self.stages.items()}
        parts = [f"{stage} {statistics.median(seconds):.2f} s" for stage, seconds in times.items() if seconds]
        return "median " + ", ".join(parts) if parts else ""
