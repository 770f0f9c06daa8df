"""The rollout machinery of a BiC-RL step (issue 27): forced lengths and finish callbacks in the
sampler, scoring that overlaps generation, and the bf16 generation copy."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dice import load_model
from dice.memory import auto_rollout_batch
from dice.rl.rollout import generate_and_score
from dice.sampling.completion import bf16_copy, generation_copy
from dice.sampling.sampler import Engine, Sampling, generate

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3], [7] * 13, [42]]
LENGTHS = [5, 9, 1, 21, 13]


@pytest.mark.parametrize("remasking", ["low_confidence_static", "low_confidence_dynamic"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_a_forced_length_ends_a_sequence_as_max_new_tokens_would_alone(peaked, remasking, use_cache):
    """Row i with lengths[i] = L equals the same prompt generated alone with max_new_tokens = L:
    tokens, step map and the last block's tail, with the cache and in the brute force."""
    kw = dict(sampling=Sampling(remasking=remasking, threshold=0.5, temperature=1.0),
              engine=Engine(use_cache=use_cache))
    seen = {}
    batch = generate(peaked, PROMPTS, max_new_tokens=21, lengths=LENGTHS, seed=list(range(5)),
                     on_finish=lambda i, g: seen.setdefault(i, g), **kw)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        alone = generate(peaked, [prompt], max_new_tokens=n, seed=[i], **kw).sequences[0]
        assert batch.sequences[i] == alone == seen[i]
        assert len(alone.tokens) == n
    assert sorted(seen) == list(range(5))


def test_finished_sequences_are_reported_in_the_block_they_finish(peaked):
    order = []
    generate(peaked, PROMPTS, max_new_tokens=21, lengths=LENGTHS, on_finish=lambda i, g: order.append(i),
             progress=lambda n: order.append("block"))
    finish_blocks = [order[:k].count("block") for k, x in enumerate(order) if x != "block"]
    assert finish_blocks == sorted(finish_blocks) and order.count("block") == 6
    assert [x for x in order if x != "block"] == [2, 0, 1, 4, 3]


def test_lengths_are_checked(peaked):
    with pytest.raises(ValueError, match="one length >= 1 per prompt"):
        generate(peaked, PROMPTS[:2], max_new_tokens=8, lengths=[3])


TOKENIZER = SimpleNamespace(eos_token_ids=(), decode=lambda ids: "")


@pytest.mark.parametrize("overlap", ["stream", "batch", "none"])
def test_every_overlap_scores_the_same_rollouts(peaked, overlap):
    """The scoring calls differ (stream: one per block with finished rows, on several threads;
    batch: one per rollout batch; none: one), the completions and rewards do not."""
    calls = []

    def score(owners, completions):
        calls.append(list(owners))
        return SimpleNamespace(rewards=[o + len(c.tokens) / 100 for o, c in zip(owners, completions)], results=None)

    prompts, owners, seen = PROMPTS * 2, list(range(10)), []
    out, rewards, results, timing = generate_and_score(
        peaked, TOKENIZER, prompts, owners, list(range(10)), score, batch_size=4, overlap=overlap, lanes=3,
        lengths=LENGTHS * 2, progress=lambda *counts: seen.append(counts), max_new_tokens=21,
        sampling=Sampling(temperature=1.0, remasking="low_confidence_dynamic"))
    reference = generate(peaked, prompts, max_new_tokens=21, lengths=LENGTHS * 2, seed=list(range(10)),
                         sampling=Sampling(temperature=1.0, remasking="low_confidence_dynamic"))
    assert [c.tokens for c in out] == reference.tokens and [c.step_map for c in out] == reference.step_map
    assert rewards == [k + n / 100 for k, n in zip(owners, LENGTHS * 2)] and results == [None] * 10
    assert sorted(o for call in calls for o in call) == owners
    assert len(calls) == {"none": 1, "batch": 3}.get(overlap, len(calls)) and (overlap != "stream" or len(calls) > 3)
    assert timing["generate_s"] > 0 and timing["verify_s"] >= 0 and timing["verify_wait_s"] >= 0
    # progress: (generated, scored, 10), each count rising by the sequences finished or scored
    assert seen[-1] == (10, 10, 10) and len(seen) == 10 + len(calls) and {n for *_, n in seen} == {10}
    assert all(b[0] - a[0] + b[1] - a[1] > 0 for a, b in zip(seen, seen[1:]))


def test_a_failing_reward_fails_the_rollout(peaked):
    def score(owners, completions):
        raise RuntimeError("the verifier broke")

    with pytest.raises(RuntimeError, match="the verifier broke"):
        generate_and_score(peaked, TOKENIZER, PROMPTS, list(range(5)), list(range(5)), score, batch_size=5,
                           max_new_tokens=8)


def test_generation_copy_is_bf16_on_cuda_only_and_keeps_tied_weights():
    model = load_model(TINY)
    assert generation_copy(model, "auto") is model          # CPU: the model itself
    tied = load_model(Path(__file__).parents[1] / "dice" / "assets" / "dice-tiny")
    for m in (model, tied):
        copy = bf16_copy(m)
        assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
        assert (copy.lm_head.weight is copy.model.embed_tokens.weight) == m.config.tie_word_embeddings
        weights = dict(copy.named_parameters())
        assert all(torch.equal(weights[name], p.to(torch.bfloat16)) for name, p in m.named_parameters())
        ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
        assert (copy(ids).float() - m(ids)).norm() < 0.02 * m(ids).norm()
    assert auto_rollout_batch(model, [7, 9, 3], 4096) == 3    # CPU: every prompt in one batch


