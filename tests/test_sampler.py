"""The cached sampler against the no-cache brute force, and the rules of DESIGN.md §5."""
from pathlib import Path

import pytest
import torch

from dice import load_model
from dice.sampling.sampler import Engine, Sampling, choose_tokens, generate, select_positions, tokens_per_step

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"
# lengths 7, 8, 3, 13, 1: on and off the block grid (block 4), mixed in one batch
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3], [7] * 13, [42]]
BRUTE = Engine(use_cache=False)


@pytest.fixture(scope="module")
def model():
    return load_model(TINY)


def run(model, prompts=PROMPTS, **kw):
    kw = {"max_new_tokens": 21, **kw}
    return generate(model, prompts, **kw)


@pytest.mark.parametrize("remasking,threshold", [("low_confidence_static", 0.9),
                                                 ("low_confidence_dynamic", 0.9),
                                                 ("low_confidence_dynamic", 0.5)])
def test_cached_equals_brute_force_and_batch_invariant(peaked, remasking, threshold):
    model = peaked
    kw = dict(sampling=Sampling(remasking=remasking, threshold=threshold))
    cached, brute = run(model, **kw), run(model, engine=BRUTE, **kw)
    assert cached.tokens == brute.tokens and cached.step_map == brute.step_map
    assert cached.tail_tokens == brute.tail_tokens and cached.tail_step_map == brute.tail_step_map
    for i, p in enumerate(PROMPTS):
        alone = run(model, [p], **kw)
        assert alone.tokens[0] == cached.tokens[i] and alone.step_map[0] == cached.step_map[i]


def test_sampling_is_seeded_batch_invariant_and_matches_brute_force(model):
    kw = dict(sampling=Sampling(temperature=1.0, top_k=50, top_p=0.9), seed=11)
    a, b, brute = run(model, **kw), run(model, **kw), run(model, engine=BRUTE, **kw)
    assert a.tokens == b.tokens == brute.tokens and a.step_map == brute.step_map
    assert run(model, [PROMPTS[2]], **{**kw, "seed": 13}).tokens[0] == a.tokens[2]  # row i uses seed + i
    assert run(model, **{**kw, "seed": 12}).tokens != a.tokens


def test_tokens_per_step_from_block_size():
    assert tokens_per_step(4, 4) == [1, 1, 1, 1]
    assert tokens_per_step(4, 3) == [2, 1, 1]
    assert tokens_per_step(5, 2) == [3, 2]
    assert tokens_per_step(4, 8) == [1, 1, 1, 1, 0, 0, 0, 0]


