"""DAPO's dynamic sampling in BiC-RL (`--dynamic-sampling-rounds`, dice.rl.rollout `sample_step`): hand-worked
draws on a stubbed rollout (one process and two), then tiny CPU runs with a Python reward that is
constant on some tasks: those groups are dropped and replaced, the update sees only the others,
the counts reach metrics.jsonl, a resume continues the task stream, and the run ends with its plot."""
import json
import threading

import pytest
import torch

import dice.rl.rollout
import dice.rl.train_rl
from dice.config import TrainConfig, config_from_args
from dice.rl.rollout import sample_step
from dice.rl.train_rl import train_rl
from dice.run_folder import RunFolderError
from dice.runtime import Runtime
from dice.tasks.load import Task
from test_rl import TASKS, rl_model_folder

ORDERED = [Task(name=f"t{i}", level=1, source="") for i in range(10)]
AGREE = {"t0", "t2", "t3", "t5", "t6"}     # the stub's groups of these tasks are all 1.0


def stub_rollout(monkeypatch):
    """`dice.rl.rollout.sample_groups` replaced: group rewards 1, 1, ... for AGREE, else 0, 1, 0, ...; returns the
    (slots, task names) of every call."""
    calls, lock = [], threading.Lock()

    def sample_groups(model, tok, tasks, slots, cfg, reward, seed, infill, fmt=None, while_scoring=None, options=None):
        with lock:
            calls.append((list(slots), [t.name for t in tasks]))
        rewards = [1.0 if t.name in AGREE else float(j % 2) for t in tasks for j in range(cfg.group_size)]
        completions = [f"{t.name}/{j}" for t in tasks for j in range(cfg.group_size)]
        if while_scoring is not None:
            while_scoring(completions, lambda: True)
        return (completions, rewards, [None] * len(rewards),
                {"generate_s": 1.0, "verify_s": 2.0, "verify_wait_s": 0.0, "rollout_batch": len(rewards)})
    monkeypatch.setattr(dice.rl.rollout, "sample_groups", sample_groups)
    return calls


def step_config(rounds: int) -> TrainConfig:
    return TrainConfig(phase="e2e", tasks_per_step=4, group_size=2, dynamic_sampling_rounds=rounds)


def kept_tasks(sampled) -> list[str]:
    return [c.split("/")[0] for c, a in zip(sampled.completions, sampled.advantages) if a is not None][::2]


@pytest.mark.parametrize("rounds, drawn, dropped, ran, kept", [
    (0, 4, 3, 1, ["t1"]),                          # DICE: t0, t2, t3 agree and are dropped
    (1, 7, 5, 2, ["t1", "t4"]),                    # their 3 places go to t4, t5, t6; t5, t6 agree
    (2, 9, 5, 3, ["t1", "t4", "t7", "t8"]),        # t7, t8 for those: the 4 groups are full
    (5, 9, 5, 3, ["t1", "t4", "t7", "t8"]),        # a round without a dropped group ends the step
])
def test_dropped_groups_are_replaced_by_the_next_tasks(monkeypatch, rounds, drawn, dropped, ran, kept):
    calls = stub_rollout(monkeypatch)
    sampled = sample_step(None, None, ORDERED, 0, step_config(rounds), None, Runtime(torch.device("cpu")),
                          seed=0, infill=False)
    assert (sampled.drawn, sampled.dropped, sampled.rounds) == (drawn, dropped, ran)
    assert kept_tasks(sampled) == kept
    assert calls == [([0, 1, 2, 3], ["t0", "t1", "t2", "t3"]), ([4, 5, 6], ["t4", "t5", "t6"]),
                     ([7, 8], ["t7", "t8"])][:ran]                     # slot d: the d-th task drawn
    assert len(sampled.rewards) == len(sampled.advantages) == len(sampled.completions) == 2 * drawn
    assert sampled.timing == {"generate_s": ran * 1.0, "verify_s": ran * 2.0, "verify_wait_s": 0.0,
                              "rollout_batch": 2 * len(calls[-1][0])}      # summed seconds, the last round's batch


def test_each_rounds_old_log_probs_count_its_responses_from_the_rounds_before(monkeypatch):
    """The pass beside a round's reward (`dice.rl.update.OldLogprobs`) numbers its responses as the update
    does, after those of the rounds before: rounds of 4, 3 and 2 tasks of 2 samples."""
    stub_rollout(monkeypatch)
    seen = []
    sample_step(None, None, ORDERED, 0, step_config(2), None, Runtime(torch.device("cpu")), seed=0, infill=False,
                old_logprobs=lambda completions, finished, offset: seen.append((offset, completions[0])))
    assert seen == [(0, "t0/0"), (8, "t4/0"), (14, "t7/0")]


