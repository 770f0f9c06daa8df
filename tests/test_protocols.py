"""evaluate.py --protocol dice | kernelbench against the originals (dice/protocols.py, DESIGN.md §8.6):
DICE's decoding and its unmasking order, the verifier options, how broken tasks and fast_p count."""
import dataclasses
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dice import load_model, load_tokenizer
from dice.metrics import format_summary, summarize
from dice.sampling.completion import Completion
from dice.sampling.sampler import Sampling, choose_tokens, generate, select_positions
from dice.verifier import VerifyResult

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"
DICE_TINY = ROOT / "dice" / "assets" / "dice-tiny"
TASK = ("import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        return torch.relu(x)\n\ndef get_inputs():\n    return [torch.randn(4)]\n\n"
        "def get_init_inputs():\n    return []\n")


def evaluate_module():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import evaluate
    return evaluate


def order_of_a_block(conf):
    """Static remasking of one all-masked block, one position a step: the step (1..4) of each position."""
    masked, steps = torch.ones(1, 4, dtype=torch.bool), [0] * 4
    for step in range(1, 5):
        chosen = select_positions(conf, masked, torch.tensor([1]), "low_confidence_static", 0.9)
        steps[chosen[0].nonzero().item()] = step
        masked &= ~chosen
    return steps


def test_dices_greedy_unmasks_left_to_right_and_ties_of_the_top_logit_last():
    """top_k 1 at temperature 1: the token is the argmax; DICE's confidence (after the filter) is 1
    at every position, 1/2 where two tokens tie for the top logit; with its first-seen tie rule
    the order is left to right, the tied position last: steps [1, 2, 4, 3]. The softmax confidence
    (ours) orders by the model's probability: 0.9, 0.7, 0.5, 0.3 at positions 1, 3, 2, 0, so the
    steps are [4, 1, 3, 2]."""
    top = torch.tensor([0.3, 0.9, 0.5, 0.7])      # token 0's probability; tokens 1-3 share the rest, 4 is MASK
    probs = torch.stack([top, *[(1 - top) / 3] * 3, torch.zeros(4)], -1)
    logits = probs.log()[None]
    u = torch.full((1, 4), 0.25, dtype=torch.float64)
    _, softmax = choose_tokens(logits.clone(), 4, 1.0, 1, 1.0, u)
    assert softmax[0].tolist() == pytest.approx([0.3, 0.9, 0.5, 0.7], abs=1e-6)
    assert order_of_a_block(softmax) == [4, 1, 3, 2]
    logits[0, 2] = torch.tensor([1.0, 1.0, 0.0, 0.0, -30.0])         # two tokens tie for the top logit
    tok, conf = choose_tokens(logits.clone(), 4, 1.0, 1, 1.0, u, confidence="filtered")
    assert tok.tolist() == [[0, 0, 0, 0]] and conf.tolist() == [[1.0, 1.0, 0.5, 1.0]]
    assert order_of_a_block(conf) == [1, 2, 4, 3]


def test_generation_with_dices_confidence_fills_every_block_left_to_right():
    """On the tiny model (prompt of 8 tokens: every generated block starts all-masked), DICE's
    decoding gives each block the steps s+1, s+2, s+3, s+4 left to right; ours does not."""
    model = load_model(TINY)
    with torch.no_grad():
        model.lm_head.weight *= 8

    def steps(**kw):
        sampling = Sampling(steps_per_block=4, remasking="low_confidence_static", **kw)
        return generate(model, [list(range(3, 11))], max_new_tokens=32, sampling=sampling, seed=0).sequences[0].step_map

    dice = steps(temperature=1.0, top_k=1, confidence="filtered")
    assert dice == list(range(1, 33))
    assert steps(temperature=0.0) != list(range(1, 33))
    with pytest.raises(ValueError, match="filtered: with temperature > 0"):
        steps(temperature=0.0, confidence="filtered")