def test_static_with_steps_equal_block_unmasks_one_token_per_step(model):
    out = run(model, max_new_tokens=30)
    for prompt, toks, smap, n_steps, tail_smap in zip(PROMPTS, out.tokens, out.step_map, out.denoising_steps,
                                                      out.tail_step_map):
        assert len(toks) == 30
        assert len(set(smap + tail_smap)) == len(smap + tail_smap)   # never two tokens in one step
        first_block = 4 - len(prompt) % 4
        positions = first_block + 4 * -(-(30 - first_block) // 4)   # whole blocks are generated
        assert len(tail_smap) == positions - 30                       # and the ones past the cut returned
        assert n_steps == positions and sorted(smap + tail_smap) == list(range(1, n_steps + 1))


def test_dynamic_never_takes_more_steps_than_static(peaked):
    static = run(peaked, max_new_tokens=40)
    saved = []
    for threshold in (0.99, 0.9, 0.5):
        dyn = run(peaked, max_new_tokens=40, sampling=Sampling(remasking="low_confidence_dynamic", threshold=threshold))
        assert all(d <= s for d, s in zip(dyn.denoising_steps, static.denoising_steps))
        saved.append(sum(static.denoising_steps) - sum(dyn.denoising_steps))
    assert saved[-1] > 0 and dyn.forwards < static.forwards   # a peaked model does save forwards


def test_eos_cuts_after_first_eos_and_keeps_it(model):
    free = run(model, max_new_tokens=40)
    toks = free.tokens[0]
    eos = toks[10]
    first = toks.index(eos)
    cut = run(model, max_new_tokens=40, eos_token_ids=(eos,))
    assert cut.tokens[0] == toks[:first + 1]
    assert cut.step_map[0] == free.step_map[0][:first + 1]
    block_end = -(-(len(PROMPTS[0]) + first + 1) // 4) * 4 - len(PROMPTS[0])   # in response positions
    assert first + 1 < block_end          # the eos is not the block's last position: there is a tail
    assert cut.tail_tokens[0] == toks[first + 1:block_end]
    assert cut.tail_step_map[0] == free.step_map[0][first + 1:block_end]


def test_mask_token_is_never_sampled(model):
    boosted = load_model(TINY)
    with torch.no_grad():
        boosted.lm_head.weight[boosted.config.mask_token_id] *= 50
    for kw in (dict(), dict(sampling=Sampling(temperature=1.0), seed=0)):
        out = run(boosted, **kw)
        assert all(boosted.config.mask_token_id not in t for t in out.tokens)


def test_a_draw_at_the_top_of_the_cdf_stays_inside_the_kept_tokens():
    # u just below 1 made u * total round up to the total, and searchsorted then picked the last id
    # (here the mask token) whatever the filter kept
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.5, 0.0]]])
    top = torch.tensor([[1 - 2.0**-53]], dtype=torch.float64)
    for top_k, top_p, kept in ((0, 1.0, {0, 1, 2, 3}), (2, 1.0, {0, 1}), (0, 0.5, {0})):
        tok, conf = choose_tokens(logits.clone(), mask_token_id=4, temperature=1.0, top_k=top_k, top_p=top_p,
                                  uniforms=top)
        assert tok.item() in kept and conf.item() > 0, (top_k, top_p, tok.item())


def test_confidence_is_the_temperature_softmax_probability():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    for temperature in (0.5, 2.0):
        tok, conf = choose_tokens(logits.clone(), mask_token_id=3, temperature=temperature, top_k=0, top_p=1.0,
                                  uniforms=torch.tensor([[0.01]], dtype=torch.float64))
        expected = (torch.tensor([2.0, 1.0, 0.0]) / temperature).softmax(0)[tok.item()]
        assert tok.item() == 0 and conf.item() == pytest.approx(expected.item(), abs=1e-6)


def test_greedy_confidence_leaves_out_the_mask_token_even_when_it_leads():
    logits = torch.tensor([[[2.0, 1.0, 3.0]]])                 # the mask token (2) has the largest logit
    tok, conf = choose_tokens(logits, mask_token_id=2, temperature=0.0, top_k=0, top_p=1.0, uniforms=None)
    assert tok.item() == 0
    assert conf.item() == pytest.approx(torch.tensor([2.0, 1.0]).softmax(0)[0].item(), abs=1e-6)   # 0.731


@pytest.mark.parametrize("vocab", [151936, 512, 97])
def test_greedy_choice_is_softmax_max_with_the_first_of_tied_maxima(vocab):
    """The piecewise reductions against the softmax's maximum: the same token (the first of two
    tied maxima in different pieces), the probability to float32 accuracy (against float64)."""
    from dice.sampling.sampler import greedy_choice
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(2, 4, vocab, generator=g) * 4
    logits[0, 1, [vocab - 1, 5]] = 30.0
    logits[1, 2, 3] = float("-inf")
    want_conf, want_tok = logits.double().softmax(-1).max(-1)
    tok, conf = greedy_choice(logits.clone())
    assert tok[0, 1].item() == 5 and torch.equal(tok, want_tok)
    assert torch.allclose(conf.double(), want_conf, rtol=1e-6, atol=0)


