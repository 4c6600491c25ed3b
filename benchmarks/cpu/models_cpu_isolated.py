"""Whole-model CPU timings with ours and the peer each in its own process, one after the other.

models_cpu.py interleaves both in one process to cancel load drift on a shared box; on a quiet
machine that costs both sides: OpenBLAS's and torch's OpenMP threads keep spinning after their
calls and steal the two cores from the other runtime (ConvNeXt-T b1: ours 76 ms alone vs 273 ms
interleaved; torch 59 ms vs 136 ms). A server runs one runtime, so this is the deployment figure.
Random weights on both sides (parity is tested in tests/ and checked by models_cpu.py).

    python benchmarks/cpu/models_cpu_isolated.py [--reps 5] [--only wan]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKLOADS = [  # name, kind, preset, shape (ours: NHWC pixels or NCHW latents)
    ("convnext-tiny 224 batch 1", "encoder", "convnext-tiny", (1, 224, 224, 3)),
    ("convnext-tiny 224 batch 8", "encoder", "convnext-tiny", (8, 224, 224, 3)),
    ("sd-vae decode 32x32 -> 256x256", "decoder", "sd-vae", (1, 4, 32, 32)),
    ("sd-vae decode 64x64 -> 512x512", "decoder", "sd-vae", (1, 4, 64, 64)),
    ("wan2.1-vae decode 2x16x16 -> 5x128x128", "video", "wan2.1-vae", (1, 16, 2, 16, 16)),
    ("wan2.1-vae decode 5x16x16 -> 17x128x128", "video", "wan2.1-vae", (1, 16, 5, 16, 16)),
    ("taesd decode 64x64 -> 512x512", "tiny", "taesd", (1, 4, 64, 64)),
    ("taesd decode 128x128 -> 1024x1024", "tiny", "taesd", (1, 4, 128, 128)),
    # the other 2026 families, at small sizes: the published configs are wide
    ("flux2-vae decode 128x16x16 -> 256x256", "flux2", "flux2-vae", (1, 128, 16, 16)),
    ("qwen-image-vae decode 16x32x32 -> 256x256", "qwen", "qwen-image-vae", (1, 16, 32, 32)),
    ("wan2.2-vae decode 48x2x8x8 -> 5x128x128", "wan22", "wan2.2-vae", (1, 48, 2, 8, 8)),
    # the 2026 families: the diffusers class built from our preset's config (the published one)
    ("hunyuanvideo1.5-vae decode 32x2x8x8 -> 5x128x128", "family:AutoencoderKLHunyuanVideo15",
     "hunyuanvideo1.5-vae", (1, 32, 2, 8, 8)),
    ("ltx2-vae decode 128x2x4x4 -> 9x128x128", "family:AutoencoderKLLTX2Video", "ltx2-vae", (1, 128, 2, 4, 4)),
    ("dc-ae-f32c32 decode 32x8x8 -> 256x256", "family:AutoencoderDC", "dc-ae-f32c32", (1, 32, 8, 8)),
    ("hunyuanimage2.1-vae decode 64x8x8 -> 256x256", "family:AutoencoderKLHunyuanImage", "hunyuanimage2.1-vae",
     (1, 64, 8, 8)),
    ("qwen-image2.1-vae decode 64x16x16 -> 256x256", "family:AutoencoderKLQwenImage21", "qwen-image2.1-vae",
     (1, 64, 16, 16)),
]

OURS = """
import json, sys, time, numpy as np
from convkernels import get_backend
from models import load_model
kind, preset, shape, reps = sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3])), int(sys.argv[4])
m = load_model("bench", preset, get_backend("numpy"))
x = np.random.default_rng(0).random(shape, dtype=np.float32)
run = (lambda: m.encode(x)) if kind == "encoder" else (lambda: m.decode(x, tiled=False))
for _ in range(2):
    run()
ts = []
for _ in range(reps):
    t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
print(json.dumps(sorted(ts)[len(ts) // 2]))
"""

PEER = """
import json, sys, time, torch
kind, preset, shape, reps = sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3])), int(sys.argv[4])
torch.set_num_threads(2)
if kind == "video":
    from diffusers import AutoencoderKLWan
    from models.wan_vae import PRESETS
    model = AutoencoderKLWan(**PRESETS[preset]).eval()
    x = torch.rand(*shape)
    run = lambda: model.decode(x)
elif kind == "tiny":  # diffusers AutoencoderTiny's defaults are taesd's
    from diffusers import AutoencoderTiny
    model = AutoencoderTiny().eval()
    x = torch.rand(*shape)
    run = lambda: model.decode(x)
elif kind == "flux2":  # the pipeline's grid N,128,h,w -> AutoencoderKLFlux2's N,32,2h,2w (its defaults: FLUX.2-dev)
    from diffusers import AutoencoderKLFlux2
    model = AutoencoderKLFlux2().eval()
    n, c, h, w = shape
    x = torch.rand(n, c // 4, 2 * h, 2 * w)
    run = lambda: model.decode(x)
elif kind == "qwen":  # AutoencoderKLQwenImage's defaults are Qwen-Image's; it takes N,16,1,h,w
    from diffusers import AutoencoderKLQwenImage
    model = AutoencoderKLQwenImage().eval()
    x = torch.rand(shape[0], shape[1], 1, shape[2], shape[3])
    run = lambda: model.decode(x)
elif kind == "wan22":
    from diffusers import AutoencoderKLWan
    from models.wan22_vae import PRESETS
    model = AutoencoderKLWan(**PRESETS[preset]).eval()
    x = torch.rand(*shape)
    run = lambda: model.decode(x)
elif kind.startswith("family:"):  # N,C,(T,)h,w as the pipeline hands vae.decode (Qwen-Image 2.1: N,C,1,h,w)
    import diffusers
    from models import PRESETS
    model = getattr(diffusers, kind.split(":", 1)[1])(**PRESETS[preset].config).eval()
    x = torch.rand(*shape)
    x = x[:, :, None] if kind.endswith("QwenImage21") else x
    run = lambda: model.decode(x)
elif kind == "encoder":
    import transformers
    cfg = transformers.ConvNextConfig(depths=[3, 3, 9, 3], hidden_sizes=[96, 192, 384, 768])
    model = transformers.ConvNextModel(cfg).eval()
    x = torch.rand(shape[0], 3, shape[1], shape[2])
    run = lambda: model(x)
else:
    from diffusers import AutoencoderKL
    model = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                          down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                          norm_num_groups=32).eval()
    x = torch.rand(*shape)
    run = lambda: model.decode(x)
with torch.no_grad():
    for _ in range(2):
        run()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
print(json.dumps(sorted(ts)[len(ts) // 2]))
"""


def timed(code: str, *args) -> float:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         check=True, cwd=HERE.parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="run the workloads whose name contains this (e.g. wan)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parents[1]))
    from benchmarks.machine import describe_machine
    print(f"machine: {describe_machine()}")
    print("| workload | ours (numpy, own process) | PyTorch CPU (own process) | peer/ours |")
    print("| --- | --- | --- | --- |")
    for name, kind, preset, shape in WORKLOADS:
        if args.only not in name:
            continue
        reps = args.reps if kind == "encoder" else max(3, args.reps // 2)
        ours = timed(OURS, kind, preset, json.dumps(shape), reps)
        peer = timed(PEER, kind, preset, json.dumps(shape), reps)
        print(f"| {name} | {ours * 1e3:.0f} ms | {peer * 1e3:.0f} ms | {peer / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
