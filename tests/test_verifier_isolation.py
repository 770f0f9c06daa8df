"""Candidates kept apart (issue #67, DESIGN.md §8.4): the trusted side's reading of a candidate's
source decides whether its worker may serve the next candidate (`isolation.reuse_problem`)."""
from pathlib import Path

import pytest

from dice.verifier.isolation import reuse_problem

HEADER = ("import cupy as cp\nimport numpy as np\nimport torch\nimport torch.nn as nn\n\n"
          "_module = cp.RawModule(code=r'''extern \"C\" __global__ void relu(const float* x, float* y, long long n) "
          "{ long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; if (i < n) y[i] = x[i] > 0 ? x[i] : 0; }''')\n"
          "relu = _module.get_function('relu')\n\n\n")


def model(forward: str, init: str = "pass", extra: str = "") -> str:
    body = "\n".join("        " + line for line in forward.strip().splitlines())
    return (HEADER + extra + "class ModelNew(nn.Module):\n    def __init__(self, *args):\n        super().__init__()\n"
            f"        {init}\n\n    def forward(self, x):\n{body}\n")


PLAIN = model("y = torch.empty_like(x)\nn = x.numel()\nwith cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n"
              "    relu(((n + 255) // 256,), (256,), (x.data_ptr(), y.data_ptr(), cp.int64(n)))\nself.calls += 1\n"
              "y[0] = y[0] * 1.0\nreturn y", init="self.calls = 0\n        self.register_buffer('scale', torch.ones(1))")


def test_plain_cupy_code_leaves_a_reusable_worker():
    assert reuse_problem(PLAIN) is None


@pytest.mark.parametrize("forward, init, extra, why", [
    ("return x", "pass", "import ctypes\n", "imports ctypes"),
    ("return x", "pass", "from torch.utils.cpp_extension import load_inline\n", "imports torch.utils"),
    ("torch.cuda.set_per_process_memory_fraction(0.01)\nreturn x", "pass", "", "calls set_per_process_memory_fraction"),
    ("cp.get_default_memory_pool().set_limit(size=1)\nreturn x", "pass", "", "calls set_limit"),
    ("torch.backends.cuda.matmul.allow_tf32 = True\nreturn x", "pass", "", "assigns to torch.backends"),
    ("flags = torch.backends.cuda.matmul\nreturn x", "pass", "", "reaches backends"),
    ("cp.RawKernel.__call__ = None\nreturn x", "pass", "", "assigns to cp.RawKernel.__call__"),
    ("torch.relu = torch.abs\nreturn x", "pass", "", "assigns to torch.relu"),
    ("getattr(torch, 'relu')\nreturn x", "pass", "", "uses getattr"),
    ("cp.cuda.runtime.deviceSynchronize()\nreturn x", "pass", "", "reaches runtime"),
    ("return torch.from_numpy(np.lib.stride_tricks.as_strided(x.cpu().numpy(), (10,), (8,)))", "pass", "",
     "reaches as_strided"),
    ("torch.nn.modules.module.register_module_forward_hook(print)\nreturn x", "pass", "",
     "calls register_module_forward_hook"),
    ("return x", "pass", "class Leftover:\n    def __del__(self):\n        pass\n\n\n", "defines __del__"),
    ("return x", "pass", "import sys\n", "imports sys"),
    ("return x", "pass", "import os\n", "imports os"),
    ("import importlib\nreturn x", "pass", "", "imports importlib"),
    ("global G\nG = 1\nreturn x", "pass", "", "a global or nonlocal statement"),
    ("cp.asarray(x).__cuda_array_interface__\nreturn x", "pass", "", "__cuda_array_interface__"),
])
def test_anything_that_can_reach_past_its_own_objects_gets_a_fresh_process_after_it(forward, init, extra, why):
    problem = reuse_problem(model(forward, init, extra))
    assert problem is not None and why in problem, problem


