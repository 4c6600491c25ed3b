"""One process of benchmarks/cpu/cpu_runtimes.py: the workload's preparation, or one contender.

    python benchmarks/cpu/cpu_runtimes_worker.py prepare WORKDIR
    python benchmarks/cpu/cpu_runtimes_worker.py steady CONTENDER WORKDIR WARMUP
    python benchmarks/cpu/cpu_runtimes_worker.py first CONTENDER WORKDIR STEADY_CALLS [PATH_STORE_DIR]

WORKDIR/spec.json names the workload (family, preset, input shape). `prepare` builds the PyTorch
reference with fresh random weights through the existing benchmarks' helpers, saves it as the
checkpoint ours and PyTorch load, exports the same module to WORKDIR/model.onnx (ONNX Runtime and
OpenVINO read it) and draws the input every contender gets. Every contender runs the same whole
job: ours' input layout in (NHWC pixels in [0, 1], or raw latents), ours' output out (the pooled
embedding, or pixels in [0, 1] channels-last), pre- and post-processing included.

`steady` loads, warms up, saves its output (WORKDIR/out-CONTENDER.npy) and then answers each
stdin line "run S" with timed calls for at least S seconds and what other processes used meanwhile (cpu_contention.py).
`first` is a fresh process's load, first call and steady calls; ours gets PATH_STORE_DIR as its
path store (an empty one: the first call measures its conv paths). Answers are JSON lines on the
original stdout; what the libraries print goes to stderr.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_contention import Window, cpu_description  # noqa: E402

#: ORT's, OpenVINO's and PyTorch's threads: cpu_runtimes.py --threads, else their own default (the physical cores)
THREADS = int(os.environ.get("CPU_RUNTIMES_THREADS") or cpu_description()["physical_cores"])


def input_array(spec: dict) -> np.ndarray:
    rng = np.random.default_rng(0)
    if spec["family"] == "convnext":
        return rng.random(spec["shape"], dtype=np.float32)
    return rng.standard_normal(spec["shape"]).astype(np.float32)


def torch_module(spec: dict, folder: Path):
    """The checkpoint in `folder` as one torch module from ours' input to ours' output."""
    import torch
    family = spec["family"]
    if family == "convnext":
        import transformers
        from convnext_cpu import MEAN, STD
        inner = transformers.ConvNextModel.from_pretrained(folder).eval()
        mean, std = torch.from_numpy(MEAN), torch.from_numpy(STD)

        def forward(x):
            return inner(pixel_values=((x - mean) / std).permute(0, 3, 1, 2)).pooler_output
    elif family == "sd-vae":
        import diffusers
        inner = diffusers.AutoencoderKL.from_pretrained(folder).eval()
        scale, shift = inner.config.scaling_factor, inner.config.shift_factor or 0.0

        def forward(z):
            return (inner.decode(z / scale + shift).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).contiguous()
    else:
        import diffusers
        inner = diffusers.AutoencoderKLWan.from_pretrained(folder).eval()
        mean = torch.tensor(inner.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(inner.config.latents_std).view(1, -1, 1, 1, 1)

        def forward(z):
            video = inner.decode(z * std + mean).sample
            return (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).contiguous()

    class Whole(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner  # registered, so an export carries its weights as initializers

        def forward(self, x):
            return forward(x)
    return Whole().eval()


def exportable(module):
    """The TorchScript exporter has no nearest-exact upsampling, which diffusers' Wan upsamplers use.
    At a whole scale factor of 2 it picks the same source pixel as plain nearest: output index d
    reads floor((d + 0.5) / 2) = floor(d / 2) either way. So those upsamplers export as nearest;
    any other scale is left alone (and fails to export, which the caller reports)."""
    import torch
    for m in module.modules():
        if isinstance(m, torch.nn.Upsample) and m.mode == "nearest-exact" and m.size is None and all(
                float(f) == 2.0 for f in np.atleast_1d(m.scale_factor)):
            m.mode = "nearest"
    return module


def prepare(workdir: Path) -> dict:
    import torch
    spec = json.loads((workdir / "spec.json").read_text())
    folder, preset = workdir / "checkpoint", spec["preset"]
    torch.manual_seed(0)
    if spec["family"] == "convnext":
        from convnext_cpu import hf_reference
        hf_reference(preset, folder)
    elif spec["family"] == "sd-vae":
        from models_cpu import diffusers_vae
        diffusers_vae(preset, folder)
    else:
        from wan_cpu import reference
        reference(preset)[0].save_pretrained(folder)
    x = input_array(spec)
    np.save(workdir / "input.npy", x)
    t0 = time.perf_counter()
    try:
        # the TorchScript exporter: it needs no onnxscript, and traces diffusers' Python loops
        with torch.no_grad():
            torch.onnx.export(exportable(torch_module(spec, folder)), (torch.from_numpy(x),),
                              str(workdir / "model.onnx"), dynamo=False, input_names=["x"], output_names=["y"],
                              opset_version=17)
    except Exception as exc:  # reported and skipped: ORT and OpenVINO then sit this workload out
        (workdir / "model.onnx").unlink(missing_ok=True)
        return {"onnx": False, "reason": f"torch.onnx.export failed: {type(exc).__name__}: {str(exc)[:300]}"}
    return {"onnx": True, "export_s": time.perf_counter() - t0}


def build(contender: str, spec: dict, workdir: Path, store: str | None = None):
    """(run(x) -> np.ndarray, threads it uses) for one contender."""
    if contender == "ours":
        from threadpoolctl import threadpool_info

        from convkernels import get_backend
        from models import load_model
        # cpu_runtimes.py --dtype: float32, or bfloat16 products (AVX-512 BF16 CPUs)
        backend = get_backend("numpy", dtype=os.environ.get("CPU_RUNTIMES_OURS_DTYPE", "float32"),
                              numpy_options={"plan_cache_dir": store} if store else None)
        model = load_model("bench", spec["preset"], backend, weights=str(workdir / "checkpoint"))
        blas = [i.get("num_threads") for i in threadpool_info() if i.get("user_api") == "blas"]
        if spec["family"] == "convnext":
            return (lambda x: model.encode(x)["embedding"]), f"BLAS {blas}"
        return (lambda x: model.decode(x, tiled=False)), f"BLAS {blas}"
    if contender == "torch":
        import torch
        torch.set_num_threads(THREADS)
        module = torch_module(spec, workdir / "checkpoint")

        def run(x):
            with torch.inference_mode():
                return module(torch.from_numpy(x)).numpy()
        return run, torch.get_num_threads()
    onnx = workdir / "model.onnx"
    if contender == "ort":
        import onnxruntime as ort
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
        session = ort.InferenceSession(str(onnx), opts, providers=["CPUExecutionProvider"])
        return (lambda x: session.run(None, {"x": x})[0]), THREADS
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hints
    # OpenVINO in ours' dtype: f32 asked for beside ours' float32 (on CPUs with bf16 or AMX its default
    # would be bf16), bf16 beside ours' bfloat16 (its like for like: the graph in bfloat16 where it can)
    bf16 = os.environ.get("CPU_RUNTIMES_OURS_DTYPE") == "bfloat16"
    compiled = ov.Core().compile_model(str(onnx), "CPU", {
        hints.inference_precision: ov.Type.bf16 if bf16 else ov.Type.f32,
        hints.performance_mode: hints.PerformanceMode.LATENCY,
        props.inference_num_threads: THREADS})
    request = compiled.create_infer_request()
    return (lambda x: request.infer({0: x})[0]), compiled.get_property(props.inference_num_threads)


def timed(run, x) -> float:
    t0 = time.perf_counter()
    run(x)
    return time.perf_counter() - t0


def steady(contender: str, workdir: Path, warmup: int, reply) -> None:
    spec = json.loads((workdir / "spec.json").read_text())
    x = np.load(workdir / "input.npy")
    t0 = time.perf_counter()
    run, threads = build(contender, spec, workdir)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    np.save(workdir / f"out-{contender}.npy", np.asarray(run(x)))
    warm = [time.perf_counter() - t0] + [timed(run, x) for _ in range(warmup - 1)]
    reply({"load_s": load_s, "warm_s": warm, "threads": str(threads)})
    for line in sys.stdin:  # "run S": calls until S seconds have passed, so that the window is long
        if not line.startswith("run "):  # enough to read other processes' CPU in it
            break
        least, ts = float(line.split()[1]), []
        with Window() as w:
            while not ts or sum(ts) < least:
                ts.append(timed(run, x))
        reply({"times": ts, "others_cores": w.others_cores, "wall_s": w.wall_s})


def first(contender: str, workdir: Path, steady_calls: int, store: str | None, reply) -> None:
    spec = json.loads((workdir / "spec.json").read_text())
    x = np.load(workdir / "input.npy")
    # other processes' CPU is read over the whole life, not the first call alone: a short window
    # reads it too coarsely (cpu_contention.py)
    with Window() as life:
        t0 = time.perf_counter()
        run, threads = build(contender, spec, workdir, store)
        load_s = time.perf_counter() - t0
        first_s = timed(run, x)
        ts = [timed(run, x) for _ in range(steady_calls)]
    reply({"load_s": load_s, "first_s": first_s, "steady_s": statistics.median(ts), "threads": str(threads),
           "others_cores": life.others_cores, "wall_s": life.wall_s})


def main() -> None:
    # the answers keep the real stdout; libraries that print go to stderr with the logs
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    mode, *rest = sys.argv[1:]
    try:
        if mode == "prepare":
            reply(prepare(Path(rest[0])))
        elif mode == "steady":
            steady(rest[0], Path(rest[1]), int(rest[2]), reply)
        else:
            first(rest[0], Path(rest[1]), int(rest[2]), rest[3] if len(rest) > 3 else None, reply)
    except Exception as exc:  # the parent reports it and goes on without this contender
        reply({"error": f"{type(exc).__name__}: {str(exc)[:400]}"})
        raise


if __name__ == "__main__":
    main()
