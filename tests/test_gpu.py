"""GPU checks of the model and the sampler (run on a CUDA machine with `pytest -m gpu`)."""
from pathlib import Path

import pytest
import torch

from dice import load_model
from dice.model.attention import block_diffusion_mask, flex_block_diffusion_mask
from dice.model.sdar import random_model
from dice.sampling.sampler import Engine, Sampling, generate

pytestmark = pytest.mark.gpu
TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3], [7] * 13, [42]]


def peaked_tiny():
    """The tiny model on the GPU with sharper output distributions, so that confidences pass thresholds."""
    model = load_model(TINY, device="cuda")
    with torch.no_grad():
        model.lm_head.weight *= 8
    return model


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@torch.no_grad()
def test_bf16_gpu_logits_agree_with_fp32_cpu():
    gpu = random_model("1.7b", dtype=torch.float32, num_hidden_layers=4)
    cpu = random_model("1.7b", dtype=torch.float32, num_hidden_layers=4)
    cpu.load_state_dict(gpu.state_dict())
    ids = torch.randint(0, 150000, (2, 37))
    ref = cpu.cpu()(ids)
    got = gpu.to(torch.bfloat16)(ids.cuda()).cpu()
    assert rel_err(got, ref) < 2e-2


@pytest.mark.slow   # the packed-update test below runs the same mask rule through FlexAttention
@torch.no_grad()
def test_flex_training_forward_equals_dense():
    """bf16, 1.7B layer shapes (FlexAttention's kernels need head_dim >= 64 in practice), packed rows."""
    model = random_model("1.7b", num_hidden_layers=2)
    n = 80
    ids = torch.randint(0, 150000, (2, 2 * n), device="cuda")
    pos = torch.tensor([list(range(48)) + list(range(32))] * 2, device="cuda")    # two packed samples
    sample = torch.tensor([[0] * 48 + [1] * 32] * 2, device="cuda")
    doubled = torch.cat([pos, pos], 1)
    dense = model(ids, doubled, block_diffusion_mask(pos, 4, sample))
    flex = model(ids, doubled, flex_block_diffusion_mask(pos, 4, sample))
    assert rel_err(flex, dense) < 1e-2


@pytest.mark.parametrize("remasking,threshold", [("low_confidence_static", 0.9), ("low_confidence_dynamic", 0.5)])
def test_graphs_cache_and_brute_force_agree_on_the_tiny_model(remasking, threshold):
    model = peaked_tiny()
    kw = dict(max_new_tokens=21, sampling=Sampling(remasking=remasking, threshold=threshold))
    runs = [generate(model, PROMPTS, engine=Engine(cuda_graphs=True), **kw),
            generate(model, PROMPTS, engine=Engine(cuda_graphs=False), **kw),
            generate(model, PROMPTS, engine=Engine(use_cache=False), **kw)]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert runs[0].step_map == runs[1].step_map == runs[2].step_map
    for i, p in enumerate(PROMPTS):
        assert generate(model, [p], **kw).tokens[0] == runs[0].tokens[i]


@pytest.mark.slow
@pytest.mark.parametrize("remasking,threshold", [("low_confidence_static", 0.9), ("low_confidence_dynamic", 0.5)])
def test_compiled_steps_agree_with_graphs_on_the_tiny_model(remasking, threshold):
    """torch.compile'd steps (an Inductor compile per step shape: the slow part) decode as the graphs do."""
    model = peaked_tiny()
    kw = dict(max_new_tokens=21, sampling=Sampling(remasking=remasking, threshold=threshold))
    graphs, compiled = generate(model, PROMPTS, **kw), generate(model, PROMPTS, engine=Engine(compile=True), **kw)
    assert graphs.tokens == compiled.tokens and graphs.step_map == compiled.step_map


@pytest.mark.slow
def test_graphs_crossing_kv_buckets_agree_with_brute_force(monkeypatch):
    """Graph replays attend over the cache's filled length rounded up to KV_BUCKET slots; with
    8-slot buckets a 41-token generation crosses several bucket boundaries (one graph each)."""
    from dice.sampling.sampler import CachedForward
    monkeypatch.setattr(CachedForward, "KV_BUCKET", 8)
    model = peaked_tiny()
    kw = dict(max_new_tokens=41, sampling=Sampling(remasking="low_confidence_dynamic", threshold=0.5))
    graphs, brute = generate(model, PROMPTS, **kw), generate(model, PROMPTS, engine=Engine(use_cache=False), **kw)
    assert graphs.tokens == brute.tokens and graphs.step_map == brute.step_map


