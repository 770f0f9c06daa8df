"""One RL step as `train_rl` runs it (issue 66): a tiny CPU run's metrics pinned to the values the code
gave before the step was gathered into one function."""
import json

import pytest
import torch

from dice.config import TrainConfig
from dice.rl.train_rl import train_rl

from test_rl import TASKS, rl_model_folder

# metrics.jsonl of the run below, recorded on the pre-refactor code at commit 7b67df1 (see the test's docstring)
PINNED = [
    {"step": 1, "reward_mean": 0.5238095238095238, "loss": 0.0015700456475893996, "kl": 0.01856477280682429,
     "clip_fraction": 0.328125, "mean_response_len": 8.0, "groups_kept_pct": 66.66666666666667, "tasks_drawn": 3,
     "tasks_dropped": 1, "rollout_rounds": 2},
    {"step": 2, "reward_mean": 0.5833333333333334, "loss": -0.004869259272619153, "kl": 0.010458790752633194,
     "clip_fraction": 0.109375, "mean_response_len": 8.0, "groups_kept_pct": 66.66666666666667, "tasks_drawn": 3,
     "tasks_dropped": 1, "rollout_rounds": 2},
]


@pytest.fixture
def float64_weights():
    """The run's model is built from its config in the default dtype: float64 here, so the pinned losses
    hold to 1e-6 on every CPU (in float32 the loss of step 2 moved by 9e-7 relative between
    ATEN_CPU_CAPABILITY avx512 and default)."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def reward(tasks, completions):
    """t0, t4: every sample 1 (the group agrees: dynamic sampling draws another task in its place); the
    others: the sum of the tokens mod 7, over 7."""
    return [1.0 if int(t.name[1:]) % 4 == 0 else sum(c.tokens) % 7 / 7 for t, c in zip(tasks, completions)]


@pytest.mark.slow
def test_a_tiny_runs_metrics_are_the_pre_refactor_codes(tmp_path, float64_weights):
    """2 steps of 2 tasks x 4 samples (t0 .. t7 interleaved, one dynamic-sampling round), an optimiser
    step per 4 round rows (so the old log-probs, the clip and the KL all act), seed 0. The values were
    recorded on the pre-refactor code at commit 7b67df1 (issue 66: before `rl_step` gathered the
    rollouts and the update into one function); the same run must give them to 1e-6 relative."""
    cfg = TrainConfig(phase="e2e", model=str(rl_model_folder(tmp_path / "model")), out=str(tmp_path / "run"),
                      steps=2, tasks_per_step=2, group_size=4, max_new_tokens=8, rollout_batch=8, lr=1e-3, seed=0,
                      kl_beta=0.01, rows_per_update=4, dynamic_sampling_rounds=1, task_order="interleaved")
    train_rl(cfg, reward_fn=reward, tasks=TASKS)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == len(PINNED)
    for record, pinned in zip(records, PINNED):
        assert {key: record[key] for key in pinned} == pytest.approx(pinned, rel=1e-6, abs=0)
