"""What the benchmarks share: the H200 ceilings, the weight bytes a decode forward reads, CUDA-graph
timing, plain-text tables, and `BenchRun` (progress, a time budget, results kept as they arrive)."""
from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from ..cli import ProgressLine, at_least
from ..errors import UsageError

HBM_BYTES_PER_S = 4.8e12   # H200 datasheet (~4.3 TB/s measured copy)
BF16_FLOPS = 790e12        # bf16 dense matmul, measured on the H200


def forward_weight_bytes(model) -> int:
    """Bytes of weights one decode forward reads: every matrix except the embedding table,
    of which only the looked-up rows are read (lm_head is read in full, tied or not)."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    untied = model.lm_head.weight is not embed
    return total - (embed.numel() * embed.element_size() if untied else 0)


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(keys), *(line([r[k] for k in keys]) for r in rows)])


def median_replay_ms(graph, repeats: int) -> float:
    """Median milliseconds of `repeats` replays of a CUDA graph, each bracketed by CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class BudgetSpent(Exception):
    """Raised where a benchmark would start new work after its `--budget-s` has passed."""


class BenchRun:
    """What every `python -m dice.bench ...` shows while it works, and where it stops.

    progress(phase, done, total) writes "[bench 41 s] phase: 12/32" on stderr (redrawn in place on
    a terminal, in a log at most every 5 s); check() raises BudgetSpent once `budget_s` seconds have
    passed, so a benchmark calls it where new work would start, never inside a measurement; row()
    prints a finished result at once and appends it to `out` as a JSON line, so a run cut short
    keeps what it finished; finish() prints the rows as one table, a row the budget cut short
    marked partial, and what was not started. shown False (a torchrun process but rank 0): nothing
    is shown or written, and the rank-0 process reports for all. A run whose progress stands still
    for about `stall_s` seconds (a verifier or build that hangs) gets every thread's stack on stderr,
    once per stall: where it waits, in the log of a run that a timeout later kills."""

    STALL_S = 180.0

    def __init__(self, name: str, budget_s: float | None = None, out: str | None = None, shown: bool = True,
                 stall_s: float = STALL_S):
        self.name, self.budget_s, self.start, self.shown = name, budget_s, time.perf_counter(), shown
        self.stall_s, self._armed = stall_s, -float("inf")
        self.rows: list[tuple[dict, bool]] = []
        self.cut: str | None = None
        self._line = ProgressLine(every_s=5.0)
        self._out = open(_bench_log(out), "a") if out and shown else None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds of the budget left (inf without one)."""
        return float("inf") if self.budget_s is None else self.budget_s - self.elapsed()

    def check(self, doing: str, rt=None) -> None:
        """Raise BudgetSpent, naming `doing` as not started, once the budget is spent. rt: a torchrun
        `dice.runtime.Runtime`, whose processes all stop once one's budget is spent (one stopping
        alone would leave the others waiting in a collective); every process must call it then."""
        spent = self.left() <= 0
        if spent if rt is None else rt.all_max(float(spent)):
            self.cut = self.cut or doing
            raise BudgetSpent(doing)

    def progress(self, phase: str, done: int | None = None, total: int | None = None, force: bool = False) -> None:
        """The progress line (`force`: written to a log at once, a milestone; `ProgressLine`)."""
        if not self.shown:
            return
        # re-armed by progress, at most every stall_s / 4 (each arming starts a watchdog thread, and a
        # rollout reports every finished sequence): it fires once progress stood still 3/4 to all of stall_s.
        # The process's own stderr: a replaced sys.stderr (a test's capture) may have no file descriptor
        if time.monotonic() - self._armed >= self.stall_s / 4:
            self._armed = time.monotonic()
            with suppress(AttributeError, ValueError, OSError):
                faulthandler.dump_traceback_later(self.stall_s, exit=False, file=sys.__stderr__)
        count = "" if done is None else f": {done}/{total}" if total else f": {done}"
        self._line.update(f"[{self.name} {self.elapsed():.0f} s] {phase}{count}", force)

    def row(self, row: dict, partial: bool = False) -> dict:
        self.rows.append((row, partial))
        self._line.close()
        if not self.shown:
            return row
        print(" | ".join(f"{k}={v}" for k, v in row.items()) + (" | partial" if partial else ""),
              file=sys.stderr, flush=True)
        if self._out:
            record = {"bench": self.name, "elapsed_s": round(self.elapsed(), 1), **row, "partial": partial}
            self._out.write(json.dumps(record) + "\n")
            self._out.flush()
        return row

    def verify_map(self, verifier, pairs: list, phase: str, on_broken_task=None, **options) -> tuple[list, float, bool]:
        """verifier.map(pairs, **options) with a progress line, stopped (no new candidate started;
        those running finish) once the budget is spent: (the results, None where not run or the
        task is broken; seconds; whether every pair was verified)."""
        results, finished, start = [None] * len(pairs), set(), time.perf_counter()

        def done(i, result=None):
            results[i] = result
            finished.add(i)
            self.progress(phase, len(finished), len(pairs))
            if len(finished) < len(pairs):
                self.check(f"the rest of {phase}")

        def broken(i, error):
            if on_broken_task is not None:
                on_broken_task(i, error)
            done(i)

        self.check(phase)
        self.progress(phase, 0, len(pairs))
        try:
            verifier.map(pairs, progress=done, on_broken_task=broken, **options)
        except BudgetSpent:
            pass
        return results, time.perf_counter() - start, len(finished) == len(pairs)

    def finish(self, title: str = "") -> None:
        faulthandler.cancel_dump_traceback_later()
        self._line.close()
        if not self.shown:
            return
        if self._out:
            self._out.close()
            self._out = None
        if self.rows:
            keys = list(dict.fromkeys(k for r, _ in self.rows for k in r))
            marked = any(p for _, p in self.rows)
            print(f"\n{title}" if title else "")
            print(table([{**{k: r.get(k, "") for k in keys}, **({"partial": "yes" if p else ""} if marked else {})}
                         for r, p in self.rows]))
        if self.cut is not None:
            print(f"{self.name}: the budget of {self.budget_s:g} s was spent after {self.elapsed():.0f} s; "
                  f"not started: {self.cut}")


def _bench_log(path: str) -> str:
    """`--out` as given, refused unless it is new or a log of benchmark rows already (appending to a
    user's other file, a `--solutions` JSON say, would change it)."""
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"--out {path} is a folder; pass a file name for the benchmark's JSON lines")
    if out.exists() and out.stat().st_size:
        with open(out, "rb") as f:
            first = f.readline()
        try:
            row = json.loads(first)
            known = isinstance(row, dict) and "bench" in row
        except (ValueError, TypeError):
            known = False
        if not known:
            raise UsageError(f"--out {path} exists and is not a benchmark log (its first line is no row of "
                             "python -m dice.bench); pass a new file name")
    return path


DEFAULT_BUDGET_S = 270.0   # a default run ends within 5 minutes on one H200, the work in flight included


def add_run_arguments(parser) -> None:
    """--budget-s and --out, which every benchmark takes (`BenchRun`)."""
    parser.add_argument("--budget-s", type=at_least(1, float), default=DEFAULT_BUDGET_S,
                        help="seconds after which no new work starts (what runs finishes); the table of what "
                        "finished is printed, rows cut short marked partial")
    parser.add_argument("--out", metavar="JSONL", help="append each result here as it arrives")


@contextmanager
def build_way(build: str | None):
    """Workers started inside build their load_inline extensions this way (`cache.BuildCache`
    reads DICE_INLINE_BUILD; the workers inherit the environment)."""
    before = os.environ.get("DICE_INLINE_BUILD")
    if build:
        os.environ["DICE_INLINE_BUILD"] = build
    try:
        yield
    finally:
        os.environ.pop("DICE_INLINE_BUILD", None)
        if before is not None:
            os.environ["DICE_INLINE_BUILD"] = before
