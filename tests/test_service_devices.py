"""Model workers, one per device, behind the HTTP front ends (service/supervisor.py, engine.py,
model_worker.py), on the NumPy backend with several emulated devices (CONVSERVE_DEVICES=0,1 gives
two CPU workers, cpu:0 and cpu:1, as two GPUs would get):

- requests are spread over the devices, every row is answered with this process's decode of it (to
  float32 summation order), and /metrics, the model cards and Triton's configuration name every device;
- a model worker killed mid-request (SIGKILL, as an OOM kill or a segfault would) is started
  again: its requests in flight get 503 with Retry-After, none hangs or is lost silently,
  /readyz is false while its model has no live worker, and the front end stays up;
- workers that die together are reaped at once and each waits out its own restart pause;
- several front ends (--workers 2) share one model worker: no model is loaded twice on a device.
"""
from __future__ import annotations

import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import metric, metric_sum, npy, scrape, start_server, wait_until_every_device_is_ready
from reference_checks import cross_process_atol

NPY = {"content-type": "application/x-npy"}
HOLD = 4242.0  # latents holding this value keep their worker busy until the release file exists
#: a worker that dies young is started again after this pause (service/supervisor.py: the first
#: pause, 1 s, doubled)
FIRST_PAUSE_S = 2.0


def latents(hold: bool = False) -> np.ndarray:
    x = np.random.default_rng().standard_normal((1, 4, 5, 7)).astype(np.float32)
    if hold:
        x[0, 0, 0, 0] = HOLD
    return x


def decode(url: str, x: np.ndarray, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/tiny-vae/decode", content=npy(x), headers=NPY, params={"format": "npy"},
                      timeout=timeout)


