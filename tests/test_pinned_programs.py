"""A candidate's own programs folder is used only as its builds made it (`dice.verifier.inline_build.pinned`,
DESIGN.md §8.4): what another candidate's process leaves there (a library, a failure marker, a held lock,
a unit object) is never used, and the worker loads the pinned bytes from a sealed copy."""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from dice.verifier.inline_build import cache as build_module
from dice.verifier.inline_build.cache import BuildCache, BuildError
from dice.verifier.inline_build.pinned import load_sealed, sealed_copy, valid_pins

from test_inline_build import CPP, HAVE_NVCC, MANY, _FakeTorchBuild

CALL = dict(name="x", cpp_sources=CPP, cuda_sources=MANY, functions=["run"])
# a program no other test imports: a process imports an extension module of one name once
PLUS = "int plus(int a, int b) { return b + a; }"


def _cache(folder: Path, pins, **kwargs) -> BuildCache:
    cache = BuildCache(folder.parent / "root", capability=(9, 0), build="torch", programs=folder, pins=pins, **kwargs)
    cache.real_load_inline = _FakeTorchBuild()
    return cache


def _within(seconds: float, fn):
    """fn() in a thread, failing the test if it has not returned after `seconds` (a lock would hang it)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still waiting after {seconds} s"
    return out[0]


def test_a_candidates_builds_use_nothing_planted_in_its_folder_and_record_what_they_made(tmp_path, monkeypatch):
    """The prebuild's caches (`pins={}`: its child's `load_inline`, the trusted builder's `build_only`)
    build although a library, a failure marker and a held lock of the program's name are in the
    folder, and record the digest of the library they placed."""
    def fast(arguments, name, build_dir, *rest, units, **kwargs):
        assert units == build_dir   # no unit object found in the folder is linked
        (build_dir / "out.so").write_bytes(b"fast")
        return build_dir / "out.so", {"dispatcher": None}
    monkeypatch.setattr(build_module, "fast_build", fast)
    folder = tmp_path / "candidate"
    for way in ("load_inline", "build_only"):
        cache = _cache(folder, {})
        name = cache.name(cache.arguments(**CALL))
        (folder / f"{name}.so").write_bytes(b"planted")
        (folder / f"{name}.failed").write_text("cuda.cu(1): error: planted")
        (folder / "locks").mkdir(exist_ok=True)
        with open(folder / "locks" / f"{name}.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            if way == "load_inline":
                assert _within(20, lambda: cache.load_inline(**CALL)) == "module"
            else:
                cache.build = "fast"
                assert _within(20, lambda: cache.build_only(cache.arguments(**CALL))) == "built"
        made = b"" if way == "load_inline" else b"fast"
        assert cache.made == {name: {"sha256": hashlib.sha256(made).hexdigest(), "dispatcher": None}}, way
        assert (folder / f"{name}.so").read_bytes() == made, way   # the build's library replaced the planted one
    assert cache.real_load_inline.calls == 0


def test_the_worker_loads_the_pinned_bytes_from_a_sealed_copy_and_builds_what_was_changed(tmp_path, monkeypatch):
    folder = tmp_path / "candidate"
    folder.mkdir()
    name = _cache(folder, {}).name(_cache(folder, {}).arguments(**CALL))
    library = folder / f"{name}.so"
    library.write_bytes(b"the prebuild's library")
    pins = {name: {"sha256": hashlib.sha256(b"the prebuild's library").hexdigest(), "dispatcher": None}}
    loads = []

    def load(n, path, is_python_module):
        data = Path(path).read_bytes()
        with open(path, "r+b", buffering=0) as f:   # a sealed copy: even its own process cannot change it
            with pytest.raises(PermissionError):
                f.write(b"x")
        loads.append((n, str(path), data))
        return "loaded"
    monkeypatch.setattr(build_module, "_load_library", load)
    seen = []
    worker = _cache(folder, valid_pins(pins), on_library=seen.append)
    assert worker.load_inline(**CALL) == "loaded" and worker.real_load_inline.calls == 0
    assert loads == [(name, loads[0][1], b"the prebuild's library")] and loads[0][1].startswith("/proc/self/fd/")
    assert seen == [b"the prebuild's library"]

    library.write_bytes(b"another candidate's library")   # changed after the pin: built again, not loaded
    worker = _cache(folder, valid_pins(pins))
    assert worker.load_inline(**CALL) == "module" and worker.real_load_inline.calls == 1 and len(loads) == 1
    library.unlink()
    worker = _cache(folder, valid_pins(pins))
    assert worker.load_inline(**CALL) == "module" and worker.real_load_inline.calls == 1


def test_a_compile_error_counts_only_where_pinned(tmp_path):
    folder = tmp_path / "candidate"
    folder.mkdir()
    name = _cache(folder, {}).name(_cache(folder, {}).arguments(**CALL))
    (folder / f"{name}.failed").write_text("cuda.cu(1): error: planted")
    assert _cache(folder, {}).load_inline(**CALL) == "module"    # no pin: the marker is not read
    (folder / f"{name}.so").write_bytes(b"")
    worker = _cache(folder, valid_pins({name: {"failed": "cuda.cu(14): error: expected a ';'"}}))
    with pytest.raises(BuildError, match="expected a ';'"):
        worker.load_inline(**CALL)
    assert worker.real_load_inline.calls == 0


def test_only_well_formed_pins_are_kept():
    good = {"dice_ext_1": {"sha256": "ab", "dispatcher": None}, "dice_ext_2": {"failed": "m"},
            "dice_ext_3": {"sha256": "cd", "dispatcher": "/d.so"}}
    bad = {"dice_ext_4": {"sha256": 1}, "other": {"failed": "m"}, "dice_ext_5": "x", 7: {}, "dice_ext_6": {},
           "dice_ext_7": {"sha256": "ef", "dispatcher": 3}}
    assert valid_pins({**good, **bad}) == good
    assert valid_pins(None) == valid_pins([1]) == {}


def test_a_sealed_copy_holds_the_bytes_and_refuses_every_change():
    fd = sealed_copy(b"\x7fELF bytes", "dice_ext_x")
    try:
        assert os.pread(fd, 64, 0) == b"\x7fELF bytes"
        for change in (lambda: os.pwrite(fd, b"y", 0), lambda: os.ftruncate(fd, 1), lambda: os.ftruncate(fd, 99)):
            with pytest.raises(PermissionError):
                change()
    finally:
        os.close(fd)


def test_two_libraries_loaded_from_sealed_copies_stay_two(tmp_path):
    """A candidate with two load_inline programs loads both from sealed copies: the dynamic loader
    returns a library it loaded before under the same path, so no copy's path may come back."""
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler")
    libraries = []
    for k in (1, 2):
        (tmp_path / f"w{k}.cpp").write_text(f'extern "C" int which() {{ return {k}; }}\n')
        subprocess.run(["c++", "-shared", "-fPIC", str(tmp_path / f"w{k}.cpp"), "-o", str(tmp_path / f"w{k}.so")],
                       check=True)
        libraries.append(load_sealed(f"w{k}", (tmp_path / f"w{k}.so").read_bytes(), lambda p: ctypes.CDLL(str(p))))
    assert [lib.which() for lib in libraries] == [1, 2]