@pytest.mark.parametrize("remasking", ["low_confidence_static", "low_confidence_dynamic"])
def test_equal_confidences_go_to_the_lower_position(remasking):
    conf = torch.tensor([[0.5, 0.5, 0.2], [0.2, 0.5, 0.5]])
    masked = torch.ones(2, 3, dtype=torch.bool)
    chosen = select_positions(conf, masked, torch.tensor([1, 1]), remasking, 0.9)
    assert chosen.tolist() == [[True, False, False], [False, True, False]]


def test_bad_sampling_arguments_are_one_line_errors(model):
    for kw, text in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                     (dict(top_k=-1), "top_k"), (dict(threshold=1.5), "threshold")):
        with pytest.raises(ValueError, match=text):
            run(model, sampling=Sampling(**kw))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        run(model, [[1, model.config.vocab_size]])


def test_eos_stops_only_its_own_sequence(model):
    free = run(model, max_new_tokens=40)
    eos = free.tokens[0][10]
    cut = run(model, max_new_tokens=40, eos_token_ids=(eos,))
    for toks, got in zip(free.tokens, cut.tokens):
        expected = toks[:toks.index(eos) + 1] if eos in toks else toks
        assert got == expected


def test_confidence_is_taken_before_top_k():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    tok, conf = choose_tokens(logits.clone(), mask_token_id=3, temperature=1.0, top_k=1, top_p=1.0,
                              uniforms=torch.tensor([[0.99]], dtype=torch.float64))
    assert tok.item() == 0
    expected = torch.tensor([2.0, 1.0, 0.0]).softmax(0)[0]   # mask excluded, no top-k
    assert conf.item() == pytest.approx(expected.item(), abs=1e-6)


