"""The harness's child processes (kvproxies, engines, mock workers) end
with it, however it ends.

Each child runs in a process group of its own (spawn), so that a terminal's
Ctrl-C reaches the harness alone and the harness stops them in its order,
each with whatever it started. A harness ended by SIGTERM, SIGINT or SIGHUP
leaves through SystemExit (exit_on_signals), so its `finally` blocks and
stop_all run; one ended by SIGKILL, which runs nothing, takes its children
with it through the kernel's parent-death signal (PR_SET_PDEATHSIG, Linux).
The parent-death signal belongs to the thread that started the child:
spawn from the main thread, or from one that lives as long as the child.
"""

import ctypes
import os
import signal
import subprocess
import threading

PR_SET_PDEATHSIG = 1

_live = set()  # Popen objects spawn started, until stop_all
_lock = threading.Lock()


def _prctl():
    """libc's prctl, looked up before any fork (the child only calls it)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with(parent):
    def pre_exec():
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took hold
            os._exit(1)

    return pre_exec


def spawn(argv, **kw):
    """subprocess.Popen(argv, **kw) in a new session (its own process group)
    that gets SIGTERM when the harness dies."""
    p = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with(os.getpid()), **kw)
    with _lock:
        _live.add(p)
    return p


def stop(p, timeout=10):
    """Ends p's process group: SIGTERM, then SIGKILL after timeout s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if p.poll() is not None:
            break
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            continue
    p.wait()
    with _lock:
        _live.discard(p)


def stop_all(timeout=10):
    """Stops every child spawn started that is still running."""
    with _lock:
        ps = list(_live)
    for p in ps:
        stop(p, timeout)


def exit_on_signals():
    """SIGTERM, SIGINT and SIGHUP end the harness with SystemExit (status
    128 + the signal), which runs its `finally` blocks."""

    def leave(sig, _frame):
        raise SystemExit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, leave)
