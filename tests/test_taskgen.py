"""The synthetic curriculum: well-formed, reproducible tasks and a held-out split by composition."""
import ast
import itertools

import pytest
import torch

from dice.taskgen import ELEMENTWISE, ROW_OPS, generate_split, one_value_matches, passed_by_a_constant
from dice.tasks.load import check_task_source
from dice.tasks.prompts import keeps_skeleton


def pairs(ops):
    return {frozenset(p) for p in itertools.combinations(ops, 2)}


@pytest.mark.slow
def test_split_is_reproducible_and_every_heldout_chain_combines_ops_training_never_combines():
    train, valid, held, rl = generate_split(3000, 20, 15, seed=3, n_rl=40)
    again = generate_split(3000, 20, 15, seed=3, n_rl=40)
    assert [t["cuda_code"] for t in train + valid + held + rl] == [t["cuda_code"] for t in sum(again, [])]
    # the RL split is drawn last: asking for it changes none of the other splits
    assert [t["cuda_code"] for t in train + valid + held] == [t["cuda_code"] for t in sum(generate_split(3000, 20, 15, seed=3), [])]
    assert {t["level"] for t in train} == {t["level"] for t in valid} == {t["level"] for t in rl} == {1, 2, 3}
    assert {t["level"] for t in held} == {3}
    # the property itself, computed from the files: some pair of each held-out chain's ops occurs
    # together in no training task (so no held-out chain is a training chain, a run inside a
    # longer one, or a reordering of one)
    trained_pairs = set().union(*(pairs(t["ops"]) for t in train))
    for t in held:
        assert pairs(t["ops"]) - trained_pairs, t["id"]
    assert not {tuple(t["ops"]) for t in held} & {tuple(t["ops"]) for t in train}
    assert not any(pairs(t["ops"]) - trained_pairs for t in valid + rl if t["level"] == 3)
    # every op is still trained, and most pairs are
    assert {op for t in train for op in t["ops"]} == set(ELEMENTWISE) | set(ROW_OPS)
    assert len(trained_pairs) > 150
    # no evaluation task is passed by writing one value everywhere, on other inputs (seed 1) of the
    # task's own shapes: the values c with |c - y| <= atol + rtol |y| for every y form an empty interval
    torch.manual_seed(1)
    for t in valid + held + rl:
        ns = {}
        exec(t["pytorch_code"], ns)
        y = ns["Model"]()(*ns["get_inputs"]())
        slack = 1e-2 + 1e-2 * y.abs()
        assert (y - slack).max() > (y + slack).min(), t["id"]
    sources = [t["pytorch_code"] for t in train + valid + held + rl]
    assert len(set(sources)) == len(sources)
    assert len({t["id"] for t in train + valid + held + rl}) == len(sources)


@pytest.mark.slow
def test_records_are_well_formed_and_reference_models_run():
    train, valid, held, rl = generate_split(60, 10, 10, seed=0, n_rl=10)
    for t in train + valid + held + rl:
        check_task_source(t["pytorch_code"], t["id"])
        ast.parse(t["cuda_code"])
        assert t["prefix"] + t["middle"] + t["suffix"] == t["cuda_code"]
        assert keeps_skeleton(t["cuda_code"], t["prefix"], t["suffix"])
        assert t["middle"].startswith("_source = r'''") and "__global__" in t["middle"]
        ns = {}
        exec(t["pytorch_code"], ns)
        model = ns["Model"](*ns["get_init_inputs"]())
        x = torch.randn(3, 5, 64)
        y = model(x)
        expected_shape = x.shape if t["ops"][-1] in ELEMENTWISE or ROW_OPS[t["ops"][-1]][1] else x.shape[:-1]
        assert y.shape == expected_shape


def test_a_task_that_a_constant_output_passes_is_flagged():
    def task(forward, dims="batch_size, dim", sizes="batch_size = 16\ndim = 4096"):
        return {"pytorch_code": "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
                f"    def forward(self, x):\n        {forward}\n        return x\n\n\n{sizes}\n\n\n"
                f"def get_inputs():\n    return [torch.randn({dims})]\n\n\ndef get_init_inputs():\n    return []\n"}
    relu_clamp = "x = torch.relu(x)\n        x = torch.clamp(x, min=-1.0, max={hi})"
    assert passed_by_a_constant(task(relu_clamp.format(hi=0.0)))       # relu >= 0, clamped to <= 0: all 0
    assert not passed_by_a_constant(task(relu_clamp.format(hi=0.5)))
    # softmax over 4096 columns: every entry ~1/4096, within atol 1e-2 of 0; over 16 it is not
    assert passed_by_a_constant(task("x = torch.softmax(x, dim=-1)"))
    assert not passed_by_a_constant(task("x = torch.softmax(x, dim=-1)", sizes="batch_size = 16\ndim = 16"))
    # a row statistic close to one value in every row: logsumexp of 4096 normals ~ 8.8 +- 0.02
    assert passed_by_a_constant(task("x = torch.logsumexp(x, dim=-1)"))
    assert not passed_by_a_constant(task("x = torch.tanh(x)"))


