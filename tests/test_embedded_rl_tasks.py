"""The embedded RL default's tasks (`python train.py --phase e2e|infill`, flagless; dice.config
EMBEDDED_RL_TASKS): the 32 shipped tasks, checked against what they claim to be: the rl split of
the taskgen draw dice-tiny's card names, none of dice-tiny's SFT tasks, none of that draw's valid or
held-out tasks, and every step of the run holding all of them (the reward can only show learning on
tasks that recur). Replaces issue 37's check that the drawn embedded tasks were no SFT tasks."""

import json
import sys
from pathlib import Path

import pytest

from dice import taskgen
from dice.config import EMBEDDED_DATA, EMBEDDED_RL_TASKS, config_from_args, with_embedded_defaults
from dice.tasks.load import load_tasks, phase_tasks, step_tasks

ROOT = Path(__file__).resolve().parents[1]

# the rl.json ids of `python -m dice.taskgen --out DIR --valid 300 --heldout 440 --seed 0` (the card's
# BiC-RL experiment) whose greedy dice-tiny kernel differs from the reference only in its numbers
# (the CPU exploration of 2026-12-04); written out here so that a changed task file is noticed
LISTED = [
    "rl-00007-L1-leaky_relu", "rl-00013-L1-hardtanh", "rl-00027-L1-clamp", "rl-00035-L1-leaky_relu",
    "rl-00041-L1-clamp", "rl-00042-L1-hardtanh", "rl-00046-L1-leaky_relu", "rl-00053-L1-shift",
    "rl-00056-L1-shift", "rl-00078-L1-leaky_relu", "rl-00083-L1-leaky_relu", "rl-00084-L1-clamp",
    "rl-00085-L1-clamp", "rl-00122-L3-shift-log_softmax", "rl-00131-L3-elu-relu",
    "rl-00137-L3-hardsigmoid-silu-elu", "rl-00148-L3-softplus-gelu-elu", "rl-00196-L3-tanh-elu-sigmoid-leaky_relu",
    "rl-00205-L3-silu-abs-leaky_relu-sigmoid", "rl-00219-L3-elu-scale", "rl-00225-L3-shift-scale",
    "rl-00231-L3-gelu-softplus-leaky_relu", "rl-00259-L3-square-relu-softplus-elu", "rl-00263-L3-shift-relu-leaky_relu",
    "rl-00274-L3-scale-shift-elu-l2_normalize", "rl-00275-L3-tanh-leaky_relu", "rl-00281-L3-leaky_relu-clamp",
    "rl-00285-L3-hardtanh-rmsnorm", "rl-00296-L3-shift-hardtanh", "rl-00297-L3-leaky_relu-hardtanh-sum",
    "rl-00307-L3-clamp-abs-gelu-shift", "rl-00324-L3-elu-sigmoid-scale",
]


def shipped() -> list[dict]:
    return json.loads(EMBEDDED_RL_TASKS.read_text())


def embedded_config(phase: str):
    cfg, given = config_from_args(["--phase", phase])
    return with_embedded_defaults(cfg, given)


def write_embedded_data(phase: str, out: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT))
    return train.write_embedded_data(phase, out)


@pytest.mark.parametrize("phase", ["e2e", "infill"])
def test_the_flagless_run_trains_on_exactly_the_listed_tasks(tmp_path, phase):
    assert EMBEDDED_DATA[phase] == EMBEDDED_RL_TASKS and EMBEDDED_RL_TASKS.parent.name == "dice-tiny"
    assert [t["id"] for t in shipped()] == LISTED
    written = json.loads(write_embedded_data(phase, tmp_path).read_text())
    assert written == shipped()
    cfg = embedded_config(phase)
    assert cfg.lr == 1e-4 and cfg.model == str(EMBEDDED_RL_TASKS.parent)
    # taskgen's records: the infill phase needs the prefix/middle/suffix split of each
    assert all(t["prefix"] + t["middle"] + t["suffix"] == t["cuda_code"] for t in written)