def test_a_step_draws_from_where_the_last_one_stopped_wrapping(monkeypatch):
    calls = stub_rollout(monkeypatch)
    sampled = sample_step(None, None, ORDERED, 9, step_config(1), None, Runtime(torch.device("cpu")),
                          seed=0, infill=False)
    assert calls == [([0, 1, 2, 3], ["t9", "t0", "t1", "t2"]), ([4, 5], ["t3", "t4"])]
    assert (sampled.drawn, sampled.dropped) == (6, 3)         # t0, t2 dropped, then t3


class ThreadRank(Runtime):
    """One of two processes as threads: all_sum adds both threads' values."""

    def __init__(self, rank: int, board: list, barrier: threading.Barrier):
        super().__init__(torch.device("cpu"), rank, 2)
        self.board, self.barrier = board, barrier

    def all_sum(self, value: float) -> float:
        self.board[self.rank] = value
        self.barrier.wait()
        total = sum(self.board)
        self.barrier.wait()
        return total


def test_two_processes_draw_the_tasks_and_slots_of_one(monkeypatch):
    """Each round's slots are spread over the processes as the first round's; together they draw
    the one-process tasks in the same slots (so with the same seeds) and count the same."""
    calls = stub_rollout(monkeypatch)
    alone = sample_step(None, None, ORDERED, 0, step_config(2), None, Runtime(torch.device("cpu")), seed=0,
                        infill=False)
    one = sorted((s, n) for slots, names in calls for s, n in zip(slots, names))
    calls.clear()
    board, barrier, out = [0.0, 0.0], threading.Barrier(2), [None, None]

    def run(rank):
        out[rank] = sample_step(None, None, ORDERED, 0, step_config(2), None, ThreadRank(rank, board, barrier),
                                seed=0, infill=False)
    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted((s, n) for slots, names in calls for s, n in zip(slots, names)) == one
    assert [(o.drawn, o.dropped, o.rounds) for o in out] == [(alone.drawn, alone.dropped, alone.rounds)] * 2
    assert sorted(kept_tasks(out[0]) + kept_tasks(out[1])) == kept_tasks(alone)


@pytest.mark.parametrize("argv, message", [
    (["--phase", "e2e", "--dynamic-sampling-rounds", "-1"], "--dynamic-sampling-rounds must be >= 0, got -1"),
    (["--phase", "sft", "--dynamic-sampling-rounds", "2"],
     "--dynamic-sampling-rounds is a flag of --phase infill/e2e, which --phase sft does not use; drop it"),
])
def test_bad_uses_of_the_flag_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        config_from_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------- tiny runs (real model, Python reward)

def even_constant(seen: list):
    """Reward 1 for every sample of t0, t2, ... (their groups agree); for t1, t3, ... the sum of the
    tokens mod 7, over 7 (their groups differ). `seen` collects the task of every completion scored."""
    def reward(tasks, completions):
        seen.extend((t.name, id(c)) for t, c in zip(tasks, completions))
        return [1.0 if int(t.name[1:]) % 2 == 0 else sum(c.tokens) % 7 / 7 for t, c in zip(tasks, completions)]
    return reward


def tiny_config(folder, out, **flags) -> TrainConfig:
    return TrainConfig(phase="e2e", model=str(folder), out=str(out), tasks_per_step=2, group_size=4,
                       max_new_tokens=8, rollout_batch=8, lr=1e-3, task_order="interleaved", **flags)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("rounds, drawn, dropped, ran", [(0, 2, 1, 1), (2, 4, 2, 3)])
