"""Ours (the NumPy backend) against the CPU runtimes people would deploy instead: ONNX Runtime (CPU
execution provider), OpenVINO (CPU, f32) and PyTorch eager, on the same weights and input.

Each contender runs in its own process (cpu_runtimes_worker.py: no runtime's thread pool or
allocator touches another's), loaded and warmed up once; the runs then take turns (ours, ORT,
OpenVINO, PyTorch, ours, ...) so drift in the machine's load falls on all alike. A run is several
calls when one call is short, so that it lasts --min-run-s; a run during which other processes
used >= --limit-cores cores (cpu_contention.py) is discarded and named. The weights are fresh
random ones, saved as the checkpoint ours and PyTorch load and exported with torch.onnx.export
for the other two; each output is compared with PyTorch's (relative L2).

The "first call" part starts a fresh process per contender and times its load, its first call
(ours: with an empty path store, so it measures its conv paths) and its steady calls.

    python benchmarks/cpu/cpu_runtimes.py                         # every workload, then the first calls
    python benchmarks/cpu/cpu_runtimes.py --workloads convnext-b1 sd-vae-256 --rounds 9 --json out.json
    python benchmarks/cpu/cpu_runtimes.py --quick                 # smoke test: tiny presets, few runs

Linux only (/proc/stat, /proc/cpuinfo). Needs the bench extra: pip install -e '.[test,bench]'.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata, util
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_contention import HZ, cpu_description, load_average, resolution_cores  # noqa: E402

WORKER = HERE / "cpu_runtimes_worker.py"
#: flag -> label, family, preset, ours' input shape, and the --quick stand-ins (tiny presets)
WORKLOADS = {
    "convnext-b1": ("ConvNeXt-T 224 batch 1", "convnext", "convnext-tiny", (1, 224, 224, 3), "tiny-convnext", (1, 64, 64, 3)),
    "convnext-b8": ("ConvNeXt-T 224 batch 8", "convnext", "convnext-tiny", (8, 224, 224, 3), "tiny-convnext", (8, 64, 64, 3)),
    "sd-vae-256": ("SD-VAE decode 256x256", "sd-vae", "sd-vae", (1, 4, 32, 32), "tiny-vae", (1, 4, 16, 16)),
    "sd-vae-512": ("SD-VAE decode 512x512", "sd-vae", "sd-vae", (1, 4, 64, 64), "tiny-vae", (1, 4, 32, 32)),
    "wan-5x128": ("Wan 2.1 decode 5x128x128", "wan", "wan2.1-vae", (1, 16, 2, 16, 16), "tiny-wan-vae", (1, 4, 2, 16, 16)),
}
FIRST_CALL = ("sd-vae-256", "convnext-b1")
CONTENDERS = {"ours": "ours (numpy)", "ort": "ONNX Runtime", "openvino": "OpenVINO", "torch": "PyTorch"}
NEEDS = {"ort": "onnxruntime", "openvino": "openvino", "torch": "torch"}
PACKAGES = ("convserve", "numpy", "torch", "onnxruntime", "openvino", "onnx", "onnxscript", "diffusers",
            "transformers", "threadpoolctl")
REPLY_TIMEOUT_S = 3600


#: --threads: every contender's threads (ours: OpenMP's and BLAS's), for a per-core comparison
THREADS_ENV = "CPU_RUNTIMES_THREADS"
#: --dtype: ours' compute dtype (the worker reads it)
OURS_DTYPE_ENV = "CPU_RUNTIMES_OURS_DTYPE"


def worker_env() -> dict:
    env = dict(os.environ)
    if env.get(THREADS_ENV):
        env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = env[THREADS_ENV]
    return env


class Worker:
    """One worker process and its JSON-line answers; its stderr goes to a log file."""

    def __init__(self, workdir: Path, mode: str, *args: str):
        self.log_path = workdir / f"log-{mode}-{args[0] if mode != 'prepare' else 'torch'}.txt"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(WORKER), mode, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=HERE.parents[1],
                                     env=worker_env())

    def answer(self, send: str | None = None) -> dict:
        if send is not None:
            self.proc.stdin.write(send + "\n")
            self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            return {"error": f"no answer; log {self.log_path}: {self.tail()}"}
        return json.loads(line)

    def tail(self) -> str:
        self.log.flush()
        return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-3:])[-400:]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def versions() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def blas() -> str:
    from threadpoolctl import threadpool_info
    return ", ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('num_threads')} threads)"
                     for i in threadpool_info() if i.get("user_api") == "blas")


def header(args, cpu: dict) -> None:
    print(f"# cpu_runtimes — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{' (--quick)' if args.quick else ''}")
    print(f"# cpu: {cpu['model']}, {cpu['logical_cpus']} CPUs usable ({cpu['physical_cores']} physical cores), "
          f"{platform.system()} {platform.machine()}, python {platform.python_version()}")
    print("# vector features: " + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu["features"].items()))
    print(f"# versions: {versions()}")
    print(f"# ours' BLAS (numpy): {blas()}")
    if args.threads:
        print(f"# threads: {args.threads} for every contender (ours: OpenMP and BLAS)")
    else:
        print(f"# threads: ORT intra-op, OpenVINO and PyTorch {cpu['physical_cores']} (the physical cores); "
              f"ours as it ships")
    print(f"# ours' dtype: {args.dtype}; OpenVINO's precision: {'bf16' if args.dtype == 'bfloat16' else 'f32'}; "
          "ONNX Runtime and PyTorch: float32")
    print(f"# load average at start: {load_average()}")
    print(f"# runs: {args.rounds} rounds, each run >= {args.min_run_s:.2f} s, {args.warmup} warm-up calls; a run is "
          f"discarded when other processes used >= {args.limit_cores} cores (read to +-"
          f"{resolution_cores(cpu['logical_cpus'], args.min_run_s):.3f} cores at {HZ} ticks/s)", flush=True)


def prepare(key: str, args, root: Path) -> tuple[Path, dict]:
    label, family, preset, shape, q_preset, q_shape = WORKLOADS[key]
    if args.quick:
        preset, shape = q_preset, q_shape
    workdir = root / key
    workdir.mkdir()
    (workdir / "spec.json").write_text(json.dumps({"family": family, "preset": preset, "shape": shape}))
    w = Worker(workdir, "prepare", str(workdir))
    info = w.answer()
    w.close()
    info.update(label=label, preset=preset, shape=shape)
    if "error" in info:
        raise RuntimeError(f"{key}: preparation failed: {info['error']}")
    export = f"ONNX export {info['export_s']:.1f} s" if info["onnx"] else info["reason"]
    print(f"\n## {label}: {preset}, input {'x'.join(map(str, shape))}; {export}; load {load_average()}", flush=True)
    return workdir, info


def skipped(contender: str, info: dict) -> str | None:
    if contender in NEEDS and util.find_spec(NEEDS[contender]) is None:
        return f"{NEEDS[contender]} is not installed (pip install -e '.[bench]')"
    if contender in ("ort", "openvino") and not info["onnx"]:
        return "no ONNX model (" + info["reason"] + ")"
    return None


def steady_rows(key: str, workdir: Path, info: dict, args) -> dict:
    """Interleaved runs of every contender on one prepared workload -> per-contender results."""
    results, workers = {}, {}
    for c in args.contenders:
        why = skipped(c, info)
        if why is None:
            w = Worker(workdir, "steady", c, str(workdir), str(args.warmup))
            ready = w.answer()  # one at a time: loads and warm-ups never overlap another's runs
            why = ready.get("error")
            if why is None:
                workers[c] = w
                results[c] = {"threads": ready["threads"], "load_s": ready["load_s"], "warm_s": ready["warm_s"],
                              "kept": [], "discarded": []}
                continue
            w.close()
        results[c] = {"skipped": why}
        print(f"  {CONTENDERS[c]} skipped: {why}", flush=True)
    print("  threads: " + ", ".join(f"{CONTENDERS[c]} {results[c]['threads']}" for c in workers), flush=True)
    for r in range(args.rounds):
        for c, w in workers.items():
            time.sleep(args.settle_s)  # the previous contender's pool threads stop spinning first
            run = w.answer(f"run {args.min_run_s}")
            if "error" in run:
                raise RuntimeError(f"{key} {c}: {run['error']}")
            if run["others_cores"] >= args.limit_cores:
                results[c]["discarded"].append(run)
                print(f"  discarded: {CONTENDERS[c]} round {r + 1}: other processes used {run['others_cores']:.2f} "
                      f"cores over its {run['wall_s']:.2f} s ({len(run['times'])} calls, median "
                      f"{statistics.median(run['times']) * 1e3:.1f} ms)", flush=True)
            else:
                results[c]["kept"].append(run)
    for w in workers.values():
        w.close()
    reference = workdir / "out-torch.npy"
    for c, res in results.items():
        if "skipped" in res:
            continue
        times = [t for run in res["kept"] for t in run["times"]]
        res["median_s"] = statistics.median(times) if times else None
        if reference.exists():
            res["rel_l2_vs_torch"] = rel_l2(np.load(workdir / f"out-{c}.npy"), np.load(reference))
    print(f"  load average after: {load_average()}", flush=True)
    return results


def rel_l2(ours, ref) -> float | str:
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from reference_checks import rel_l2 as check  # torch-free, the parity tests' own measure
    try:
        return check(ours, ref)
    except AssertionError as exc:  # a shape mismatch is a finding to print, not a crash
        return str(exc)


def cell(err) -> str:
    return f"{err:.1e}" if isinstance(err, float) else err


def ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def ratio(results: dict, peer: str) -> str:
    a, b = (results.get(c, {}).get("median_s") for c in ("ours", peer))
    return f"{a / b:.2f}" if a and b else "n/a"


def steady_table(rows: dict, args) -> None:
    names = [CONTENDERS[c] for c in args.contenders]
    print("\nSteady calls: median over the kept runs (kept/all runs); ours/X is a time ratio, < 1: ours faster")
    print("| workload | " + " | ".join(names) + " | ours/ORT | ours/OpenVINO | ours/PyTorch |")
    print("| --- " * (len(names) + 4) + "|")
    for key, (info, res) in rows.items():
        cells = []
        for c in args.contenders:
            r = res[c]
            cells.append("skipped" if "skipped" in r else
                         f"{ms(r['median_s'])} ({len(r['kept'])}/{len(r['kept']) + len(r['discarded'])})")
        print(f"| {info['label']} | " + " | ".join(cells) + " | "
              + " | ".join(ratio(res, p) for p in ("ort", "openvino", "torch")) + " |")
    print("\nOutputs: relative L2 to PyTorch's output on the same input")
    print("| workload | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for key, (info, res) in rows.items():
        cells = [cell(res[c].get("rel_l2_vs_torch", "-")) for c in args.contenders]
        print(f"| {info['label']} | " + " | ".join(cells) + " |")


def first_calls(key: str, workdir: Path, info: dict, args) -> list[dict]:
    """Fresh processes, contenders in turn, args.first_reps times; ours with an empty path store."""
    out = []
    for rep in range(args.first_reps):
        for c in args.contenders:
            if skipped(c, info):
                continue
            store = tempfile.mkdtemp(prefix="cpu-runtimes-paths-")
            w = Worker(workdir, "first", c, str(workdir), str(args.first_steady), store)
            res = w.answer()
            w.close()
            stored = [json.loads(Path(p).read_text()).get("choices", {}) for p in glob.glob(f"{store}/*.json")]
            shutil.rmtree(store, ignore_errors=True)
            res.update(workload=key, contender=c, rep=rep + 1, store_choices=sum(map(len, stored)) if c == "ours" else None)
            out.append(res)
            if "error" in res:
                print(f"  {CONTENDERS[c]} first call failed: {res['error']}", flush=True)
            elif res["others_cores"] >= args.limit_cores:
                print(f"  discarded: {CONTENDERS[c]} fresh process {rep + 1}: other processes used "
                      f"{res['others_cores']:.2f} cores over its {res['wall_s']:.2f} s (load {res['load_s']:.2f} s, "
                      f"first call {ms(res['first_s'])}, steady {ms(res['steady_s'])}"
                      + (f", {res['store_choices']} path choices stored)" if c == "ours" else ")"), flush=True)
    return out


def first_table(runs: list[dict], labels: dict, args) -> None:
    print("\nFirst call in a fresh process (ours: empty path store); medians over the kept fresh processes")
    print("| workload | contender | load (imports, build) | first call | steady call | first/steady | kept | "
          "path choices stored |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in labels:
        for c in args.contenders:
            mine = [r for r in runs if r["workload"] == key and r["contender"] == c and "error" not in r]
            kept = [r for r in mine if r["others_cores"] < args.limit_cores]
            if not mine:
                continue
            if not kept:
                print(f"| {labels[key]} | {CONTENDERS[c]} | n/a | n/a | n/a | n/a | 0/{len(mine)} | |")
                continue
            load, first, steady = (statistics.median(r[f] for r in kept) for f in ("load_s", "first_s", "steady_s"))
            stored = kept[0]["store_choices"]
            print(f"| {labels[key]} | {CONTENDERS[c]} | {load:.2f} s | {ms(first)} | {ms(steady)} | "
                  f"{first / steady:.1f}x | {len(kept)}/{len(mine)} | {'-' if stored is None else stored} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", choices=[*WORKLOADS, "first-call"], default=[*WORKLOADS, "first-call"])
    ap.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS))
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny presets, 2 rounds, short runs")
    ap.add_argument("--rounds", type=int, help="runs per contender (default 7; --quick 2)")
    ap.add_argument("--warmup", type=int, help="warm-up calls (default 2; --quick 1)")
    ap.add_argument("--min-run-s", type=float, help="shortest run (default: long enough to read other processes' "
                    "CPU to 0.05 cores, at least 0.5 s; --quick 0.2)")
    ap.add_argument("--limit-cores", type=float, default=0.15, help="discard runs where others used this much")
    ap.add_argument("--settle-s", type=float, default=0.3, help="pause before each run")
    ap.add_argument("--first-reps", type=int, help="fresh processes per contender (default 3; --quick 1)")
    ap.add_argument("--first-steady", type=int, default=3, help="steady calls after the first call")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--threads", type=int, help="threads for every contender (default: ORT, OpenVINO and PyTorch "
                    "the physical cores, ours as it ships); with taskset, a per-core comparison on a shared box")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="ours' dtype; bfloat16: its matrix products in bfloat16 (CPUs with AVX-512 BF16), and "
                    "OpenVINO's inference precision bf16 beside it (its CPU plugin's own bfloat16)")
    args = ap.parse_args()
    if args.threads:
        os.environ[THREADS_ENV] = str(args.threads)
    os.environ[OURS_DTYPE_ENV] = args.dtype
    cpu = cpu_description()
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.first_reps = args.first_reps or (1 if args.quick else 3)
    args.min_run_s = args.min_run_s or (0.2 if args.quick else max(0.5, resolution_cores(cpu["logical_cpus"], 1) / 0.05))
    args.contenders = [c for c in CONTENDERS if c in args.contenders]  # the fixed turn order
    header(args, cpu)
    root = Path(tempfile.mkdtemp(prefix="cpu-runtimes-"))
    rows, firsts, labels = {}, [], {}
    try:
        for key in (k for k in WORKLOADS if k in args.workloads or ("first-call" in args.workloads and k in FIRST_CALL)):
            workdir, info = prepare(key, args, root)
            if key in args.workloads:
                rows[key] = (info, steady_rows(key, workdir, info, args))
            if "first-call" in args.workloads and key in FIRST_CALL:
                print(f"  first calls ({args.first_reps} fresh process(es) per contender)", flush=True)
                labels[key] = info["label"]
                firsts += first_calls(key, workdir, info, args)
            shutil.rmtree(workdir)  # checkpoints and ONNX files run to hundreds of MB
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n# load average at the end: {load_average()}")
    if rows:
        steady_table(rows, args)
    if firsts:
        first_table(firsts, labels, args)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cpu": cpu, "versions": versions(), "quick": args.quick, "limit_cores": args.limit_cores, "dtype": args.dtype,
            "steady": {k: {"info": info, "results": res} for k, (info, res) in rows.items()},
            "first_call": firsts}, indent=1))
        print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
