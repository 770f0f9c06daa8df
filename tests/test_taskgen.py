"""The synthetic curriculum: well-formed, reproducible tasks and a held-out split by composition."""
import ast
from collections import Counter

import torch

from dice.prompts import keeps_skeleton
from dice.tasks import check_task_source
from dice.taskgen import ELEMENTWISE, ROW_OPS, generate_split, is_heldout_composition


def test_split_is_reproducible_and_holds_out_compositions():
    train, held = generate_split(200, 40, seed=3)
    again, _ = generate_split(200, 40, seed=3)
    assert [t["cuda_code"] for t in train] == [t["cuda_code"] for t in again]
    assert Counter(t["level"] for t in train).keys() == {1, 2, 3}
    seen = {tuple(t["ops"]) for t in train}
    assert not any(is_heldout_composition(t["ops"]) for t in train)
    assert all(tuple(t["ops"]) not in seen for t in held if t["level"] == 3)
    assert all(tuple(t["ops"]) in {(op,) for op in ELEMENTWISE} | {(op,) for op in ROW_OPS}
               for t in held if t["level"] < 3)
    assert len({t["id"] for t in train + held}) == len(train + held)


def test_records_are_well_formed_and_reference_models_run():
    train, held = generate_split(60, 20, seed=0)
    for t in train + held:
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
