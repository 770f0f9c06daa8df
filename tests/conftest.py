import json
import os
import threading
import time

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():   # tests that wait on torch's own builds last: by then `prebuilt_programs` is done
        items.sort(key=lambda item: bool(getattr(item.module, "BUILDS_TORCH_WAY", False)))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With DICE_TEST_LOG=FILE, one JSON line per test as it ends (`python -m dice.bench check`
    reads them, so a run cut short still says what passed and how long each test took)."""
    path = os.environ.get("DICE_TEST_LOG")
    if not path or (report.when == "teardown" and report.passed):
        return
    failure = "\n".join(report.longreprtext.splitlines()[-30:]) if report.failed else ""
    with open(path, "a") as log:
        log.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                              "seconds": round(report.duration, 2), "at": round(time.time(), 1),
                              "slow": "slow" in report.keywords, "failure": failure}) + "\n")


@pytest.fixture(scope="session")
def gpu_cache(tmp_path_factory):
    """One build cache for the whole GPU session: the fast build's precompiled header and
    dispatcher, and CuPy's NVRTC cache, are made once."""
    return tmp_path_factory.mktemp("gpu-cache")


@pytest.fixture(scope="session")
def torch_build_cache(tmp_path_factory):
    """The build cache of Verifiers that build the torch way (a cache of its own: an extension's
    name does not depend on how it was built)."""
    return tmp_path_factory.mktemp("gpu-cache-torch")


@pytest.fixture(scope="session", autouse=True)
def prebuilt_programs(request):
    """On a GPU, the load_inline programs the selected GPU tests verify (their modules' PREBUILD
    list) are built from the session's start, on every core, while the GPU runs the tests before
    them: the fast way into `gpu_cache`, then torch's way into `torch_build_cache` when a selected
    test uses it. A worker asking for a program still being built waits for that build
    (`build.BuildCache`'s per-name lock)."""
    if not torch.cuda.is_available():
        yield
        return
    from dice.verifier.prebuild import BuildPool
    selected = [item for item in request.session.items if "gpu" in item.keywords]
    sources = sorted({src for item in selected for src in getattr(item.module, "PREBUILD", ())})
    ways = [("fast", "gpu_cache")] + [("torch", "torch_build_cache")] * any(
        "torch_build_cache" in item.fixturenames for item in selected)
    pools = [BuildPool(request.getfixturevalue(cache), build=way) for way, cache in ways] if sources else []

    def build_all():   # the fast way first: more tests wait on it
        for pool in pools:
            for future in [pool.submit(src) for src in sources]:
                future.result()
    threading.Thread(target=build_all, daemon=True, name="dice-test-prebuild").start()
    yield
    for pool in pools:
        pool.close()


@pytest.fixture(scope="session")
def verifier(gpu_cache):
    """One GPU Verifier pool for the whole session (workers start once, the judge caches reference
    outputs per task): the GPU tests verify through it, mostly with `map` so candidates overlap."""
    from dice.verifier import Verifier
    with Verifier(workers=8, cache_dir=gpu_cache, timing_budget_s=2.0) as v:
        yield v


def make_tiny_model_folder(folder, texts, *, vocab_size=300, hidden=64, layers=2):
    """A from-scratch model folder: a tokenizer trained on `texts` and a config without weights."""
    import json
    from pathlib import Path

    from dice.tokenizer import train_tokenizer

    folder = Path(folder)
    tok = train_tokenizer(texts, vocab_size, folder)
    config = dict(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                  mask_token_id=tok.mask_token_id, block_size=4, tie_word_embeddings=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def addition_task(tmp_path_factory):
    """A tiny SFT corpus (addition facts) and a from-scratch model folder for it."""
    import json
    import random

    root = tmp_path_factory.mktemp("addition")
    rng = random.Random(0)
    records = []
    for _ in range(200):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        records.append({"prompt": f"add {a} and {b}", "response": f"{a} + {b} = {a + b}"})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    model = make_tiny_model_folder(root / "model", [r["prompt"] + " " + r["response"] for r in records] * 3)
    return model, data


@pytest.fixture(scope="module")
def cpu_verifier(tmp_path_factory):
    """A Verifier in CPU mode (pure-PyTorch candidates), shared by a test module."""
    from dice.verifier import Verifier
    with Verifier(workers=2, device="cpu", cache_dir=tmp_path_factory.mktemp("cache"), timing_budget_s=0.5) as verifier:
        yield verifier


@pytest.fixture(scope="module")
def peaked():
    """The tiny model with sharper output distributions, so that confidences pass thresholds."""
    from pathlib import Path

    from dice import load_model
    m = load_model(Path(__file__).parent / "fixtures" / "tiny-sdar")
    with torch.no_grad():
        m.lm_head.weight *= 8
    return m


@pytest.fixture
def fake_verifier(monkeypatch):
    """dice.verifier.Verifier replaced by one that calls every candidate correct, on a "GPU";
    the returned record holds the candidates it saw and the options of its last map()."""
    import types

    import dice.verifier
    from dice.verifier import VerifyResult
    seen = types.SimpleNamespace(candidates=[], options={})

    class FakeVerifier:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, pairs, **kwargs):
            seen.options.update(kwargs)
            seen.candidates.extend(code for _, code in pairs)
            return [VerifyResult("correct", compiled=True) for _ in pairs]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dice.verifier, "Verifier", FakeVerifier)
    return seen
