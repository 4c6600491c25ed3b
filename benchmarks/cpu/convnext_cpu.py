"""ConvNeXt-Tiny 224 on the NumPy backend vs Hugging Face transformers' ConvNextModel on
PyTorch CPU, same random weights, same run, interleaved (the CI box is shared: the ratio is
what counts). Prints a ratio table (peer time / ours: > 1 means we are faster), the parity
error, and with --profile where our time goes, op by op, beside PyTorch's profiler.

    python benchmarks/cpu/convnext_cpu.py [--reps 5] [--batches 1 8] [--profile]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
from benchmarks.machine import describe_machine  # noqa: E402

from convkernels import get_backend  # noqa: E402
from models.convnext import PRESETS, build  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


class OpTimer:
    """Backend proxy that times each op the encoder calls, by role. Fused calls are split
    into their parts (linear+gelu -> matmul, gelu; linear+residual -> matmul, add) so the
    table says which part costs; the maths is unchanged."""

    def __init__(self, backend):
        self._bk = backend
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name):
        return getattr(self._bk, name)

    def _timed(self, role, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[role] += time.perf_counter() - t0
        self.calls[role] += 1
        return out

    def conv2d(self, x, w, bias=None, **kw):
        groups = kw.get("groups", 1)
        role = f"conv dw {w.shape[1]}x{w.shape[2]}" if groups > 1 else f"conv {w.shape[1]}x{w.shape[2]} s{kw.get('stride', 1)}"
        return self._timed(role, self._bk.conv2d, x, w, bias, **kw)

    def layer_norm(self, *a, **kw):
        return self._timed("layer_norm", self._bk.layer_norm, *a, **kw)

    def linear(self, x, w, b=None, *, residual=None, activation=None):
        out = self._timed("linear matmul+bias", self._bk.linear, x, w, b)
        if activation is not None:
            out = self._timed(f"{activation}", self._bk._activation, out, activation)
        if residual is not None:
            out = self._timed("residual add", self._bk.add, out, residual)
        return out

    def mean(self, *a, **kw):
        return self._timed("mean pool", self._bk.mean, *a, **kw)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds over all threads) of one call. CPU time is the steadier
    number on a shared box: waiting for a core costs wall time, not CPU time."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def hf_reference(preset: str, folder: Path):
    """transformers' ConvNextModel with the preset's architecture and random (non-trivial)
    weights, saved as a checkpoint our loader reads."""
    import torch
    import transformers
    p = PRESETS[preset]
    cfg = transformers.ConvNextConfig(depths=list(p["depths"]), hidden_sizes=list(p["dims"]),
                                      layer_scale_init_value=0.5)
    model = transformers.ConvNextModel(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model, torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="convnext-tiny")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--candidate-gelu", action="store_true",
                    help="what-if: swap the backend's GELU for convnext_numpy_probes.gelu_chunked_rational "
                         "in this process (the backend file is untouched)")
    ap.add_argument("--force-path", default=None,
                    help="force a conv path wherever its guard allows (e.g. depthwise_shift: the pure-NumPy "
                         "fallback when the C kernel is not built)")
    ap.add_argument("--candidate-dw", action="store_true",
                    help="what-if: the depthwise_shift path runs convnext_numpy_probes.dw_candidate "
                         "(use with --force-path depthwise_shift)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ref, torch = hf_reference(args.preset, Path(tmp))
        if args.threads:
            torch.set_num_threads(args.threads)
        backend = get_backend("numpy")
        ours = build("bench", args.preset, backend, tmp)
    if args.candidate_gelu:
        use_candidate_gelu(backend)
    backend.paths.forced = args.force_path
    if args.candidate_dw:
        import convnext_numpy_probes
        from convkernels.backends.numpy import conv as numpy_conv
        numpy_conv.conv_depthwise_shift = convnext_numpy_probes.dw_candidate
    print(f"machine: {describe_machine()}")
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]} (other jobs share these cores)")
    print(f"model: {args.preset} {args.size}x{args.size}, fp32, HF ConvNextModel (eager, channels-first) vs "
          f"ours (numpy backend, channels-last); median of {args.reps} after a warm-up, interleaved")
    print(f"{'batch':>5s} {'ours ms':>9s} {'torch ms':>9s} {'torch/ours':>10s} {'ours img/s':>10s} "
          f"{'ours cpu-s':>10s} {'torch cpu-s':>11s} {'cpu ratio':>9s} {'rel L2 (pooled)':>15s}")
    rng = np.random.default_rng(0)
    for n in args.batches:
        pixels = rng.random((n, args.size, args.size, 3), dtype=np.float32)
        x = torch.from_numpy(((pixels - MEAN) / STD).transpose(0, 3, 1, 2).copy())

        def run_torch():
            with torch.inference_mode():
                return ref(x).pooler_output

        got = ours.encode(pixels)["embedding"]
        want = run_torch().numpy()
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        ts_ours, ts_torch = [], []
        for _ in range(args.reps):  # interleave so load from other jobs hits both sides alike
            ts_ours.append(timed(lambda: ours.encode(pixels)))
            ts_torch.append(timed(run_torch))
        o, t = (statistics.median(w for w, _ in ts) for ts in (ts_ours, ts_torch))
        oc, tc = (statistics.median(c for _, c in ts) for ts in (ts_ours, ts_torch))
        print(f"{n:5d} {o * 1e3:9.1f} {t * 1e3:9.1f} {t / o:10.2f} {n / o:10.1f} "
              f"{oc:10.3f} {tc:11.3f} {tc / oc:9.2f} {err:15.2e}")

    paths = sorted({(c["op"], c["path"]) for c in backend.conv_choices()})
    print("conv paths chosen:", ", ".join(f"{op}->{path}" for op, path in paths),
          "(depthwise_shift runs the candidate)" if args.candidate_dw else "",
          "| GELU:", "chunked rational (candidate)" if args.candidate_gelu else "backend's")
    if args.profile:
        profile(ours, ref, torch, args)


def use_candidate_gelu(backend):
    from convnext_numpy_probes import gelu_chunked_rational
    real = backend._activation

    def activation(x, kind):
        return gelu_chunked_rational(x) if kind == "gelu" else real(x, kind)
    backend._activation = activation


def profile(ours, ref, torch, args):
    n = args.batches[-1]
    pixels = np.random.default_rng(1).random((n, args.size, args.size, 3), dtype=np.float32)
    timer = OpTimer(ours.backend)
    ours.backend, real = timer, ours.backend  # the layers are handed the model's backend per call
    try:
        t0 = time.perf_counter()
        for _ in range(args.reps):
            ours.encode(pixels)
        total = (time.perf_counter() - t0) / args.reps
    finally:
        ours.backend = real
    print(f"\nours, batch {n}: {total * 1e3:.1f} ms per encode")
    for role, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1]):
        per = s / args.reps
        print(f"  {role:22s} {per * 1e3:8.1f} ms {100 * per / total:5.1f}%  ({timer.calls[role] // args.reps} calls)")

    from torch.profiler import ProfilerActivity, profile as tprof
    x = torch.from_numpy(((pixels - MEAN) / STD).transpose(0, 3, 1, 2).copy())
    with torch.inference_mode(), tprof(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.reps):
            ref(x)
    print(f"\ntorch, batch {n} (self CPU time per forward):")
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    for e in rows:
        print(f"  {e.key:28s} {e.self_cpu_time_total / 1e3 / args.reps:8.1f} ms  ({e.count // args.reps} calls)")


if __name__ == "__main__":
    main()
