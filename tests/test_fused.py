"""The persistent fused decoding kernel (`dice.fused`) against the layer-by-layer model,
phase by phase (GPU tests: a Hopper GPU and CuPy, `pytest -m gpu`); on the CPU, the errors for
models it cannot run and the layout of its tiled weight copies."""
import pytest
import torch
import torch.nn.functional as F

from dice.model.attention import attend, folded_attention_bias, write_kv
from dice.model.sdar import SDAR, ModelConfig, apply_rope, random_model, rope_cos_sin
from dice.sampling.sampler import Engine, Sampling, generate, greedy_choice

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a Hopper GPU")


def slow(*values):
    """A parameter set the quick GPU check (`-m "gpu and not slow"`) leaves out."""
    return pytest.param(*values, marks=pytest.mark.slow)


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def small_model(peaked=1.0, layers=2, dtype=torch.bfloat16, vocab=512):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, mask_token_id=511, block_size=4)
    model = SDAR(cfg).cuda().init_weights(std=0.1, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(peaked)
    return model.to(dtype).eval()


def layer_by_layer(model, ids, pos, cache, slots, lf):
    """Every phase's output of one step, written out with the model's own modules: {phase: tensor}
    with phases numbered as the kernel numbers them (5 per layer, then the logits)."""
    c = model.config
    T = ids.shape[1]
    valid = torch.ones(1, T, dtype=torch.bool, device="cuda")
    h = model.model.embed_tokens(ids)
    mask = cache.attention_mask(slots, pos, valid, c.block_size, cache.length + T)
    mask = folded_attention_bias(mask, c.num_attention_heads // c.num_key_value_heads, h.dtype)
    cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, h.dtype)
    out = {}
    for i, layer in enumerate(model.model.layers):
        a, mlp = layer.self_attn, layer.mlp
        qkv = a.qkv_proj(layer.input_layernorm(h))
        q, k, v = qkv.split(a.qkv_split, dim=-1)
        q = apply_rope(a.q_norm(q.reshape(1, T, a.n_heads, a.head_dim)).transpose(1, 2), cos, sin)
        k = apply_rope(a.k_norm(k.reshape(1, T, a.n_kv, a.head_dim)).transpose(1, 2), cos, sin)
        k, v = write_kv(*cache.layer(i), k, v.reshape(1, T, a.n_kv, a.head_dim).transpose(1, 2), slots,
                        cache.length + T)
        att = attend(q, k, v, mask).transpose(1, 2).reshape(1, T, -1)
        h = h + a.o_proj(att)
        gate, up = mlp.gate_up_proj(layer.post_attention_layernorm(h)).chunk(2, dim=-1)
        act = F.silu(gate) * up
        h_out = h + mlp.down_proj(act)
        out.update({5 * i: qkv, 5 * i + 1: att, 5 * i + 2: h, 5 * i + 3: act, 5 * i + 4: h_out})
        h = h_out
    out[5 * c.num_hidden_layers] = model.lm_head(model.model.norm(h[:, lf:]))
    return {p: t[0] for p, t in out.items()}


def two_caches(model, length, T, max_len=200):
    g = torch.Generator().manual_seed(length * 31 + T)
    ids = torch.randint(0, model.config.vocab_size - 16, (1, length + T), generator=g).cuda()
    pos = torch.arange(length + T, device="cuda")[None]
    caches = [model.new_cache(1, max_len) for _ in range(2)]
    for c in caches:
        if length:
            model.forward_cached(ids[:, :length], pos[:, :length], c, commit=length)
    return ids[:, length:], pos[:, length:], torch.arange(length, length + T, device="cuda"), caches


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape,length,T,lf,piece,slack", [
    ("small", 0, 4, 0, None, 64), ("small", 70, 8, 4, None, 64), slow("small", 75, 8, 4, None, 0),
    ("1.7b", 100, 4, 0, None, 64), slow("1.7b", 133, 8, 4, None, 64), slow("small", 300, 4, 0, 2, 64),
    slow("1.7b", 1000, 8, 4, 16, 64), slow("1.7b", 1000, 4, 0, None, 0), slow("1.7b", 5000, 8, 4, None, 64),
    slow("vocab 500", 40, 4, 0, None, 64)])