@pytest.mark.slow
def test_a_prebuild_pins_what_it_built_and_a_worker_imports_it_from_the_sealed_copy(tmp_path):
    """End to end with a real build: BuildPool builds a candidate's C++ extension in its own folder
    (here torch's build in the candidate's child: the fast build takes CUDA sources), reports the
    library's digest, and a pinned cache imports that library from its sealed copy and runs it."""
    if not HAVE_NVCC:
        pytest.skip("needs nvcc and g++")
    from dice.verifier.inline_build.pool import BuildPool
    folder = tmp_path / "cache" / "torch_extensions" / "candidates" / "c0"
    with BuildPool(tmp_path / "cache", processes=1, timeout_s=600, capability=(9, 0)) as pool:
        report = pool.submit(f"from torch.utils.cpp_extension import load_inline\n"
                             f"ext = load_inline('plus', {PLUS!r}, functions=['plus'])", folder).result()
    assert report["status"] == "built", report
    [(name, pin)] = valid_pins(report["pins"]).items()
    assert pin == {"sha256": hashlib.sha256((folder / f"{name}.so").read_bytes()).hexdigest(), "dispatcher": None}
    seen = []
    worker = BuildCache(tmp_path / "cache" / "torch_extensions", capability=(9, 0), programs=folder,
                        pins={name: pin}, on_library=seen.append)
    worker.real_load_inline = _FakeTorchBuild()
    ext = worker.load_inline("plus", PLUS, functions=["plus"])
    assert ext.plus(2, 3) == 5 and worker.real_load_inline.calls == 0 and ext.__file__.startswith("/proc/self/fd/")
    assert seen == [(folder / f"{name}.so").read_bytes()]

    # another candidate's process takes the library away, plants a failure marker, holds the lock:
    # the worker builds the program itself, at once
    (folder / f"{name}.so").rename(folder / "gone.so")
    (folder / f"{name}.failed").write_text("cuda.cu(1): error: planted")
    (folder / "locks").mkdir(exist_ok=True)
    with open(folder / "locks" / f"{name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = BuildCache(tmp_path / "cache" / "torch_extensions", capability=(9, 0), programs=folder,
                            pins={name: pin}, on_library=seen.append)
        ext = _within(300, lambda: worker.load_inline("plus", PLUS, functions=["plus"]))
    assert ext.plus(2, 3) == 5 and worker.history[-1]["how"] == "torch"
    assert len(seen) == 2 and seen[1].startswith(b"\x7fELF")   # its kernel names from the bytes it built


@pytest.mark.slow
def test_the_verifier_hands_the_prebuilds_pins_to_the_worker_and_none_without_a_report(tmp_path, monkeypatch):
    """`Verifier._verify_one`: what the prebuild's report pins goes with the candidate to its worker;
    a prebuild with no report in time (or none at all) leaves `{}`, so the worker trusts nothing in
    the candidate's folder and builds itself."""
    from concurrent.futures import Future
    from dice.verifier import Verifier, VerifyResult
    from test_verifier import RELU_TASK, candidate

    pins = {"dice_ext_1": {"sha256": "ab", "dispatcher": None}}

    class Prebuild:
        timeout_s = 0.1

        def __init__(self, report):
            self.report = report

        def submit(self, source, programs):
            done = Future()
            if self.report is not None:
                done.set_result(self.report)
            return done

        def toolchain(self, wait=True):
            return None

        def close(self):
            pass

    handed = []
    with Verifier(workers=1, judges=1, device="cpu", cache_dir=tmp_path) as verifier:
        monkeypatch.setattr(verifier, "_run_candidate", lambda worker, plan, src, opts, programs, got:
                            handed.append((programs, got)) or VerifyResult("correct", compiled=True))
        monkeypatch.setattr("dice.verifier.verifier.PREBUILD_SLACK_S", 0.1)
        source = candidate("return x.clamp_min(0)", extra="# load_inline is named, so it builds in its own folder")
        for report in ({"status": "built", "pins": pins}, {"status": "error"}, None):
            verifier._prebuild = Prebuild(report)
            assert verifier.verify(RELU_TASK, source, timing=False).correct
    assert [got for _, got in handed] == [pins, {}, {}]
    assert all(programs is not None and programs.parent.name == "candidates" for programs, _ in handed)
