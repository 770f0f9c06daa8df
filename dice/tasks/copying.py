"""Did a program copy its task? The diagnostic of issue #65 for the synthetic curriculum
(`dice.taskgen`), whose reference solutions mirror the task line by line: a model that maps op
names to kernels but does not copy a task's constants writes the right structure with the wrong
numbers, and the verifier's verdict alone cannot tell that from a wrong structure.

For a program and its task's reference solution (`cuda_code`), both compared as text:
- structure right: the two are equal once every CUDA float literal (a number with the `f` suffix,
  `0.137f`, `-2.5f`, `1e-6f`) is masked and whitespace collapsed;
- constants right: every float literal of the reference (each as often) is in the program, by
  value to 6 significant digits (the task's own constants and the op templates' alike).
`evaluate.py` prints the counts for the tasks that carry a reference (`copy_counts`); the card
reports them on valid, before and after each phase.
"""
from __future__ import annotations

import collections
import re

# a CUDA float literal: digits with a point or an exponent, or both, then `f`; a sign directly before it
FLOAT = re.compile(r"(?<![\w.])-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)f\b")


def literals(program: str) -> collections.Counter:
    """The program's CUDA float literals by value (6 significant digits), with their counts."""
    return collections.Counter(float(f"{float(m.group()[:-1]):.6g}") for m in FLOAT.finditer(program))


def masked(program: str) -> str:
    """The program with every CUDA float literal replaced by `#` and whitespace collapsed."""
    return " ".join(FLOAT.sub("#", program).split())


def copy_diagnostic(reference: str, program: str | None) -> tuple[bool, bool]:
    """(structure right, constants right) of `program` against its task's reference solution
    (module docstring); a missing program is neither."""
    if not program:
        return False, False
    return masked(program) == masked(reference), not literals(reference) - literals(program)


def copy_counts(pairs) -> dict[str, int]:
    """{"tasks": those with a reference solution, "structure": structure right, "constants":
    constants right, "both": both} over (task, program) pairs; {} when no task has a reference."""
    checked = [copy_diagnostic(task.solution, program) for task, program in pairs if task.solution]
    if not checked:
        return {}
    return {"tasks": len(checked), "structure": sum(s for s, _ in checked), "constants": sum(c for _, c in checked),
            "both": sum(s and c for s, c in checked)}


def format_copying(counts: dict[str, int]) -> str:
    """One line of the counts; "miscopied" are the programs with the right structure and wrong
    constants, what a model that recalls op names but not a task's numbers writes."""
    n, miscopied = counts["tasks"], counts["structure"] - counts["both"]
    return (f"copying (against each task's reference solution, {n} tasks): structure right {counts['structure']} "
            f"({100 * counts['structure'] / n:.1f}%), constants right {counts['constants']} "
            f"({100 * counts['constants'] / n:.1f}%), both {counts['both']} ({100 * counts['both'] / n:.1f}%), "
            f"right structure with wrong constants {miscopied} ({100 * miscopied / n:.1f}%)")
