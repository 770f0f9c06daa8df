"""The RL update's micro-batch budget planned from the GPU memory (issue 64): the bytes a token and
the fixed part by hand, the plan against fake free memory, the run's budget kept from update to
update, and the refusals before the first rollout (the 4B on an 80 GB GPU)."""
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dice.memory as memory
from dice import load_model
from dice.config import TrainConfig
from dice.memory import GIB, MemoryShortage, UpdateTokens, auto_update_tokens, update_fixed_bytes, update_token_bytes
from dice.model.checkpoint import read_config
from dice.model.packing import group_bound, largest_group
from dice.model.sdar import sdar_shape
from dice.refusals import check_update_fits
from dice.rl.update import policy_update
from dice.sampling.completion import Completion
from dice.runtime import Runtime

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"
CPU = Runtime(torch.device("cpu"))
# h 4, q = 2 heads x 2 = 4, k = 1 kv head x 2 = 2, I 8, L 2, V 10, block 4
SMALL = SimpleNamespace(hidden_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=2, intermediate_size=8,
                        num_hidden_layers=2, vocab_size=10, block_size=4)
FLAGS = {"state": "STATE", "workers": "--workers", "tokens": "--update-tokens", "checkpointing": "--ckpt",
         "length": "--max-new-tokens"}


def test_a_tokens_bytes_by_hand():
    """A layer under bf16 autocast (a = 2): residuals, norms and Linear inputs 2 (8 + 2) 4 = 80; q and k
    8 (4 + 2) = 48; the qkv product 2 (4 + 4) = 16; attention's output and o_proj's input 2 * 2 * 4 = 16;
    the MLP 4 * 2 * 8 = 64; log-sum-exp and 1/rms 4 (2 * 2 + 1 + 2) = 28: 252. In float32 (a = 4):
    2 * 12 * 4 = 96, 48, 4 * 8 = 32, 2 * 4 * 4 = 32, 4 * 4 * 8 = 128, 28: 364. Besides: cos and sin
    8 * 2 = 16, the final norm 8 * 4 = 32. Half the tokens' logits: (12 * 10 + 6 * 4) / 2 = 72, below a
    layer; with a vocabulary of 100, (12 * 100 + 6 * 4) / 2 = 612, above two. The larger of them:
    without checkpointing 2 layers + max(a layer, the logits), with it 2 inputs of 4 * 4 + max(2
    layers, the logits)."""
    assert update_token_bytes(SMALL, False) == 2 * 252 + 252 + 16 + 32
    assert update_token_bytes(SMALL, True) == 2 * 4 * 4 + 2 * 252 + 16 + 32
    assert update_token_bytes(SMALL, False, element_size=4) == 2 * 364 + 364 + 16 + 32
    wide = SimpleNamespace(**{**vars(SMALL), "vocab_size": 100})
    assert update_token_bytes(wide, False) == 2 * 252 + 612 + 16 + 32
    assert update_token_bytes(wide, True) == 2 * 4 * 4 + 612 + 16 + 32
    assert update_token_bytes(wide, False, loss_share=0.25) == 2 * 252 + 306 + 16 + 32


def test_the_fixed_part_by_hand():
    """The tiny fixture (h 64, 2 layers, q 64, k 32, I 160, V 320, untied): matmul weights 2 x (64 * 64 +
    2 * 64 * 32 + 64 * 64 + 3 * 64 * 160) + 2 * 64 + 2 * 16 norms, + 64, + lm_head 320 * 64 cast to bf16
    (2 bytes each); the largest matrix, lm_head, 6 bytes each; under FSDP2 two layers' float32 weights."""
    config = read_config(TINY)
    layers = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 160 + 2 * 64 + 2 * 16) + 64
    assert update_fixed_bytes(config, autocast=True) == 2 * (layers + 320 * 64) + 6 * 320 * 64
    assert update_fixed_bytes(config, autocast=False) == 6 * 320 * 64
    assert update_fixed_bytes(config, autocast=False, processes=2) == 6 * 320 * 64 + 8 * layers // 2


# .device/calib_update.py on one H100 (torch 2.11, 2026-12-07): the 1.7B shape's peak
# (max_memory_allocated over the weights and gradients) for one micro-batch of N tokens, bf16 autocast,
# FlexAttention: (N, gradient checkpointing, loss tokens, GiB)
MEASURED = [(2048, False, 992, 11.717), (2048, True, 992, 4.803), (2048, False, 396, 11.193),
            (2048, True, 396, 4.126), (4096, False, 2016, 20.283), (4096, True, 2016, 6.437),
            (4096, False, 804, 18.220), (4096, True, 804, 5.060), (8192, False, 4064, 37.417),
            (8192, True, 4064, 9.706), (8192, False, 1624, 33.262), (8192, True, 1624, 6.933)]


