"""The GPU's own account of a forward, judged outside the candidate's process (DESIGN.md §8.1, §8.3).

A candidate worker ships what CUPTI recorded (`kernels.gpu_records`) as raw records, one
`[name, start_ns, end_ns, correlation_id, on_gpu]` per kernel, copy and memset (`on_gpu` True)
and per CUDA runtime or driver call (False), and does no arithmetic on them: counting, spans and
sums happen here, in the trainer or the judge, where no candidate code runs, so patching a tally
(`collections.Counter`, builtins, the harness's functions) in the worker changes nothing. A
three-field record `[name, start_ns, end_ns]` is a device record (hand-made records in tests).
The worker's marker kernel (`torch.cuda._sleep(0)`, its profiler name reported by the worker
before any candidate loads) delimits what belongs to a forward:
- `split_marker`: a correctness trial ends with one marker on torch's current stream, launched
  after forward returned, then the harness's canary copy; work that ends after the marker started
  was still running when the caller got its outputs (an unjoined side stream), and so is any
  device record that starts after the marker and is not the canary;
- `unrecorded_launches`: every launch, copy or memset call the runtime recorded must have its
  device record (the same CUPTI correlation id), so a candidate that switched the device kinds
  of the recording off while its work ran is found from the records themselves.
"""
from __future__ import annotations

import bisect
import collections
import re

COPY_PREFIXES = {"dtoh": "Memcpy DtoH", "htod": "Memcpy HtoD"}
JOIN_SLACK_NS = 2_000   # CUPTI stamps of two streams may differ by this much for work that was joined
CANARY = COPY_PREFIXES["dtoh"]   # the harness's copy after each profiled forward: copies are recorded
# runtime / driver calls that put work on the device, by family (`kernels.matched_families`)
LAUNCH_FAMILIES = {"kernel": re.compile(r"^cu(da)?Launch\w*Kernel"), "graph": re.compile(r"^cu(da)?GraphLaunch"),
                   "copy": re.compile(r"^cu(da)?Memcpy"), "set": re.compile(r"^cu(da)?Memset")}


def is_kernel(name: str) -> bool:
    return not name.startswith(("Memcpy", "Memset"))


def on_device(records: list) -> list:
    """The device records (kernels, copies, memsets) as [name, start_ns, end_ns]."""
    return [r[:3] for r in records if len(r) < 5 or r[4]]


def api_calls(records: list) -> list:
    """The runtime and driver call records as [name, start_ns, end_ns, correlation_id]."""
    return [r[:4] for r in records if len(r) == 5 and not r[4]]


def activity(records: list, exclude: frozenset = frozenset()) -> dict:
    """{"kernels": {name: launches}, "dtoh": copies, "htod": copies, "busy_ms": time} of records.
    `busy_ms` is the union of the kernels' intervals (kernels named in `exclude` left out): work
    spread over parallel streams counts once, so concurrent padding cannot pay the work check
    (`rules.timed_work_problem`) with little time."""
    kernels, copies, spans = collections.Counter(), {"dtoh": 0, "htod": 0}, []
    for name, start, end in on_device(records):
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


def split_marker(records: list, marker: str, canary: bool = False) -> tuple[list, str | None]:
    """(the device records of the forward: those that started before the trailing marker, why its
    outputs were not complete when it returned, or None). The marker runs on torch's current
    stream once everything forward made that stream wait for has finished; work that ends later,
    or starts later, was left running on another stream. With `canary`, what follows the marker
    must be the harness's canary copy to the host, and it must be there (else copies were not
    being recorded). A forward that launches markers itself is refused (it could move the one
    that decides)."""
    device = on_device(records)
    starts = [start for name, start, _ in device if name == marker]
    if len(starts) != 1:
        return device, (f"the trial's records hold {len(starts)} timing markers (torch.cuda._sleep) where the "
                        "harness launched one: forward must not launch them, nor stop the profiler's recording")
    mark = starts[0]
    forward = [r for r in device if r[0] != marker and r[1] <= mark]
    after = [r for r in device if r[0] != marker and r[1] > mark]
    canaries = [r for r in after if r[0].startswith(CANARY)] if canary else []
    late = [name for name, _, end in forward if end > mark + JOIN_SLACK_NS] + [r[0] for r in after if r not in canaries]
    if late:
        return forward, (f"{late[0][:80]} was still running after forward returned: work launched on "
                         "another stream must be joined to torch's current stream before forward returns")
    if canary and not canaries:
        return forward, ("the harness's copy after forward left no record: the profiler's recording of copies "
                         "was switched off (forward must not touch CUPTI or the profiler)")
    return forward, None


def unrecorded_launches(records: list, families: list) -> list[str]:
    """Names of runtime / driver calls of the checked `families` (`LAUNCH_FAMILIES`; those the
    worker found matched before any candidate ran) that have no device record of their
    correlation id. A call made inside another one (the runtime's call of the driver) shares
    the device record of the one around it."""
    patterns = [LAUNCH_FAMILIES[f] for f in families if f in LAUNCH_FAMILIES]
    calls = [r for r in api_calls(records) if r[3] and any(p.match(r[0]) for p in patterns)]
    recorded = {r[3] for r in records if len(r) == 5 and r[4]}
    matched = sorted((start, end) for _, start, end, correlation in calls if correlation in recorded)
    starts = [start for start, _ in matched]

    def nested(start: int, end: int) -> bool:   # inside a matched call, or around one
        i, j = bisect.bisect_right(starts, start), bisect.bisect_left(starts, start)
        return (i > 0 and matched[i - 1][1] >= end) or any(
            matched[m][1] <= end for m in range(j, bisect.bisect_right(starts, end)))
    return [name for name, start, end, correlation in calls if correlation not in recorded and not nested(start, end)]
