"""Child processes spectrain starts for an engine (a build, a server, a benchmark) end when spectrain does.

Each child runs in its own session (its own process group), so the whole tree it starts (cmake -> ninja ->
compilers, llama-server's workers) is stopped in one ``killpg``, and a terminal's Ctrl-C does not hit it half way.
The price: nothing outside spectrain stops it, so spectrain must. ``sigterm_exits`` turns a SIGTERM (a scheduler,
``timeout``, ``kill``) into SystemExit, whose unwinding reaches the ``except`` / ``finally`` that stop the group;
Python's default SIGTERM action ends the interpreter without running either and leaves the children running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """The child's whole process group: SIGTERM, then SIGKILL after `grace` seconds; reaped."""
    if proc.poll() is not None:  # reaped long ago, maybe: its id may name another group by now
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            _kill_leftovers(proc.pid)  # the leader is gone; a member that ignored SIGTERM (a compiler) is not
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_leftovers(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def install_sigterm_exit():
    """Make SIGTERM raise SystemExit(128 + 15) in the main thread; returns the handler to restore, or None off the
    main thread (where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """Inside: a SIGTERM unwinds the stack (SystemExit), so the children started inside are stopped."""
    previous = install_sigterm_exit()
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run_stopped_with_us(cmd: list[str], timeout: float, **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``, but the child (and its group) is stopped
    when the caller is interrupted (Ctrl-C, SIGTERM) or fails, never left running on its own."""
    with sigterm_exits():
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True, **popen_kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            stop_group(proc, grace=2.0)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