PLANTER = '''import torch
import torch.nn as nn
from pathlib import Path
from dice.verifier.inline_build.cache import BuildCache

root = Path({root!r})
cache = BuildCache(root, capability=None)
name = cache.name(cache.arguments("tiny", {source!r}, no_implicit_headers=True))
for folder in [root, *root.glob("candidates/*")]:
    (folder / f"{{name}}.failed").write_text("load_inline build failed: planted")
    (folder / f"{{name}}.so").write_bytes(b"not a library")


class ModelNew(nn.Module):
    def forward(self, x):
        return x.clamp_min(0)
'''


@pytest.mark.slow
def test_a_failure_marker_planted_under_a_siblings_program_does_not_reach_it(cpu_verifier):
    """Issue #67's class: one candidate writes a failure marker (and a library) under the cache key of
    the program its sibling will build, in the shared cache and in every candidate's folder there;
    the sibling builds in a folder of its own and is judged on its own build."""
    from test_verifier import RELU_TASK, TINY_EXTENSION, candidate, needs_compiler
    if needs_compiler.args[0]:
        pytest.skip(needs_compiler.kwargs["reason"])
    root = cpu_verifier.cache_dir / "torch_extensions"
    planter = PLANTER.format(root=str(root), source=TINY_EXTENSION)
    assert cpu_verifier.verify(RELU_TASK, planter, timing=False).correct
    assert (root / next(p.name for p in root.glob("*.failed"))).read_text().endswith("planted")
    extension = ("from torch.utils.cpp_extension import load_inline\n"
                 f"ext = load_inline('tiny', r\"\"\"{TINY_EXTENSION}\"\"\", no_implicit_headers=True)")
    sibling = cpu_verifier.verify(RELU_TASK, candidate("return x.clamp_min(0) * (ext.answer() / 42)", extra=extension),
                                  timing=False)
    assert sibling.correct, sibling.message


@pytest.mark.slow
def test_a_replaced_worker_rejoins_the_pool_once_started(tmp_path):
    """After a non-plain candidate its worker is replaced; the next candidate takes a worker that is
    ready meanwhile, and the replaced one returns to the pool once its new process has started."""
    from dice.verifier import Verifier
    with Verifier(workers=2, judges=1, device="cpu", cache_dir=tmp_path) as verifier:
        first, second = verifier._idle.get(), verifier._idle.get()
        for worker in (first, second):
            worker.wait_started()
        verifier._release(second, fresh=False)
        verifier._release(first, fresh=True)          # restarting: its process is new and not started
        assert verifier._idle.get(timeout=5) is second
        back = verifier._idle.get(timeout=120)
        assert back is first and first.ready


@pytest.mark.slow
def test_fresh_workers_are_forked_from_a_zygote_that_imported_their_modules(tmp_path):
    """A fresh process after every non-plain candidate is affordable: the zygote imports the
    worker's modules once and forks each new keeper, whose worker then imports nothing. A pool's
    first workers start from new interpreters, in parallel; without a zygote (it is gone) every
    fresh worker does."""
    import subprocess

    from dice.verifier.process import WORKER_ENV, WorkerProcess
    from dice.verifier.zygote import Keeper, Zygote
    config = {"device": "cpu", "cache_dir": str(tmp_path), "reference_cache_gb": 1, "build": None}
    zygote = Zygote(WORKER_ENV)
    try:
        worker = WorkerProcess("candidate", config, tmp_path / "worker.log", zygote)
        worker.wait_started()
        assert isinstance(worker._process, subprocess.Popen)
        for _ in range(2):      # fresh ones after restarts
            worker.restart()
            worker.wait_started()
            assert isinstance(worker._process, Keeper), worker._process
            assert worker.info["startup_s"]["imports"] < 0.5, worker.info
            assert worker.call({"op": "timing_done"}, timeout=30)["status"] == "ok"
        worker.close()
    finally:
        zygote.close()
    worker = WorkerProcess("candidate", config, tmp_path / "worker.log", zygote)
    worker.restart()
    worker.wait_started()
    assert isinstance(worker._process, subprocess.Popen)
    worker.close()