@pytest.mark.parametrize("n, ckpt, loss, measured", MEASURED)
def test_the_formula_bounds_the_measured_peaks_from_above(n, ckpt, loss, measured):
    """At each micro-batch's own loss tokens the estimate is above the measured peak: by at most 20%
    without checkpointing; with it by up to 50% (its forward ends holding the bf16 weights and 8 V a
    loss token, its backward 12 V without them; the formula counts both)."""
    config = sdar_shape("1.7b")
    estimate = update_fixed_bytes(config, autocast=True) + n * update_token_bytes(config, ckpt, 2, loss / n)
    assert measured * GIB <= estimate <= (1.5 if ckpt else 1.2) * measured * GIB


class Param:
    """A parameter on the GPU as `unallocated_state_bytes` and `auto_update_tokens` read it."""
    device, dtype, requires_grad = torch.device("cuda", 0), torch.float32, True

    def __init__(self, numel: int, grad=None):
        self.size, self.grad = numel, grad

    def numel(self) -> int:
        return self.size

    def element_size(self) -> int:
        return 4


def fake_gpu(monkeypatch, available_gib: float, in_use_gib: float, per_token: int = 4 * 2**20,
             fixed: int = 2 * GIB) -> None:
    monkeypatch.setattr(memory, "gpu_memory", lambda device: (int(available_gib * GIB), int(in_use_gib * GIB)))
    monkeypatch.setattr(memory, "update_token_bytes", lambda *a: per_token)
    monkeypatch.setattr(memory, "update_fixed_bytes", lambda *a: fixed)


def test_auto_update_tokens_sets_aside_the_state_to_come_and_the_verifiers_memory(monkeypatch):
    """4 MiB a token, 2 GiB fixed, one float32 parameter of 1 GiB, 40 GiB available, the verifier's
    processes holding 5 of their 17 GiB. Nothing allocated yet (its gradient None, no moments):
    1 + 2 GiB more; the plan's room min(0.9 * 40, 40 - 12) - 2 - 3 = 23 GiB, 23 * 256 = 5888 tokens
    (46 tiles of 128). The gradient and moments allocated (`--optimizer-state run`): 28 - 2 = 26 GiB,
    6656. The verifier's 17 GiB all in use: 36 - 2 - 3 = 31 GiB, 7936."""
    fake_gpu(monkeypatch, 40, 5)
    param = Param(2**28)
    model = SimpleNamespace(config=SimpleNamespace(block_size=4), parameters=lambda: iter([param]))
    cfg = TrainConfig(phase="e2e")
    assert auto_update_tokens(model, cfg, 17 * GIB) == 5888
    param.grad = object()
    assert auto_update_tokens(model, cfg, 17 * GIB, optimizer=SimpleNamespace(state={param: {"exp_avg": 0}})) == 6656
    param.grad = None
    fake_gpu(monkeypatch, 40, 17)
    assert auto_update_tokens(model, cfg, 17 * GIB) == 7936
    fake_gpu(monkeypatch, 400, 17)   # at most UPDATE_TOKENS_MAX, never below the largest group (rounded up)
    assert auto_update_tokens(model, cfg, 17 * GIB) == 16384
    assert auto_update_tokens(model, cfg, 17 * GIB, longest=20000) == 20096
    assert auto_update_tokens(SimpleNamespace(parameters=lambda: iter([torch.zeros(1)])), cfg) == 16384   # a CPU


