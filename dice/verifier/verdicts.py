"""What a correctness trial's replies mean: plain functions of the worker's and the judge's replies,
run in the trainer (DESIGN.md §8.1, §8.2). The worker's reply carries raw GPU records and the
facts it saw (inputs changed, memory shared); the judge's the comparison and the reference's own
facts, so a candidate's behaviour is only ever judged against what its task's reference does.
"""
from __future__ import annotations

from .checks import kernel_problem, timed_kernel_problem, timed_work_problem
from .kernels import qualified_name
from .records import activity, call_windows, split_marker
from .results import VerifyOptions, VerifyResult

PROFILER_BROKEN = ("the CUDA profiler in the verifier's worker records no kernels (CUPTI unavailable?), or the CuPy "
                   "compile hooks are missing, so it cannot tell the candidate's own kernels; run where "
                   "torch.profiler works, with CuPy 14")


def trial_activity(ran: dict, marker: str) -> tuple[dict | None, str | None]:
    """(the forward's activity from the worker's raw records, or None on a CPU; why its outputs
    were not complete when forward returned, or None)."""
    if ran["records"] is None:
        return None, None
    found, problem = split_marker(ran["records"], marker)
    return activity(found), problem


def trial_verdict(where: str, ran: dict, judged: dict, history: list, opts: VerifyOptions,
                  marker: str, library: frozenset = frozenset()) -> VerifyResult | None:
    """The verdict of one trial when it fails, else None; appends the trial to `history`
    ([(reference fingerprints, candidate fingerprints, activity)], the earlier trials).
    `library`: kernel names torch and the CUDA libraries hold (`kernels.library_kernel_names`)."""
    def invalid(message):
        return VerifyResult("invalid", compiled=True, message=message)

    forward, unfinished = trial_activity(ran, marker)
    if unfinished:
        return invalid(f"{where}: {unfinished}")
    problem = kernel_verdict(forward, ran["own"], judged["reference_activity"], opts, library)
    if problem:
        return invalid(f"{where}: {problem}")
    mutated = sorted(set(ran["mutated"]) - set(judged["reference_mutated"]))
    if mutated:
        return invalid(f"forward modified input {mutated[0]} in place ({where}); inputs must be left unchanged")
    aliased = [pair for pair in ran["aliased"] if pair not in judged["reference_aliased"]]
    if aliased:
        return invalid(f"output {aliased[0][0]} shares memory with input {aliased[0][1]} ({where}); "
                       "return a newly allocated tensor")
    reused = sorted(set(ran["reused"]) - set(judged["reference_reused"]))
    if reused:
        return invalid(f"output {reused[0]} ({where}) lies in the memory of an output an earlier call returned, so "
                       "each call overwrites what its callers hold; allocate every output anew")
    if ran["stale"]:
        return invalid(f"output {ran['stale'][0]} of the first call changed when forward was called again ({where}); "
                       "an earlier call's outputs belong to its caller")
    for j, (reference_fp, got_fp, _) in enumerate(history):
        if got_fp == judged["fingerprints"] and reference_fp != judged["reference_fingerprints"]:
            return invalid(f"{where} returned exactly the output of trial {j + 1} although the reference "
                           "outputs differ: results are cached across calls or constant")
    history.append((judged["reference_fingerprints"], judged["fingerprints"], forward))
    if judged["mismatch"]:
        return VerifyResult("incorrect", compiled=True, message=f"{where}: {judged['mismatch']}")
    if judged["second_mismatch"]:
        return VerifyResult("incorrect", compiled=True, message=(
            f"a second call on the same inputs ({where}) went wrong: {judged['second_mismatch']}; "
            "forward must not depend on earlier calls"))
    return None


def kernel_verdict(forward: dict | None, own, reference_activity: dict | None, opts: VerifyOptions,
                   library: frozenset = frozenset()) -> str | None:
    """`checks.kernel_problem` on a profiled forward (None on a CPU, where nothing is profiled).
    A compiled name that a library holds too is not the candidate's own (a collision is refused:
    its launches may be the library's kernel)."""
    if forward is None or reference_activity is None:
        return None
    if not forward["kernels"] and not reference_activity["kernels"]:
        raise RuntimeError(PROFILER_BROKEN)
    collided = set(own or ()) & library
    problem = kernel_problem(forward["kernels"], set(own or ()) - collided, reference_activity["kernels"],
                             forward, reference_activity, qualified_name, opts.rules)
    shared = sorted(collided & {qualified_name(k) for k in forward["kernels"]})
    if problem and shared and problem.startswith("none of the kernels"):
        return (f"the candidate's kernel {shared[0][:80]} has the name of a kernel in torch or a CUDA library, so its "
                "launches may be the library's; give the candidate's kernels their own names")
    return problem


def timed_block_verdict(reply: dict, marker: str, calls: int, trials: list[dict], reference_activity: dict | None,
                        own, opts: VerifyOptions, library: frozenset = frozenset()) -> tuple[list, str | None]:
    """(the block's times in ms, why its calls broke a rule or None) for a worker's time_block
    reply: an eager GPU block is timed from its raw records (`records.call_windows`) and must run
    the trials' work (`checks.timed_work_problem`) and, under the strict rule, no library compute
    beyond `calls` forwards of the reference; a graph's or a CPU's times are the worker's."""
    if reply["records"] is None:
        return reply["times"], None
    try:
        times, inside = call_windows(reply["records"], marker, calls)
    except ValueError as exc:
        return [], str(exc)
    problem = timed_work_problem(inside, calls, trials)
    if problem is None and reference_activity is not None and opts.rules == "strict":
        problem = timed_kernel_problem(inside["kernels"], set(own or ()) - library, reference_activity["kernels"],
                                       calls, qualified_name)
    return list(times), problem
