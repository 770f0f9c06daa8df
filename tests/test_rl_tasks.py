"""Which tasks each RL step takes (dice.tasks.load `curriculum`, `step_tasks`, `--task-order`): hand-worked
orders, and the interleaved order's promise checked by brute force over every window."""

import json
import random

import pytest

from dice.config import TrainConfig
from dice.rl.train_rl import train_rl
from dice.tasks.load import Task, curriculum, step_tasks
from test_rl import TASKS, rl_model_folder


def tasks_at(levels) -> list[Task]:
    return [Task(name=f"t{i}", level=level, source=f"class Model:\n    scale = {i}\n")
            for i, level in enumerate(levels)]


def names(tasks) -> list[str]:
    return [t.name for t in tasks]


def test_both_orders_on_a_hand_worked_case():
    tasks = tasks_at([3, 1, 3, 2, 3, 1, 2, 3, None])
    # ascending level, file order within a level, no level last
    assert names(curriculum(tasks)) == ["t1", "t5", "t3", "t6", "t0", "t2", "t4", "t7", "t8"]
    # keys (rank + 1/2) / count: level 1 t1 .25, t5 .75; level 2 t3 .25, t6 .75;
    # level 3 t0 .125, t2 .375, t4 .625, t7 .875; no level t8 .5; ties by level
    assert names(curriculum(tasks, "interleaved")) == ["t0", "t1", "t3", "t2", "t8", "t4", "t5", "t6", "t7"]


def test_step_tasks_take_consecutive_runs_and_wrap():
    ordered = tasks_at([1, 1, 1])
    assert names(step_tasks(ordered, 0, 2)) == ["t0", "t1"]
    assert names(step_tasks(ordered, 1, 2)) == ["t2", "t0"]
    assert names(step_tasks(ordered, 2, 4)) == ["t2", "t0", "t1", "t2"]


def test_every_interleaved_step_holds_each_level_in_its_share():
    """rl.json's levels at seed 0 (96 / 23 / 199 tasks), shuffled: every step of 32 tasks, over
    two passes, holds each level's share of 32 to within 2 tasks; in curriculum order the first
    three steps are level 1 only and level 2 is a step's minority at best."""
    levels = [1] * 96 + [2] * 23 + [3] * 199
    random.Random(0).shuffle(levels)
    tasks = tasks_at(levels)
    share = {level: levels.count(level) / len(levels) for level in (1, 2, 3)}
    ordered = curriculum(tasks, "interleaved")
    assert sorted(names(ordered)) == sorted(names(tasks))
    for level in (1, 2, 3):     # a level's tasks keep their file order
        assert [t for t in ordered if t.level == level] == [t for t in tasks if t.level == level]
    for step in range(2 * len(tasks) // 32):
        chosen = [t.level for t in step_tasks(ordered, step, 32)]
        for level in (1, 2, 3):
            assert abs(chosen.count(level) - 32 * share[level]) < 2, (step, chosen)
    first_steps = [t.level for step in range(3) for t in step_tasks(curriculum(tasks), step, 32)]
    assert set(first_steps) == {1}


@pytest.mark.slow
@pytest.mark.parametrize("order, first_step", [("curriculum", ["t0", "t2", "t4", "t6"]),
                                               ("interleaved", ["t0", "t1", "t2", "t3"])])
def test_train_rl_takes_the_tasks_in_the_order_asked(tmp_path, order, first_step):
    """TASKS alternate levels 1, 2: a step of 4 takes four level-1 tasks in curriculum order, two
    of each level interleaved (keys t0 .125, t1 .125, t2 .375, t3 .375, ...)."""
    seen = []

    def record(ts, completions):
        seen.extend(t.name for t in ts)
        return [0.0] * len(ts)

    cfg = TrainConfig(phase="e2e", model=str(rl_model_folder(tmp_path / "model")), out=str(tmp_path / "out"),
                      steps=1, tasks_per_step=4, group_size=1, rollout_batch=4, max_new_tokens=4, task_order=order)
    train_rl(cfg, reward_fn=record, tasks=TASKS)
    assert sorted(seen) == first_step
    assert json.loads((tmp_path / "out" / "run.json").read_text())["--task-order"] == order


def test_an_unknown_task_order_is_refused():
    with pytest.raises(ValueError, match="--task-order must be one of curriculum, interleaved"):
        TrainConfig(phase="e2e", task_order="random")
