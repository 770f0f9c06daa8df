"""What a correctness trial's replies mean: plain functions of the worker's and the judge's replies,
run in the trainer (DESIGN.md §8.1, §8.2). The worker's reply carries raw GPU records and the
facts it saw (inputs changed, memory shared); the judge's the comparison and the reference's own
facts, so a candidate's behaviour is only ever judged against what its task's reference does.
"""
from __future__ import annotations

from .kernel_names import qualified_name
from .records import activity, split_marker, unrecorded_launches
from .results import VerifyOptions, VerifyResult
from .rules import kernel_problem

PROFILER_BROKEN = ("the CUDA profiler in the verifier's worker records no kernels (CUPTI unavailable?), or the CuPy "
                   "compile hooks are missing, so it cannot tell the candidate's own kernels; run where "
                   "torch.profiler works, with CuPy 14")


def trial_activity(ran: dict, marker: str, families: list = ()) -> tuple[dict | None, str | None]:
    """(the forward's activity from the worker's raw records, or None on a CPU; why its outputs
    were not complete when forward returned, or why its records are not complete, or None).
    `families`: the launch families the worker found CUPTI matching (`kernels.matched_families`)."""
    if ran["records"] is None:
        return None, None
    found, problem = split_marker(ran["records"], marker, canary=True)
    return activity(found), problem or unrecorded_problem(ran["records"], families)


def unrecorded_problem(records: list, families: list) -> str | None:
    """Why `records` miss device work the runtime recorded launching (`records.unrecorded_launches`)."""
    missing = unrecorded_launches(records, families)
    if not missing:
        return None
    return (f"{len(missing)} of the recorded launches ({missing[0][:40]}) left no device record: CUPTI's recording of "
            "device activity was switched off while they ran (forward must not touch CUPTI or the profiler)")


def trial_verdict(where: str, ran: dict, judged: dict, history: list, opts: VerifyOptions,
                  marker: str, library: frozenset = frozenset(), families: list = ()) -> VerifyResult | None:
    """The verdict of one trial when it fails, else None; appends the trial to `history`
    ([(reference fingerprints, candidate fingerprints, activity)], the earlier trials).
    `library`: kernel names torch and the CUDA libraries hold (`kernel_names.library_kernel_names`);
    `families`: the launch families the worker's recording matched (`kernels.matched_families`)."""
    def invalid(message):
        return VerifyResult("invalid", compiled=True, message=message)

    forward, unfinished = trial_activity(ran, marker, families)
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
    shared = [pair for pair in ran["shared"] if pair not in judged["reference_shared"]]
    if shared:
        return invalid(f"output {shared[0][1]} shares memory with output {shared[0][0]} ({where}), where the "
                       "reference's are separate: return each output in memory of its own")
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
    if judged.get("inputs_mismatch"):
        return VerifyResult("incorrect", compiled=True, message=(
            f"{where}: {judged['inputs_mismatch']}; the reference modifies that input in place, so forward must "
            "leave it as the reference does"))
    if judged["second_mismatch"]:
        return VerifyResult("incorrect", compiled=True, message=(
            f"a second call on the same inputs ({where}) went wrong: {judged['second_mismatch']}; "
            "forward must not depend on earlier calls"))
    return None


def kernel_verdict(forward: dict | None, own, reference_activity: dict | None, opts: VerifyOptions,
                   library: frozenset = frozenset()) -> str | None:
    """`rules.kernel_problem` on a profiled forward (None on a CPU, where nothing is profiled).
    A compiled name that a library holds too is not the candidate's own (a collision is refused:
    its launches may be the library's kernel)."""
    if forward is None or reference_activity is None or opts.rules == "dice":
        return None
    if not forward["kernels"] and not reference_activity["kernels"]:
        raise RuntimeError(PROFILER_BROKEN)
    collided = set(own or ()) & library
    problem = kernel_problem(forward["kernels"], set(own or ()) - collided, reference_activity["kernels"],
                             forward, reference_activity, qualified_name, opts.rules, reference_activity.get("epilogues"))
    shared = sorted(collided & {qualified_name(k) for k in forward["kernels"]})
    if problem and shared and problem.startswith("none of the kernels"):
        return (f"the candidate's kernel {shared[0][:80]} has the name of a kernel in torch or a CUDA library, so its "
                "launches may be the library's; give the candidate's kernels their own names")
    return problem
