"""GPU op benchmark: the CUDA backend (CuPy + cuDNN frontend, autotuned plans) vs PyTorch
(cuDNN, benchmark mode, channels-last) on the same GPU in the same run, per docs/peers.md's kernel
workloads. Prints ours / torch as a ratio (below 1 = we are faster) and writes JSON to $OUT.

Timing: CUDA events around each call from Python (so per-call Python overhead counts, as it
does in serving), warm-up first, median of `REPS` calls, inputs fixed (not zeros).
Run on a GPU machine: PYTHONPATH=. python3 benchmarks/gpu/gpu_ops.py
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys

import numpy as np

REPS = 30


def bench(fn, sync_event_mod, warm=5, reps=REPS):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        s, e = sync_event_mod()
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_ms(e))
    return statistics.median(ts)


class CpEvents:
    def __init__(self, cp):
        self.cp = cp

    def __call__(self):
        cp = self.cp

        class E:
            def __init__(self):
                self.ev = cp.cuda.Event()

            def record(self):
                self.ev.record()

            def synchronize(self):
                self.ev.synchronize()

            def elapsed_ms(self, other):
                return cp.cuda.get_elapsed_time(self.ev, other.ev)
        return E(), E()


class TorchEvents:
    def __init__(self, torch):
        self.torch = torch

    def __call__(self):
        torch = self.torch

        class E:
            def __init__(self):
                self.ev = torch.cuda.Event(enable_timing=True)

            def record(self):
                self.ev.record()

            def synchronize(self):
                self.ev.synchronize()

            def elapsed_ms(self, other):
                return self.ev.elapsed_time(other.ev)
        return E(), E()


def main():
    import cupy as cp
    import torch
    import torch.nn.functional as F

    from convkernels import ConvSpec, get_backend

    torch.backends.cudnn.benchmark = True
    cpe, tte = CpEvents(cp), TorchEvents(torch)
    rng = np.random.default_rng(0)
    results = {}
    backends = {dt: get_backend("cuda", dtype=dt, autotune=True) for dt in ("float16", "bfloat16")}
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}

    def tensors(dt, x_shape, w_shape, scale=1.0):
        x = (rng.standard_normal(x_shape) * scale).astype(np.float32)
        w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
        return x, w

    def torch_cl(a_nhwc, dt):
        t = torch.from_numpy(a_nhwc).to("cuda", tdt[dt])
        return t.movedim(-1, 1)  # a channels-last view of NCHW, no copy

    def run_conv(name, dt, x_shape, w_shape, spec, torch_fn, bias=False, act=None, path=None):
        be = backends[dt]
        x, w = tensors(dt, x_shape, w_shape)
        b = rng.standard_normal(w_shape[0]).astype(np.float32) if bias else None
        xd, wd = be.asarray(x), be.asarray(w)
        bd = be.asarray(b) if bias else None
        old = be.paths.forced
        be.paths.clear()  # forget memoised choices, or `forced` would not apply to a seen key
        be.paths.forced = path
        ours = bench(lambda: be.conv(xd, wd, spec, bd, activation=act), cpe)
        chosen = [c["path"] for c in be.conv_choices()]
        be.paths.forced = old
        be.paths.clear()
        xt = torch_cl(x, dt)
        wt = torch.from_numpy(w).to("cuda", tdt[dt]).movedim(-1, 1)
        bt = torch.from_numpy(b).to("cuda", tdt[dt]) if bias else None
        theirs = bench(lambda: torch_fn(xt, wt, bt), tte)
        results[name] = dict(ours_ms=ours, torch_ms=theirs, ratio=ours / theirs, path=chosen)

    s11 = ConvSpec.make(2, 1, 1)
    run_conv("conv3x3 512->512 64x64 +bias+relu fp16 n1", "float16", (1, 64, 64, 512), (512, 3, 3, 512), s11,
             lambda x, w, b: F.relu(F.conv2d(x, w, b, padding=1)), bias=True, act="relu")
    run_conv("conv3x3 128->128 256x256 fp16 n1", "float16", (1, 256, 256, 128), (128, 3, 3, 128), s11,
             lambda x, w, b: F.conv2d(x, w, padding=1))
    for n, c, s in ((1, 384, 14), (16, 384, 14), (1, 96, 56), (32, 96, 56)):
        spec = ConvSpec.make(2, 1, 3, groups=c)
        for path in (None, "cudnn", "depthwise_direct"):
            run_conv(f"depthwise7x7 c{c} {s}x{s} fp16 n{n} [{path or 'chosen'}]", "float16", (n, s, s, c),
                     (c, 7, 7, 1), spec, lambda x, w, b, c=c: F.conv2d(x, w, padding=3, groups=c), path=path)
    spec3 = ConvSpec.make(3, 1, ((0, 0), (1, 1), (1, 1)))
    for path in (None, "small_kd_2d"):
        run_conv(f"conv3d 3x3x3 256ch 19x64x64 bf16 [{path or 'chosen'}]", "bfloat16", (1, 19, 64, 64, 256),
                 (256, 3, 3, 3, 256), spec3, lambda x, w, b: F.conv3d(x, w, padding=(0, 1, 1)), path=path)
    spec_t = ConvSpec.make(2, 2, 1, transpose=True)

    def torch_convT(x, w, b):
        return F.conv_transpose2d(x, w, stride=2, padding=1)
    # our transposed weight is O,k,k,I; torch's is I,O,k,k: for square channel counts the
    # random weights are the same distribution, the ratio compares equal work
    run_conv("conv_transpose2d k4s2 256ch 64->128 fp16", "float16", (1, 64, 64, 256), (256, 4, 4, 256), spec_t,
             torch_convT)

    be = backends["float16"]
    x = rng.standard_normal((1, 64, 64, 512)).astype(np.float32)
    g = rng.standard_normal(512).astype(np.float32)
    xd, gd = be.asarray(x), be.asarray(g)
    ours = bench(lambda: be.group_norm(xd, 32, gd, gd, 1e-6, activation="silu"), cpe)
    xt, gt = torch_cl(x, "float16"), torch.from_numpy(g).cuda().half()
    theirs = bench(lambda: F.silu(F.group_norm(xt, 32, gt, gt, 1e-6)), tte)
    results["group_norm+silu 512ch 64x64 fp16"] = dict(ours_ms=ours, torch_ms=theirs, ratio=ours / theirs)

    q = rng.standard_normal((1, 1, 4096, 512)).astype(np.float32)
    qd = be.asarray(q)
    ours = bench(lambda: be.attention(qd, qd, qd), cpe)
    qt = torch.from_numpy(q).cuda().half()
    theirs = bench(lambda: F.scaled_dot_product_attention(qt, qt, qt), tte)
    results["attention L4096 D512 fp16"] = dict(ours_ms=ours, torch_ms=theirs, ratio=ours / theirs)

    # bfloat16: the mid-block of a 512x512 and a 1024x1024 image's decode (4096, 16384 tokens)
    bf = backends["bfloat16"]
    for tokens in (4096, 16384):
        q = rng.standard_normal((1, 1, tokens, 512)).astype(np.float32)
        qd, qt = bf.asarray(q), torch.from_numpy(q).cuda().bfloat16()
        ours = bench(lambda: bf.attention(qd, qd, qd), cpe)
        theirs = bench(lambda: F.scaled_dot_product_attention(qt, qt, qt), tte)
        results[f"attention L{tokens} D512 bf16"] = dict(ours_ms=ours, torch_ms=theirs, ratio=ours / theirs)

    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cudnn_torch=torch.backends.cudnn.version(),
               cudnn_ours=be.cudnn_version, cupy=cp.__version__, host=platform.node(), python=sys.version.split()[0],
               plan_cache=be.plan_cache_stats(), small_kd_measurements={str(k.x_shape): v for k, v in
                                                                       backends["bfloat16"].measurements.items()})
    out = dict(env=env, results=results)
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "gpu_ops.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"# GPU ops, {env['gpu']}, ours (CuPy + cuDNN frontend {be.cudnn_version}, autotune) vs "
          f"PyTorch {torch.__version__} cuDNN {env['cudnn_torch']} benchmark mode, same run")
    print(f"{'workload':55s} {'ours ms':>9s} {'torch ms':>9s} {'ours/torch':>10s}  path")
    for k, v in results.items():
        print(f"{k:55s} {v['ours_ms']:9.4f} {v['torch_ms']:9.4f} {v['ratio']:10.2f}  {','.join(v.get('path', []))}")
    if "--profile" in sys.argv:
        profile_host_overhead(be, rng)


def profile_host_overhead(be, rng, calls=500):
    """Where a small conv's host time goes (cProfile over many calls of a launch-bound conv)."""
    import cProfile
    import pstats

    from convkernels import ConvSpec

    x = be.asarray(rng.standard_normal((1, 14, 14, 384)).astype(np.float32))
    w = be.asarray(rng.standard_normal((384, 7, 7, 1)).astype(np.float32))
    b = be.asarray(rng.standard_normal(384).astype(np.float32))
    spec = ConvSpec.make(2, 1, 3, groups=384)
    for _ in range(10):
        be.conv(x, w, spec, b, activation="gelu")
    be.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        be.conv(x, w, spec, b, activation="gelu")
    prof.disable()
    be.synchronize()
    print(f"# host profile, {calls} depthwise 7x7 convs (+bias+gelu)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)

    # attention pieces, device time each (events)
    import cupy as cp
    from convkernels.backends.cuda.kernels import Kernels
    q = be.asarray(rng.standard_normal((1, 1, 4096, 512)).astype(np.float32))
    kt = cp.swapaxes(q, -1, -2)
    kern = Kernels.for_dtype("float16")
    ev = CpEvents(cp)
    pieces = {
        "qk^T (swapaxes view)": lambda: cp.matmul(q, kt),
        "qk^T (2-d)": lambda: cp.matmul(q[0, 0], kt[0, 0]),
    }
    s_ = cp.matmul(q, kt)
    pieces["softmax 4096x4096"] = lambda: kern.softmax_rows(s_, 0.04)
    pieces["pv"] = lambda: cp.matmul(s_, q)
    for name, fn in pieces.items():
        print(f"attention piece {name:24s} {bench(fn, ev):.4f} ms")


if __name__ == "__main__":
    main()
