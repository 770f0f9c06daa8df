"""The rollout machinery of a BiC-RL step (issue 27): forced lengths and finish callbacks in the
sampler, scoring that overlaps generation, the bf16 generation copy, and the bucketed FlexAttention
round batches of the update."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dice import load_model
from dice.trace import RoundBatch, flex_shape, pad_round_batch, round_logprobs, trace_rounds
from dice.rollout import auto_rollout_batch, bf16_copy, generate_and_score, generation_copy
from dice.sampler import generate

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3], [7] * 13, [42]]
LENGTHS = [5, 9, 1, 21, 13]


@pytest.mark.parametrize("remasking", ["low_confidence_static", "low_confidence_dynamic"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_a_forced_length_ends_a_sequence_as_max_new_tokens_would_alone(peaked, remasking, use_cache):
    """Row i with lengths[i] = L equals the same prompt generated alone with max_new_tokens = L:
    tokens, step map and the last block's tail, with the cache and in the brute force."""
    kw = dict(remasking=remasking, threshold=0.5, temperature=1.0, use_cache=use_cache)
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

    prompts, owners = PROMPTS * 2, list(range(10))
    out, rewards, results, timing = generate_and_score(
        peaked, TOKENIZER, prompts, owners, list(range(10)), score, batch_size=4, overlap=overlap, lanes=3,
        lengths=LENGTHS * 2, max_new_tokens=21, temperature=1.0, remasking="low_confidence_dynamic")
    reference = generate(peaked, prompts, max_new_tokens=21, lengths=LENGTHS * 2, seed=list(range(10)),
                         temperature=1.0, remasking="low_confidence_dynamic")
    assert [c.tokens for c in out] == reference.tokens and [c.step_map for c in out] == reference.step_map
    assert rewards == [k + n / 100 for k, n in zip(owners, LENGTHS * 2)] and results == [None] * 10
    assert sorted(o for call in calls for o in call) == owners
    assert len(calls) == {"none": 1, "batch": 3}.get(overlap, len(calls)) and (overlap != "stream" or len(calls) > 3)
    assert timing["generate_s"] > 0 and timing["verify_s"] >= 0 and timing["verify_wait_s"] >= 0


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


def test_flex_shape_buckets():
    assert flex_shape(3, 100) == (4, 128) and flex_shape(8, 1024) == (8, 1024) and flex_shape(1, 4) == (1, 128)
    assert [flex_shape(2, n)[1] for n in (1025, 1300, 2048, 2049, 3500)] == [1280, 1536, 2048, 2560, 3584]
    for n in range(1, 9000, 37):
        rows, padded = flex_shape(5, n)
        assert rows == 8 and padded % 128 == 0 and n <= padded < max(1.25 * n, n + 128)
        assert flex_shape(rows, padded) == (rows, padded)     # a bucket is its own bucket


def round_batch(rows, mask_id: int) -> RoundBatch:
    """The rounds' doubled rows as `dice.rl.build_round_batch` lays them out (its weights aside)."""
    n = -(-max(len(seq) for seq, _ in rows) // 4) * 4
    clean, sample = torch.zeros(len(rows), n, dtype=torch.long), torch.full((len(rows), n), -1)
    loss_at = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, (seq, rnd) in enumerate(rows):
        clean[i, :len(seq)], sample[i, :len(seq)], loss_at[i, rnd.loss] = torch.tensor(seq), 0, True
    noisy = clean.clone()
    for i, (_, rnd) in enumerate(rows):
        noisy[i, rnd.masked] = mask_id
    weights = torch.ones(int(loss_at.sum()))
    return RoundBatch(noisy, clean, torch.arange(n).expand(len(rows), n).clone(), sample, loss_at, weights, weights)


@pytest.mark.slow
def test_padded_flex_round_batch_gives_the_dense_log_probs():
    """FlexAttention on the padded [rows, bucket] batch and the dense mask on the batch as built give
    the same log-probs, in the same order (CPU: forward only)."""
    model = load_model(TINY)
    prompts = [list(range(5, 12)), list(range(3, 16)), [9]]
    out = generate(model, prompts, max_new_tokens=13, remasking="low_confidence_dynamic", threshold=0.5,
                   temperature=1.0, seed=3)
    rows = []
    for p, g in zip(prompts, out.sequences):
        rows += [(p + g.tokens + g.tail_tokens, r) for r in trace_rounds(g.step_map, len(p), 4, g.tail_step_map)]
    batch = round_batch(rows[:-1], model.config.mask_token_id)
    padded = pad_round_batch(batch, *flex_shape(*batch.clean.shape))
    assert padded.clean.shape == flex_shape(*batch.clean.shape) != batch.clean.shape
    assert torch.equal(padded.loss_at[:batch.loss_at.shape[0], :batch.loss_at.shape[1]], batch.loss_at)
    with torch.no_grad():
        dense, flex = round_logprobs(model, batch, use_flex=False), round_logprobs(model, batch, use_flex=True)
    assert dense.shape == (int(batch.loss_at.sum()),)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)
