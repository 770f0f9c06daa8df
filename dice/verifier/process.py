"""Worker processes for the kernel verifier: start, call with a deadline, kill, restart (DESIGN.md §8).

A `WorkerProcess` is a fresh interpreter started with `subprocess` (never a fork of a process that
may hold a CUDA context, and never a re-import of the caller's script, so `verify()` needs no
`if __name__ == "__main__":` guard): the keeper (`keeper.py`: child subreaper, watches the trainer)
and below it the worker running `dice.verifier.worker.serve`. The parent talks to the worker over a
socket pair, one request dict -> one reply dict at a time; replies are decoded with `plain_loads`
(built-in types only), so a tampered worker cannot run code in the parent. When a request overruns
its deadline the keeper's whole subtree is killed (`keeper.kill_tree`: the worker, whatever it
started, detached daemons included); when the worker dies (segfault, os._exit, CUDA abort) the
pipe reports EOF. Either way the caller gets `WorkerTimeout` / `WorkerDied` and the handle has
already started a replacement, so a bad candidate costs one process, never the pool. If the
trainer itself dies, every keeper notices within ~0.1 s and ends its subtree.

Worker stdout/stderr (including C-level output: nvcc logs, CUDA asserts, faulthandler tracebacks)
go to a per-worker log file; `WorkerDied` carries the tail written during the failed request.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from .keeper import descendants, kill_tree
from .wire import plain_loads

KEEPER = Path(__file__).with_name("keeper.py")
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])

STARTUP_TIMEOUT_S = 300.0  # importing torch + cupy and creating a CUDA context on a busy host
LOG_TAIL_LINES = 40
LOG_TAIL_BYTES = 64 * 2**10    # of a dead worker's log, read back into the parent
STACK_DUMP_S = 0.5             # for a worker that does not answer to write its stacks (`_stack_dump`)
REPLY_MAX_BYTES = 2**30        # a longer reply is treated as the worker's death
# CuPy keeps compiled kernels in the process, not in ~/.cupy/kernel_cache, which every worker
# shares: a file one candidate planted under another's kernel would be loaded for it (DESIGN.md §8.4)
WORKER_ENV = {"CUPY_CACHE_IN_MEMORY": "1"}


class WorkerTimeout(Exception):
    """The worker did not answer before the deadline; it was killed and replaced. `where`: the
    innermost frames of its main thread just before (`stuck_frames`), or ""."""

    def __init__(self, message: str, where: str = ""):
        self.where = where
        super().__init__(message)


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

    def __init__(self, role: str, config: dict, log_path: Path, zygote=None, starts: list | None = None):
        self.role, self.zygote = role, zygote   # `zygote.Zygote`: fresh processes forked after the imports
        self.config = config
        self.log_path = Path(log_path)
        self.info: dict = {}  # what the worker reported when it became ready (e.g. GPU name)
        self.jobs = 0         # candidates handled since the last (re)start; the Verifier counts them
        self.busy_s = 0.0     # seconds spent answering requests (start-up excluded), over all restarts
        self.busy_by_op: collections.Counter = collections.Counter()   # the same per request op
        self.round_trip_s = 0.0   # the last call's seconds from sending the request to the reply's last byte
        # (forked from the zygote, seconds until ready) per start; a list the pool's workers may share
        self.starts: list[tuple[bool, float]] = [] if starts is None else starts
        self._lock = threading.Lock()
        self._process = None
        self._conn = None
        self._ready = False
        self._start(first=True)   # a new interpreter: the pool starts in parallel, not behind the zygote

    def _start(self, first: bool = False) -> None:
        try:   # a dead worker may have left a FIFO or a link in its log's place: the next would block on it
            if not stat.S_ISREG(os.lstat(self.log_path).st_mode):
                os.unlink(self.log_path)
        except FileNotFoundError:
            pass
        self._start_time = time.perf_counter()
        ours, theirs = socket.socketpair()
        forked = not first and self.zygote and self.zygote.spawn(os.dup(theirs.fileno()), self.role,
                                                                 json.dumps(self.config), str(self.log_path))
        self._process = forked or subprocess.Popen(
            [sys.executable, str(KEEPER), str(theirs.fileno()), self.role, json.dumps(self.config),
             str(self.log_path), str(os.getpid()), PROJECT_ROOT],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env={**os.environ, **WORKER_ENV})
        theirs.close()   # so that the worker's death reads as EOF here
        self._conn = Connection(ours.detach())
        self._ready = False
        self.jobs = 0

    def _kill(self) -> None:
        if self._process is not None:
            kill_tree(self._process.pid)   # the keeper's subtree, then the keeper
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self._conn is not None:
            self._conn.close()

    @property
    def ready(self) -> bool:
        """Whether the current process has started up and served (no start-up wait on next call)."""
        return self._ready

    def pause(self) -> None:
        """Stop the worker process (SIGSTOP: every thread of it) until `resume`: while its baseline
        is timed, nothing a candidate left behind in it (a native thread) can launch GPU work.
        Returns once the kernel reports it stopped (at most ~0.1 s)."""
        pid = self.info.get("pid") if self._ready else None
        if not pid:
            return
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 0.1
        while time.monotonic() < deadline and _state(pid) not in ("T", "t", None):
            time.sleep(0.0005)

    def pause_tree(self) -> list[int]:
        """Stop the keeper, the worker and everything below them (a candidate's helpers, detached
        daemons too: they stay below the keeper, a subreaper), ready or still starting; the pids
        stopped, for `resume_tree`."""
        if self._process is None or self._process.poll() is not None:
            return []
        stopped = []
        for pid in [self._process.pid, *descendants(self._process.pid)]:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        return stopped

    @staticmethod
    def resume_tree(pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def resume(self) -> None:
        pid = self.info.get("pid") if self._ready else None
        if pid:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def descendants(self) -> list[int]:
        """The live processes below the worker: what a candidate started, detached daemons too (the
        worker is their subreaper), read from /proc here, where no candidate code runs."""
        pid = self.info.get("pid") if self._ready else None
        children = collections.defaultdict(list)
        for entry in (e for e in os.listdir("/proc") if e.isdigit()) if pid else ():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state, parent = f.read().rsplit(b")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if state != b"Z":
                children[int(parent)].append(int(entry))
        found, todo = [], [pid] if pid else []
        while todo:
            below = children.get(todo.pop(), [])
            found += below
            todo += below
        return found

    def restart(self) -> None:
        with self._lock:
            self._kill()
            self._start()

    def close(self) -> None:
        with self._lock:
            if self._process is not None and self._process.poll() is None and self._ready:
                try:
                    self._conn.send(None)  # polite shutdown lets CUDA tear down cleanly
                    self._process.wait(timeout=5)
                except (OSError, BrokenPipeError, subprocess.TimeoutExpired):
                    pass
            self._kill()
            self._process = None

    def call(self, request: dict, timeout: float) -> dict:
        """Send one request and wait at most `timeout` seconds (not counting worker start-up).
        A reply marked `recycle` (the worker's CUDA context or torch is no longer trustworthy)
        replaces the process before the reply is returned."""
        with self._lock:
            self._await_start()
            log_start, start = self._log_size(), time.monotonic()
            try:
                sent = time.perf_counter()
                try:
                    self._conn.send(request)
                except (OSError, BrokenPipeError):
                    raise self._died(log_start) from None
                reply = self._receive(timeout, log_start, sent)
            finally:
                took = time.monotonic() - start
                self.busy_s += took
                self.busy_by_op[request["op"]] += took
            if reply.get("recycle"):   # replaced under the lock: no other caller reaches the old process
                self._kill()
                self._start()
            return reply

    def wait_started(self) -> None:
        """Return once the current process has started up (import, CUDA context, probes); raise
        RuntimeError as `call` would if it failed to."""
        with self._lock:
            self._await_start()

    def _await_start(self) -> None:
        if self._ready:
            return
        try:
            self.info = self._receive(STARTUP_TIMEOUT_S, log_start=0)
        except (WorkerTimeout, WorkerDied) as exc:
            if not (self.zygote and self.zygote.forked(self._process)):
                raise RuntimeError(f"the verifier's {self.role} worker failed to start ({exc}); "
                                   f"its full log is {self.log_path}") from None
            self.zygote.broken = True      # a worker forked from it cannot start here: new interpreters from now on
            self.zygote.problem = f"a worker forked from it failed to start ({exc}); see {self.log_path}"
            self._kill()
            self._start()
            self._await_start()
            return
        self._ready = True
        forked = bool(self.zygote and self.zygote.forked(self._process))
        self.starts.append((forked, time.perf_counter() - self._start_time))

    def _receive(self, timeout: float, log_start: int, sent: float | None = None) -> dict:
        if not self._conn.poll(max(timeout, 0.0)):
            where = self._stack_dump(log_start) if self._ready else ""
            self._kill()
            self._start()
            raise WorkerTimeout(f"no answer within {timeout:.0f} s", where)
        try:
            data = self._conn.recv_bytes(REPLY_MAX_BYTES)
        except (EOFError, OSError):
            raise self._died(log_start) from None
        if sent is not None:
            self.round_trip_s = time.perf_counter() - sent
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

    def _stack_dump(self, log_start: int) -> str:
        """Where a started worker that does not answer is: SIGUSR1 makes it write its threads'
        Python stacks to its log (`worker.serve` registers faulthandler for it), read back here
        (`stuck_frames`). A candidate may have replaced the handler: then nothing, or its own text."""
        try:
            os.kill(self.info["pid"], signal.SIGUSR1)
        except (KeyError, TypeError, OSError):
            return ""
        time.sleep(STACK_DUMP_S)
        return stuck_frames(self._log_tail(log_start))

    def _died(self, log_start: int) -> WorkerDied:
        try:   # the keeper exits with the worker's status once it has ended what the worker left
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        error = WorkerDied(self._process.returncode, self._log_tail(log_start))
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


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (T: stopped), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def stuck_frames(log_tail: str, frames: int = 4) -> str:
    """The innermost `frames` frames of the main thread in the last faulthandler dump of a log
    ("Current thread ... (most recent call first):" and its "File ..., line N in f" lines), each
    as "f (file.py:N)", innermost first; "" without a dump."""
    lines = log_tail.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("Current thread ")]
    if not heads:
        return ""
    found = []
    for line in lines[heads[-1] + 1:]:
        match = re.match(r'\s+File "(.+)", line (\d+) in (\S+)', line)
        if not match or len(found) == frames:
            break
        found.append(f"{match[3]} ({Path(match[1]).name}:{match[2]})")
    return " <- ".join(found)


def log_summary(log_tail: str, max_lines: int = 8) -> str:
    """The lines of a dead worker's log that say what happened (errors, candidate frames)."""
    lines = log_tail.splitlines()
    useful = [line for line in lines if re.search(r"candidate\.py|error|Error|CUDA|Fatal|Abort|assert", line)]
    return "\n".join((useful or lines)[-max_lines:])


def close_all(processes: list[WorkerProcess]) -> None:
    """Close worker processes in parallel: each one's CUDA teardown takes a second or two. Plain
    threads, since this also runs from atexit, where a ThreadPoolExecutor refuses new work;
    Python 3.12.0-1 refuse even threads there (gh-113964), and then they close one by one."""
    closers = []
    for process in processes:
        closer = threading.Thread(target=process.close)
        try:
            closer.start()
        except RuntimeError:
            process.close()
            continue
        closers.append(closer)
    for closer in closers:
        closer.join()
