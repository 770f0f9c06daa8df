import contextlib
import faulthandler
import io
import json
import os
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path

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
    """With DICE_TEST_LOG=FILE, one JSON line per test phase (setup, call, teardown) as it ends
    (`python -m dice.bench check` reads them, so a run cut short still says what passed and how long
    each test took, session fixtures' start and end included: they land on the first and last test)."""
    path = os.environ.get("DICE_TEST_LOG")
    if not path:
        return
    failure = "\n".join(report.longreprtext.splitlines()[-30:]) if report.failed else ""
    with open(path, "a") as log:
        outcome = "xfailed" if report.skipped and hasattr(report, "wasxfail") else report.outcome
        log.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": outcome,
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


def wanted_builds(items) -> dict[str, list[str]]:
    """The load_inline programs the GPU tests among `items` verify, by way of building them: a
    module's PREBUILD list (the fast way, whichever of its tests runs) and each test's own
    `@pytest.mark.prebuild(*sources, build="fast" | "torch")`; each program once, in test order."""
    wanted = {"fast": {}, "torch": {}}
    for item in items:
        if "gpu" not in item.keywords:
            continue
        for source in getattr(item.module, "PREBUILD", ()):
            wanted["fast"][source] = None
        for mark in item.iter_markers("prebuild"):
            for source in mark.args:
                wanted[mark.kwargs.get("build", "fast")][source] = None
    return {way: list(sources) for way, sources in wanted.items()}


class SessionBuilds:
    """The session's build pools, `pools` = {"fast": a BuildPool into `gpu_cache`, "torch": one into
    `torch_build_cache`}, and `reports(way)` = {source: the Future of its prebuild's report}."""

    def __init__(self):
        self.pools, self._reports, self._submitted = {}, {"fast": {}, "torch": {}}, threading.Event()

    def submit(self, wanted: dict[str, list[str]]) -> None:
        try:
            for way, pool in self.pools.items():
                for source in wanted[way]:
                    self._reports[way][source] = pool.submit(source)
        finally:
            self._submitted.set()

    def reports(self, way: str) -> dict:
        self._submitted.wait()
        return self._reports[way]


@pytest.fixture(autouse=True)
def no_stall_watchdog_left():
    """A test's BenchRun arms its stall watchdog (`dice.bench.common.BenchRun.progress`) and may end
    without `finish`: the watchdog ends with the test, not 3 minutes later in another one."""
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session", autouse=True)
def prebuilt_programs(request):
    """On a GPU, from the session's start, the load_inline programs the selected GPU tests verify
    (`wanted_builds`, nothing else: a quick run builds nothing torch's way) are built on every core,
    both ways at once, a process each, while the GPU runs the tests before them (`SessionBuilds`);
    a worker asking for a program still being built waits for that build (`cache.BuildCache`'s
    per-name lock). The session Verifier's workers start now too, when a selected test uses it, so
    that no test waits for them."""
    builds = SessionBuilds()
    if not torch.cuda.is_available():
        builds.submit({})
        yield builds
        return
    from dice.verifier.inline_build.pool import BuildPool
    selected = [item for item in request.session.items if "gpu" in item.keywords]
    wanted = wanted_builds(selected)
    builds.pools["fast"] = BuildPool(request.getfixturevalue("gpu_cache"), build="fast")
    if wanted["torch"]:
        builds.pools["torch"] = BuildPool(request.getfixturevalue("torch_build_cache"), build="torch")
    # a thread: a server reads its requests only once it has imported torch, and a pipe holds 64 KiB
    threading.Thread(target=builds.submit, args=(wanted,), daemon=True, name="dice-test-prebuild").start()
    if any("verifier" in item.fixturenames for item in selected):
        request.getfixturevalue("verifier")
    yield builds
    for pool in builds.pools.values():
        pool.close()


@pytest.fixture(scope="session")
def verifier(gpu_cache):
    """One GPU Verifier pool for the whole session (workers start once, with the session when a
    selected test uses it: `prebuilt_programs`; the judges cache reference outputs per task): the GPU
    tests verify through it, mostly with `map` so candidates overlap."""
    from dice.verifier import Verifier
    with Verifier(workers=8, cache_dir=gpu_cache, timing_budget_s=2.0) as v:
        yield v


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def refusal(monkeypatch):
    """`refusal(script, *args, cwd=ROOT)` runs `python script *args` (a script of the repository) in
    this interpreter and reports it as `subprocess.run(capture_output=True, text=True)` would: exit
    status, stdout, stderr (a `sys.exit("message")` prints the message, status 1). For commands
    that stop before their work: a fresh interpreter would spend ~3 s importing torch to refuse."""
    def run(script: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [str(ROOT / script), *args])
        out, err, status = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(ROOT / script), run_name="__main__")
            except SystemExit as stop:
                if isinstance(stop.code, str):
                    print(stop.code, file=sys.stderr)
                status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        return subprocess.CompletedProcess([script, *args], status, out.getvalue(), err.getvalue())
    return run


def make_tiny_model_folder(folder, texts, *, vocab_size=300, hidden=64, layers=2):
    """A from-scratch model folder: a tokenizer trained on `texts` and a config without weights."""
    from dice.model.tokenizer import train_tokenizer

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

        def prepare(self, task_srcs, **kwargs):
            return []

        def map(self, pairs, **kwargs):
            seen.options.update(kwargs)
            seen.candidates.extend(code for _, code in pairs)
            return [VerifyResult("correct", compiled=True) for _ in pairs]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dice.verifier, "Verifier", FakeVerifier)
    return seen


def run_bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd`; past `timeout` fail the test instead of blocking it. A deadlocked torchrun is
    stopped with SIGTERM, which it passes on to its workers (they run in sessions of their own,
    so killing torchrun alone would leave them holding the output pipes open)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stderr = proc.communicate(timeout=60)[1][-3000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            stderr = "(no output: it did not stop on SIGTERM either)"
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s (deadlocked?):\n{stderr}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)



class Occupancy:
    """The most threads ever inside `occupy` at once (`most`): tests of locks and slots."""

    def __init__(self):
        self._lock, self._inside, self.most = threading.Lock(), 0, 0

    def occupy(self, seconds: float) -> None:
        with self._lock:
            self._inside += 1
            self.most = max(self.most, self._inside)
        time.sleep(seconds)
        with self._lock:
            self._inside -= 1


def run_in_threads(jobs) -> None:
    """Start every job in a thread of its own, then wait for all of them."""
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