def _rollout_with(monkeypatch, events: list, reward_fn, auto_batch: bool, generate_and_score):
    """`dice.rl.rollout.sample_groups` of two tasks x 2 samples with the model's parts replaced: `events`
    records the order of the reward's preparation, the batch's sizing and the generation."""
    import dice.rl.rollout as rollout
    monkeypatch.setattr(rollout, "task_prompt_ids", lambda tok, task, **kw: [1, 2, 3])
    monkeypatch.setattr(rollout, "generation_copy", lambda model, dtype: model)
    monkeypatch.setattr(rollout, "auto_rollout_batch",
                        lambda model, lens, new, others: events.append(f"size {others}") or 3)
    monkeypatch.setattr(rollout, "generate_and_score", generate_and_score)
    cfg = SimpleNamespace(group_size=2, dtype="auto", rollout_batch=64, max_new_tokens=8, verifier_workers=2,
                          sampling=lambda: None)
    model = torch.nn.Linear(1, 1)
    tasks = [SimpleNamespace(name="a"), SimpleNamespace(name="b")]
    return rollout.sample_groups(model, None, tasks, [0, 1], cfg, reward_fn, 0, False, fmt=object(),
                                 options=rollout.RolloutOptions(auto_batch=auto_batch))


def test_the_rollout_batch_is_sized_with_room_for_the_verifiers_processes(monkeypatch):
    """The reward's processes' GPU memory (`Verifier.gpu_bytes`) reaches the batch's sizing; a
    given batch is used as it is."""
    from dice.rl.reward import Reward
    events = []

    class Busy(Reward):
        def prepare(self, tasks):
            events.append("prepare")

        def gpu_bytes(self):
            return 17 * 2**30

    reward = Busy()

    def generate(*args, batch_size, **kw):
        events.append(f"generate {batch_size}")
        return [], [], [], {}

    *_, timing = _rollout_with(monkeypatch, events, reward, True, generate)
    assert events == ["prepare", f"size {17 * 2**30}", "generate 3"] and timing["rollout_batch"] == 3
    events.clear()
    _rollout_with(monkeypatch, events, reward, False, generate)     # a given batch: nothing to size
    assert events == ["prepare", "generate 64"]


def test_auto_rollout_batch_sets_aside_what_the_verifier_does_not_hold_yet(monkeypatch):
    """The 8B rollouts of 2026-12-06 (one H100) ran out of memory at the batch that 70% of the free
    memory held (then the rule): the verifier's 17 processes, ~0.2 GiB each when the batch was sized, grew to ~0.8
    GiB each. Sequences of 1 GiB, 31 GiB available: with 2.4 of the verifier's 17 GiB in use the
    batch is what 31 - 14.6 GiB holds; with all 17 in use, ROLLOUT_SHARE (80%) of the 31."""
    import dice.memory as memory
    monkeypatch.setattr(memory, "rollout_sequence_bytes", lambda *a: 2**30)
    param = SimpleNamespace(device=torch.device("cuda", 0), element_size=lambda: 2)
    model = SimpleNamespace(parameters=lambda: iter([param]), config=None)
    for in_use, batch in ((2.4, 16), (17, 24), (20, 24)):
        monkeypatch.setattr(memory, "gpu_memory", lambda device: (31 * 2**30, int(in_use * 2**30)))
        assert auto_rollout_batch(model, [800] * 64, 4096, others_bytes=17 * 2**30) == batch
    assert auto_rollout_batch(model, [800] * 8, 4096, others_bytes=17 * 2**30) == 8     # no more than the prompts


def test_a_rollout_sequences_memory_by_hand_and_against_the_8b_measured():
    """By hand: 2 layers, 1 KV head of 4, block 4, vocab 10, intermediate 8, hidden 4, bf16; a
    prompt of 5 and 8 new tokens: a cache of 16 positions, 2*2*1*4*16*2 = 512 bytes of keys and
    values and 16*26 = 416 of the sampler's row state (three int64 and two bool a position); logits
    work 8*40*4 + 1*40*2 = 1360; prefill 5*(4*8 + 6*4)*2 = 560. Measured: the 8B
    shape's rollouts at batch 13 (prompts of 820 tokens, 4,096 new) peaked at 56.3 GiB beside
    45.8 GiB of float32 and bf16 weights (one H100, 2026-12-06): 0.81 GiB a sequence."""
    from dice.bench.training import model_config
    from dice.memory import rollout_sequence_bytes
    tiny = SimpleNamespace(block_size=4, num_hidden_layers=2, num_key_value_heads=1, head_dim=4, vocab_size=10,
                           intermediate_size=8, hidden_size=4)
    assert rollout_sequence_bytes(tiny, 5, 8, 2) == 512 + 416 + 1360 + 560
    config = model_config("8b")
    measured = (56.3 * 2**30 - config.num_parameters() * (4 + 2)) / 13
    assert measured <= rollout_sequence_bytes(config, 820, 4096, 2) <= 1.25 * measured


def test_rollouts_out_of_gpu_memory_say_which_flag_helps(monkeypatch):
    """Out of memory while generating is one line naming --rollout-batch at half the batch, not
    torch's traceback (the bench's 4B and 8B rollouts beside 17 verifier processes, 2026-12-06)."""
    from dice.errors import UserError
    from dice.rl.reward import PythonReward

    def generate(*args, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 850.00 MiB.")

    with pytest.raises(UserError, match=r"^the rollouts ran out of GPU memory .* a rollout batch of 64 sequences; "
                                        r"pass --rollout-batch 32$"):
        _rollout_with(monkeypatch, [], PythonReward(lambda tasks, completions: [0.0] * len(tasks)), False, generate)