def test_one_value_matches_as_a_brute_force_search_for_the_value():
    """Independent truth: a value c with |c - y_i| <= tol + tol |y_i| for every i exists iff c lies
    in every interval [y_i - s_i, y_i + s_i]; each interval's ends are the candidates to try."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        y = (torch.randn(int(torch.randint(1, 6, (1,), generator=gen)), generator=gen)
             * [0.001, 0.01, 0.05, 1.0][trial % 4] + [0.0, 3.0, -2.0][trial % 3])
        s = 0.01 + 0.01 * y.abs()
        ends = torch.cat([y - s, y + s])
        brute = any(bool(((c - y).abs() <= s + 1e-6).all()) for c in ends)
        assert one_value_matches(y) == brute, y


def _forward_constants(source: str) -> list[float]:
    """The float constants of a task's forward, read from its Python syntax tree."""
    forward = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "forward")
    values = []
    for node in ast.walk(forward):
        if isinstance(node, ast.Constant) and isinstance(node.value, float):
            negated = any(isinstance(p, ast.UnaryOp) and isinstance(p.op, ast.USub) and p.operand is node
                          for p in ast.walk(forward))
            values.append(-node.value if negated else node.value)
    return values


def test_wide_constants_are_drawn_per_task_and_mirrored_in_each_kernel():
    """--constants wide: an op's constants take hundreds of values over a split (few: a handful),
    with 3 significant digits, a scale away from 1; every constant of a task's forward is a float
    literal of its kernel, by value (`copying.literals`), so the kernel mirrors the task."""
    from dice.tasks.copying import literals
    few = generate_split(300, 0, 0, seed=0)[0]
    wide = generate_split(300, 0, 0, seed=0, constants="wide")[0]
    distinct = {name: {c for t in tasks for c in _forward_constants(t["pytorch_code"])}
                for name, tasks in (("few", few), ("wide", wide))}
    assert len(distinct["few"]) < 40 and len(distinct["wide"]) > 150, {k: len(v) for k, v in distinct.items()}
    for t in wide:
        constants = _forward_constants(t["pytorch_code"])
        assert all(float(f"{c:.3g}") == c for c in constants), t["pytorch_code"]
        assert not literals("".join(f"{c}f " for c in constants)) - literals(t["cuda_code"]), t["id"]
        if "scale" in t["ops"]:
            assert all(abs(c - 1.0) >= 0.05 for c in constants if "x = x * " in t["pytorch_code"])


def test_the_copying_diagnostic_tells_wrong_constants_from_wrong_structure():
    """Against its task's reference: the reference itself (re-spaced too) is right on both counts;
    one constant changed keeps the structure; a line dropped keeps the constants only if none of
    them was on it; no program is neither."""
    from dice.tasks.copying import copy_counts, copy_diagnostic, format_copying
    from dice.tasks.load import Task
    task = next(t for t in generate_split(200, 0, 0, seed=1, constants="wide")[0]
                if t["ops"] == ["leaky_relu"] or t["ops"][:1] == ["leaky_relu"])
    reference = task["cuda_code"]
    slope = _forward_constants(task["pytorch_code"])[0]
    assert copy_diagnostic(reference, reference) == (True, True)
    assert copy_diagnostic(reference, reference.replace("    ", "  ")) == (True, True)
    assert copy_diagnostic(reference, reference.replace(f"{slope}f", f"{slope + 0.01:.3g}f")) == (True, False)
    dropped = "\n".join(line for line in reference.splitlines() if "v > 0.0f ?" not in line)
    assert copy_diagnostic(reference, dropped) == (False, False)
    assert copy_diagnostic(reference, None) == (False, False)
    owner = Task(name="t", level=1, source=task["pytorch_code"], solution=reference)
    counts = copy_counts([(owner, reference), (owner, dropped), (Task(name="u", level=1, source=""), "x")])
    assert counts == {"tasks": 2, "structure": 1, "constants": 1, "both": 1}
    assert "structure right 1 (50.0%)" in format_copying(counts)
    miscopied = copy_counts([(owner, reference.replace(f"{slope}f", f"{slope + 0.01:.3g}f")), (owner, reference)])
    assert format_copying(miscopied).endswith("right structure with wrong constants 1 (50.0%)")
