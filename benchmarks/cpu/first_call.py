"""First call against steady calls of the NumPy backend, for two source trees in the same run
(say, a checkout before a change and one after), fresh processes taking turns.

Each fresh process builds the model (seeded random weights) on a NumPy backend with an empty path
store and times: its first call, its second call, and then, where the tree has a background path
tuner, how long the tuner took to measure everything (the process idle meanwhile), and the median
of --steady further calls; each in wall seconds and in the process's CPU seconds (all threads),
which a burst of other jobs on a shared box stretches far less. The load averages are printed
before and after each process: the numbers only compare within one run.

    python benchmarks/cpu/first_call.py --tree before=/path/to/old/checkout --tree after=. \\
        [--workloads sd-vae-256 convnext-b1] [--reps 3] [--steady 3] [--json out.json]

Each tree needs its compiled kernels built in place (python setup.py build_ext --inplace).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = {  # preset, input shape, call
    "sd-vae-256": ("sd-vae", (1, 4, 32, 32), "decode"),
    "sd-vae-512": ("sd-vae", (1, 4, 64, 64), "decode"),
    "convnext-b1": ("convnext-tiny", (1, 224, 224, 3), "encode"),
    "tiny-vae-512": ("tiny-vae", (1, 4, 64, 64), "decode"),  # the README's first example, in-process
    "wan-5x128": ("wan2.1-vae", (1, 16, 2, 16, 16), "decode"),  # 5 frames of 128x128, the video path
}


def child(workload: str, store: str, steady: int, tuner_wait_s: float) -> dict:
    import numpy as np

    import convkernels
    from convkernels import get_backend
    from models import load_model

    preset, shape, call = WORKLOADS[workload]
    backend = get_backend("numpy", plan_cache_dir=store)
    # the load is timed too: weight transforms done at load (prepared weights) moved there from the
    # first call, and a fresh server pays both before its first answer
    t0 = time.perf_counter()
    model = load_model("bench", preset, backend)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    x = rng.random(shape, dtype=np.float32) if call == "encode" else rng.standard_normal(shape).astype(np.float32)

    cpu = {}

    def run(name=None):
        # wall time, and this process's CPU seconds (all its threads): on a shared box a burst of
        # other jobs stretches the wall time far more than the CPU time the call needed
        c0, t0 = sum(os.times()[:2]), time.perf_counter()
        model.encode(x) if call == "encode" else model.decode(x, tiled=False)
        wall = time.perf_counter() - t0
        if name:
            cpu[name] = sum(os.times()[:2]) - c0
        return wall
    out = {"convkernels": convkernels.__file__, "load_s": load_s, "first_s": run("first_cpu_s"),
           "second_s": run("second_cpu_s")}
    tuner = getattr(getattr(backend, "choice", None), "tuner", None)
    if tuner is not None:
        t0 = time.perf_counter()
        # the tuner waits for the box's load average to fall below its CPU count: on a busy
        # shared box it may not finish, and the steady calls then run the cost model's choices
        out["tuner_done"] = tuner.wait(tuner_wait_s)
        out["tuner_s"], out["tuner_keys"] = time.perf_counter() - t0, tuner.measured
    times, cpus = [], []
    for _ in range(steady):
        times.append(run("c"))
        cpus.append(cpu["c"])
    out.update(cpu, steady_s=statistics.median(times), steady_cpu_s=statistics.median(cpus))
    out.pop("c", None)
    out["steady_all_s"] = times
    out["paths"] = sorted({c["path"] for c in backend.conv_choices()})
    return out


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=False, default=[], help="NAME=PATH (repeat)")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["sd-vae-256", "convnext-b1"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steady", type=int, default=3)
    ap.add_argument("--tuner-wait-s", type=float, default=300, help="longest wait for the background tuner")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "STORE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steady, args.tuner_wait_s)))
        return
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": os.getcwd()}
    print(f"# first_call — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs; "
          f"trees: " + ", ".join(f"{n}={p}" for n, p in trees.items()), flush=True)
    rows = []
    for workload in args.workloads:
        for rep in range(args.reps):
            for name, path in trees.items():  # turns: drift in the box's load falls on all alike
                path = os.path.abspath(path)
                with tempfile.TemporaryDirectory(prefix="first-call-paths-") as store:
                    before = load()
                    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", workload, store,
                                           "--steady", str(args.steady), "--tuner-wait-s", str(args.tuner_wait_s)],
                                          cwd=path, capture_output=True, text=True,
                                          env={**os.environ, "PYTHONPATH": path})
                if proc.returncode:
                    print(f"  {workload} {name}: failed: {proc.stderr.strip()[-600:]}", flush=True)
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                assert r["convkernels"].startswith(path), (r["convkernels"], path)
                r.update(workload=workload, tree=name, rep=rep + 1, load_before=before, load_after=load())
                rows.append(r)
                tuner = (f", tuner {r['tuner_s']:.1f} s for {r['tuner_keys']} keys"
                         f"{'' if r['tuner_done'] else ' (not done)'}" if "tuner_s" in r else "")
                print(f"  {workload} {name} #{rep + 1}: load {r.get('load_s', float('nan')):.2f} s, first "
                      f"{r['first_s']:.2f} s, second {r['second_s']:.2f} s"
                      f"{tuner}, steady {r['steady_s']:.2f} s (all {', '.join(f'{t:.2f}' for t in r['steady_all_s'])})"
                      f"; CPU s first {r['first_cpu_s']:.2f}, second {r['second_cpu_s']:.2f}, steady "
                      f"{r['steady_cpu_s']:.2f}; load {before} -> {r['load_after']}", flush=True)
    print("\nMedians over the fresh processes; wall seconds, then the process's CPU seconds (all threads)")
    print("| workload | tree | load | first call | second call | steady call | first/steady | CPU s first / steady "
          "| runs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for workload in args.workloads:
        for name in trees:
            mine = [r for r in rows if r["workload"] == workload and r["tree"] == name]
            if not mine:
                continue
            f, s2, st, fc, sc = (statistics.median(r[k] for r in mine) for k in (
                "first_s", "second_s", "steady_s", "first_cpu_s", "steady_cpu_s"))
            spread = f"first {min(r['first_s'] for r in mine):.2f}-{max(r['first_s'] for r in mine):.2f} s"
            ld = statistics.median(r.get("load_s", float("nan")) for r in mine)  # an older tree's child lacks it
            print(f"| {workload} | {name} | {ld:.2f} s | {f:.2f} s | {s2:.2f} s | {st:.2f} s | {f / st:.1f}x | {fc:.2f} / {sc:.2f} "
                  f"({fc / sc:.1f}x) | {len(mine)} ({spread}) |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