def wait_for(cond, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def reference_model(seed: int = 0, path: str | None = None):
    """tiny-vae in this process: the server's random init is seeded (0 unless told), so the same
    weights; `path` forces every conv that path takes onto it."""
    from convkernels import get_backend
    from models import ModelOptions, load_model

    backend = get_backend("numpy")
    backend.paths.forced = path
    return load_model("tiny-vae", "tiny-vae", backend, options=ModelOptions(seed=seed))


def test_the_cross_process_bound_admits_every_conv_path_and_refuses_other_weights():
    """What the bound the devices are held to must tell apart, here in one process: tiny-vae with
    its convs forced onto each of the backend's paths (what another process's timing may choose)
    stays within it; the same model with other random weights (a worker that loaded the wrong
    ones) is far outside it."""
    xs = [latents() for _ in range(3)]
    base = reference_model()
    refs = [base.decode(x) for x in xs]
    for path in [p.name for p in base.backend.paths.catalogue]:
        model = reference_model(path=path)
        for x, ref in zip(xs, refs):
            np.testing.assert_allclose(model.decode(x), ref, rtol=0, atol=cross_process_atol(ref), err_msg=path)
    wrong = reference_model(seed=1)
    for x, ref in zip(xs, refs):
        assert np.abs(wrong.decode(x) - ref).max() > 1000 * cross_process_atol(ref)


@pytest.fixture(scope="module")
def two_devices(server_factory):
    return server_factory(models="tiny-vae", devices="0,1", max_batch=2, max_queue_delay_ms=0)


def died_at(log: str, pid: int) -> datetime:
    """When the supervisor logged the death of `pid` (its log line's timestamp)."""
    line = next(line for line in log.splitlines() if f"(pid {pid}) died" in line)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


def test_workers_that_die_together_wait_out_their_restart_pauses_side_by_side(two_devices):
    """Both workers killed at once (as a shard group's failure ends both): each death is reaped
    and logged at once, and each worker waits out its own restart pause (2 s after a short
    life). The supervisor once slept each pause in its watch loop, so the second death was
    only seen, and its pause begun, after the first worker had been started again: the second
    death line came a whole pause after the first. (First in this module: the workers must die
    young, under STABLE_AFTER_S, to have a pause at all.)"""
    srv = two_devices
    wait_until_every_device_is_ready(srv.url, "tiny-vae")
    pids = [d["pid"] for d in httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"]]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: all(f"(pid {pid}) died" in srv.log_path.read_text(errors="replace") for pid in pids), 30,
             "both deaths logged")
    log = srv.log_path.read_text(errors="replace")
    apart = abs((died_at(log, pids[1]) - died_at(log, pids[0])).total_seconds())
    # side by side: milliseconds apart; one after the other: a whole pause and a process start
    assert apart < FIRST_PAUSE_S / 2, f"the deaths were logged {apart:.3f} s apart:\n{srv.log()}"
    wait_until_every_device_is_ready(srv.url, "tiny-vae")
    devices = httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"]
    assert not {d["pid"] for d in devices} & set(pids)
    assert decode(srv.url, latents()).status_code == 200


def test_requests_spread_over_two_devices_and_every_device_is_reported(two_devices):
    srv = two_devices
    # ready once one device is; the other may still be warming up
    wait_for(lambda: len(httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"]) == 2, what="both devices")
    devices = httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"]
    assert [d["device"] for d in devices] == ["cpu:0", "cpu:1"] and {d["state"] for d in devices} == {"ready"}
    assert len({d["pid"] for d in devices}) == 2
    s0 = scrape(srv.url)
    xs = [latents() for _ in range(24)]
    with ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda x: decode(srv.url, x), xs))
    assert [r.status_code for r in rs] == [200] * len(xs)
    s1 = scrape(srv.url)
    rows = {d: metric(s1, "convserve_device_rows_total", model="tiny-vae", device=d)
            - metric(s0, "convserve_device_rows_total", model="tiny-vae", device=d) for d in ("cpu:0", "cpu:1")}
    assert sum(rows.values()) == len(xs) and min(rows.values()) > 0, rows
    # whichever device ran a row, its image is this process's decode of it with the same seeded
    # weights, up to float32 summation order (each worker times its own conv paths): every row is
    # checked, so a device that computed wrongly (other weights, another row) fails
    model = reference_model()
    for i, (x, r) in enumerate(zip(xs, rs)):
        want = model.decode(x)
        np.testing.assert_allclose(np.load(io.BytesIO(r.content)), want, rtol=0, atol=cross_process_atol(want),
                                   err_msg=f"row {i}")
    assert metric(s1, "convserve_worker_up", device="cpu:0") == 1 and metric(s1, "convserve_worker_up", device="cpu:1") == 1
    config = httpx.get(f"{srv.url}/v2/models/tiny-vae/config").json()
    assert [g["name"] for g in config["instance_group"]] == ["tiny-vae_0", "tiny-vae_1"]
    kernels = httpx.get(f"{srv.url}/v1/kernels").json()
    assert [k["device"] for k in kernels["devices"]] == ["cpu:0", "cpu:1"] and kernels["conv_choices"]


def test_a_killed_worker_is_restarted_and_its_requests_get_503(server_factory, tmp_path):
    release = tmp_path / "release"
    srv = server_factory(models="tiny-vae", max_batch=1, max_queue_delay_ms=0, fault_hold_value=HOLD,
                         fault_hold_release_file=release)
    s0 = scrape(srv.url)
    old_pid = httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"][0]["pid"]
    with ThreadPoolExecutor(3) as pool:
        held = pool.submit(decode, srv.url, latents(hold=True))
        wait_for(lambda: release.with_name("release.holding").exists(), what="the held request on the worker")
        # the queue-depth gauge lags its queue by up to the worker's publish interval: the held
        # request's own 1 must have given way to 0, or that stale 1 reads as the next one queued
        wait_for(lambda: metric(scrape(srv.url), "convserve_queue_depth", model="tiny-vae") == 0, what="none queued")
        queued = pool.submit(decode, srv.url, latents())  # waits behind the held one
        wait_for(lambda: metric(scrape(srv.url), "convserve_queue_depth", model="tiny-vae") == 1, what="queued")
        os.kill(old_pid, signal.SIGKILL)
        for r in (held.result(30), queued.result(30)):  # answered, not hung: 503 with Retry-After
            assert r.status_code == 503, r.text
            assert r.json()["type"].endswith("#worker-died") and int(r.headers["retry-after"]) >= 1
    assert httpx.get(f"{srv.url}/healthz").status_code == 200  # the front end stayed up
    wait_for(lambda: httpx.get(f"{srv.url}/readyz").status_code == 200, what="the worker back")
    new = httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"][0]
    assert new["pid"] != old_pid and new["state"] == "ready"
    assert decode(srv.url, latents()).status_code == 200
    s1 = scrape(srv.url)
    assert metric(s1, "convserve_worker_restarts_total", device="cpu") - \
        metric(s0, "convserve_worker_restarts_total", device="cpu") == 1
    assert metric(s1, "convserve_faults_total", model="tiny-vae", fault="worker_died", outcome="failed") - \
        metric(s0, "convserve_faults_total", model="tiny-vae", fault="worker_died", outcome="failed") == 2


def test_readyz_is_false_while_the_only_worker_is_down(server_factory, tmp_path):
    srv = server_factory(models="tiny-vae")
    pid = httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"][0]["pid"]
    os.kill(pid, signal.SIGKILL)  # restarted after a pause of seconds: long enough to see it down
    wait_for(lambda: httpx.get(f"{srv.url}/readyz").status_code == 503, what="not ready while down")
    r = decode(srv.url, latents())
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    wait_for(lambda: httpx.get(f"{srv.url}/readyz").status_code == 200, what="ready again")


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_two_front_ends_share_one_model_worker(tmp_path):
    """... and FRONTEND_NICE lowers both front ends (front end 0 is the supervisor process's main
    thread), never the model worker nor the supervisor's thread that starts workers again."""
    srv = start_server(tmp_path, models="tiny-vae,tiny-convnext", cli_args=("--workers", "2"),
                       env_extra={"CONVSERVE_FRONTEND_NICE": "3"})
    try:
        spawned = [k for k in children(srv.proc.pid) if b"spawn_main" in cmdline(k)]
        # one model worker (the CPU) and one more front end (the resource tracker is no spawn)
        assert len(spawned) == 2, [cmdline(k) for k in children(srv.proc.pid)]
        worker = httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"][0]["pid"]
        (frontend,) = set(spawned) - {worker}
        base = nice_of(os.getpid())
        watcher = [int(t.name) for t in Path(f"/proc/{srv.proc.pid}/task").iterdir()
                   if (t / "comm").read_text().strip() == "supervisor"]
        assert len(watcher) == 1
        assert (nice_of(srv.proc.pid), nice_of(frontend)) == (base + 3, base + 3)
        assert (nice_of(worker), nice_of(watcher[0])) == (base, base)
        assert "FRONTEND_NICE=3 on a CPU backend" in srv.log()  # the CPU backend's worker takes every core
        snap = scrape(srv.url)
        for model in ("tiny-vae", "tiny-convnext"):  # loaded once, by the one device's worker
            assert metric_sum(snap, "convserve_model_loads_total", model=model) == 1
            assert metric(snap, "convserve_model_loads_total", model=model, device="cpu") == 1
        pids = {httpx.get(f"{srv.url}/v1/models/tiny-vae").json()["devices"][0]["pid"] for _ in range(6)}
        assert len(pids) == 1  # whichever front end answers, the same worker
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda _: httpx.Client().post(
                f"{srv.url}/v1/models/tiny-vae/decode", content=npy(latents()), headers=NPY,
                params={"format": "npy"}, timeout=60).status_code, range(12)))
        assert codes == [200] * 12
        assert metric_sum(scrape(srv.url), "convserve_requests_total", model="tiny-vae", status="200") >= 12
    finally:
        assert srv.stop(timeout=30) == 0, srv.log()


