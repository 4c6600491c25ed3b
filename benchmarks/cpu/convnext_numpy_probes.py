"""Candidate NumPy formulations for the two ops that dominate ConvNeXt on the NumPy backend,
timed against the backend's current code and PyTorch CPU in the same run (interleaved, best
of --reps, because the CI box is shared). Errors are relative L2 vs torch in float64.

- GELU (exact, erf): the backend evaluates a 10-term erfc polynomial with exp over the whole
  tensor (~30 full-size temporaries). Candidate: a rational erf (Eigen/XLA's float32
  coefficients; no exp) evaluated in place, in chunks that stay in L2.
- depthwise 7x7: `depthwise_shift` does 49 full-size multiply + add passes; `depthwise_direct`
  is the optional C kernel. Candidates: the same shifts over row blocks that stay in L2, and a
  per-channel banded (Toeplitz) gemm over the width axis, which trades ~(W+6)/7 times more
  multiplies for BLAS speed.

    python benchmarks/cpu/convnext_numpy_probes.py [--reps 7] [--only gelu|dw]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
from benchmarks.machine import describe_machine  # noqa: E402

from convkernels.backends.numpy import conv as nc  # noqa: E402
from convkernels.backends.numpy.activations import apply_activation  # noqa: E402
from convkernels.spec import ConvKey, ConvSpec  # noqa: E402

# Eigen's generic_fast_erf_float (also XLA's): erf(z) ~ z * P(z^2) / Q(z^2) on [-4, 4]
ERF_P = [-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
         -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02]
ERF_Q = [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
         -1.42647390514189e-02]


def gelu_chunked_rational(x: np.ndarray, bias: np.ndarray | None = None, chunk: int = 1 << 15) -> np.ndarray:
    """GELU(x + bias), exact-erf form, in place over L2-sized chunks (bias fused in the same
    sweep: the linear's epilogue becomes one pass instead of two)."""
    c = x.shape[-1]
    rows = max(1, chunk // c)
    flat = x.reshape(-1, c)
    out = np.empty_like(flat)
    z, z2, p, q = (np.empty((rows, c), np.float32) for _ in range(4))
    inv_sqrt2 = np.float32(1 / math.sqrt(2))
    pc = [np.float32(v) for v in ERF_P]
    qc = [np.float32(v) for v in ERF_Q]
    for r0 in range(0, flat.shape[0], rows):
        xs = flat[r0:r0 + rows]
        m = xs.shape[0]
        v, zz, zz2, pp, qq = out[r0:r0 + m], z[:m], z2[:m], p[:m], q[:m]
        if bias is not None:
            np.add(xs, bias, out=v)
        else:
            v[...] = xs
        np.multiply(v, inv_sqrt2, out=zz)
        np.clip(zz, -4.0, 4.0, out=zz)
        np.multiply(zz, zz, out=zz2)
        np.multiply(zz2, pc[0], out=pp)
        pp += pc[1]
        for coef in pc[2:]:
            pp *= zz2
            pp += coef
        pp *= zz
        np.multiply(zz2, qc[0], out=qq)
        qq += qc[1]
        for coef in qc[2:]:
            qq *= zz2
            qq += coef
        pp /= qq          # erf(v / sqrt 2)
        pp += 1.0
        pp *= 0.5
        v *= pp
    return out.reshape(x.shape)


def dw_shift_blocked(x: np.ndarray, w: np.ndarray, pad: int, block_bytes: int = 1 << 18) -> np.ndarray:
    """The backend's 49 shifted multiply-adds, over blocks of output rows sized to stay in L2."""
    n, h, wd, c = x.shape
    k = w.shape[1]
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    taps = w.reshape(c, -1).T
    out = np.empty_like(x)
    rb = max(1, block_bytes // (wd * c * 4))
    acc = np.empty((rb, wd, c), x.dtype)
    tmp = np.empty_like(acc)
    for b in range(n):
        for r0 in range(0, h, rb):
            r1 = min(h, r0 + rb)
            a, t = acc[:r1 - r0], tmp[:r1 - r0]
            np.multiply(xp[b, r0:r1, 0:wd], taps[0], out=a)
            for ti in range(1, k * k):
                i, j = divmod(ti, k)
                np.multiply(xp[b, r0 + i:r1 + i, j:j + wd], taps[ti], out=t)
                a += t
            out[b, r0:r1] = a
    return out


def dw_toeplitz(x: np.ndarray, w: np.ndarray, pad: int) -> np.ndarray:
    """Per channel c: out_c (N*H, W) = [x_c rows h..h+6 side by side] (N*H, 7*Wp) @ T_c
    (7*Wp, W), T_c banded with the kernel rows; one batched gemm over channels."""
    n, h, wd, c = x.shape
    k = w.shape[1]
    wp = wd + 2 * pad
    xc = np.ascontiguousarray(np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0))).transpose(3, 0, 1, 2))
    s = xc.strides
    a = np.lib.stride_tricks.as_strided(xc, (c, n, h, k, wp), (s[0], s[1], s[2], s[2], s[3]))
    a = a.reshape(c, n * h, k * wp)
    t = np.zeros((c, k, wp, wd), x.dtype)
    cols = np.arange(wd)
    wr = w.reshape(c, k, k)
    for kw in range(k):
        t[:, :, cols + kw, cols] = wr[:, :, kw][:, :, None]
    out = np.matmul(a, t.reshape(c, k * wp, wd))
    return np.ascontiguousarray(out.reshape(c, n, h, wd).transpose(1, 2, 3, 0))