def test_every_phase_matches_the_layer_by_layer_model(shape, length, T, lf, piece, slack):
    """Each phase's buffer after a launch of phases [0, p], against the same step written out
    with the model's modules: bf16 rounding differences only (an indexing slip gives O(1) errors).
    Small pieces, or a chunk too long for shared memory (5000 slots), make attention stream each
    chunk in several pieces (online softmax), new keys among them. The slack moves the new tokens
    into an early chunk (length 0), or, without it, short chunks split them (75 + 8 slots)."""
    from dice.fused import FusedDecoder
    model = {"small": small_model, "vocab 500": lambda: small_model(vocab=500)}.get(
        shape, lambda: random_model("1.7b", num_hidden_layers=2))()
    ids, pos, slots, (c_ref, c_got) = two_caches(model, length, T, max_len=length + 16)
    with torch.no_grad():
        ref = layer_by_layer(model, ids, pos, c_ref, slots, lf)
        dec = FusedDecoder(model, c_got, piece=piece, slack=slack)
        assert piece or length < 5000 or dec.kernels[8]["piece"] < -(-c_got.max_len // dec.nchunks)
        for p in range(dec.all_phases):
            logits = dec.step_logits(ids, pos, None, c_got, slots, length + T, lf, phases=(0, p + 1))
            got = logits[0] if p == dec.all_phases - 1 else (dec.qkv, dec.att, dec.h, dec.act, dec.h)[p % 5][:T]
            assert got.shape == ref[p].shape
            assert rel_err(got, ref[p]) < (1e-3 if p == 0 else 3e-2), p
        for a, b in zip(c_ref.k + c_ref.v, c_got.k + c_got.v):      # the new keys/values were written
            assert rel_err(b[:, :, :length + T], a[:, :, :length + T]) < 2e-2


@pytest.mark.gpu
@pytest.mark.slow
@hopper
def test_one_launch_equals_a_launch_per_phase_and_both_row_kernels_agree():
    """The ring across phases, the grid barriers and the attention tickets: one persistent launch
    gives the bits of one launch per phase (which crosses no barrier and starts a fresh ring); and
    the 4-row kernel gives the bits of the 8-row one on a 4-token step."""
    from dice.fused import FusedDecoder
    model = random_model("1.7b", num_hidden_layers=2)
    results = []
    for split, rows in ((False, (4, 8)), (True, (4, 8)), (False, (8,))):
        ids, pos, slots, (_, cache) = two_caches(model, 90, 4)
        with torch.no_grad():
            dec = FusedDecoder(model, cache, rows=rows)
            spans = [(p, p + 1) for p in range(dec.all_phases)] if split else [None]
            for span in spans:
                logits = dec.step_logits(ids, pos, None, cache, slots, 94, 0, phases=span).clone()
        results.append((logits, [t[:, :, :94].clone() for t in cache.k + cache.v]))
    for logits, kv in results[1:]:
        assert torch.equal(logits, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(kv, results[0][1]))


@pytest.mark.gpu
@pytest.mark.slow
@hopper
def test_bf16_fused_step_is_as_close_to_float32_as_the_layer_by_layer_step():
    from dice.fused import FusedDecoder
    model = random_model("1.7b", num_hidden_layers=4, dtype=torch.float32)
    ids, pos, slots, (c32, _) = two_caches(model, 60, 4)
    with torch.no_grad():
        valid = torch.ones_like(ids, dtype=torch.bool)
        ref32 = model.step_logits(ids, pos, valid, c32, slots, 64)
        model = model.to(torch.bfloat16)
        _, _, _, (c16, cf) = two_caches(model, 60, 4)
        ref16 = model.step_logits(ids, pos, valid, c16, slots, 64)
        fused = FusedDecoder(model, cf).step_logits(ids, pos, None, cf, slots, 64)
    assert rel_err(fused, ref32) < 1.5 * rel_err(ref16, ref32) + 1e-3


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("T,lf", [(4, 0), slow(8, 4)])
def test_kernel_greedy_choice_is_the_samplers_on_its_logits(T, lf):
    """The kernel's greedy choice (each block's pass over its own logits, then the last block's combine)
    against `dice.sampling.sampler.greedy_choice` on the logits it returns; then with every lm_head row
    equal, so that all logits tie: the first row wins and the mask token is left out of the sum
    (exactly 1 / (V - 1))."""
    from dice.fused import FusedDecoder
    model = random_model("1.7b", num_hidden_layers=2)
    c = model.config
    ids, pos, slots, (_, cache) = two_caches(model, 50, T)
    with torch.no_grad():
        dec = FusedDecoder(model, cache, greedy=True)
        for tie in (False, True):
            if tie:
                model.lm_head.weight.copy_(model.lm_head.weight[5].expand_as(model.lm_head.weight))
                dec = FusedDecoder(model, cache, greedy=True)
            logits = dec.step_logits(ids, pos, None, cache, slots, 50 + T, lf).float()
            tok, conf = dec.greedy_choice(T - lf)
            logits[..., c.mask_token_id] = float("-inf")
            want_tok, want_conf = greedy_choice(logits)
            assert torch.equal(tok, want_tok)
            assert torch.allclose(conf, want_conf, rtol=1e-5, atol=0)
            if tie:
                assert tok.eq(0).all() and conf.eq(torch.tensor(1.0) / (c.vocab_size - 1)).all()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("remasking,temperature", [("low_confidence_static", 0.0), slow("low_confidence_dynamic", 0.0),
                                                   slow("low_confidence_static", 1.0)])
def test_every_fused_step_of_generate_matches_the_layer_by_layer_step(remasking, temperature, monkeypatch):
    """Inside `generate(engine=Engine(fused=True))`: each step's logits against the layer-by-layer step run on a
    copy of the same cache (bf16 greedy choices can differ between any two paths on near-ties, so
    the steps are compared, not the tokens), and at temperature 0 the kernel's greedy choice, which
    the sampler takes, against the sampler's own on those logits (sampling builds the kernel
    without it); then the same generation replayed from CUDA graphs gives the same tokens and step
    map."""
    from dice.fused import FusedDecoder
    model = small_model(peaked=3.0)
    fused_step, errors, choices = FusedDecoder.step_logits, [], []
    sampling = Sampling(remasking=remasking, temperature=temperature)

    def checked(self, ids, pos, valid, cache, slots, kv_len, logits_from=0, run_layer=None, **kw):
        ref_cache = model.new_cache(1, cache.max_len)
        for a, b in zip(ref_cache.k + ref_cache.v + [ref_cache.valid], cache.k + cache.v + [cache.valid]):
            a.copy_(b)
        ref_cache.length = cache.length
        ref = model.step_logits(ids, pos, valid, ref_cache, slots, kv_len, logits_from)
        got = fused_step(self, ids, pos, valid, cache, slots, kv_len, logits_from)
        errors.append(rel_err(got, ref))
        if not self.greedy:
            return got
        tok, conf = self.greedy_choice(got.shape[1])          # the kernel's choice, on its own logits
        masked = got.float().index_fill(-1, torch.tensor([model.config.mask_token_id], device="cuda"), float("-inf"))
        want_tok, want_conf = greedy_choice(masked)
        choices.append(torch.equal(tok, want_tok) and torch.allclose(conf, want_conf, rtol=1e-5, atol=0))
        return got

    prompts = ([5, 6, 7], [9] * 9, list(range(1, 13)))
    with monkeypatch.context() as m:
        m.setattr(FusedDecoder, "step_logits", checked)
        eager = [generate(model, [p], max_new_tokens=30, sampling=sampling, seed=3,
                          engine=Engine(fused=True, cuda_graphs=False)) for p in prompts]
    assert len(errors) >= 3 * 8 and max(errors) < 3e-2
    assert all(choices) and len(choices) == (len(errors) if temperature == 0 else 0)
    for p, e in zip(prompts, eager):
        graphed = generate(model, [p], max_new_tokens=30, sampling=sampling, seed=3, engine=Engine(fused=True))
        assert graphed.tokens == e.tokens and graphed.step_map == e.step_map


def tiny_config(**overrides):
    return ModelConfig(**{**dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, mask_token_id=63),
                          **overrides})