def test_a_lower_front_end_priority_on_a_cpu_backend_is_warned_of():
    from service import process_plan as plan
    from service.settings import Settings

    cpu, gpu = [plan.Device("cpu", None)], [plan.Device("cuda:0", "0")]
    assert "FRONTEND_NICE=5 on a CPU backend" in plan.frontend_priority_warning(Settings(frontend_nice=5), cpu)
    assert plan.frontend_priority_warning(Settings(frontend_nice=5), gpu) is None
    assert plan.frontend_priority_warning(Settings(), cpu) is None


def test_auto_front_ends_leave_a_core_per_gpu_worker_and_one_more(monkeypatch):
    """WORKERS=0 with GPUs: the usable cores less one per model worker and one, within 2..32; one
    front end where the CPU computes; an explicit count wins."""
    from service import process_plan as plan
    from service.settings import Settings

    gpus = [plan.Device(f"cuda:{i}", str(i)) for i in range(4)]
    for cores, devices, expected in [(16, gpus[:1], 14), (64, gpus, 32), (32, gpus[:2], 29), (2, gpus[:1], 2)]:
        monkeypatch.setattr(plan, "available_cpus", lambda cores=cores: cores)
        assert plan.frontends_for(Settings(workers=0), devices) == expected, (cores, len(devices))
    assert plan.frontends_for(Settings(workers=0), [plan.Device("cpu", None)]) == 1
    assert plan.frontends_for(Settings(workers=3), gpus) == 3


