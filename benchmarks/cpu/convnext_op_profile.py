"""Where a ConvNeXt encode's time goes, op by op: ours (the NumPy backend) beside ONNX Runtime's
own per-node profile, on the same random weights and input (cpu_runtimes_worker.prepare makes
both). Ours is timed by wrapping the backend's kernels in place (the maths and the paths are the
ones a real call takes; a fused op counts once, under its fused name), exclusive of nested ops.
ORT runs in a child process (its thread pool never meets ours) with SessionOptions.enable_profiling.

    python benchmarks/cpu/convnext_op_profile.py [--batch 1] [--reps 10] [--no-ort] [--openvino]
        [--dtype float32|bfloat16] [--workdir DIR]

--dtype bfloat16: ours with the backend's bfloat16 products (AVX-512 BF16 CPUs), and OpenVINO (--openvino,
its per-node performance counters) in its bf16 inference precision beside it; ORT stays float32.

Times are per encode (sum over the calls of one forward); the shared 2-core box is noisy, so
read the shares and the ratios more than the absolute numbers. The load average is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

#: ORT op types -> the role names ours uses, so the table lines up
ORT_ROLES = {"MatMul": "matmul (linear)", "Gemm": "matmul (linear)", "FusedMatMul": "matmul (linear)",
             "Gelu": "GELU", "BiasGelu": "GELU", "Erf": "GELU", "Conv": "conv (stem/downsample/dw)",
             "FusedConv": "conv (stem/downsample/dw)", "LayerNormalization": "layer_norm",
             "Transpose": "transpose/reorder", "Add": "add (bias/residual)", "Mul": "mul (layer scale)",
             "ReduceMean": "mean pool", "GlobalAveragePool": "mean pool"}


class Exclusive:
    """Wraps callables so each records its time minus that of wrapped callables it calls."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []

    def wrap(self, role, fn):
        def timed(*a, **kw):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                child = self._stack.pop()
                r = role(*a, **kw) if callable(role) else role
                self.seconds[r] += dt - child
                self.calls[r] += 1
                if self._stack:
                    self._stack[-1] += dt
        return timed


def instrument(backend) -> Exclusive:
    """Wrap the NumPy backend's kernels (module globals and bound methods) in place."""
    from convkernels._cpu import _kernels
    from convkernels.backends.numpy import activations, backend as bmod, conv as nc
    ex = Exclusive()
    if _kernels is not None:
        import convkernels._cpu as cpu
        shim = type("K", (), {})()
        for name in dir(_kernels):
            if not name.startswith("_"):
                setattr(shim, name, ex.wrap(f"C {name}", getattr(_kernels, name)))
        cpu._kernels = shim
    activations.gelu = bmod.gelu = ex.wrap("GELU (+bias)", activations.gelu)
    bmod.apply_activation = ex.wrap("activation", bmod.apply_activation)
    nc.conv_pointwise = ex.wrap("conv pointwise", nc.conv_pointwise)
    backend._linear = ex.wrap("linear: matmul + bias + residual", backend._linear)
    backend._layer_norm = ex.wrap("layer_norm (python)", backend._layer_norm)
    backend._mean = ex.wrap("mean pool", backend._mean)
    real_run = backend._run

    def role(path, key, *a):
        return f"conv {path.name} {'x'.join(map(str, key.kernel))}"
    backend._run = ex.wrap(role, real_run)
    fused = getattr(backend, "depthwise_conv_layer_norm")
    backend.depthwise_conv_layer_norm = ex.wrap(
        lambda *a, **k: "dw conv + layer_norm (fused, python)", fused)
    return ex