@pytest.mark.slow
def test_a_zygote_whose_imports_started_a_thread_says_so_and_workers_start_anew(tmp_path):
    """A fork copies only the calling thread, so a zygote with another thread forks nothing; it
    says why (on a GPU host every fresh worker then costs a new interpreter, ~9 s), and a restart
    still gets a worker, a new interpreter. The thread here comes from a sitecustomize on the path."""
    import os
    import subprocess

    from dice.verifier.process import WORKER_ENV, WorkerProcess
    from dice.verifier.zygote import Zygote
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    config = {"device": "cpu", "cache_dir": str(tmp_path), "reference_cache_gb": 1, "build": None}
    zygote = Zygote({**WORKER_ENV, "PYTHONPATH": path})
    starts = []
    try:
        worker = WorkerProcess("candidate", config, tmp_path / "worker.log", zygote, starts)
        worker.wait_started()
        worker.restart()
        worker.wait_started()
        assert isinstance(worker._process, subprocess.Popen)
        assert zygote.problem and "1 thread(s)" in zygote.problem, zygote.problem
        assert [forked for forked, _ in starts] == [False, False]
        worker.close()
    finally:
        zygote.close()


@pytest.mark.slow
def test_the_zygote_imports_with_no_gpu_visible_and_its_workers_see_the_trainers_devices(tmp_path, monkeypatch):
    """On a GPU host, torch.utils.cpp_extension's import starts a driver thread (NVML's device count),
    and a process with two threads is not forked: the zygote imports with CUDA_VISIBLE_DEVICES empty.
    Its workers see the trainer's value (here "7"; unset stays unset), read at their cuInit."""
    import os

    from dice.verifier import Verifier
    from test_verifier import RELU_TASK, candidate
    told = "import os\n" + candidate("raise RuntimeError('devices=' + repr(os.environ.get('CUDA_VISIBLE_DEVICES')) + "
                                      "' extra=' + repr(os.environ.get('DICE_WORKERS_CUDA_VISIBLE_DEVICES')))")
    for value, expected in (("7", "devices='7' extra=None"), (None, "devices=None extra=None")):
        if value is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        with Verifier(workers=1, judges=1, device="cpu", cache_dir=tmp_path) as verifier:
            zygote = verifier._zygote._process.pid
            messages = [verifier.verify(RELU_TASK, told, timing=False).message for _ in range(2)]
            verifier._idle.put(verifier._idle.get(timeout=120))
            summary = verifier.worker_starts()
            environ = Path(f"/proc/{zygote}/environ").read_bytes().split(b"\0")
        assert "CUDA_VISIBLE_DEVICES=" in [e.decode() for e in environ], environ
        assert summary.startswith("worker starts: 2 forked"), summary   # the second and third workers
        for message in messages:    # the first from a new interpreter, the second forked
            assert expected in message, message


@pytest.mark.slow
def test_the_pool_reports_its_workers_starts_forked_after_a_non_plain_candidate(tmp_path):
    """`Verifier.worker_starts`: the pool's first workers are new interpreters; the fresh worker
    after a candidate that is not plain Python is forked from the zygote, and no problem is named."""
    from dice.verifier import Verifier
    from test_verifier import GOOD, RELU_TASK
    native = "import os\n" + GOOD
    with Verifier(workers=1, judges=1, device="cpu", cache_dir=tmp_path) as verifier:
        assert verifier.verify(RELU_TASK, native, timing=False).correct
        verifier._idle.put(verifier._idle.get(timeout=120))     # the replaced worker has started
        since = len(verifier.stats.starts)
        assert verifier.verify(RELU_TASK, native, timing=False).correct
        verifier._idle.put(verifier._idle.get(timeout=120))
        summary = verifier.worker_starts()
    assert summary.startswith("worker starts: 2 forked (median") and "1 new interpreters" in summary, summary
    assert "zygote" not in summary, summary
    assert verifier.worker_starts(since=since).startswith("worker starts: 1 forked"), verifier.worker_starts(since)


