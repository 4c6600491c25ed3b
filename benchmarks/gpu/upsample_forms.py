"""The CUDA backend's two forms of upsample_conv2d (nearest 2x + 3x3 conv; convkernels/backends/
cuda/upsample.py) side by side, in one process on one GPU: the transposed conv (the default) and
the phase form (a forward 2x2 conv + one copy placing its phases), each forced
(CudaOptions.upsample_form); `auto` picks between them by size.

1. The op alone at the upsampler shapes of the decoders (CUDA events, median of --reps after warm-up,
   the residual joined as Wan 2.2's DupUp3D shortcut does where marked).
2. Whole decodes with each form (host latents to host pixels, CUDA graphs as served), and the two
   forms' outputs' distance from each other (same function; only the rounding differs).

Run (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/gpu/upsample_forms.py [--reps 20]
[--only ops,taesd,sd,flux2,qwen,wan22] [--dtype bfloat16] [--op-dtypes bfloat16,float16].
Writes $OUT/upsample_forms.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_models import wall  # noqa: E402  (the shared wall-clock helper)
from gpu_ops import CpEvents, bench  # noqa: E402  (the shared CUDA-event timing)
from sharded_decode import rel_l2  # noqa: E402

#: (label, N, H, W, C in = C out, residual): the upsamplers' inputs, one frame of a video (N = frames)
OP_SHAPES = [
    ("wan2.2 720p 88x160 -> 176x320, 1024 ch, 4 frames", 4, 88, 160, 1024, True),
    ("wan2.2 720p 176x320 -> 352x640, 512 ch, 4 frames", 4, 176, 320, 512, True),
    ("wan2.1 480p 120x208 -> 240x416, 384 ch, 4 frames", 4, 120, 208, 384, False),
    ("wan2.1 480p 60x104 -> 120x208, 384 ch, 1 frame", 1, 60, 104, 384, False),
    ("sd-vae 512 64x64 -> 128x128, 512 ch", 1, 64, 64, 512, False),
    ("sd-vae 512 128x128 -> 256x256, 512 ch", 1, 128, 128, 512, False),
    ("sd-vae 512 256x256 -> 512x512, 256 ch", 1, 256, 256, 256, False),
    ("taesd 1024 128x128 -> 256x256, 64 ch", 1, 128, 128, 64, False),
    ("taesd 1024 256x256 -> 512x512, 64 ch", 1, 256, 256, 64, False),
    ("taesd 1024 512x512 -> 1024x1024, 64 ch", 1, 512, 512, 64, False),
]
#: the forms a decode is timed in: each forced, then the default's choice by size
DECODE_FORMS = ("transposed", "phases", "auto")

#: (section, label, preset, latents shape, decode keywords)
DECODES = [
    ("wan22", "wan2.2-vae 121x704x1280", "wan2.2-vae", (1, 48, 31, 44, 80), {"uint8": True}),
    ("taesd", "taesd 1024x1024", "taesd", (1, 4, 128, 128), {}),
    ("sd", "sd-vae 512x512", "sd-vae", (1, 4, 64, 64), {}),
    ("flux2", "flux2-vae 1024x1024", "flux2-vae", (1, 128, 64, 64), {}),
    ("qwen", "qwen-image-vae 1328x1328", "qwen-image-vae", (1, 16, 166, 166), {}),
]


def time_op(be, dtype, label, n, h, w, c, with_r, rng, reps) -> dict:
    """One upsampler shape in both forms, forced: CUDA events, median of `reps` after warm-up."""
    import cupy as cp

    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wt = (rng.standard_normal((c, 3, 3, c)) / np.sqrt(9 * c)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    r = rng.standard_normal((n, 2 * h, 2 * w, c)).astype(np.float32) if with_r else None
    ms, outs = {}, {}
    for form in ("transposed", "phases"):
        k = be(dtype, form)
        xd, wd, bd = k.asarray(x), k.asarray(wt), k.asarray(b)
        rd = None if r is None else k.asarray(r)
        run = lambda: k.upsample_conv2d(xd, wd, bd, residual=rd)  # noqa: E731
        ms[form] = bench(run, CpEvents(cp), warm=3, reps=reps)
        outs[form] = k.to_host(run())
    gflop = 2 * 4 * 4 * n * h * w * c * c / 1e9  # 4 taps per output, 4 outputs per input pixel
    row = dict(kind="op", workload=label, dtype=dtype, positions=n * h * w, transposed_ms=ms["transposed"],
               phases_ms=ms["phases"], rel_l2_between=rel_l2(outs["phases"], outs["transposed"]))
    print(f"{label + ' ' + dtype:60s} transposed {ms['transposed']:8.3f} ms ({gflop / ms['transposed']:5.0f} TFLOP/s)"
          f"  phases {ms['phases']:8.3f} ms ({gflop / ms['phases']:5.0f} TFLOP/s)  transposed / phases "
          f"{ms['transposed'] / ms['phases']:5.2f}x  rel L2 between {row['rel_l2_between']:.1e}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="ops,taesd,sd,flux2,qwen,wan22")
    ap.add_argument("--dtype", default="bfloat16", help="the image decoders' dtype (TAESD: float16 always)")
    ap.add_argument("--op-dtypes", default="bfloat16,float16", help="the op section's dtypes")
    ap.add_argument("--reps", type=int, default=20, help="op and image decode repetitions (Wan 2.2: 2)")
    args = ap.parse_args()
    only = set(args.only.split(","))

    import cupy as cp

    from convkernels import get_backend
    from models import load_model

    def csync():
        cp.cuda.get_current_stream().synchronize()

    backends = {}

    def be(dtype, form):
        if (dtype, form) not in backends:
            backends[dtype, form] = get_backend("cuda", dtype=dtype, upsample_form=form)
        return backends[dtype, form]

    rng = np.random.default_rng(0)
    rows = []
    gpu = be(args.dtype, "auto").gpu_name
    if "ops" in only:
        for dtype in args.op_dtypes.split(","):
            for label, n, h, w, c, with_r in OP_SHAPES:
                rows.append(time_op(be, dtype, label, n, h, w, c, with_r, rng, args.reps))
    for section, label, preset, shape, kw in DECODES:
        if section not in only:
            continue
        dtype = "float16" if preset == "taesd" else args.dtype
        lat = rng.standard_normal(shape).astype(np.float32)
        ms, outs, first = {}, {}, {}
        for form in DECODE_FORMS:
            model = load_model(label, preset, be(dtype, form))
            t0 = time.time()
            model.decode(lat, tiled=False, **kw)
            first[form] = time.time() - t0
            reps = args.reps if preset != "wan2.2-vae" else 2
            ms[form] = wall(lambda: model.decode(lat, tiled=False, **kw), 1, reps, csync)
            outs[form] = np.asarray(model.decode(lat, tiled=False, **kw), np.float32)
            model = None
            cp.get_default_memory_pool().free_all_blocks()
        row = dict(kind="decode", workload=label, dtype=dtype, ms=ms, first_call_s=first,
                   rel_l2_between=rel_l2(outs["phases"], outs["transposed"]))
        rows.append(row)
        print(f"{label + ' ' + dtype:52s} " + "  ".join(f"{f} {ms[f]:9.2f} ms" for f in DECODE_FORMS)
              + f"  transposed / auto {ms['transposed'] / ms['auto']:5.2f}x  rel L2 phases vs transposed "
              f"{row['rel_l2_between']:.1e}", flush=True)
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=gpu, cupy=cp.__version__)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "upsample_forms.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print(f"# upsample_conv2d forms, {env['date']}, {gpu}: op ratios > 1: the phase form faster; "
          f"decode ratios > 1: auto (the default) faster than the transposed form")


if __name__ == "__main__":
    main()
