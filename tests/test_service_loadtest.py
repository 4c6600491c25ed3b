"""A short headless locust run (seconds, localhost) passes loadtests/run.py's assertions, the
checker does fail on errors or a slow p99, and a run leaves no temporary folder behind."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# find_spec, not importorskip: importing locust monkey-patches this process with gevent
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed (the load/test extras)", allow_module_level=True)
REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("convserve_loadtests_run", REPO / "loadtests" / "run.py")
loadrun = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loadrun)


def stats_row(name, n, fails, times):
    return {"name": name, "num_requests": n, "num_failures": fails, "start_time": 100.0,
            "last_request_timestamp": 110.0, "response_times": times}


def test_checker_judges_error_rate_and_p99():
    fast = stats_row("encode", 1000, 0, {"20": 980, "40": 15, "90": 5})
    ok, report = loadrun.check_stats([fast], 0.001, 100)
    assert ok and "PASS" in report
    assert loadrun.percentile_ms(fast["response_times"], 0.99) == 40
    assert not loadrun.check_stats([fast], 0.001, 30)[0]                     # p99 40 ms > 30 ms
    assert not loadrun.check_stats([stats_row("decode", 1000, 2, {"20": 1000})], 0.001, 100)[0]  # 0.2% errors
    assert loadrun.check_stats([stats_row("decode", 1000, 1, {"20": 1000})], 0.001, 100)[0]      # 0.1% is allowed
    assert not loadrun.check_stats([], 0.001, 100)[0]


def test_refuses_remote_hosts():
    with pytest.raises(SystemExit):
        loadrun.main(["--host", "http://example.com:8000", "--run-time", "1s"])


def test_short_mixed_run_passes(live_server, tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "loadtests" / "run.py"), "--scenario", "mixed", "--users", "3",
                        "--run-time", "4s", "--host", live_server.url, "--max-p99-ms", "5000",
                        "--csv-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "PASS" in p.stdout
    assert (tmp_path / "mixed.json").exists()
    lines = {line.split()[0]: line.split() for line in p.stdout.splitlines() if line[:6] in ("encode", "decode")}
    assert int(lines["encode"][1]) > 0 and int(lines["decode"][1]) > 0


def test_a_run_without_csv_dir_leaves_no_folder_behind(live_server, tmp_path):
    """Without --csv-dir locust's files go to a temporary folder (here under TMPDIR=tmp_path): it is
    gone after a passing run, after one that locust refuses (a bad --run-time), and after a run
    stopped by SIGTERM."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = [sys.executable, str(REPO / "loadtests" / "run.py"), "--scenario", "decode", "--users", "2",
           "--host", live_server.url, "--max-p99-ms", "5000"]
    left = lambda: sorted(p.name for p in tmp_path.glob("convserve-locust-*"))  # noqa: E731
    ok = subprocess.run([*run, "--run-time", "2s"], env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert left() == []
    bad = subprocess.run([*run, "--run-time", "soon"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "locust exited" in bad.stderr, bad.stderr[-2000:]
    assert left() == []
    p = subprocess.Popen([*run, "--run-time", "60s"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not left():
            assert p.poll() is None and time.monotonic() < deadline, "no scratch folder appeared"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 143
    finally:
        p.kill()
    assert left() == []