@pytest.mark.slow
def test_a_memory_cap_left_by_one_candidate_does_not_meet_the_next(tmp_path):
    """Process state (here an address-space cap a candidate sets on its worker) stays with that
    candidate: its source is not plain, so the next candidate gets a fresh process."""
    from dice.verifier import Verifier
    from test_verifier import GOOD, RELU_TASK
    capper = GOOD.replace("import torch\n", "import resource\nimport torch\n", 1).replace(
        "        return x.clamp_min(0)\n", "        resource.setrlimit(resource.RLIMIT_AS, (1 << 20, resource.RLIM_INFINITY))\n"
        "        return x.clamp_min(0)\n")
    with Verifier(workers=1, judges=1, device="cpu", cache_dir=tmp_path) as verifier:
        verifier.verify(RELU_TASK, capper, timing=False)
        assert verifier.verify(RELU_TASK, GOOD, timing=False).correct


def test_a_toolchain_artifact_is_used_only_as_its_trusted_build_made_it(tmp_path, monkeypatch):
    """`toolchain.TRUSTED` set (a prebuild or a worker): an artifact folder is used when its files have
    the digests the warm-up reported, and refused once any of them changed, or with no digests."""
    from dice.verifier.inline_build import toolchain
    folder = tmp_path / "pch" / "key"
    folder.mkdir(parents=True)
    (folder / "prefix.h").write_text("#include <torch/extension.h>\n")
    (folder / "ok").touch()
    digests = toolchain.artifact_digests(tmp_path)
    assert set(digests) == {"pch/key/prefix.h", "pch/key/ok"}
    monkeypatch.setattr(toolchain, "TRUSTED", digests)
    make = lambda f: pytest.fail("a process that runs candidate code built a toolchain artifact")  # noqa: E731
    assert toolchain._locked_artifact(tmp_path / "pch", "key", make) == folder
    (folder / "prefix.h").write_text("#define at planted\n")
    assert toolchain._locked_artifact(tmp_path / "pch", "key", make) is None
    monkeypatch.setattr(toolchain, "TRUSTED", {})
    assert toolchain._locked_artifact(tmp_path / "pch", "key", make) is None


@pytest.mark.slow
def test_a_load_with_the_toolchains_digests_is_not_taken_for_tampering(tmp_path):
    """The worker sets `toolchain.TRUSTED` from each load request (the digests a GPU pool's warm-up
    reported); that is the harness's own doing, not a candidate's change to the harness."""
    from dice.verifier.process import WorkerProcess
    from test_verifier import GOOD, RELU_TASK
    import hashlib
    worker = WorkerProcess("candidate", {"device": "cpu", "cache_dir": str(tmp_path), "reference_cache_gb": 1,
                                         "build": None}, tmp_path / "worker.log")
    task = {"task_src": RELU_TASK, "task_key": hashlib.sha256(RELU_TASK.encode()).hexdigest(), "precision": "strict"}
    reply = worker.call({"op": "load", **task, "candidate_src": GOOD, "init_seed": 1, "programs": None,
                         "toolchain": {"pch/key/ok": "0" * 64}}, timeout=120)
    assert reply["status"] == "ok", reply
    worker.close()


@pytest.mark.slow
def test_a_worker_forked_from_a_broken_zygote_is_started_anew(tmp_path):
    """Where a worker forked from the zygote cannot start (CUDA after a fork, say), the pool stops
    forking and starts that worker, and every later one, from a new interpreter."""
    import os
    import subprocess

    from dice.verifier.process import WorkerProcess
    from dice.verifier.zygote import Keeper

    class DeadZygote:
        broken, ended = False, {}

        def spawn(self, fd, role, config, log):
            os.close(fd)                        # the worker's end: the trainer reads EOF at once
            self.ended[2**22 + 1] = 0
            return None if self.broken else Keeper(2**22 + 1, self)

        def forked(self, process):
            return isinstance(process, Keeper)

    zygote = DeadZygote()
    worker = WorkerProcess("candidate", {"device": "cpu", "cache_dir": str(tmp_path), "reference_cache_gb": 1,
                                         "build": None}, tmp_path / "worker.log", zygote)
    worker.restart()
    worker.wait_started()
    assert zygote.broken and isinstance(worker._process, subprocess.Popen) and worker.ready
    worker.close()
