"""GPU checks of the persistent fused decoding kernel (`dice.fused_decode`), against the
layer-by-layer model (run on a CUDA machine with `pytest -m gpu`)."""
import pytest
import torch

from dice.bench import random_model
from dice.model import SDAR, ModelConfig
from dice.sampler import generate

pytestmark = pytest.mark.gpu


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def small_model(dtype, peaked=1.0, layers=2):
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, mask_token_id=511, block_size=4)
    model = SDAR(cfg).cuda().init_weights(std=0.1, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(peaked)
    return model.to(dtype).eval()


def step_both_ways(model, length, T, lf, per_phase=False, **kw):
    """Prefill `length` tokens into two caches, then one step of T tokens layer by layer and fused."""
    from dice.fused_decode import FusedDecoder
    g = torch.Generator().manual_seed(length * 31 + T)
    ids = torch.randint(0, 500, (1, length + T), generator=g).cuda()
    pos = torch.arange(length + T, device="cuda")[None]
    valid = torch.ones(1, T, dtype=torch.bool, device="cuda")
    slots = torch.arange(length, length + T, device="cuda")
    caches = [model.new_cache(1, 200) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            if length:
                model.forward_cached(ids[:, :length], pos[:, :length], c, commit=length)
        ref = model.step_logits(ids[:, length:], pos[:, length:], valid, caches[0], slots, length + T, lf).clone()
        got = FusedDecoder(model, caches[1], **kw).step_logits(ids[:, length:], pos[:, length:], valid, caches[1],
                                                               slots, length + T, lf, per_phase=per_phase).clone()
    return ref, got, caches


@pytest.mark.parametrize("length,T,lf", [(0, 4, 0), (8, 8, 4), (70, 4, 0), (133, 8, 4)])
def test_fused_step_equals_the_layer_by_layer_step_in_float32(length, T, lf):
    """Cache lengths on and off the attention chunk grid, a plain step and a commit + step."""
    ref, got, (c_ref, c_got) = step_both_ways(small_model(torch.float32), length, T, lf, chunk=32)
    assert got.shape == ref.shape == (1, T - lf, 512)
    assert rel_err(got, ref) < 1e-5
    for a, b in zip(c_ref.k + c_ref.v, c_got.k + c_got.v):      # the new keys/values were written too
        assert rel_err(b[:, :, :length + T], a[:, :, :length + T]) < 1e-5


def test_persistent_launch_equals_one_launch_per_phase():
    """The grid barrier and the attention tickets: one persistent launch gives the bits of the
    phase-by-phase launches (which need neither), on the 1.7B layer shapes in bf16."""
    model = random_model("1.7b", num_hidden_layers=3)
    _, per_phase, c1 = step_both_ways(model, 100, 8, 4, per_phase=True)
    _, persistent, c2 = step_both_ways(model, 100, 8, 4)
    assert torch.equal(per_phase, persistent)
    assert all(torch.equal(a, b) for a, b in zip(c1[1].k + c1[1].v, c2[1].k + c2[1].v))


def test_bf16_fused_step_is_as_close_to_float32_as_the_layer_by_layer_step():
    model = random_model("1.7b", num_hidden_layers=4, dtype=torch.float32)
    ref32, _, _ = step_both_ways(model, 60, 4, 0)
    ref16, fused16, _ = step_both_ways(model.to(torch.bfloat16), 60, 4, 0)
    assert rel_err(fused16, ref32) < 1.5 * rel_err(ref16, ref32) + 1e-3


@pytest.mark.parametrize("remasking", ["low_confidence_static", "low_confidence_dynamic"])
def test_fused_generate_equals_brute_force_in_float32(remasking):
    model = small_model(torch.float32, peaked=20.0)
    for prompt in ([5, 6, 7], [9] * 9, list(range(1, 13))):
        fused = generate(model, [prompt], max_new_tokens=30, remasking=remasking, fused=True)
        brute = generate(model, [prompt], max_new_tokens=30, remasking=remasking, use_cache=False)
        assert fused.tokens == brute.tokens and fused.step_map == brute.step_map