def test_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 5.0]).expand(1, 20000, 4).clone()
    u = torch.rand(1, 20000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tok, _ = choose_tokens(logits, mask_token_id=3, temperature=1.0, top_k=0, top_p=1.0, uniforms=u)
    freq = torch.bincount(tok.flatten(), minlength=4).float() / 20000
    target = torch.tensor([1.0, 0.0, -1.0]).softmax(0)
    assert freq[3] == 0 and torch.allclose(freq[:3], target, atol=0.02)
    tok, _ = choose_tokens(logits, mask_token_id=3, temperature=1.0, top_k=0, top_p=0.6, uniforms=u)
    assert set(tok.flatten().tolist()) == {0}                 # nucleus 0.6 holds only the top token


def test_select_positions_static_and_dynamic():
    conf = torch.tensor([[0.95, 0.2, 0.97, 0.5], [0.3, 0.4, 0.1, 0.2]])
    masked = torch.tensor([[True, True, False, True], [True, True, True, True]])
    n = torch.tensor([1, 2])
    static = select_positions(conf, masked, n, "low_confidence_static", 0.9)
    assert static.tolist() == [[True, False, False, False], [True, True, False, False]]
    dyn = select_positions(conf, masked, n, "low_confidence_dynamic", 0.4)
    # row 0: 0.95 and 0.5 pass the threshold (0.97 is not masked); row 1: none does -> top 2
    assert dyn.tolist() == [[True, False, False, True], [True, True, False, False]]
    at = select_positions(conf, masked, torch.tensor([1, 1]), "low_confidence_dynamic", 0.5)
    assert at.tolist()[0] == [True, False, False, False]      # c > threshold: 0.5 itself does not pass


def reference_generate(model, prompt, max_new_tokens, steps, remasking, threshold, temperature, top_k, top_p,
                       eos, seed):
    """DESIGN.md §5 for one sequence in plain Python: no padding, no cache, the whole sequence
    recomputed every step, each rule written out per position. Independent of `generate` except
    for the noise hash (`uniform_noise`) and the 32-bit seed fold."""
    from dice.sampling.choice import row_seeds as _row_seeds, uniform_noise
    B, mask = model.config.block_size, model.config.mask_token_id
    schedule = [B // steps + (s < B % steps) for s in range(steps)]
    x, g0, step, unmasked_at = list(prompt), len(prompt), 0, {}
    row_seed = torch.tensor(_row_seeds([seed], 1))
    while True:
        b0 = len(x) // B * B
        x += [mask] * (b0 + B - len(x))
        masked = list(range(max(b0, g0), b0 + B))
        for n_s in schedule:
            if not masked:
                break
            pos = torch.arange(len(x))
            with torch.no_grad():
                logits = model(torch.tensor([x]), pos[None], (pos // B)[None, :] <= (pos // B)[:, None])[0].double()
            step += 1
            u = uniform_noise(row_seed, torch.tensor([step]), torch.arange(b0, b0 + B)[None])[0]
            token, conf = {}, {}
            for p in masked:
                logit = logits[p].clone()
                logit[mask] = float("-inf")
                if temperature == 0:
                    conf[p], token[p] = (v.item() for v in logit.softmax(-1).max(-1))
                    continue
                probs = (logit / temperature).softmax(-1)
                kept = logit / temperature
                if 0 < top_k < len(kept):
                    kept[kept < kept.topk(top_k).values[-1]] = float("-inf")
                if top_p < 1:
                    ordered, order = kept.sort(descending=True)
                    q = ordered.softmax(-1)
                    kept[order[q.cumsum(0) - q > top_p]] = float("-inf")
                cdf = kept.softmax(-1).cumsum(0)
                token[p] = int((cdf <= u[p - b0].item() * cdf[-1].item()).sum())   # first index with cdf > target
                conf[p] = probs[token[p]].item()
            ranked = sorted(masked, key=lambda p: (-conf[p], p))
            n = min(n_s, len(masked))
            confident = [p for p in masked if conf[p] > threshold]
            pick = confident if remasking == "low_confidence_dynamic" and len(confident) >= n else ranked[:n]
            for p in pick:
                x[p], unmasked_at[p] = token[p], step
            masked = [p for p in masked if p not in pick]
        out = x[g0:b0 + B]
        if any(t in eos for t in x[max(b0, g0):b0 + B]) or b0 + B - g0 >= max_new_tokens:
            cut = min(max_new_tokens, next((i + 1 for i, t in enumerate(out) if t in eos), len(out)))
            return out[:cut], [unmasked_at[p] for p in range(g0, g0 + cut)], step


@pytest.mark.parametrize("block_size", [4, 3])
def test_generate_equals_a_plain_per_sequence_reference(peaked, block_size):
    rng = torch.Generator().manual_seed(block_size)
    saved = peaked.config.block_size
    peaked.config.block_size = block_size
    try:
        for case in range(12):
            pick = lambda options: options[int(torch.randint(len(options), (), generator=rng))]  # noqa: E731
            kw = dict(max_new_tokens=pick([5, 9, 14]), steps=pick([1, 2, 3, 4, 6]),
                      remasking=pick(["low_confidence_static", "low_confidence_dynamic"]),
                      threshold=pick([0.5, 0.9]), temperature=pick([0.0, 0.0, 0.7, 1.0]), top_k=pick([0, 0, 5]),
                      top_p=pick([1.0, 1.0, 0.8]), eos=pick([(), (7, 11)]), seed=case)
            sampling = Sampling(steps_per_block=kw["steps"],
                                **{k: kw[k] for k in ("remasking", "threshold", "temperature", "top_k", "top_p")})
            got = generate(peaked, PROMPTS, max_new_tokens=kw["max_new_tokens"], sampling=sampling,
                           eos_token_ids=kw["eos"], seed=[kw["seed"]] * len(PROMPTS))
            for i, prompt in enumerate(PROMPTS):
                tokens, step_map, steps = reference_generate(peaked, prompt, **kw)
                assert (got.tokens[i], got.step_map[i], got.denoising_steps[i]) == (tokens, step_map, steps), (kw, i)
    finally:
        peaked.config.block_size = saved
