"""The keeper: the process a verifier worker runs under, so that nothing a candidate starts outlives it.

    python dice/verifier/keeper.py FD ROLE CONFIG_JSON LOG PARENT_PID PROJECT_ROOT

Started by `process.WorkerProcess` (stdlib only: it stays a small process, torch is imported by
the worker alone). It leads a new session, makes itself the child subreaper (prctl
PR_SET_CHILD_SUBREAPER), so every process a candidate starts, even a `setsid` + double-fork
daemon, stays in its subtree when its own parent dies, then forks the worker, which serves the
pipe `FD` (`worker.serve`). From then on it polls every POLL_S:
- the trainer died (its parent changed): it kills its whole subtree and exits, within ~0.1 s,
  whatever the candidate is doing (a spinning kernel, a Python loop, a blocked syscall);
- the worker exited (a segfault, os._exit, a clean shutdown): it kills what the worker left
  behind and exits with the worker's status.
`kill_tree` is also what the trainer calls to end a worker: the keeper last, so that orphans of
killed processes land on it and are found by the next scan.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.1


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc/PID/stat, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()   # the command name may hold spaces and parentheses
    return fields[0], int(fields[1])


def descendants(root: int) -> list[int]:
    """Live (not zombie) processes below `root`, parents before children."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[0] != "Z":
                children.setdefault(stat[1], []).append(int(name))
    found, frontier = [], [root]
    while frontier:
        kids = [c for p in frontier for c in children.get(p, ())]
        found += kids
        frontier = kids
    return found


def _kill(pid: int, below: set[int]) -> None:
    """SIGKILL `pid` if it is still a child of a process in `below` (a pid reused meanwhile is left
    alone: with a pidfd the check and the signal refer to the same process)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
            return           # the process is gone
        stat = _stat(pid)    # no pidfds here (an old kernel, a sandbox): check, then signal
        if stat is not None and stat[1] in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return
    try:
        stat = _stat(pid)
        if stat is not None and stat[1] in below:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def kill_tree(root: int, *, include_root: bool = True, rounds: int = 100) -> None:
    """Kill every process below `root` (scanning again until none is left: orphans of a killed
    process reparent to the subreaper `root` while it lives), then `root` itself."""
    me = os.getpid()
    for _ in range(rounds):
        pids = [p for p in descendants(root) if p != me]
        if not pids:
            break
        tree = {root, *pids}
        for pid in pids:
            _kill(pid, tree)
        time.sleep(0.005)
    if include_root:
        try:
            os.kill(root, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap() -> list[tuple[int, int]]:
    """Collect exited children (a subreaper's adopted orphans too): [(pid, wait status)]."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


def set_child_subreaper() -> bool:
    """prctl(PR_SET_CHILD_SUBREAPER): orphans below this process reparent to it, not to init.
    False where the kernel refuses (then a daemon that detaches escapes the tree kill)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _exit_like(status: int) -> None:
    """Exit with the worker's wait status, so the trainer reads the same exit code or signal."""
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str]) -> None:
    fd, role, config, log_path, parent, root = argv
    sys.path.insert(0, root)
    keep(int(fd), role, config, log_path, int(parent))


def keep(fd: int, role: str, config: str, log_path: str, parent: int) -> None:
    """Be the keeper of a new worker serving `fd` (module docstring); never returns. `parent`: the
    process whose end ends this keeper's tree (the trainer, or the zygote that forked it)."""
    os.setsid()
    set_child_subreaper()
    worker = os.fork()
    if worker == 0:
        # isolation: the keeper itself imports no torch (unless a zygote did); its worker loads the worker's modules
        import json
        from multiprocessing.connection import Connection
        started = time.perf_counter()
        from dice.verifier.worker import serve
        serve(Connection(fd), role, json.loads(config), log_path, imported_s=time.perf_counter() - started)
        os._exit(0)
    os.close(fd)   # the trainer reads EOF when the worker dies, not when the keeper does
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:          # the trainer (or the zygote) is gone
            kill_tree(os.getpid(), include_root=False)
            os._exit(1)
        for pid, status in reap():     # the worker, and orphans that a subreaper inherits
            if pid == worker:
                kill_tree(os.getpid(), include_root=False)
                _exit_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])
