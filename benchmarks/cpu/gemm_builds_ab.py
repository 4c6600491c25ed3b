"""Two builds of the compiled CPU kernels' matrix products (convkernels/_cpu/gemm.c), compared in
one process, call by call: this checkout's build against another `_kernels*.so` (an older
commit's, or one built with other -D flags), on ConvNeXt-T's linear shapes.

Why one process: on the shared 2-core CI-class boxes the same product's speed moves up to 2x from
one process to the next (a neighbour on the host's cores, its clock), so two builds timed in turn
in separate processes say nothing about a change of a few per cent. Here both builds' calls
alternate within milliseconds, on the same arrays, and what moves the box moves both.

    python benchmarks/cpu/gemm_builds_ab.py --other /path/to/_kernels.cpython-311-x86_64-linux-gnu.so [--batch 8] [--reps 15]

To get the other build: `git worktree add /tmp/old <commit> && (cd /tmp/old && python setup.py
build_ext --inplace)`. Printed per shape: each build's GF/s (median of --reps calls), the time
ratio this/other (< 1: this build faster), and the largest difference of their outputs relative
to the output's largest value (a change meant to keep the maths should print 0 or float32
rounding); then the linears of one forward, each shape times its depth. The build against
itself read 0.94-1.06 a shape and 0.986 for the forward at --reps 5 (2-core Xeon, 2026-12-01): a
change smaller than that needs more reps or is not there.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.machine import describe_machine  # noqa: E402
from convkernels import _cpu  # noqa: E402
from convkernels.backends.numpy import fused  # noqa: E402

#: ConvNeXt-T's stages: channels, side at 224, blocks
STAGES = ((96, 56, 3), (192, 28, 3), (384, 14, 9), (768, 7, 3))
ACT_NONE, ACT_GELU = 0, 2


def load_build(path: str):
    """Another build of convkernels._cpu._kernels as a module of its own (its init symbol is named
    after the last part of the module's name, so it is loaded as `<other>._kernels`)."""
    spec = importlib.util.spec_from_file_location("other_build._kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="the other build's _kernels*.so")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    nr = _cpu._kernels.gemm_panel_width()
    if not nr:
        sys.exit("this CPU runs none of the compiled matrix tiles (gemm_panel_width() is 0)")
    builds = {"this": _cpu._kernels, "other": load_build(args.other)}
    rng, none = np.random.default_rng(0), np.zeros(1, np.float32)
    print(f"machine: {describe_machine()}")
    print(f"ConvNeXt-T 224 linears at batch {args.batch}, panel width {nr}; median of {args.reps} calls each, "
          f"the builds alternating")
    print("| M | K | N | epilogue | this GF/s | other GF/s | this / other time | max difference |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    totals = {"this": 0.0, "other": 0.0}
    for c, side, depth in STAGES:
        m = args.batch * side * side
        for k, n, act in ((c, 4 * c, ACT_GELU), (4 * c, c, ACT_NONE)):
            x = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
            bias = rng.standard_normal(n, dtype=np.float32)
            res = rng.standard_normal((m, n), dtype=np.float32) if act == ACT_NONE else none
            packed, out = fused.pack_panels(w), fused.aligned_empty((m, n))

            def call(build) -> np.ndarray:
                build.gemm(x, packed, bias, res, out, m, k, n, nr, True, act == ACT_NONE, act)
                return out

            first = {name: call(build).copy() for name, build in builds.items()}
            diff = float(np.abs(first["this"] - first["other"]).max() / np.abs(first["other"]).max())
            times: dict[str, list[float]] = {"this": [], "other": []}
            for _ in range(args.reps):
                for name, build in builds.items():
                    t0 = time.perf_counter()
                    call(build)
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            for name in totals:
                totals[name] += med[name] * depth
            flops = 2 * m * k * n
            print(f"| {m} | {k} | {n} | {'bias, GELU' if act else 'bias, residual'} | {flops / med['this'] / 1e9:.1f} "
                  f"| {flops / med['other'] / 1e9:.1f} | {med['this'] / med['other']:.3f} | {diff:.1e} |")
    print(f"the linears of one forward: this {totals['this'] * 1e3:.1f} ms, other {totals['other'] * 1e3:.1f} ms "
          f"({totals['this'] / totals['other']:.3f})")


if __name__ == "__main__":
    main()
