"""What DICE's reward lets through (issue #68 item 6, DESIGN.md §8.6): `python -m dice.bench rules
--solutions FILE` (GPU).

The same programs judged twice, untimed, by one Verifier: under DICE's own reward
(`train.py --reward-rules dice`, `protocols.DICE_REWARD`: KernelBench's check as DICE's RL calls
it, one trial on the inputs as drawn, allclose at 1e-2, no kernel rule) and under ours (strict:
`rl.reward.verifier_options` with `--verify-timeout`'s default, as `train.py` rewards). Program sets:
- references: the reference solutions (`cuda_code`) of a DICE JSON file (DICE's 99 infilling ones);
- rollouts: a DICE-shaped step replayed as `bench rl` replays one (`replay.replay_programs`: the
  first `--tasks-per-step` tasks with a reference, in curriculum order, `--group-size` salted
  copies each, a `--broken` share broken), here whatever verdict the reference gets, so every
  difference between the rules shows once per copy;
- attacks and honest controls: from a checkout, the candidates of the GPU tests
  (tests/test_verifier_gpu.py CHEATS, tests/test_verifier_integrity_gpu.py ATTACKS and HONEST;
  the timing attacks are left out: both rewards are untimed).

The table: per set, programs judged by both, correct under each rule, and those DICE's reward calls
correct that ours does not, counted by ours' verdict and reason (its message's first clause,
numbers left out, `reason`); then a line for each attack, honest control or reference that DICE's
reward calls correct and ours does not.
"""
from __future__ import annotations

import collections
import importlib.util
import re
from pathlib import Path

from ..cli import at_least, in_range
from ..config import TrainConfig
from ..protocols import DICE_REWARD
from ..rl.reward import verifier_options
from ..tasks.load import curriculum, load_tasks, step_tasks
from ..verifier import Verifier
from .common import BudgetSpent
from .replay import BROKEN, replay_programs

TESTS = Path(__file__).resolve().parents[2] / "tests"
ATTACK_SETS = {"attacks": (("test_verifier_gpu.py", "CHEATS"), ("test_verifier_integrity_gpu.py", "ATTACKS")),
               "honest controls": (("test_verifier_integrity_gpu.py", "HONEST"),)}


def add_arguments(p) -> None:
    p.add_argument("--solutions", required=True, metavar="FILE.json",
                   help="DICE JSON file with reference solutions (cuda_code), e.g. kernel_infilling_evaluation.json")
    p.add_argument("--tasks-per-step", type=at_least(1), default=64, help="tasks of the replayed step (DICE: 64)")
    p.add_argument("--group-size", type=at_least(1), default=16, help="samples per task (DICE: 16)")
    p.add_argument("--broken", type=in_range(0, 1), default=BROKEN, help="share of replayed programs broken")
    p.add_argument("--workers", type=at_least(1), default=16, help="verifier worker processes")
    p.add_argument("--no-attacks", action="store_true", help="leave out the GPU tests' candidates")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of the broken picks")


def program_sets(args) -> dict[str, list[tuple[str, str, str]]]:
    """{set name: [(label, task source, program)]} (module docstring)."""
    tasks = [t for t in load_tasks(args.solutions) if t.solution]
    if not tasks:
        raise SystemExit(f"error: {args.solutions}: no records with a cuda_code reference solution; pass a DICE JSON "
                         "file with reference solutions")
    sets = {"references": [(t.name, t.source, t.solution) for t in tasks]}
    if not args.no_attacks:
        sets.update(test_candidates())
    # last, the longest: a budget cuts it, not the others
    chosen = step_tasks(curriculum(tasks), 0, min(args.tasks_per_step, len(tasks)))
    replay = replay_programs(chosen, args.group_size, args.broken, args.seed, run=0)
    sets["rollouts"] = [(f"{t.name} ({kind})", t.source, t.solution) for t, kind in replay]
    return sets


def test_candidates() -> dict[str, list[tuple[str, str, str]]]:
    """The GPU tests' candidates (ATTACK_SETS) from a checkout's tests/, or {} where there is none."""
    found = {}
    for name, sources in ATTACK_SETS.items():
        for file, table in sources:
            path = TESTS / file
            if not path.is_file():
                return {}
            spec = importlib.util.spec_from_file_location(f"dice_bench_reward_rules_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            cases = getattr(module, table).items()
            found.setdefault(name, []).extend((label, case[0], case[1]) for label, case in cases)
    return found


def reason(result) -> str:
    """A verdict's reason to count by: its status and its message's first clause, numbers as N."""
    clause = re.split(r"[:;(]", result.message or "", maxsplit=1)[0].strip()
    return f"{result.status}: {re.sub(r'[0-9][0-9.e+-]*', 'N', clause)[:80]}" if clause else result.status


def bench_rules(args, bench) -> None:
    """Judge every set under both rules and print the tables (module docstring)."""
    sets = program_sets(args)
    rules = {"dice": dict(DICE_REWARD), "strict": verifier_options(timeout_s=TrainConfig.verify_timeout)}
    let_through = []
    with Verifier(workers=args.workers) as verifier:
        for name, programs in sets.items():
            verdicts, cut = {rule: [None] * len(programs) for rule in rules}, False
            for rule, options in rules.items():
                pairs = [(task, program) for _, task, program in programs]
                try:
                    verdicts[rule], _, _ = bench.verify_map(verifier, pairs, f"{name} under the {rule} rule",
                                                            timing=False, **options)
                except BudgetSpent:     # at the start of a rule's run: this set's row as far as it got, then stop
                    cut = True
                    break
            both = [(label, d, s) for (label, _, _), d, s in zip(programs, verdicts["dice"], verdicts["strict"])
                    if d is not None and s is not None]
            through = [(label, s) for label, d, s in both if d.correct and not s.correct]
            let_through += [(name, label, s) for label, s in through]
            counts = collections.Counter(reason(s) for _, s in through)
            bench.row({"programs": name, "judged by both": len(both),
                       "correct (dice)": sum(d.correct for _, d, _ in both),
                       "correct (strict)": sum(s.correct for _, _, s in both),
                       "dice correct, strict not": len(through),
                       "by strict's reason": "; ".join(f"{n} {r}" for r, n in counts.most_common()) or "-"},
                      partial=len(both) < len(programs))
            if cut:
                break
    for name, label, result in let_through:
        if name != "rollouts":
            print(f"{name}: {label}: strict {result.status}: {(result.message or '')[:160]}")