def test_protocol_options_are_the_originals(tmp_path):
    """DICE: evaluation/scripts/sdar_utils.py via src/utils.py (temperature 1.0, top_k 1, static, blocks
    of 4 with 4 steps, gen_length 4096, float16, ChatML through the chat template), KernelBench's
    eval at 1e-2 in 5 trials, README's timeout=300. KernelBench main: fp32 tolerance 1e-4, 5 trials,
    timeout 180. Default: ours."""
    evaluate = evaluate_module()
    base = ["--tasks", str(tmp_path), "--model", str(DICE_TINY)]
    dice = evaluate.parse_args([*base, "--protocol", "dice"])
    assert (dice.samples, dice.temperature, dice.remasking, dice.max_new_tokens, dice.steps_per_block) == \
        (1, 1.0, "low_confidence_static", 4096, 4)
    assert dice.decoding == {"top_k": 1, "confidence": "filtered", "cuda_dtype": "float16", "chat": "chatml"}
    assert dice.verify == {"rules": "kernelbench", "precision": "dice", "trials": 5, "timeout_s": 300.0,
                           "atol": 1e-2, "rtol": 1e-2, "rel_l2": math.inf}
    kb = evaluate.parse_args([*base, "--protocol", "kernelbench", "--temperature", "0.5"])
    assert kb.verify == {"rules": "kernelbench", "precision": "strict", "trials": 5, "timeout_s": 180.0,
                         "atol": 1e-4, "rtol": 1e-4, "rel_l2": math.inf}
    assert (kb.temperature, kb.max_new_tokens, kb.decoding["confidence"]) == (0.5, 2048, "softmax")
    ours = evaluate.parse_args([*base, "--timeout", "30", "--rules", "kernelbench"])
    assert ours.verify == {"rules": "kernelbench", "precision": "strict", "trials": 5, "timeout_s": 30.0}
    assert (ours.samples, ours.temperature, ours.remasking, ours.max_new_tokens) == \
           (1, 0.0, "low_confidence_dynamic", 2048)
    assert evaluate.parse_args([*base, "--samples", "4"]).temperature == 1.0


@pytest.mark.parametrize("protocol, flag, value", [
    ("dice", "--samples", "5"), ("dice", "--remasking", "low_confidence_dynamic"), ("dice", "--temperature", "0"),
    ("dice", "--max-new-tokens", "2048"), ("dice", "--timeout", "120"), ("kernelbench", "--rules", "strict"),
    ("kernelbench", "--trials", "3"), ("default", "--dice-scripts", None)])
def test_a_flag_that_contradicts_the_protocol_is_a_usage_error(tmp_path, capsys, protocol, flag, value):
    evaluate = evaluate_module()
    with pytest.raises(SystemExit) as stop:
        evaluate.parse_args(["--tasks", str(tmp_path), "--model", str(DICE_TINY), "--protocol", protocol, flag]
                            + ([value] if value else []))
    assert stop.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_protocol_dice_asks_in_chatml_and_decodes_as_dice(tmp_path, monkeypatch):
    """An SDAR/DICE folder (no dice_one_shot) is asked in DICE's RL chat shape by default; --protocol
    dice asks it as DICE's evaluation did (the chat template's ChatML), with DICE's decoding."""
    evaluate = evaluate_module()
    seen = {}

    def fake_complete(model, tok, prompts, **kwargs):
        seen.update(kwargs, **dataclasses.asdict(kwargs["sampling"]), text=tok.decode(prompts[0]))
        return [Completion(list(p), [], [], "", None) for p in prompts]

    monkeypatch.setattr(evaluate, "complete", fake_complete)
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: load_model(TINY))     # config without dice_one_shot
    monkeypatch.setattr(evaluate, "load_tokenizer", lambda *a, **k: load_tokenizer(DICE_TINY))
    task = tmp_path / "relu.py"
    task.write_text(TASK)
    for protocol, ending in (("default", "testing code! <|im_end|>\n<|im_start|>assistant\n\n"),
                             ("dice", "testing code!<|im_end|>\n<|im_start|>assistant\n")):
        args = evaluate.parse_args(["--tasks", str(task), "--model", "m", "--protocol", protocol])
        evaluate.generate_solutions(args, evaluate.load_tasks(task))
        assert seen["text"].endswith(ending) and "return torch.relu(x)" in seen["text"], protocol
    assert (seen["temperature"], seen["top_k"], seen["confidence"], seen["stop_at_eos"]) == (1.0, 1, "filtered", True)