@pytest.mark.slow
@pytest.mark.parametrize("remasking", ["low_confidence_static", "low_confidence_dynamic"])
def test_cached_equals_brute_force_on_a_random_1p7b_shape_in_fp32(remasking):
    """float32: exact agreement is expected (bf16 near-ties may differ; the bench reports bf16)."""
    model = random_model("1.7b", dtype=torch.float32, peaked=12.0, num_hidden_layers=6)
    prompts = [torch.randint(0, 150000, (n,)).tolist() for n in (16, 21, 30)]
    kw = dict(max_new_tokens=24, sampling=Sampling(remasking=remasking))
    cached, brute = generate(model, prompts, **kw), generate(model, prompts, engine=Engine(use_cache=False), **kw)
    assert cached.tokens == brute.tokens and cached.step_map == brute.step_map


def test_static_decoding_does_not_wait_on_the_gpu_per_step():
    """Without eos ids, static steps and finishes by length are known on the host, so the number of
    host-GPU synchronisations must not grow with the generation length (the earlier loop
    synchronised several times a block)."""
    import warnings
    model = load_model(TINY, device="cuda")

    def syncs(max_new_tokens):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                generate(model, PROMPTS[:2], max_new_tokens=max_new_tokens,
                         sampling=Sampling(remasking="low_confidence_static"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    generate(model, PROMPTS[:2], max_new_tokens=8)   # lazy initialisation outside the count
    assert syncs(32) == syncs(64) > 0


@pytest.mark.slow   # FlexAttention compiles
@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-3), ("bf16", 0.1)])
def test_old_log_probs_beside_the_reward_are_the_updates_own(dtype, atol):
    """`dice.rl.update.OldLogprobs` packs the responses its own way; through FlexAttention its log-probs
    equal those of the update's micro-batches (its plan's packing) to rounding: float32 as the
    flex/dense check above, bf16 autocast within its logits' rounding (1.7B layer shapes, 2 layers)."""
    import random
    from types import SimpleNamespace

    from dice.config import TrainConfig
    from dice.model.packing import packed_logprobs
    from dice.rl.update import OldLogprobs, update_plan
    from dice.runtime import Runtime
    from dice.sampling.completion import Completion
    model = random_model("1.7b", dtype=torch.float32, num_hidden_layers=2)
    rng, comps = random.Random(1), []
    for prompt_len, n in ((37, 90), (64, 41), (5, 150), (20, 300)):
        steps = [s for b in range(0, n, 4) for s in rng.choices(range(4 * b, 4 * b + 4), k=min(4, n - b))]
        comps.append(Completion(rng.choices(range(1000), k=prompt_len), rng.choices(range(1000), k=n), steps, "", None))
    cfg = TrainConfig(phase="e2e", out="unused", dtype=dtype, attention="flex", update_tokens=1024, updates_per_step=2)
    rt = Runtime(torch.device("cuda"))
    old = OldLogprobs(model, cfg, rt, pad_id=0)
    with torch.no_grad():
        old(comps, lambda: False)
        plan, _, _ = update_plan(comps, [1.0, -1.0, 0.5, -0.5], cfg, rt, 4, 151669, 0, True)
        for batch in (b for step in plan for b in step):
            with rt.autocast(dtype):
                own = packed_logprobs(model, batch, use_flex=True)
            torch.testing.assert_close(old.old(batch), own, atol=atol, rtol=0)


@pytest.mark.slow   # FlexAttention's first Inductor compile, ~15 s on the H200: the full run's, not the quick check's
@torch.no_grad()
def test_flex_packed_update_rows_equal_dense():
    """The update's packed micro-batch (several responses, each with noisy copies of its rounds
    beside one clean stream), padded to the budget as the update pads it, through FlexAttention
    equals the dense mask on the unpadded batch (float32, 1.7B layer shapes: FlexAttention's kernels
    need head_dim >= 64 in practice; forward only)."""
    import random

    from dice.model.packing import flex_length, group_rounds, pack, pad_batch, packed_logprobs
    from dice.rl.update import trace_rounds
    from dice.sampling.completion import Completion
    model = random_model("1.7b", dtype=torch.float32, num_hidden_layers=2)
    rng, comps = random.Random(0), []
    for prompt_len, n in ((37, 90), (64, 41), (5, 150)):
        steps = [s for b in range(0, n, 4) for s in rng.choices(range(4 * b, 4 * b + 4), k=min(4, n - b))]
        comps.append(Completion(rng.choices(range(1000), k=prompt_len), rng.choices(range(1000), k=n), steps, "", None))
    items = [(k, c, r) for k, c in enumerate(comps) for r in trace_rounds(c.step_map, len(c.prompt_ids), 4)]
    batch = pack([group_rounds(items, [1.0] * len(items), "response", 4, 10**6)], 151669, 0, [1.0] * 3)
    assert batch.stream.max() >= 3 and batch.ids.shape[1] > 256
    padded = pad_batch(batch, flex_length(batch.ids.shape[1], 2048))
    dense, flex = packed_logprobs(model, batch, use_flex=False), packed_logprobs(model, padded, use_flex=True)
    assert dense.shape == (sum(len(c.tokens) for c in comps),) and padded.ids.shape == (1, 2048)
    torch.testing.assert_close(flex, dense, atol=1e-3, rtol=0)
