"""The zygote: fresh worker processes forked from one that has imported the worker's modules already
(DESIGN.md §8.4).

    python -m dice.verifier.zygote PARENT_PID        (its control socket on fd 0)

A candidate that could leave something in its process is followed by a fresh worker
(`isolation`); started from scratch, each costs an interpreter, torch's and CuPy's imports and a
CUDA context. The zygote pays the imports once: it imports the worker's modules (touching no GPU:
a CUDA context does not survive a fork, so torch's availability check goes through NVML) and then
forks each new keeper (`keeper.keep`), whose worker only makes its own CUDA context. It runs one
thread (a fork copies the calling thread alone, so a lock another thread held would stay held), and
so imports with no GPU visible: torch.utils.cpp_extension's import asks for the device count, and
even NVML's answer starts a driver thread on a GPU host. Each forked keeper gets the trainer's
CUDA_VISIBLE_DEVICES back before its worker touches CUDA, which reads it at cuInit.

Protocol on the control socket: a request is one JSON line {"role", "config", "log"} sent with the
worker's end of its socket pair as an SCM_RIGHTS descriptor; the reply is {"pid": the keeper's
pid}; whenever a keeper ends, {"ended": pid, "status": its wait status}. When the trainer ends, so
does the zygote, and its keepers (whose parent it is) then end their trees (`keeper.keep`).
`Zygote` is the trainer's side; `Keeper` stands for a keeper started there, as `subprocess.Popen`
does for one started directly.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .keeper import POLL_S, keep, reap

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
# torch.cuda.is_available() without cuInit; CPU thread pools of one thread (OpenBLAS starts its pool at
# numpy's import: the zygote would no longer fork from a single thread; workers use one anyway)
ZYGOTE_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
WORKERS_DEVICES = "DICE_WORKERS_CUDA_VISIBLE_DEVICES"   # the trainer's CUDA_VISIBLE_DEVICES (JSON: null if unset)
SPAWN_TIMEOUT_S = 60.0


class Keeper:
    """A keeper the zygote forked: the part of `subprocess.Popen` that `process.WorkerProcess` uses."""

    def __init__(self, pid: int, zygote: "Zygote"):
        self.pid, self._zygote, self.returncode = pid, zygote, None

    def poll(self) -> int | None:
        status = self._zygote.ended.get(self.pid)
        if status is not None and self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("keeper", timeout)
            time.sleep(0.01)
        return self.returncode


class Zygote:
    """The trainer's side of a zygote process; `spawn` forks a keeper from it, None if it cannot."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        environ = {**os.environ, **env}
        devices = environ.get("CUDA_VISIBLE_DEVICES")     # before ZYGOTE_ENV hides the GPU from the zygote
        environ.update(ZYGOTE_ENV, **{WORKERS_DEVICES: json.dumps(devices)})
        self._process = subprocess.Popen([sys.executable, "-m", "dice.verifier.zygote", str(os.getpid())],
                                         stdin=theirs, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         cwd=PROJECT_ROOT, env=environ)
        theirs.close()
        self._socket, self._lock, self._replies = ours, threading.Lock(), []
        self._reply = threading.Condition()
        self.ended: dict[int, int] = {}
        self.broken = False     # set by a worker forked from it that failed to start
        self.problem: str | None = None   # why fresh workers are new interpreters (~9 s each on a GPU host)
        threading.Thread(target=self._read, daemon=True, name="dice-zygote-reader").start()

    def forked(self, process) -> bool:
        return isinstance(process, Keeper) and process._zygote is self

    def spawn(self, fd: int, role: str, config: str, log: str) -> Keeper | None:
        """A keeper forked by the zygote serving `fd` (closed here either way), or None when the
        zygote is not there (it failed to start, or found itself running more than one thread) or a
        worker forked from it failed to start."""
        if self.broken:
            os.close(fd)
            return None
        with self._lock:
            try:
                socket.send_fds(self._socket, [json.dumps({"role": role, "config": config, "log": log}).encode()
                                               + b"\n"], [fd])
            except OSError:
                return None
            finally:
                os.close(fd)
            with self._reply:
                if not self._reply.wait_for(lambda: self._replies, timeout=SPAWN_TIMEOUT_S):
                    return None
                pid = self._replies.pop(0)
        return Keeper(pid, self) if pid else None

    def _read(self) -> None:
        buffered = b""
        while True:
            try:
                chunk = self._socket.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:       # the zygote is gone: spawns fail from now on
                with self._reply:
                    self._replies.append(0)
                    self._reply.notify_all()
                return
            *lines, buffered = (buffered + chunk).split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "problem" in message:
                    self.problem = f"the zygote forks no workers: {message['problem']}"
                elif "ended" in message:
                    self.ended[message["ended"]] = message["status"]
                else:
                    with self._reply:
                        self._replies.append(message["pid"])
                        self._reply.notify_all()

    def close(self) -> None:
        self._socket.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()


def serve(parent: int) -> None:
    """The zygote's loop (module docstring)."""
    control = socket.socket(fileno=0)
    try:
        import dice.verifier.worker  # noqa: F401  what every worker imports, once
    except Exception as exc:
        return _refuse(control, f"importing the worker's modules failed ({type(exc).__name__}: {exc})")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:     # a fork would copy a thread's locks, not the thread
        return _refuse(control, f"its imports started {len(threads) - 1} thread(s) ({_thread_names(threads)}); "
                       "a fork copies only the calling thread")
    keepers, buffered = set(), b""
    while os.getppid() == parent:     # then out at once (`os._exit`: no teardown): the keepers end their trees
        ready, _, _ = select.select([control], [], [], POLL_S)
        for pid, status in reap():
            if pid in keepers:
                keepers.discard(pid)
                control.sendall(json.dumps({"ended": pid, "status": status}).encode() + b"\n")
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(control, 65536, 1)
        if not data:
            break
        *lines, buffered = (buffered + data).split(b"\n")
        for line, fd in zip(lines, fds):
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                control.close()
                _show_the_workers_devices()
                keep(fd, request["role"], request["config"], request["log"], os.getppid())
            os.close(fd)
            keepers.add(pid)
            control.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _show_the_workers_devices() -> None:
    """In a forked keeper: the trainer's CUDA_VISIBLE_DEVICES, for its worker's cuInit (module docstring)."""
    devices = json.loads(os.environ.pop(WORKERS_DEVICES, "null"))
    if devices is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices


def _refuse(control: socket.socket, problem: str) -> None:
    """Tell the trainer why this zygote forks nothing (`Zygote.problem`), then end."""
    with contextlib.suppress(OSError):
        control.sendall(json.dumps({"problem": problem}).encode() + b"\n")


def _thread_names(tids: list[str]) -> str:
    names = []
    for tid in tids:
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    return ", ".join(names)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
    os._exit(0)
