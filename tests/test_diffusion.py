"""Forward noising and the SFT loss (DESIGN.md §4) against hand computations and statistics."""
import pytest
import torch

from dice.sft.diffusion import EPS, add_noise, count_samples, diffusion_loss, token_weights


def test_masking_rate_prompt_and_at_least_one():
    g = torch.Generator().manual_seed(0)
    B, n, prompt = 4000, 64, 16
    ids = torch.randint(0, 50, (B, n))
    loss_mask = torch.arange(n)[None].expand(B, n) >= prompt
    sample = torch.zeros(B, n, dtype=torch.long)
    noisy, masked, p = add_noise(ids, loss_mask, sample, 99, g)
    assert torch.equal(noisy[:, :prompt], ids[:, :prompt]) and not masked[:, :prompt].any()
    assert torch.equal(noisy[masked], torch.full((int(masked.sum()),), 99))
    assert torch.equal(noisy[~masked], ids[~masked])
    assert (masked.sum(1) >= 1).all()
    rate = masked[:, prompt:].float().mean(1)
    p_row = p[:, 0]
    assert ((p_row >= EPS) & (p_row <= 1)).all()
    assert abs(float(p_row.mean()) - 0.5) < 0.02                    # t ~ U(0, 1)
    high = p_row > 0.2                                             # away from the at-least-one floor
    assert abs(float((rate - p_row)[high].mean())) < 0.005           # E[rate | p] = p


def test_packed_samples_get_their_own_rate():
    g = torch.Generator().manual_seed(1)
    sample = torch.tensor([[0] * 8 + [1] * 8 + [-1] * 4])
    loss_mask = (sample >= 0) & (torch.arange(20) % 8 >= 2)
    _, masked, p = add_noise(torch.ones(1, 20, dtype=torch.long), loss_mask, sample, 5, g)
    assert p[0, 0] != p[0, 8] and (p[0, :8] == p[0, 0]).all()
    assert masked[0, :8].any() and masked[0, 8:16].any() and not masked[0, 16:].any()


def test_token_weights_and_sample_count_hand_computed():
    sample = torch.tensor([[0, 0, 0, 1, 1, -1]])
    loss_mask = torch.tensor([[False, True, True, False, True, False]])
    p = torch.tensor([[0.5, 0.5, 0.5, 0.25, 0.25, 0.1]])
    # sample: 1 / (p * |its response|); batch: 1 / (p * the 3 response tokens of the batch)
    torch.testing.assert_close(token_weights(loss_mask, sample, p, "sample"),
                               torch.tensor([[0.0, 1 / (0.5 * 2), 1 / (0.5 * 2), 0.0, 1 / (0.25 * 1), 0.0]]))
    torch.testing.assert_close(token_weights(loss_mask, sample, p, "batch"),
                               torch.tensor([[0.0, 1 / (0.5 * 3), 1 / (0.5 * 3), 0.0, 1 / (0.25 * 3), 0.0]]))
    assert count_samples(loss_mask, sample) == 2


def test_a_packed_row_of_an_8_and_a_56_token_response():
    """DESIGN.md §4: SDAR's batch normalisation gives the short sample 8/64 = 12.5% of the loss, the
    per-sample mean 50% (every token masked at p = 1, so each weighs what the normalisation says)."""
    sample = torch.tensor([[0] * 10 + [1] * 60])
    loss_mask = torch.tensor([[False] * 2 + [True] * 8 + [False] * 4 + [True] * 56])
    p = torch.ones(1, 70)
    batch = token_weights(loss_mask, sample, p, "batch")
    assert batch[0, :10].sum() == pytest.approx(0.125) and batch[0, 10:].sum() == pytest.approx(0.875)
    per_sample = token_weights(loss_mask, sample, p, "sample") / count_samples(loss_mask, sample)
    assert per_sample[0, :10].sum() == pytest.approx(0.5) and per_sample[0, 10:].sum() == pytest.approx(0.5)


