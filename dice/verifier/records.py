"""The GPU's own account of a forward, judged outside the candidate's process (DESIGN.md §8.1, §8.3).

A candidate worker ships what CUPTI recorded (`kernels.gpu_records`) as raw records, one
`[name, start_ns, end_ns]` per kernel, copy and memset, and does no arithmetic on them: counting,
spans and sums happen here, in the trainer or the judge, where no candidate code runs, so
patching a tally (`collections.Counter`, builtins, the harness's functions) in the worker changes
nothing. The worker's marker kernel (`torch.cuda._sleep(0)`, its profiler name reported by the
worker before any candidate loads) delimits what belongs to a forward:
- `split_marker`: a correctness trial ends with one marker on torch's current stream, launched
  after forward returned; work that ends after the marker started was still running when the
  caller got its outputs (an unjoined side stream);
- `call_windows`: an eager timed block brackets each call with two markers; a call's time and
  work are what started inside its window, so work run between calls (by a finalizer, a hook)
  is neither timed nor credited as work.
"""
from __future__ import annotations

import collections

COPY_PREFIXES = {"dtoh": "Memcpy DtoH", "htod": "Memcpy HtoD"}
JOIN_SLACK_NS = 2_000   # CUPTI stamps of two streams may differ by this much for work that was joined
MIN_MS = 1e-4           # a call that ran nothing on the GPU still gets a positive time


def is_kernel(name: str) -> bool:
    return not name.startswith(("Memcpy", "Memset"))


def activity(records: list, exclude: frozenset = frozenset()) -> dict:
    """{"kernels": {name: launches}, "dtoh": copies, "htod": copies, "busy_ms": time} of records.
    `busy_ms` is the union of the kernels' intervals (kernels named in `exclude` left out): work
    spread over parallel streams counts once, so concurrent padding cannot pay the work check
    (`checks.timed_work_problem`) with little time."""
    kernels, copies, spans = collections.Counter(), {"dtoh": 0, "htod": 0}, []
    for name, start, end in records:
        kind = next((k for k, prefix in COPY_PREFIXES.items() if name.startswith(prefix)), None)
        if kind:
            copies[kind] += 1
        elif is_kernel(name):
            kernels[name] += 1
            if name not in exclude:
                spans.append((start, end))
    return {"kernels": dict(kernels), **copies, "busy_ms": busy_ns(spans) / 1e6}


def busy_ns(spans: list) -> int:
    """Length of the union of [start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def split_marker(records: list, marker: str) -> tuple[list, str | None]:
    """(the records without the trailing marker, why the forward's outputs were not complete when
    it returned, or None). The marker runs on torch's current stream once everything forward made
    that stream wait for has finished; work that ends later was left running on another stream.
    A forward that launches markers itself is refused (it could move the one that decides)."""
    starts = [start for name, start, _ in records if name == marker]
    if len(starts) != 1:
        return records, (f"forward launched {len(starts) - 1} timing markers (torch.cuda._sleep); "
                         "it must not launch them")
    rest = [r for r in records if r[0] != marker]
    late = [name for name, _, end in rest if end > starts[0] + JOIN_SLACK_NS]
    if late:
        return rest, (f"{late[0][:80]} was still running after forward returned: work launched on "
                      "another stream must be joined to torch's current stream before forward returns")
    return rest, None


def call_windows(records: list, marker: str, calls: int) -> tuple[tuple, dict]:
    """(each eager timed call's time in ms, the activity of what ran inside the calls) from a
    block's records. Call i's window runs from its first marker to its second (the device is
    synchronized before the second, so the window holds all the call's work, on every stream);
    its time is the span from the first start to the last end of the kernels, copies and memsets
    that started inside. What ran between windows (the harness's new inputs and L2 flush, and
    anything a finalizer or hook of the candidate launched there) is neither timed nor counted.
    Raises ValueError when forward launched markers itself."""
    ordered = sorted(records, key=lambda r: r[1])
    markers = [start for name, start, _ in ordered if name == marker]
    if len(markers) != 2 * calls:
        raise ValueError(f"the timed calls launched {len(markers) - 2 * calls} extra timing markers "
                         "(torch.cuda._sleep); forward must not launch them")
    times, inside = [], []
    for i in range(calls):
        low, high = markers[2 * i], markers[2 * i + 1]
        mine = [r for r in ordered if low <= r[1] < high and r[0] != marker]
        span = (max(r[2] for r in mine) - min(r[1] for r in mine)) / 1e6 if mine else 0.0
        times.append(max(span, MIN_MS))
        inside += mine
    return tuple(times), activity(inside)
