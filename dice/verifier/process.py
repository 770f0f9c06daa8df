"""Worker processes for the kernel verifier: spawn, call with a deadline, kill, respawn (DESIGN.md §8).

A `WorkerProcess` is one fresh interpreter (multiprocessing "spawn": never a fork of a process
that may hold a CUDA context) running `dice.verifier.worker.serve`. The parent talks to it over a
pipe, one request dict -> one reply dict at a time; replies are decoded with `plain_loads`
(built-in types only), so a tampered worker cannot run code in the parent. When a request overruns
its deadline the worker's process group is killed (SIGKILL: the worker and whatever it started);
when the process dies (segfault, os._exit, CUDA abort) the pipe reports EOF. Either way the
caller gets `WorkerTimeout` / `WorkerDied` and the handle has already started a replacement, so a
bad candidate costs one process, never the pool.

Worker stdout/stderr (including C-level output: nvcc logs, CUDA asserts, faulthandler tracebacks)
go to a per-worker log file; `WorkerDied` carries the tail written during the failed request.

`GpuLock` is the pool-wide readers-writer lock: correctness checks hold it shared, timing holds it
exclusive, so no other work of this pool runs on the GPU while a kernel is being timed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from .protocol import plain_loads
from .worker import serve

STARTUP_TIMEOUT_S = 300.0  # importing torch + cupy and creating a CUDA context on a busy host
LOG_TAIL_LINES = 40
LOG_TAIL_BYTES = 64 * 2**10    # of a dead worker's log, read back into the parent
REPLY_MAX_BYTES = 2**30        # a longer reply is treated as the worker's death


class WorkerTimeout(Exception):
    """The worker did not answer before the deadline; it was killed and replaced."""


class WorkerDied(Exception):
    """The worker process exited while handling a request; it was replaced."""

    def __init__(self, exitcode: int | None, log_tail: str):
        self.exitcode = exitcode
        self.log_tail = log_tail
        super().__init__(f"worker {describe_exit(exitcode)}" + (f"; last output:\n{log_tail}" if log_tail else ""))


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "died (exit status unknown)"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class WorkerProcess:
    """One worker process in a given role ("candidate" or "judge"), restarted on failure."""

    def __init__(self, role: str, config: dict, log_path: Path):
        self.role = role
        self.config = config
        self.log_path = Path(log_path)
        self.info: dict = {}  # what the worker reported when it became ready (e.g. GPU name)
        self.jobs = 0         # candidates handled since the last (re)start; the Verifier counts them
        self.busy_s = 0.0     # seconds spent answering requests (start-up excluded), over all restarts
        self._lock = threading.Lock()
        self._process = None
        self._conn = None
        self._ready = False
        self._start()

    def _start(self) -> None:
        try:   # a dead worker may have left a FIFO or a link in its log's place: the next would block on it
            if not stat.S_ISREG(os.lstat(self.log_path).st_mode):
                os.unlink(self.log_path)
        except FileNotFoundError:
            pass
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=serve, args=(child_conn, self.role, self.config, str(self.log_path)),
                                    name=f"dice-verifier-{self.role}", daemon=True)
        self._process.start()
        child_conn.close()  # so that the worker's death reads as EOF here
        self._ready = False
        self.jobs = 0

    def _kill(self) -> None:
        if self._process is not None and self._process.pid is not None:
            try:  # the worker leads its own process group (worker.serve)
                os.killpg(self._process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._process is not None and self._process.is_alive():
            self._process.kill()
        if self._process is not None:
            self._process.join(timeout=30)
        if self._conn is not None:
            self._conn.close()

    @property
    def ready(self) -> bool:
        """Whether the current process has started up and served (no start-up wait on next call)."""
        return self._ready

    def restart(self) -> None:
        with self._lock:
            self._kill()
            self._start()

    def close(self) -> None:
        with self._lock:
            if self._process is not None and self._process.is_alive() and self._ready:
                try:
                    self._conn.send(None)  # polite shutdown lets CUDA tear down cleanly
                    self._process.join(timeout=5)
                except (OSError, BrokenPipeError):
                    pass
            self._kill()
            self._process = None

    def call(self, request: dict, timeout: float) -> dict:
        """Send one request and wait at most `timeout` seconds (not counting worker start-up).
        A reply marked `recycle` (the worker's CUDA context or torch is no longer trustworthy)
        replaces the process before the reply is returned."""
        with self._lock:
            if not self._ready:
                try:
                    self.info = self._receive(STARTUP_TIMEOUT_S, log_start=0)
                except (WorkerTimeout, WorkerDied) as exc:
                    raise RuntimeError(f"the verifier's {self.role} worker failed to start ({exc}); "
                                       f"its full log is {self.log_path}") from None
                self._ready = True
            log_start, start = self._log_size(), time.monotonic()
            try:
                try:
                    self._conn.send(request)
                except (OSError, BrokenPipeError):
                    raise self._died(log_start) from None
                reply = self._receive(timeout, log_start)
            finally:
                self.busy_s += time.monotonic() - start
            if reply.get("recycle"):   # replaced under the lock: no other caller reaches the old process
                self._kill()
                self._start()
            return reply

    def _receive(self, timeout: float, log_start: int) -> dict:
        if not self._conn.poll(max(timeout, 0.0)):
            self._kill()
            self._start()
            raise WorkerTimeout(f"no answer within {timeout:.0f} s")
        try:
            data = self._conn.recv_bytes(REPLY_MAX_BYTES)
        except (EOFError, OSError):
            raise self._died(log_start) from None
        try:
            reply = plain_loads(data)
        except Exception as exc:
            reply = exc
        if not isinstance(reply, dict):
            self._kill()
            self._start()
            return {"status": "invalid", "message": f"the {self.role} worker sent a reply that is not plain data "
                    f"({str(reply)[:200]}); the candidate tampered with the verifier"}
        return reply

    def _died(self, log_start: int) -> WorkerDied:
        self._process.join(timeout=30)
        error = WorkerDied(self._process.exitcode, self._log_tail(log_start))
        self._kill()
        self._start()
        return error

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def _log_tail(self, start: int) -> str:
        # the worker can replace its log (with a FIFO, a link): open without blocking or following
        try:
            fd = os.open(self.log_path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            return ""
        with open(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return f"(its log {self.log_path} is no longer a regular file)"
            f.seek(max(start, info.st_size - LOG_TAIL_BYTES))
            text = f.read(LOG_TAIL_BYTES).decode(errors="replace")
        return "\n".join(text.strip().splitlines()[-LOG_TAIL_LINES:])


class GpuLock:
    """Readers-writer lock, writer-preferring: `shared()` for checks, `exclusive()` for timing.

    Writer preference keeps a steady stream of correctness checks from starving timing."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self):
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