def test_auto_update_tokens_refuses_in_one_line_what_cannot_fit(monkeypatch):
    """The room of 5,888 tokens cannot hold a response's group of 9,000; and where the state to come
    alone passes the room (40 GiB of gradients and moments), no group fits."""
    fake_gpu(monkeypatch, 40, 5)
    model = SimpleNamespace(config=SimpleNamespace(block_size=4), parameters=lambda: iter([Param(2**28)]))
    with pytest.raises(MemoryShortage, match=r"^the RL update cannot hold a micro-batch of its longest response "
                                             r"\(9000 tokens.*lower --max-new-tokens or turn on gradient"):
        auto_update_tokens(model, TrainConfig(phase="e2e"), 17 * GIB, longest=9000)
    model = SimpleNamespace(config=SimpleNamespace(block_size=4), parameters=lambda: iter([Param(10 * 2**30 // 4)]))
    with pytest.raises(MemoryShortage) as refused:
        auto_update_tokens(model, TrainConfig(phase="e2e", gradient_checkpointing=True), 17 * GIB)
    assert "\n" not in str(refused.value) and str(refused.value).endswith("; lower --max-new-tokens")


def test_the_runs_budget_is_kept_while_it_fits_and_given_ones_are_used_as_given(monkeypatch):
    """FlexAttention compiles once a shape: a budget that still fits and holds the step's largest
    group stays; less room or a larger group change it. The old log-probs' forwards take the last
    budget while it holds their largest group (8 + 16 tokens and a copy of 16: 40). --update-tokens
    N is N, asked of no plan."""
    plans = iter([8192, 10240, 6144, 7168, 4096])
    asked = []
    monkeypatch.setattr(memory, "auto_update_tokens",
                        lambda model, cfg, others, optimizer, longest, processes: asked.append(longest) or next(plans))
    model = SimpleNamespace(config=SimpleNamespace(block_size=4), parameters=lambda: iter([Param(1)]))
    tokens = UpdateTokens(model, None, CPU, others=lambda: 17 * GIB)
    cfg = TrainConfig(phase="e2e")
    assert [tokens.plan(cfg, longest) for longest in (5000, 5000, 5000, 7000)] == [8192, 8192, 6144, 7168]
    assert asked == [5000, 5000, 5000, 7000]
    response = [Completion(list(range(8)), list(range(16)), [1] * 16, "", None)]
    assert tokens.for_forwards(cfg, response) == 7168 and len(asked) == 4
    tokens.last = 32
    assert tokens.for_forwards(cfg, response) == 4096 and asked[-1] == 40
    given = dataclasses.replace(cfg, update_tokens=3000)
    assert tokens.plan(given, 9000) == tokens.for_forwards(given, response) == 3000 and len(asked) == 5


def test_auto_turns_gradient_checkpointing_on_where_only_that_fits(monkeypatch):
    """A group that fits only with gradient checkpointing: the plan turns it on for the run (the model's
    flag, one log line naming why) and plans with it from then on; a group that fits neither way is
    refused with the checkpointed plan's shortage (which names no checkpointing to turn on)."""
    asked = []

    def auto(model, cfg, others, optimizer, longest, processes):
        asked.append((longest, cfg.gradient_checkpointing))
        if longest > 9000 or not cfg.gradient_checkpointing:
            raise MemoryShortage(f"{longest} tokens do not fit" + ("" if cfg.gradient_checkpointing else "; ckpt"))
        return 8192
    monkeypatch.setattr(memory, "auto_update_tokens", auto)
    model = SimpleNamespace(config=SimpleNamespace(block_size=4), parameters=lambda: iter([Param(1)]),
                            gradient_checkpointing=False)
    lines = []
    tokens = UpdateTokens(model, None, CPU, log=lines.append)
    cfg = TrainConfig(phase="e2e")
    assert tokens.plan(cfg, 5000) == 8192 and model.gradient_checkpointing and tokens.checkpointing
    assert asked == [(5000, False), (5000, True)] and len(lines) == 1
    assert "(5000 tokens) does not fit this GPU without it (5000 tokens do not fit; ckpt)" in lines[0]
    assert tokens.plan(cfg, 6000) == 8192 and asked[-1] == (6000, True) and len(lines) == 1
    with pytest.raises(MemoryShortage, match=r"^9500 tokens do not fit$"):
        tokens.plan(cfg, 9500)

    model.gradient_checkpointing, asked[:] = False, []
    tokens = UpdateTokens(model, None, CPU, log=lines.append)
    with pytest.raises(MemoryShortage, match=r"^9500 tokens do not fit$"):
        tokens.plan(cfg, 9500)
    assert asked == [(9500, False), (9500, True)] and not model.gradient_checkpointing and not tokens.checkpointing


def test_a_groups_bound_and_the_plan_before_the_rollouts():
    """A prompt of 6 (its last block holds 2 of them) and 9 response tokens with a tail of 1: 16
    positions; a response-rows group holds them and a copy of 16 - 4 = 12; a round-rows group 2 x 16.
    Before the rollouts, --max-new-tokens 4096 after no prompt: 2 x 4096."""
    c = Completion(list(range(6)), list(range(9)), [1] * 9, "", None, tail_tokens=[0], tail_step_map=[1])
    assert group_bound(6, 16, 4, "response") == 28 and group_bound(6, 16, 4, "round") == 32
    assert largest_group([None, c, Completion([1], [], [], "", None)], "response", 4) == 28
    longest = []
    tokens = UpdateTokens(SimpleNamespace(config=SimpleNamespace(block_size=4)), None, CPU)
    tokens.plan = lambda cfg, n: longest.append(n) or n
    tokens.before_rollouts(TrainConfig(phase="e2e"))
    tokens.before_rollouts(TrainConfig(phase="e2e"), prompt_len=6, response_len=9)
    assert longest == [8192, 28]


def test_an_update_logs_its_budget():
    """On a CPU auto is 16384; a given budget is used as given."""
    model = load_model(TINY)
    comp = Completion([5, 6, 7], [8, 9, 10, 11, 12], [1, 2, 2, 3, 4], "", None)
    for given, used in ((0, 16384), (40, 40)):
        cfg = TrainConfig(phase="e2e", model=str(TINY), out="unused", update_tokens=given, dtype="fp32")
        stats = policy_update(model, None, [comp, comp], [1.0, -1.0], cfg, CPU, torch.optim.AdamW(model.parameters()), 0)
        assert stats["update_tokens"] == used


def sdar_folder(tmp_path: Path, shape: str) -> Path:
    folder = tmp_path / shape
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(sdar_shape(shape).to_dict()))
    return folder


def on_a_gpu_of(monkeypatch, free_gib: float) -> None:
    """A CUDA GPU with `free_gib` free (an 80 GB H100: 79.6 GiB, less its CUDA context)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(free_gib * GIB))


def test_the_4b_on_an_80_gb_gpu_is_refused_before_the_first_rollout(monkeypatch, tmp_path, capsys):
    """Its float32 weights, gradients and moments (65.7 GiB) and bf16 copies leave no room on 79 GiB:
    train.py's memory check (before the model loads) and bench rl's (before the references are checked)
    say so in one line naming a smaller model, the CPU offload or more GPUs; on a 141 GB GPU the state
    fits, and on the 80 GB one with --offload cpu (the state in host memory), beside the verifier and
    a micro-batch of a 4,096-token response."""
    import importlib.util
    on_a_gpu_of(monkeypatch, 79.0)
    spec = importlib.util.spec_from_file_location("train_script", Path(__file__).resolve().parents[1] / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    cfg = TrainConfig(phase="e2e", model=str(sdar_folder(tmp_path, "4b")), data="unused", steps=1,
                      gradient_checkpointing=True)
    with pytest.raises(MemoryShortage, match=r"float32 weights, gradients and AdamW moments 65\.7 GiB.*; train a "
                                             r"smaller --model, keep its float32 state in host memory \(--offload cpu\)"):
        train.check_memory(cfg)
    train.check_memory(dataclasses.replace(cfg, offload="cpu"))
    from dice.bench import main
    with pytest.raises(SystemExit, match=r"^error: --shape 4b: the RL update needs .*--skip-update"):
        main(["rl", "--shape", "4b", "--solutions", "unused.json", "--grad-ckpt", "--update-tokens", "4096"])
    on_a_gpu_of(monkeypatch, 139.0)
    check_update_fits(sdar_shape("4b"), torch.device("cuda", 0), tokens=0, longest=0, gradient_checkpointing=True,
                      autocast=True, processes=1, others=10 * GIB, flags=FLAGS)
    on_a_gpu_of(monkeypatch, 79.0)
    check_update_fits(sdar_shape("4b"), torch.device("cuda", 0), tokens=0, longest=8192, gradient_checkpointing=True,
                      autocast=True, processes=1, others=10 * GIB, flags=FLAGS, offload=True)


def test_the_update_check_names_the_lever_that_fits(monkeypatch):
    """The 1.7B on 79 GiB beside 10 GiB of verifier processes: a response of 4,096 tokens (a micro-batch
    of 8,192 at 4.5 MiB a token) does not fit the plan without gradient checkpointing, fits with it, so
    auto passes (it turns checkpointing on, `UpdateTokens.plan`); an explicit 8,192 beside 30 GiB fits
    only with checkpointing; an explicit 16,384 does not fit where auto would; more room and the
    verifier's memory are named."""
    on_a_gpu_of(monkeypatch, 79.0)
    check = dict(device=torch.device("cuda", 0), autocast=True, processes=1, flags=FLAGS)
    config = sdar_shape("1.7b")
    for ckpt in (False, True):
        check_update_fits(config, tokens=0, longest=8192, gradient_checkpointing=ckpt, others=10 * GIB, **check)
    with pytest.raises(MemoryShortage, match=r"a micro-batch's activations \(8192 tokens\).*; pass --ckpt$"):
        check_update_fits(config, tokens=8192, longest=8192, gradient_checkpointing=False, others=30 * GIB, **check)
    with pytest.raises(MemoryShortage, match=r"; pass --update-tokens auto \(planned to fit\) or a smaller one$"):
        check_update_fits(config, tokens=16384, longest=0, gradient_checkpointing=False, others=17 * GIB, **check)
    with pytest.raises(MemoryShortage, match=r"; lower --max-new-tokens$"):
        check_update_fits(config, tokens=0, longest=60000, gradient_checkpointing=True, others=10 * GIB, **check)
    on_a_gpu_of(monkeypatch, 35.0)   # the state fits the plan without the verifier's 10 GiB, not beside them
    with pytest.raises(MemoryShortage, match=r"; STATE, or fewer --workers$"):
        check_update_fits(config, tokens=0, longest=0, gradient_checkpointing=True, others=10 * GIB, **check)