def test_dice_scripts_run_every_token_and_read_the_code_past_the_end(tmp_path, monkeypatch):
    """--dice-scripts: no stop at the end token, a prompt cut at 4096 tokens, and the code read from
    everything generated with special tokens dropped (here it follows an early <|im_end|>)."""
    evaluate = evaluate_module()
    tok = load_tokenizer(DICE_TINY)
    seen = {}
    answer = tok.encode("<|im_end|>```python\nx = 1\n```")

    def fake_complete(model, tok, prompts, **kwargs):
        seen.update(kwargs, lengths=[len(p) for p in prompts])
        return [Completion(list(p), answer, [1] * len(answer), "", None) for p in prompts]

    monkeypatch.setattr(evaluate, "complete", fake_complete)
    task = tmp_path / "long.py"
    task.write_text(TASK + "".join(f"# {i} {'z' * 40}\n" for i in range(400)))
    args = evaluate.parse_args(["--tasks", str(task), "--model", str(DICE_TINY), "--protocol", "dice",
                                "--dice-scripts"])
    pairs = evaluate.generate_solutions(args, evaluate.load_tasks(task))
    assert seen["stop_at_eos"] is False and seen["lengths"] == [4096]
    assert [code for _, code in pairs] == ["x = 1"]


def test_broken_tasks_are_failures_under_the_reference_protocols_and_left_out_by_default(capsys):
    """Task a's reference fails (2 samples), task b has one correct sample: left out, the correct
    rate is 1/1; failed (KernelBench's and DICE's `patch`), 1/3."""
    evaluate = evaluate_module()
    a, b = SimpleNamespace(name="a", source="A"), SimpleNamespace(name="b", source="B")
    pairs = [(a, "x"), (a, "y"), (b, "z")]
    results = [None, VerifyResult("incorrect", compiled=True), VerifyResult("correct", compiled=True)]
    broken = {"A": "its forward raises"}
    kept, got = evaluate.score_broken_tasks(pairs, results, broken, "left out")
    assert [t.name for t, _ in kept] == ["b"] and [r.correct for r in got] == [True]
    kept, got = evaluate.score_broken_tasks(pairs, results, broken, "failed")
    assert [t.name for t, _ in kept] == ["a", "a", "b"]
    assert [(r.status, r.compiled, r.correct) for r in got] == [("runtime_error", False, False)] * 2 + \
        [("correct", True, True)]
    assert "task a is counted as failed: its forward raises" in capsys.readouterr().err


def test_fast_p_at_kernelbenchs_thresholds_hand_computed():
    """Speedups 0.6, 0.9, 1.2, 1.6, 2.5 (correct) and 3.0 (incorrect) of 6: fast_p for p = 0, 0.5,
    0.8, 1, 1.5, 2 is 5, 5, 4, 3, 2, 1 sixths (strictly faster than p)."""
    results = [VerifyResult("correct", compiled=True, speedup=s) for s in (0.6, 0.9, 1.2, 1.6, 2.5)]
    results.append(VerifyResult("incorrect", compiled=True, speedup=3.0))
    ps = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)
    summary = summarize([(f"t{i}", 1, r) for i, r in enumerate(results)], ps=ps)
    assert summary["all"].fast == pytest.approx(dict(zip(ps, [5 / 6, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])))
    header = format_summary(summary).splitlines()[0].split()
    assert header[5:11] == ["fast_0", "fast_0.5", "fast_0.8", "fast_1", "fast_1.5", "fast_2"]
