"""The service's threads, started under a name the operating system knows too.

Python (before 3.14) names a thread for itself only: `top -H`, `/proc/<pid>/task/*/comm`, perf and
py-spy's native mode see every thread of a process as `python3`. A thread started here sets its
kernel name (at most 15 bytes: the Python name's tail after `convserve-`) before its work, so a
benchmark can read each thread's CPU seconds from /proc and say which one a request costs (the
model worker's I/O, delivery and device threads; benchmarks/service/service_throughput.py).

Naming is best effort: where prctl is missing (macOS, Windows) the thread runs unnamed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from typing import Callable

_PR_SET_NAME = 15
_PREFIX = "convserve-"


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def os_name(name: str) -> bytes:
    """The kernel's name for a thread called `name`: its tail after `convserve-`, 15 bytes."""
    return name.removeprefix(_PREFIX).encode("utf-8", "replace")[:15]


def name_current(name: str) -> None:
    """Give the calling thread its kernel name (nothing where prctl is missing)."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(os_name(name)), 0, 0, 0)


def start(target: Callable, name: str, args: tuple = (), daemon: bool = True) -> threading.Thread:
    """A started thread running target(*args), named `name` for Python and for the kernel."""
    def run() -> None:
        name_current(name)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def lower_priority(increment: int) -> None:
    """This thread, and every thread it starts from now on, `increment` nice steps lower.

    Why a thread and not the process: on Linux a nice value belongs to a thread and a new thread
    takes its creator's. Front end 0 runs in the supervisor's process, whose watcher thread
    (started before this) restarts model workers: they keep the server's own priority. Elsewhere,
    or if the thread's value cannot be set, the process is lowered (os.nice). Lowering needs no
    privilege; nothing here raises a priority."""
    if increment <= 0:
        return
    if sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
            return
        except OSError:
            pass
    os.nice(increment)


def pin_process(cpus, pid: int | str = "self") -> bool:
    """Every thread of process `pid` (default: this one) on `cpus`, and every thread they start
    from now on (a new thread takes its creator's CPUs, and a new process its parent's). Linux only
    (each thread's affinity is set one by one through /proc/PID/task); False where it could not be
    set."""
    tasks = f"/proc/{pid}/task"
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir(tasks):
        return False
    cpus, done = set(cpus), False
    try:
        names = os.listdir(tasks)
    except OSError:  # the process ended
        return False
    for task in names:
        try:
            os.sched_setaffinity(int(task), cpus)
            done = True
        except OSError:  # a thread that ended meanwhile, or CPUs outside this process's cpuset
            continue
    return done
