"""The synthetic curriculum: well-formed, reproducible tasks and a held-out split by composition."""
import ast
import itertools
from collections import Counter

import torch

from dice.prompts import keeps_skeleton
from dice.tasks import check_task_source
from dice.taskgen import ELEMENTWISE, ROW_OPS, constant_output, generate_split


def pairs(ops):
    return {frozenset(p) for p in itertools.combinations(ops, 2)}


def test_split_is_reproducible_and_every_heldout_chain_combines_ops_training_never_combines():
    train, valid, held = generate_split(3000, 40, 30, seed=3)
    again = generate_split(3000, 40, 30, seed=3)
    assert [t["cuda_code"] for t in train + valid + held] == [t["cuda_code"] for t in sum(again, [])]
    assert Counter(t["level"] for t in train).keys() == Counter(t["level"] for t in valid).keys() == {1, 2, 3}
    assert {t["level"] for t in held} == {3}
    # the property itself, computed from the files: some pair of each held-out chain's ops occurs
    # together in no training task (so no held-out chain is a training chain, a run inside a
    # longer one, or a reordering of one)
    trained_pairs = set().union(*(pairs(t["ops"]) for t in train))
    for t in held:
        assert pairs(t["ops"]) - trained_pairs, t["id"]
    assert not {tuple(t["ops"]) for t in held} & {tuple(t["ops"]) for t in train}
    assert not any(pairs(t["ops"]) - trained_pairs for t in valid if t["level"] == 3)
    # every op is still trained, and most pairs are
    assert {op for t in train for op in t["ops"]} == set(ELEMENTWISE) | set(ROW_OPS)
    assert len(trained_pairs) > 150
    # no evaluation task has an output that ignores the input (checked on other shapes and inputs)
    for t in valid + held:
        ns = {}
        exec(t["pytorch_code"], ns)
        model = ns["Model"]()
        assert not torch.equal(model(torch.randn(3, 5, 64)), model(torch.randn(3, 5, 64))), t["id"]
    sources = [t["pytorch_code"] for t in train + valid + held]
    assert len(set(sources)) == len(sources)
    assert len({t["id"] for t in train + valid + held}) == len(sources)


def test_records_are_well_formed_and_reference_models_run():
    train, valid, held = generate_split(60, 20, 20, seed=0)
    for t in train + valid + held:
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


def test_constant_output_flags_a_chain_whose_output_ignores_the_input():
    forward = "x = torch.relu(x)\n        x = torch.clamp(x, min=-1.0, max={hi})\n        return x"
    source = ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
              "        " + forward + "\n")
    assert constant_output({"pytorch_code": source.format(hi=0.0)})          # relu >= 0, clamped to <= 0: all 0
    assert not constant_output({"pytorch_code": source.format(hi=0.5)})
