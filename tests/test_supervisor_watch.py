"""The supervisor's watch thread (service/supervisor.py `_watch`), the one thread that reaps,
restarts and kills the server's children, on real spawned processes:

- a child still being spawned while the watch takes its turn is not seen half-made: its process
  is published only once started (the watch once read the sentinel of a Process still in
  `start()`, raised, and died: from then on nothing was reaped, and a SIGKILLed front end stayed a
  zombie for good);
- an error in one turn of the watch is logged and the watch goes on reaping and restarting;
- a stop that comes while the watch starts a child again leaves no child running: it either
  comes first (nothing starts) or waits for that start and stops what it made."""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time

from service import threads
from service.settings import Settings
from service.supervisor import WATCH_S, Supervisor, _Child

SPAWN = multiprocessing.get_context("spawn")


def _die_young() -> None:
    """A child that exits at once: the watch reaps it and, after its pause, starts it again."""
    os._exit(3)


def _dies_then_idles(marker: str) -> None:
    """Exits at once the first time (no marker yet); started again, lives until it is stopped."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    time.sleep(120)  # SIGTERM's default action ends it


#: how many times a _SlowStart began, and set as each begins
STARTS: list[float] = []
STARTING = threading.Event()


class _SlowStart(SPAWN.Process):
    def start(self) -> None:
        STARTS.append(time.monotonic())
        STARTING.set()
        time.sleep(2.5 * WATCH_S)  # the watch takes at least two turns while this child is being started
        super().start()


class _SlowSpawn:
    """The spawn context, but each Process takes longer than two watch turns to start."""

    def Process(self, **kwargs):  # noqa: N802 - the context's own name
        return _SlowStart(**kwargs)


class _RaisesOnce:
    """A worker's beat record whose first reading fails (as a torn file or a bug would)."""

    def __init__(self):
        self.calls = 0

    def hung(self, now, limit, started):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a beat record that cannot be read")
        return None


def _restarted(sup: Supervisor, child: _Child, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.restarts >= 1 and child.proc is not None and child.proc.pid is not None:
            return True
        time.sleep(0.05)
    return False


def _watch_failures(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "convserve.supervisor" and "watch failed" in r.getMessage()]


def test_a_child_started_while_the_watch_runs_is_reaped_and_started_again(caplog):
    caplog.set_level(logging.INFO, logger="convserve.supervisor")
    sup = Supervisor(Settings(backend="numpy"))
    sup.ctx = _SlowSpawn()
    try:
        watch = threads.start(sup._watch, "convserve-supervisor")
        time.sleep(WATCH_S)  # the watch is turning before the child's start begins
        sup.add_frontend("convserve-frontend-1", _die_young, ())
        [child] = sup.frontends
        assert _restarted(sup, child), "the dead child was never started again"
        assert watch.is_alive()
        assert not _watch_failures(caplog), "the watch read a child that was still being started"
        assert "died (exit code 3)" in caplog.text
    finally:
        sup.stop(grace_s=1.0)


def test_the_watch_outlives_an_error_in_one_turn(caplog):
    caplog.set_level(logging.INFO, logger="convserve.supervisor")
    sup = Supervisor(Settings(backend="numpy"))
    broken = _Child("convserve-worker-fake", None, ())
    broken.beat = _RaisesOnce()
    sup.workers.append(broken)  # never started: only its hang check runs, and fails once
    try:
        watch = threads.start(sup._watch, "convserve-supervisor")
        sup.add_frontend("convserve-frontend-1", _die_young, ())
        [child] = sup.frontends
        assert _restarted(sup, child), "the watch stopped reaping after one failed turn"
        assert watch.is_alive()
        assert broken.beat.calls > 1
        assert len(_watch_failures(caplog)) == 1
    finally:
        sup.workers.remove(broken)
        sup.stop(grace_s=1.0)


def test_a_stop_while_a_child_is_started_again_leaves_none_running(tmp_path):
    STARTS.clear()
    sup = Supervisor(Settings(backend="numpy"))
    sup.ctx = _SlowSpawn()
    child = None
    try:
        threads.start(sup._watch, "convserve-supervisor")
        sup.add_frontend("convserve-frontend-1", _dies_then_idles, (str(tmp_path / "died"),))
        [child] = sup.frontends
        STARTING.clear()
        deadline = time.monotonic() + 60
        while len(STARTS) < 2:  # the watch reaped it and is inside its start again (a slow spawn)
            assert time.monotonic() < deadline, "the dead child was never started again"
            STARTING.wait(0.1)
        sup.stop(grace_s=1.0)
        time.sleep(4 * WATCH_S)  # past the slow start: a child made after the stop would be running now
        assert child.proc is None or not child.proc.is_alive(), "a child started again after the stop runs on"
    finally:
        if child is not None and child.proc is not None and child.proc.is_alive():
            child.proc.kill()