def profile_ours(workdir: Path, reps: int) -> tuple[float, dict]:
    from cpu_runtimes_worker import build
    spec = json.loads((workdir / "spec.json").read_text())
    run, _ = build("ours", spec, workdir)
    x = np.load(workdir / "input.npy")
    import gc
    for _ in range(2):
        run(x)
    # the backend object the model holds: find it through the closure's model
    model = run.__closure__[0].cell_contents
    ex = instrument(model.backend)
    gc.collect()
    t0 = time.perf_counter()
    for _ in range(reps):
        run(x)
    total = (time.perf_counter() - t0) / reps
    return total, {r: (s / reps, ex.calls[r] // reps) for r, s in ex.seconds.items()}


def profile_ort(workdir: Path, reps: int) -> tuple[float, dict]:
    import onnxruntime as ort
    from cpu_runtimes_worker import THREADS
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
    x = np.load(workdir / "input.npy")
    plain = ort.InferenceSession(str(workdir / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    for _ in range(2):
        plain.run(None, {"x": x})
    t0 = time.perf_counter()
    for _ in range(reps):
        plain.run(None, {"x": x})
    total = (time.perf_counter() - t0) / reps
    opts.enable_profiling = True
    opts.profile_file_prefix = str(workdir / "ort-profile")
    session = ort.InferenceSession(str(workdir / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    for _ in range(2 + reps):
        session.run(None, {"x": x})
    events = json.loads(Path(session.end_profiling()).read_text())
    per: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    start = runs[2]["ts"] if len(runs) > 2 else 0  # skip the two warm-up runs
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op = e.get("args", {}).get("op_name", "?")
            role = ORT_ROLES.get(op, op)
            per[role] += e["dur"] / 1e6
            calls[role] += 1
    return total, {r: (s / reps, calls[r] // reps) for r, s in per.items()}


def profile_openvino(workdir: Path, reps: int) -> tuple[float, dict]:
    """OpenVINO's own per-node times (PERF_COUNT), by the type its plugin ran each node as, in the
    precision cpu_runtimes_worker.build compiles it in (bf16 beside ours' bfloat16)."""
    import openvino.properties as props
    from cpu_runtimes_worker import THREADS, build
    spec = json.loads((workdir / "spec.json").read_text())
    x = np.load(workdir / "input.npy")
    run, _ = build("openvino", spec, workdir)
    for _ in range(2):
        run(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        run(x)
    total = (time.perf_counter() - t0) / reps
    import openvino as ov
    core = ov.Core()
    bf16 = os.environ.get("CPU_RUNTIMES_OURS_DTYPE") == "bfloat16"
    compiled = core.compile_model(str(workdir / "model.onnx"), "CPU", {
        "INFERENCE_PRECISION_HINT": ov.Type.bf16 if bf16 else ov.Type.f32, "PERFORMANCE_HINT": "LATENCY",
        props.inference_num_threads: THREADS, props.enable_profiling: True})
    request = compiled.create_infer_request()
    for _ in range(2):
        request.infer({0: x})
    per: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for _ in range(reps):
        request.infer({0: x})
        for info in request.profiling_info:
            if info.real_time.total_seconds() > 0:
                role = f"{info.node_type} [{info.exec_type}]"
                per[role] += info.real_time.total_seconds()
                calls[role] += 1
    return total, {r: (s / reps, calls[r] // reps) for r, s in per.items()}


def table(title: str, total: float, rows: dict) -> None:
    print(f"\n{title}: {total * 1e3:.1f} ms per encode (wall)")
    for role, (s, n) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        print(f"  {role:42s} {s * 1e3:8.2f} ms {100 * s / total:5.1f}%  ({n} calls)")
    rest = total - sum(s for s, _ in rows.values())
    print(f"  {'(outside the timed ops)':42s} {rest * 1e3:8.2f} ms {100 * rest / total:5.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--preset", default="convnext-tiny")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--no-ort", action="store_true")
    ap.add_argument("--openvino", action="store_true", help="OpenVINO's per-node profile too")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="ours' products (and OpenVINO's inference precision); ORT stays float32")
    ap.add_argument("--workdir", default=None, help="reuse a prepared workdir (else a fresh temporary one)")
    ap.add_argument("--row-block-bytes", type=int, default=None,
                    help="what-if: the fused linear's output block (convkernels/backends/numpy/fused.py)")
    ap.add_argument("--child", choices=["ort", "openvino", "prepare"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    # read by cpu_runtimes_worker.build, here and in the children
    os.environ["CPU_RUNTIMES_OURS_DTYPE"] = args.dtype
    if args.child == "prepare":  # torch (the weights, the ONNX export) only ever in this child
        from cpu_runtimes_worker import prepare
        print(json.dumps(prepare(Path(args.workdir))))
        return
    if args.child:
        total, rows = (profile_ort if args.child == "ort" else profile_openvino)(Path(args.workdir), args.reps)
        print(json.dumps({"total": total, "rows": rows}))
        return
    tmp = None
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory()
        workdir = Path(tmp.name)
    if not (workdir / "spec.json").exists() or not (workdir / "input.npy").exists():
        (workdir / "spec.json").write_text(json.dumps(
            {"family": "convnext", "preset": args.preset, "shape": [args.batch, args.size, args.size, 3]}))
        # in a child: torch loaded here would bind our C kernels to its libgomp, whose spinning
        # threads made the epilogue 77 ms instead of ~8 (2-core Xeon, 2026-11-29; NOTES.md)
        out = subprocess.run([sys.executable, __file__, "--child", "prepare", "--workdir", str(workdir)],
                             capture_output=True, text=True, check=True)
        print("prepare:", out.stdout.strip().splitlines()[-1])
    if args.row_block_bytes:
        from convkernels.backends.numpy import fused
        fused.ROW_BLOCK_BYTES = args.row_block_bytes
    with open("/proc/loadavg") as f:
        print("load average at start:", " ".join(f.read().split()[:3]))
    total, rows = profile_ours(workdir, args.reps)
    table(f"ours (numpy backend, {args.dtype}), {args.preset} {args.size} batch {args.batch}", total, rows)
    if not args.no_ort and (workdir / "model.onnx").exists():
        out = subprocess.run([sys.executable, __file__, "--child", "ort", "--workdir", str(workdir),
                              "--reps", str(args.reps)], capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        table("ONNX Runtime (node kernel times; the total is an unprofiled session's)", got["total"],
              {k: tuple(v) for k, v in got["rows"].items()})
        print(f"\nours / ORT: {total / got['total']:.2f}")
    if args.openvino and (workdir / "model.onnx").exists():
        out = subprocess.run([sys.executable, __file__, "--child", "openvino", "--workdir", str(workdir),
                              "--reps", str(args.reps), "--dtype", args.dtype], capture_output=True, text=True,
                             check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        table(f"OpenVINO ({'bf16' if args.dtype == 'bfloat16' else 'f32'}; its per-node counters; the total is an "
              "unprofiled request's)", got["total"], {k: tuple(v) for k, v in got["rows"].items()})
        print(f"\nours / OpenVINO: {total / got['total']:.2f}")
    with open("/proc/loadavg") as f:
        print("load average at end:", " ".join(f.read().split()[:3]))
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