@pytest.mark.parametrize("phase", ["e2e", "infill"])
def test_every_step_of_the_flagless_run_holds_every_task_once(tmp_path, phase):
    cfg = embedded_config(phase)
    ordered = phase_tasks(load_tasks(write_embedded_data(phase, tmp_path)), None, phase == "infill", cfg.task_order)
    assert len(ordered) == cfg.tasks_per_step == 32
    for step in range(cfg.steps):
        assert sorted(t.name.split("/")[-1] for t in step_tasks(ordered, step, cfg.tasks_per_step)) == sorted(LISTED)


def test_no_listed_task_is_one_of_dice_tinys_sft_tasks():
    """dice-tiny's SFT data is taskgen's default train.json (--train 4000, seed 0), by PyTorch source.
    (A level-1 reference kernel does not depend on the shape, so those of the 13 level-1 tasks are SFT
    kernels byte for byte: the model was trained on them and still miscopies their constants.)"""
    sft = taskgen.generate_split(4000, 0, 0, seed=0)[0]
    assert len(sft) == 2862           # the card's count
    sources = {t["pytorch_code"] for t in sft}
    assert not [t["id"] for t in shipped() if t["pytorch_code"] in sources]


@pytest.mark.slow
def test_the_listed_tasks_are_the_card_experiments_rl_tasks_and_in_no_evaluation_split(monkeypatch):
    """The shipped records are those taskgen draws as rl.json of the card's experiment, and none of
    them is a valid or held-out task there or in the default split that dice-tiny's recipe drew
    (--valid 90 --heldout 60). Only the rl draws run the constant-output filter (it runs each task,
    ~0.1 s): the rl split does not depend on it elsewhere (a task it drops from valid is dropped
    again if drawn for rl; it draws nothing from the generator), and unfiltered evaluation splits
    are supersets of the filtered ones, so a stronger check."""
    real_filter, draws = taskgen.passed_by_a_constant, [0]
    monkeypatch.setattr(taskgen, "passed_by_a_constant", lambda task: False)

    def drawn():   # called before each draw: the 4741st is the first of rl
        draws[0] += 1
        if draws[0] == 4000 + 300 + 440 + 1:
            monkeypatch.setattr(taskgen, "passed_by_a_constant", real_filter)
    _, valid, heldout, rl = taskgen.generate_split(4000, 300, 440, seed=0, n_rl=600, drawn=drawn)
    assert len(rl) == 325       # the card's count
    by_id = {t["id"]: t for t in rl}
    assert [by_id.get(t["id"]) for t in shipped()] == shipped()
    monkeypatch.setattr(taskgen, "passed_by_a_constant", lambda task: False)
    _, valid90, heldout60, _ = taskgen.generate_split(4000, 90, 60, seed=0)
    evaluation = {t["pytorch_code"] for t in valid + heldout + valid90 + heldout60}
    assert not [t["id"] for t in shipped() if t["pytorch_code"] in evaluation]


@pytest.mark.slow
def test_train_rl_on_the_embedded_recipe_rolls_out_every_task_each_step(tmp_path):
    """The loop itself (not only the plan): the flagless e2e recipe, cut to 2 steps of 2 samples of
    4 tokens, with a reward that records the tasks it scores."""
    import dataclasses

    from dice.rl.train_rl import train_rl
    seen = []

    def record(ts, completions):
        seen.append([t.name.split("/")[-1] for t in ts])
        return [0.0] * len(ts)

    cfg = dataclasses.replace(embedded_config("e2e"), out=str(tmp_path / "run"), steps=2, group_size=2,
                              max_new_tokens=4, rollout_batch=64, save_every=0)
    cfg.data = str(write_embedded_data("e2e", tmp_path / "run"))
    train_rl(cfg, reward_fn=record)
    scored = sum(seen, [])          # the reward is called in pieces, step 1's before step 2's
    steps = [scored[:64], scored[64:]]
    assert [sorted(set(s)) for s in steps] == [sorted(LISTED)] * 2 and [len(s) for s in steps] == [64, 64]