@pytest.mark.parametrize("overrides, dtype, message", [
    ({}, torch.float32, "needs bfloat16 weights"),
    ({"block_size": 8}, torch.bfloat16, "block_size <= 4"),
    ({"head_dim": 48, "hidden_size": 96}, torch.bfloat16, "head_dim 32, 64 or 128"),
    ({"intermediate_size": 72}, torch.bfloat16, "divisible by 64"),
    ({"intermediate_size": 96}, torch.bfloat16, "divisible by 64"),
    ({}, torch.bfloat16, "Hopper"),                 # a fine model, on the CPU
])
def test_fused_decoder_says_what_it_needs(overrides, dtype, message):
    from dice.fused import FusedDecoder
    model = SDAR(tiny_config(**overrides)).to(dtype)
    with pytest.raises(ValueError, match=message):
        FusedDecoder(model, model.new_cache(1, 16))


@pytest.mark.parametrize("n", [48, 40])
def test_tiled_weights_put_each_piece_where_the_kernel_reads_it(n):
    """fused_decode.cu reads stage (tile, k0) of W at offset (tile*16) * K + 16 * k0 of the tiled
    copy, and there the 8 columns k0 + 8c .. +7 of row r at r * kc + 8 * (c ^ 4 * (r & 1)); rows
    past N (a vocabulary that is not a multiple of 16) read zeros."""
    from dice.fused import FusedDecoder
    k, kc = 256, 128
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k) + 1
    holder = type("Holder", (), {"tiled": []})()
    flat = FusedDecoder._tile(holder, w, kc).reshape(-1)
    assert flat.numel() == 48 * k
    for tile in range(3):
        for k0 in range(0, k, kc):
            stage = flat[tile * 16 * k + 16 * k0:][:16 * kc]
            for r in range(16):
                row = tile * 16 + r
                for c in range(kc // 8):
                    at = r * kc + 8 * (c ^ (4 * (r & 1)))
                    want = w[row, k0 + 8 * c:k0 + 8 * c + 8] if row < n else torch.zeros(8)
                    assert torch.equal(stage[at:at + 8], want)


@pytest.mark.parametrize("max_len", [1040, 2064, 4016, 20016])
def test_shared_memory_layout_keeps_a_ring_and_cuts_long_chunks_into_equal_pieces(max_len, monkeypatch):
    """The layout `_build` picks for SDAR-1.7B on an H200 (227 KB of shared memory a block, 16
    chunks per head): it fits, a chunk of ceil(max_len / 16) slots is one piece while that leaves 4
    ring stages, else equal pieces that cover it, and the ring then keeps at least 4 stages."""
    import types
    from dice.fused import decoder as fd
    from dice.model.sdar import sdar_shape
    limit = 232448
    monkeypatch.setattr(fd, "_max_shared", lambda device: limit)
    kernel = types.SimpleNamespace(max_dynamic_shared_size_bytes=0)
    cupy = types.SimpleNamespace(RawModule=lambda code, options: types.SimpleNamespace(get_function=lambda n: kernel))
    monkeypatch.setattr(fd, "_KERNELS", {})
    dec = fd.FusedDecoder.__new__(fd.FusedDecoder)
    dec.cfg, dec.cupy, dec.nchunks, dec.piece, dec.slack = sdar_shape("1.7b"), cupy, 16, None, 0
    dec.model = types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=torch.zeros(1)))
    dec.cache = types.SimpleNamespace(max_len=max_len)
    chunk = -(-max_len // 16)
    for nt in (4, 8):
        k = dec._build(nt, fd.KC, None)
        assert k["smem"] <= limit - 256 and k["stages"] >= fd.MIN_RING
        pieces = -(-chunk // k["piece"])
        assert k["piece"] * pieces >= chunk > (k["piece"] - 1) * pieces      # equal pieces, covering it
        if max_len == 1040:
            assert k["piece"] == chunk == 65
        if max_len == 20016:
            assert pieces > 1


def test_phase_detail_tables_read_the_trace_build_slots():
    """`bench fused`'s inside-the-phases rows from hand-made slots: 2 layers, 4 blocks (2 chunks
    per KV head), every phase 10 us apart; block 3 has no tile in the O phase and is left out."""
    from dice.fused.tables import phase_detail
    P = 11
    t = torch.zeros(4, P + 1, 2, dtype=torch.float64)
    d = torch.zeros(4, P + 1, 8, dtype=torch.float64)
    for p in range(P + 1):
        t[:, p, 0] = p * 10_000
        t[:, p, 1] = p * 10_000 + 9_000                 # 1 us at each barrier
    for p in (5, 7, 8, 9):                              # layer 1's matrix phases
        d[:, p, 0] = p * 10_000 + 2_000                 # prologue 2 us
        d[:, p, 1] = p * 10_000 + 2_500                 # first stage after 0.5 us
        d[:, p, 2] = p * 10_000 + 8_000                 # stages 5.5 us, tail 1 us
        d[:, p, 3], d[:, p, 6], d[:, p, 7] = 300, 1200, 8
    d[2, 8, 2] = 8 * 10_000 + 8_700                     # block 2's gate/up stages end 0.7 us late
    d[3, 7] = 0                                         # no O tile on block 3
    d[3, 7, 0] = 7 * 10_000 + 5_000                     # (would move the medians if it counted)
    p = 6                                               # layer 1's attention
    d[:, p, 0] = p * 10_000 + 1_000
    d[:, p, 1] = p * 10_000 + 4_000
    d[:, p, 2] = p * 10_000 + 5_000
    d[0, p, 2] = p * 10_000 + 6_500                     # the heads' chunks 0 take their tickets last
    d[2, p, 2] = p * 10_000 + 6_000
    d[:, p, 3:7] = torch.tensor([500., 1000., 1500., 9000.])   # cycles; 9000 in a 9 us phase: 1 GHz
    t[1, p, 1] = p * 10_000 + 9_500                     # each head's merging block ends later
    t[3, p, 1] = p * 10_000 + 9_800
    steps, attn = phase_detail([(t, d)], layers=2, nchunks=2, kv_heads=2, new_chunk=1)
    for row in steps:
        assert (row["prologue"], row["first stage"], row["stages"], row["tail"]) == (2.0, 0.5, 5.5, 1.0), row
        assert row["slowest stages"] == (6.2 if row["phase"] == "UP" else 5.5)
        assert row["barrier wait"] == 1.0 and row["waiting share"] == 0.25
        assert abs(row["SM GHz"] - 1200 / 9000) < 1e-2     # 1200 cycles in a 9 us phase
    a = attn[0]
    assert (a["queries, new keys"], a["ticket"]) == (1.0, 1.0)
    assert a["last ticket"] == 6.0 and a["new tokens' ticket"] == 5.0   # heads' last: 6.5 and 6 (lower median)
    # the merging blocks' longer phases make their cycles longer; the medians are the others' 0.5 / 1 / 1.5
    assert (a["K/V wait"], a["scores"], a["softmax, values"]) == (0.5, 1.0, 1.5)
    assert a["merge"] == 4.5            # head 0's 4.5 us and head 1's 4.8 us (torch's median: the lower)


def test_short_caches_split_each_kv_head_over_half_as_many_chunks():
    """132 SMs and 8 KV heads: 16 chunks a head (one per block), 8 up to SHORT_CACHE slots."""
    from dice.fused.decoder import SHORT_CACHE, chunks_per_head
    assert [chunks_per_head(132, 8, n) for n in (100, SHORT_CACHE, SHORT_CACHE + 1, 20000)] == [8, 8, 16, 16]
    assert chunks_per_head(132, 128, 100) == 1 and chunks_per_head(4, 8, 100000) == 1