def test_pinned_workers_get_a_core_each_and_everything_else_the_rest():
    """PIN_WORKERS=on: each GPU worker the last cores of the server's set, one each, in device
    order; the rest for the supervisor and front ends. Off (the default), a CPU worker, or fewer
    than 4 cores a GPU worker: no pinning."""
    from service import process_plan as plan
    from service.settings import Settings

    on = Settings(pin_workers="on")
    gpus = [plan.Device(f"cuda:{i}", str(i)) for i in range(4)]
    one = plan.pins(on, gpus[:1], set(range(16)))
    assert one.workers == [frozenset({15})] and one.rest == frozenset(range(15))
    odd = {1, 3, 4, 8, 9, 10, 11, 20, 21, 22, 23, 30, 31, 33, 40, 41}  # a cpuset with holes
    four = plan.pins(on, gpus, odd)
    assert four.workers == [frozenset({c}) for c in (31, 33, 40, 41)]
    assert four.rest == frozenset(odd - {31, 33, 40, 41})
    assert plan.pins(on, gpus, set(range(15))) is None  # 3.75 cores a worker
    assert plan.pins(Settings(), gpus[:1], set(range(16))) is None  # off by default
    assert plan.pins(on, [plan.Device("cpu", None)], set(range(16))) is None


PIN_PROBE = """
import os, sys, threading, time
sys.path.insert(0, {repo!r})
from service import threads
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
assert threads.pin_process({{{cpu}}})
after = threading.Thread(target=stop.wait); after.start()
time.sleep(0.1)
for task in sorted(os.listdir("/proc/self/task")):
    print(task, sorted(os.sched_getaffinity(int(task))))
stop.set()
"""


def test_pin_process_moves_every_thread_and_those_started_later():
    """service/threads.py `pin_process`, in a process of its own: a thread started before and one
    started after both end up on the given core, with the main thread."""
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PIN_PROBE.format(repo=str(Path(__file__).parents[1]), cpu=cpu)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    tasks = [line for line in lines if line.strip()]
    assert len(tasks) >= 3  # main, before, after
    assert all(line.split(" ", 1)[1] == f"[{cpu}]" for line in tasks), out.stdout