def dw_candidate(x: np.ndarray, w: np.ndarray, key: ConvKey, original=nc.conv_depthwise_shift) -> np.ndarray:
    """Drop-in for numpy.conv.conv_depthwise_shift: banded gemm on maps up to 28 wide, row-blocked
    shifts above; anything but stride 1 / dilation 1 / symmetric 'same' padding goes to `original`."""
    spec = key.spec
    k = key.kernel
    simple = (spec.nd == 2 and k[0] == k[1] and k[0] % 2 == 1 and spec.stride == (1, 1)
              and spec.dilation == (1, 1) and all(p == (k[0] // 2, k[0] // 2) for p in spec.padding))
    if not simple:
        return original(x, w, key)
    return dw_toeplitz(x, w, k[0] // 2) if x.shape[2] <= 28 else dw_shift_blocked(x, w, k[0] // 2)


def best_of(fns: dict, reps: int) -> dict:
    """Best time per candidate, candidates interleaved rep by rep."""
    for f in fns.values():
        f()
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def probe_gelu(torch, reps):
    print("\nGELU (exact) on ConvNeXt-T fc1 outputs; ratio = torch time / candidate time")
    for shape in [(1, 56, 56, 384), (1, 14, 14, 1536), (8, 56, 56, 384), (8, 28, 28, 768)]:
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32) * 2
        tx = torch.from_numpy(x)
        ref = torch.nn.functional.gelu(torch.from_numpy(x.astype(np.float64))).numpy()
        fns = {"backend gelu": lambda: apply_activation(x, "gelu"),
               "chunked rational": lambda: gelu_chunked_rational(x),
               "torch": lambda: torch.nn.functional.gelu(tx)}
        best = best_of(fns, reps)
        errs = {"backend gelu": rel(apply_activation(x, "gelu"), ref),
                "chunked rational": rel(gelu_chunked_rational(x), ref), "torch": rel(fns["torch"](), ref)}
        print(f"  {str(shape):18s} " + " | ".join(
            f"{k} {best[k] * 1e3:7.2f} ms ({best['torch'] / best[k]:5.2f}x, err {errs[k]:.0e})" for k in fns))


def probe_depthwise(torch, reps):
    print("\ndepthwise 7x7, pad 3 (ConvNeXt-T stage shapes); ratio = torch (channels-last) time / candidate")
    for n, hw, c in [(1, 56, 96), (1, 28, 192), (1, 14, 384), (1, 7, 768), (8, 56, 96), (8, 14, 384)]:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((n, hw, hw, c), dtype=np.float32)
        w = rng.standard_normal((c, 7, 7, 1), dtype=np.float32)
        tx = torch.from_numpy(x).permute(0, 3, 1, 2)  # a channels-last NCHW view: no copy
        tw = torch.from_numpy(np.ascontiguousarray(w.transpose(0, 3, 1, 2)))
        ref = torch.nn.functional.conv2d(tx.double(), tw.double(), padding=3, groups=c).permute(0, 2, 3, 1).numpy()
        key = ConvKey("conv2d", x.shape, w.shape, "float32", ConvSpec.make(2, 1, 3, 1, c), (False, False, None))
        fns = {"shift (now)": lambda: nc.conv_depthwise_shift(x, w, key),
               "shift blocked": lambda: dw_shift_blocked(x, w, 3),
               "toeplitz gemm": lambda: dw_toeplitz(x, w, 3),
               "hybrid": lambda: dw_candidate(x, w, key)}
        try:
            from convkernels._cpu import AVAILABLE
        except ImportError:
            AVAILABLE = False
        if AVAILABLE:
            fns["C direct"] = lambda: nc.conv_depthwise_direct(x, w, key, None)
        fns["torch"] = lambda: torch.nn.functional.conv2d(tx, tw, padding=3, groups=c)
        best = best_of(fns, reps)
        errs = {k: rel(f() if k != "torch" else f().permute(0, 2, 3, 1).numpy(), ref) for k, f in fns.items()}
        print(f"  N{n} {hw}x{hw}x{c:<4d} " + " | ".join(
            f"{k} {best[k] * 1e3:7.2f} ms ({best['torch'] / best[k]:5.2f}x, err {errs[k]:.0e})" for k in fns))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", choices=["gelu", "dw"])
    args = ap.parse_args()
    import torch
    print(f"machine: {describe_machine()}")
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]} (other jobs share these cores)")
    if args.only in (None, "gelu"):
        probe_gelu(torch, args.reps)
    if args.only in (None, "dw"):
        probe_depthwise(torch, args.reps)


if __name__ == "__main__":
    main()