class TableModel(torch.nn.Module):
    """Logits that depend only on (row, position): a stand-in whose loss is easy to compute by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)
        self.config = type("C", (), {"block_size": 2})()

    def forward(self, ids, pos, mask, logits_at):
        full = torch.cat([self.table, self.table], dim=1)
        return full[logits_at]


@pytest.mark.parametrize("norm", ["batch", "sample"])
def test_loss_of_packed_rows_hand_computed(norm):
    """Two rows, the second packing two samples of unequal responses (1 and 3 tokens): batch is the sum
    of CE/p over all masked tokens divided by the batch's 8 response tokens; sample the sum over the
    three samples of (their sum of CE/p) / |response|."""
    torch.manual_seed(0)
    table = torch.randn(2, 6, 7)
    batch = {"input_ids": torch.randint(0, 6, (2, 6)),
             "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 3]]),
             "sample_ids": torch.tensor([[0] * 6, [0, 0, 1, 1, 1, 1]]),
             "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1]], dtype=torch.bool)}
    seeds = [10, 11]
    loss = diffusion_loss(TableModel(table), batch, [torch.Generator().manual_seed(s) for s in seeds], 6, norm=norm)
    expected = 0.0
    for i, s in enumerate(seeds):
        _, masked, p = add_noise(batch["input_ids"][i:i + 1], batch["loss_mask"][i:i + 1],
                                 batch["sample_ids"][i:i + 1], 6, torch.Generator().manual_seed(s))
        logp = table[i].log_softmax(-1)
        for k in batch["sample_ids"][i].unique().tolist():
            own = batch["sample_ids"][i] == k
            ce = sum(-logp[j, batch["input_ids"][i, j]] / p[0, j] for j in range(6) if masked[0, j] and own[j])
            expected += ce / (8 if norm == "batch" else int((batch["loss_mask"][i] & own).sum()))
    torch.testing.assert_close(loss, torch.as_tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)


class InputRecorder(torch.nn.Module):
    """Records the ids and logits_at of every forward; its logits ignore the inputs."""

    def __init__(self, vocab):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(vocab))
        self.config = type("C", (), {"block_size": 2})()
        self.calls = []

    def forward(self, ids, pos, mask, logits_at):
        self.calls.append((ids.clone(), logits_at.clone()))
        return self.bias.expand(int(logits_at.sum()), -1)


def test_loss_feeds_x_t_then_x_0_and_reads_logits_where_x_t_is_masked():
    """The doubled input is [x_t ; x_0]: MASK exactly at the noised response tokens in the first
    half, the clean ids in the second, logits read at the MASK positions of the first half only."""
    mask_id = 6
    ids = torch.tensor([[1, 2, 3, 4, 5, 0, 1, 2], [3, 3, 4, 4, 5, 5, 0, 0]])
    batch = {"input_ids": ids, "position_ids": torch.arange(8).repeat(2, 1),
             "sample_ids": torch.tensor([[0] * 8, [0] * 4 + [1] * 4]),
             "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 1, 1]], dtype=torch.bool)}
    model = InputRecorder(7)
    diffusion_loss(model, batch, [torch.Generator().manual_seed(s) for s in (3, 4)], mask_id)
    (seen, logits_at), = model.calls
    noisy, clean = seen[:, :8], seen[:, 8:]
    assert torch.equal(clean, ids)
    masked = noisy == mask_id
    assert masked.any(1).all() and not (masked & ~batch["loss_mask"]).any()
    assert torch.equal(noisy[~masked], ids[~masked])
    assert torch.equal(logits_at, torch.cat([masked, torch.zeros_like(masked)], 1))
    for i, s in enumerate((3, 4)):    # the noise of row i comes from its own generator
        _, expect, _ = add_noise(ids[i:i + 1], batch["loss_mask"][i:i + 1], batch["sample_ids"][i:i + 1], mask_id,
                                 torch.Generator().manual_seed(s))
        assert torch.equal(masked[i:i + 1], expect)


def test_activation_checkpointing_gives_the_same_gradients():
    from pathlib import Path

    from dice import load_model

    tiny = Path(__file__).parent / "fixtures" / "tiny-sdar"
    batch = {"input_ids": torch.randint(0, 300, (2, 12)), "position_ids": torch.arange(12).repeat(2, 1),
             "sample_ids": torch.zeros(2, 12, dtype=torch.long),
             "loss_mask": (torch.arange(12) >= 4).repeat(2, 1)}
    grads = []
    for checkpointing in (False, True):
        model = load_model(tiny).train()
        model.gradient_checkpointing = checkpointing
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        diffusion_loss(model, batch, gens, model.config.mask_token_id).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
