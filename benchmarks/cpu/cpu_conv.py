"""NumPy backend vs PyTorch CPU (and MLX CPU where installed) on the conv shapes the project
measures its peers on (docs/peers.md). Prints a ratio table (peer time / ours: > 1 means we are faster).

    python benchmarks/cpu/cpu_conv.py [--reps 5] [--no-mlx] [--same-process]

Each runtime runs in a process of its own, one after the other, as each would in deployment:
with PyTorch imported first, our C kernels bind to torch's bundled libgomp (spinning threads that
fight OpenBLAS's for the cores) and 3x3 512ch ran 107 ms instead of 77 ms. --same-process
measures all runtimes in one process, interleaved per shape (the old way). Each time is the
median of at least --reps calls and at least 0.5 s of calls.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

# name, N, H, W, C_in, C_out, k, groups, target ratio (peer/ours)
SHAPES = [
    ("3x3 512->512 64x64", 1, 64, 64, 512, 512, 3, 1, 0.8),
    ("3x3 128->128 256x256", 1, 256, 256, 128, 128, 3, 1, 0.8),
    ("dw7x7 96ch 56x56", 1, 56, 56, 96, 96, 7, 96, 0.5),
    ("dw7x7 384ch 14x14", 1, 14, 14, 384, 384, 7, 384, 0.5),
]


def timeit(fn, reps, min_seconds=0.5):
    """Median of at least `reps` calls, and of enough calls to fill `min_seconds`: five samples of
    a 0.2 ms conv are mostly timer noise and the other runtime's threads winding down."""
    fn()
    ts = []
    start = time.perf_counter()
    while len(ts) < reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def operands(shape):
    name, n, h, w, cin, cout, k, g, _ = shape
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x = rng.standard_normal((n, h, w, cin)).astype(np.float32)
    wt = (rng.standard_normal((cout, k, k, cin // g)) * 0.05).astype(np.float32)
    return x, wt, k, g


def runner(side: str):
    """shape -> a no-argument call running that conv on `side` (imports only that runtime)."""
    if side == "ours":
        from convkernels import get_backend
        be = get_backend("numpy")

        def make(shape):
            x, wt, k, g = operands(shape)
            return lambda: be.conv2d(x, wt, padding=k // 2, groups=g)
        return make, lambda: sorted({(c["op"], c["path"]) for c in be.conv_choices()})
    if side == "torch":
        import torch
        import torch.nn.functional as F

        def make(shape):
            x, wt, k, g = operands(shape)
            xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
            wtt = torch.from_numpy(wt).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)

            def run():
                with torch.no_grad():
                    F.conv2d(xt, wtt, padding=k // 2, groups=g)
            return run
        return make, lambda: None
    import mlx.core as mx

    def make(shape):
        x, wt, k, g = operands(shape)
        xm, wm = mx.array(x), mx.array(wt)
        return lambda: mx.eval(mx.conv2d(xm, wm, padding=k // 2, groups=g))
    return make, lambda: None


def measure(side: str, reps: int) -> dict:
    make, extra = runner(side)
    times = {}
    for shape in SHAPES:
        times[shape[0]] = timeit(make(shape), reps if side != "mlx" else max(1, reps // 2))
    return {"times": times, "extra": extra()}


def in_child(side: str, reps: int) -> dict | None:
    r = subprocess.run([sys.executable, __file__, "--side", side, "--reps", str(reps)], capture_output=True, text=True)
    if r.returncode != 0:
        if side == "mlx":
            return None
        raise SystemExit(f"{side} run failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-mlx", action="store_true")
    ap.add_argument("--same-process", action="store_true", help="all runtimes in this process (interleaved)")
    ap.add_argument("--side", choices=("ours", "torch", "mlx"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args.reps)))
        return
    sides = ["ours", "torch"] + ([] if args.no_mlx else ["mlx"])
    if args.same_process:
        sys.path.insert(0, str(HERE.parents[1]))
        importlib.import_module("benchmarks.machine")  # torch before convkernels, as the peers expect
        makers = {}
        for side in sides:
            try:
                makers[side] = runner(side)
            except ImportError:
                pass
        res = {side: {"times": {}, "extra": None} for side in makers}
        for shape in SHAPES:
            for side, (make, _) in makers.items():
                res[side]["times"][shape[0]] = timeit(make(shape), args.reps if side != "mlx" else max(1, args.reps // 2))
        res["ours"]["extra"] = makers["ours"][1]()
    else:
        res = {side: in_child(side, args.reps) for side in sides}
        res = {k: v for k, v in res.items() if v is not None}
    sys.path.insert(0, str(HERE.parents[1]))
    from benchmarks import machine  # after the children: torch is imported here only
    print(f"machine: {machine.describe_machine()}")
    print("each runtime in " + ("one shared process, interleaved" if args.same_process else "its own process"))
    head = f"{'conv (NHWC, fp32, batch 1)':26s} {'ours ms':>9s} {'torch ms':>9s} {'torch/ours':>10s} {'target':>7s}"
    if "mlx" in res:
        head += f" {'mlx-cpu ms':>10s} {'mlx/ours':>9s}"
    print(head)
    for name, *_, target in SHAPES:
        ours, peer = res["ours"]["times"][name], res["torch"]["times"][name]
        line = f"{name:26s} {ours * 1e3:9.2f} {peer * 1e3:9.2f} {peer / ours:10.2f} {target:7.1f}"
        if "mlx" in res:
            mt = res["mlx"]["times"][name]
            line += f" {mt * 1e3:10.1f} {mt / ours:9.2f}"
        print(line, flush=True)
    print("path choices:", res["ours"]["extra"])


if __name__ == "__main__":
    main()