def test_agreeing_tasks_are_dropped_replaced_and_never_trained(tmp_path, monkeypatch, capsys, rounds, drawn,
                                                               dropped, ran):
    """TASKS in interleaved order are t0, t1, ..., t7; 2 tasks a step. With 2 rounds step 1 draws t0
    (agrees), t1; t2 in t0's place (agrees); t3 in t2's: 4 drawn, 2 dropped, 3 rounds, the update
    sees t1's and t3's groups alone (8 of the 16 responses); step 2 goes on with t4 .. t7. Without
    dynamic sampling (DICE) a step is t0, t1 then t2, t3. The run's last line names its plot."""
    seen, trained = [], []
    update = dice.rl.train_rl.policy_update

    def spy(model, ref, completions, advantages, *args, **kwargs):
        trained.append([id(c) for c, a in zip(completions, advantages) if a is not None])
        return update(model, ref, completions, advantages, *args, **kwargs)
    monkeypatch.setattr(dice.rl.train_rl, "policy_update", spy)
    out = tmp_path / "run"
    train_rl(tiny_config(rl_model_folder(tmp_path / "model"), out, steps=2, dynamic_sampling_rounds=rounds),
             reward_fn=even_constant(seen), tasks=TASKS)
    task_of = dict((c, name) for name, c in seen)
    assert [name for name, _ in seen] == [f"t{i}" for i in range(2 * drawn) for _ in range(4)]
    odd = [f"t{i}" for i in range(1, 2 * drawn, 2)]
    assert [sorted(set(task_of[c] for c in step)) for step in trained] == [odd[:len(odd) // 2], odd[len(odd) // 2:]]
    assert all(len(step) == 4 * (drawn - dropped) for step in trained)
    for r in records(out):
        assert (r["tasks_drawn"], r["tasks_dropped"], r["rollout_rounds"]) == (drawn, dropped, ran)
        assert r["groups_kept_pct"] == 100 * (drawn - dropped) / drawn
    assert (out / "plot.png").stat().st_size > 0
    assert capsys.readouterr().err.splitlines()[-1] == f"wrote {out / 'plot.png'} (the run's curves)"


@pytest.mark.slow
def test_a_resumed_run_draws_the_tasks_the_unbroken_run_drew(tmp_path):
    """The step's first task is checkpointed (a step may draw more than --tasks-per-step): resumed
    after step 1, step 2 draws t4 .. t7 and logs what the unbroken run logged; a resume with another
    --dynamic-sampling-rounds is refused."""
    folder = rl_model_folder(tmp_path / "model")
    whole, cut, seen = tmp_path / "whole", tmp_path / "cut", []
    train_rl(tiny_config(folder, whole, steps=2, dynamic_sampling_rounds=2), reward_fn=even_constant([]), tasks=TASKS)
    train_rl(tiny_config(folder, cut, steps=1, dynamic_sampling_rounds=2, save_every=1),
             reward_fn=even_constant([]), tasks=TASKS)
    # --optimizer-state step (the default) forgets AdamW's moments before every update: none are saved
    assert torch.load(cut / "checkpoints" / "step_000001" / "trainer_state.pt")["optimizer"]["state"] == {}
    with pytest.raises(RunFolderError, match="--dynamic-sampling-rounds: the run was started with 2, this one has 1; "
                                             "resume with --dynamic-sampling-rounds 2"):
        train_rl(tiny_config(folder, cut, steps=2, dynamic_sampling_rounds=1, resume=True),
                 reward_fn=even_constant([]), tasks=TASKS)
    train_rl(tiny_config(folder, cut, steps=2, dynamic_sampling_rounds=2, resume=True, save_every=1),
             reward_fn=even_constant(seen), tasks=TASKS)
    assert sorted({name for name, _ in seen}) == ["t4", "t5", "t6", "t7"]
    timed = ("rollout_tokens_per_s", "kernels_verified_per_s", "generate_s", "verify_s", "update_s", "step_time_s")
    unbroken, resumed = ([{k: v for k, v in r.items() if k not in timed} for r in records(out)] for out in (whole, cut))
    assert [sorted(r) for r in resumed] == [sorted(r) for r in unbroken]
    for got, expected in zip(resumed, unbroken):   # pytest.approx takes flat records one at a time (pytest 9)
        assert got == pytest.approx(expected), got["step"]


def test_a_run_long_optimiser_state_is_checkpointed(tmp_path):
    """With --optimizer-state run the moments live across RL steps, so the checkpoint keeps them
    (AdamW's exp_avg and exp_avg_sq)."""
    folder = rl_model_folder(tmp_path / "model")
    out = tmp_path / "run"
    train_rl(tiny_config(folder, out, steps=1, save_every=1, optimizer_state="run"), reward_fn=even_constant([]),
             tasks=TASKS)
    state = torch.load(out / "checkpoints" / "step_000001" / "trainer_state.pt")["optimizer"]["state"]
    assert state and all({"exp_avg", "exp_avg_sq"} <= set(v) for v in state.values())
