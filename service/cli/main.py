"""`convserve serve | pull | decode | encode | bench`: the commands, their flags and their checks;
`serve` hands the server's processes to service/supervisor.py."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from .checks import (check_backend, check_model_entries, fail, fetch_hub_weights, input_file, listen_socket,
                     model_entries, settings_problem, validated)
from .files import answer_format, check_output, read_tensor, write_decoded
from .remote import post, remote_decode

__all__ = ["app", "check_model_entries", "settings_from_flags"]

# show_locals off: an unexpected error's traceback must not print the locals (an API key, whole arrays)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="convserve: decode latents to images/video and encode images, over HTTP or locally.")

#: CONVSERVE_MODELS's default (service.settings.DEFAULT_MODELS, which the help names: not imported
#: from there, as importing the settings imports prometheus_client; tests/test_service_cli.py
#: holds the two equal)
DEFAULT_MODELS = "tiny-vae,tiny-convnext,tiny-wan-vae?"

#: prometheus_client's multiprocess directory variable (service.metrics.MULTIPROC_ENV; not
#: imported from there, since importing it imports prometheus_client, which reads the variable)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def settings_from_flags(**flags):
    """The service's Settings, built once per command: the flags given (None = not given) over
    the CONVSERVE_* variables and the defaults. Every process of a server receives this object
    (service/supervisor.py hands it to the model workers and front ends it starts); an invalid
    value is one line naming it (--flag or CONVSERVE_VARIABLE) and what it accepts."""
    from ..settings import Settings

    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return Settings(**given)
    except ValueError as exc:  # pydantic's ValidationError: a multi-line report
        fail(settings_problem(exc, set(given)))


@app.command(short_help="Run the HTTP server (CPU default: tiny presets on NumPy).")
def serve(host: Optional[str] = typer.Option(None, help="bind address [CONVSERVE_HOST; default 127.0.0.1]"),
          port: Optional[int] = typer.Option(None, help="TCP port [CONVSERVE_PORT; default 8000]"),
          models: Optional[str] = typer.Option(None, help="models to serve, name=preset[:weights],... (a trailing ? "
                                               "makes one optional); weights: a folder, a .safetensors file or a "
                                               "Hub reference org/name, optionally /subfolder and @revision [CONVSERVE_MODELS; "
                                               f"default {DEFAULT_MODELS}]"),
          backend: Optional[str] = typer.Option(None, help="auto|numpy|mlx|cuda; auto: cuda where CuPy and a GPU "
                                                "are, else mlx on Apple silicon, else numpy [CONVSERVE_BACKEND; "
                                                "default auto]"),
          dtype: Optional[str] = typer.Option(None, help="compute dtype: float32|float64 on numpy (and "
                                              "bfloat16 on CPUs with AVX-512 BF16: its matrix products), "
                                              "float16|bfloat16|float32 on mlx and cuda [CONVSERVE_DTYPE; default "
                                              "float32 on numpy and mlx, float16 on cuda]"),
          workers: Optional[int] = typer.Option(None, help="HTTP front-end processes; 0 = auto: 1 on CPU "
                                                "backends, all cores but one per GPU and one (<= 32) with GPUs [CONVSERVE_WORKERS; "
                                                "default 0]"),
          devices: Optional[str] = typer.Option(None, help="GPUs that get a model worker each: all, or 0,1 "
                                                "[CONVSERVE_DEVICES; default all]"),
          max_batch: Optional[int] = typer.Option(None, help="rows per model call [CONVSERVE_MAX_BATCH; default 8]"),
          max_queue_delay_ms: Optional[float] = typer.Option(None, help="batching window in ms "
                                                             "[CONVSERVE_MAX_QUEUE_DELAY_MS; default 5]"),
          max_queue: Optional[int] = typer.Option(None, help="queued requests (per front end) before 429 "
                                                  "[CONVSERVE_MAX_QUEUE; default 64]"),
          request_timeout_s: Optional[float] = typer.Option(None, help="per-request timeout in seconds "
                                                            "[CONVSERVE_REQUEST_TIMEOUT_S; default 60]"),
          keep_alive_s: Optional[float] = typer.Option(None, help="idle kept-alive connections close after this "
                                                       "many seconds [CONVSERVE_KEEP_ALIVE_S; default 75]"),
          api_key: Optional[str] = typer.Option(None, help="require 'Authorization: Bearer KEY' "
                                                "[CONVSERVE_API_KEY; default none]"),
          shutdown_grace_s: Optional[float] = typer.Option(None, help="seconds to drain after SIGTERM "
                                                           "[CONVSERVE_SHUTDOWN_GRACE_S; default 30]"),
          warmup_sizes: Optional[str] = typer.Option(None, help="image sizes run once before ready, e.g. "
                                                     "512,1024x768 [CONVSERVE_WARMUP_SIZES; default none]"),
          log_level: Optional[str] = typer.Option(None, help="debug|info|warning [CONVSERVE_LOG_LEVEL; "
                                                  "default info]")):
    """Run the HTTP server: one model worker per device, HTTP front ends in front of them. On a
    CPU the default serves the tiny presets (random weights) on NumPy, with one front end and one
    worker. Every option has a CONVSERVE_* variable (docs/settings.md lists all); a flag wins over
    its variable. A start-up problem (a bad value, a port in use, a backend that cannot run here, a
    model that does not load) ends the command with one line and exit code 2."""
    import shutil
    import tempfile

    # The model workers' metrics (batches, kernels) live in their processes: every process
    # writes its values under one directory and /metrics, in any front end, sums them
    # (prometheus_client's multiprocess mode). prometheus_client reads the variable when it is
    # first imported, which importing the settings already does: so it is set first of all.
    own_dir = not os.environ.get(MULTIPROC_ENV)
    if own_dir:
        os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="convserve-metrics-")
    try:
        settings = settings_from_flags(host=host, port=port, models=models, backend=backend, dtype=dtype,
                                       workers=workers, devices=devices, max_batch=max_batch,
                                       max_queue_delay_ms=max_queue_delay_ms, max_queue=max_queue,
                                       request_timeout_s=request_timeout_s, keep_alive_s=keep_alive_s, api_key=api_key,
                                       shutdown_grace_s=shutdown_grace_s, warmup_sizes=warmup_sizes,
                                       log_level=log_level)
        check_backend(settings.backend)
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        entries = model_entries(settings.models)
        check_model_entries(entries)  # a typo'd preset or a missing path: one line, before anything starts
        # Hub weights resolved here are in the cache: the model workers (started now, or again after
        # one dies) load them from there, so they all get the commit resolved here even if a branch
        # moves meanwhile, and none waits on the Hub. huggingface_hub in those processes reads
        # HF_HUB_OFFLINE from the environment they inherit (with the metrics directory above, the
        # only values that reach them that way; their settings travel as the Settings object).
        offline = {"HF_HUB_OFFLINE": "1"} if fetch_hub_weights(entries, hashes=False) else {}
        sock = listen_socket(settings.host, settings.port, own=settings.frontend_sockets == "own")
        from ..supervisor import StartupFailed
        from ..supervisor import serve as run_server
        try:
            run_server(settings, sock, environment=offline)  # the processes: service/supervisor.py
        except StartupFailed as exc:
            fail(str(exc))
    finally:
        if own_dir:
            shutil.rmtree(os.environ.pop(MULTIPROC_ENV), ignore_errors=True)


@app.command(short_help="Download Hub weights into the Hugging Face cache.")
def pull(models: Optional[list[str]] = typer.Argument(
        None, help="MODELS entries (name=preset:org/name, optionally org/name/subfolder@revision; comma "
                   "lists) or bare Hub references; default: CONVSERVE_MODELS")):
    """Download the Hub weights of MODELS into the Hugging Face cache (HF_HOME / HF_HUB_CACHE) ahead of
    time, e.g. while building an image or in a Kubernetes init container; `serve` with HF_HUB_OFFLINE=1
    then loads them without the network."""
    from ..settings import ModelEntry

    specs = models or [settings_from_flags().models]
    entries = []
    for item in (i.strip() for spec in specs for i in spec.split(",")):
        if item.startswith("hf://") or ("/" in item and not {"=", ":"} & set(item)):  # a bare reference
            entries.append(ModelEntry(item, "", item))
        elif item:
            entries.extend(model_entries(item))
    check_model_entries(entries)
    if not any(e.weights for e in entries):
        typer.echo("nothing to pull: no entry names Hub weights")
        return
    for entry, got in fetch_hub_weights(entries, hashes=True):
        p = got.provenance
        size = sum(f["size"] for f in p["files"].values())
        typer.echo(f"pulled {got.source} (revision {p['revision']}): {len(p['files'])} files, "
                   f"{size / 1e6:.1f} MB in {p['path']}")


def _load_local(settings, preset: str, weights: Optional[str], backend: str):
    """The model loaded here as a model worker loads it: the backend knobs (unfold limit, plan
    cache, ...) and the tile size are the server's settings."""
    from convkernels import get_backend

    from ..worker.loading import load_entry
    from ..settings import ModelEntry

    entry = ModelEntry(preset, preset, weights)
    check_model_entries([entry])
    try:
        be = get_backend(backend, **settings.backend_options())
    except (ValueError, RuntimeError, ImportError) as exc:  # an unknown or unavailable backend
        fail(f"backend {backend!r}: {exc}")
    try:
        return load_entry(entry, be, settings.tile_size)
    except (ValueError, KeyError) as exc:  # a WeightsError or a ModelConfigError (unknown preset, refused config)
        fail(str(exc).strip("'\""))


@app.command(short_help="Decode latents to images, MP4 or .npy (local or --url).")
def decode(latents: Path = typer.Argument(..., help=".npy, .safetensors or .json latents"),
           output: Path = typer.Option(..., "-o", "--output", help="out.png|.jpg|.webp, out.mp4, out.npy or a folder"),
           preset: Optional[str] = typer.Option(None, help="model preset (default tiny-vae; tiny-wan-vae for 5-D latents)"),
           weights: Optional[str] = typer.Option(None, help="a .safetensors file, diffusers folder or Hub reference"),
           backend: str = typer.Option("auto", help="auto|numpy|mlx|cuda"),
           tiled: str = typer.Option("auto", help="on|off|auto"),
           tile_size: Optional[int] = typer.Option(None, help="output pixels per tile side [CONVSERVE_TILE_SIZE; "
                                                   "the model's own]"),
           quality: int = typer.Option(90, min=1, max=100, help="JPEG, WebP and MP4 quality"),
           fps: float = typer.Option(16.0, help="frames per second of an MP4"),
           url: Optional[str] = typer.Option(None, help="decode on a running server instead (e.g. http://127.0.0.1:8000)"),
           model: Optional[str] = typer.Option(None, help="with --url: the served model name"),
           shards: str = typer.Option("1", help="split the decode by rows over this many GPUs, exactly "
                                      "(CUDA; SD, SDXL, FLUX.1, FLUX.2, Qwen-Image, Wan 2.1 and 2.2 VAEs; docs/sharding.md); with --url "
                                      "also auto: the server's rule"),
           channels: Optional[str] = typer.Option(None, help="rgba|rgb; default: the model's own, RGBA (alpha "
                                                  "last) for a decoder with alpha (Qwen-Image 2.1 VAE) except as JPEG"),
           api_key: Optional[str] = typer.Option(None, envvar="CONVSERVE_API_KEY", help="with --url: the server's key")):
    """Decode latents to images, an MP4, .npy or a folder of frames. Locally the decode takes the
    server's path: its tile size and, on running out of memory, its retries in smaller tiles; and
    its channels rule (service/alpha_option.py): RGBA from a decoder with alpha unless JPEG or
    --channels rgb, and the server's refusals as one line."""
    from tqdm import tqdm

    from ..alpha_option import decide_alpha, parse_channels
    from ..worker import oom_recovery
    from ..frontend import validation

    lat = read_tensor(latents, "latents")
    video = lat.ndim == 5
    check_output(output, video, local=not url)
    channels = validated(parse_channels, channels)
    if url:
        remote_decode(url, model or preset or ("tiny-wan-vae" if video else "tiny-vae"), lat, output,
                       tiled, quality, fps, api_key, shards, channels)
        return
    if not shards.isdigit() or int(shards) < 1:
        fail(f"--shards {shards}: locally a whole number of GPUs (auto is the server's rule, with --url)")
    shards = int(shards)
    if shards > 1:
        from .sharded import decode_sharded
        out, secs = decode_sharded(lat, preset or ("tiny-wan-vae" if video else "tiny-vae"), weights, backend,
                                   shards, settings_from_flags(), channels, answer_format(output))
        written = validated(write_decoded, out, output, video, quality, fps)
        typer.echo(f"decoded {list(lat.shape)} -> {list(out.shape)} on {shards} GPUs in {secs:.2f}s; wrote "
                   f"{len(written)} file(s)")
        return
    hm = _load_local(settings_from_flags(tile_size=tile_size), preset or ("tiny-wan-vae" if video else "tiny-vae"),
                     weights, backend)
    alpha = validated(decide_alpha, hm.name, hm.decodes_alpha, channels, answer_format(output))
    lat = validated(validation.latents, hm, lat)
    t = {"on": True, "off": False}.get(tiled)
    t0 = time.perf_counter()
    try:
        if hm.is_video:
            # the causal decoder yields frames in order: 1 for the first latent frame, 4 per later one
            chunks = list(tqdm(oom_recovery.frames(hm, lat, t), total=lat.shape[2], desc="decode",
                               unit="latent frame"))
            out = np.concatenate(chunks, axis=1)
        else:
            out = np.concatenate([oom_recovery.decode(hm, lat[i:i + 1], tiled=t, clamp=True, alpha=alpha)
                                  for i in tqdm(range(lat.shape[0]), desc="decode", unit="img",
                                                disable=lat.shape[0] < 2)])
    except oom_recovery.DeviceOutOfMemory as exc:
        fail(str(exc), 1)
    secs = time.perf_counter() - t0
    written = validated(write_decoded, out, output, hm.is_video, quality, fps)
    typer.echo(f"decoded {list(lat.shape)} -> {list(out.shape)} in {secs:.2f}s; wrote {len(written)} file(s): "
               f"{', '.join(map(str, written[:4]))}{' ...' if len(written) > 4 else ''}")


@app.command(short_help="Encode images to embeddings, top-k labels (local or --url).")
def encode(images: list[Path] = typer.Argument(..., help="JPEG/PNG/WebP files"),
           preset: str = typer.Option("tiny-convnext", help="encoder preset"),
           weights: Optional[str] = typer.Option(None, help="an HF folder, .safetensors file or Hub reference"),
           backend: str = typer.Option("auto", help="auto|numpy|mlx|cuda"),
           top_k: Optional[int] = typer.Option(None, "--top-k", min=1, help="print the k most likely labels"),
           output: Optional[Path] = typer.Option(None, "-o", "--output", help="save embeddings as .npy"),
           url: Optional[str] = typer.Option(None, help="encode on a running server instead"),
           model: Optional[str] = typer.Option(None, help="with --url: the served model name"),
           api_key: Optional[str] = typer.Option(None, envvar="CONVSERVE_API_KEY", help="with --url: the server's key")):
    """Encode images to embeddings (and top-k labels when the checkpoint has a head)."""
    from tqdm import tqdm

    from ..frontend import validation
    from ..codecs import npy_bytes, open_image, preprocess
    from ..codecs import top_k as rank

    for p in images:
        input_file(p)
    if output and not output.parent.is_dir():
        fail(f"{output}: the folder {output.parent} does not exist")
    if url:
        files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in images]
        doc = post(f"{url.rstrip('/')}/v1/models/{model or preset}/encode", api_key, files=files,
                    params={"top_k": top_k} if top_k else {}).json()
        emb = np.asarray(doc["embeddings"], np.float32)
        ranks = doc.get("top_k")
    else:
        hm = _load_local(settings_from_flags(), preset, weights, backend)
        size = int(hm.model.input_size)
        px = np.stack([preprocess(validated(open_image, p.read_bytes(), 1 << 62, str(p)), size)
                       for p in tqdm(images, desc="load", unit="img", disable=len(images) < 2)])
        out = hm.model.encode(validated(validation.encoder_pixels, hm, px))
        emb = np.asarray(out["embedding"], np.float32)
        ranks = None
        if top_k:
            if out.get("logits") is None:
                fail(f"{preset} has no classifier head: no labels")
            ranks = rank(np.asarray(out["logits"], np.float64), top_k, hm.labels)
    if output:
        output.write_bytes(npy_bytes(emb))
    for i, p in enumerate(images):
        line = {"image": str(p), "embedding_dim": int(emb.shape[1]), "norm": round(float(np.linalg.norm(emb[i])), 6)}
        if ranks:
            line["top_k"] = ranks[i]
        if not output:
            line["embedding_head"] = [round(float(v), 6) for v in emb[i, :8]]
        typer.echo(json.dumps(line))


@app.command(short_help="A quick local throughput number for one preset (no HTTP).")
def bench(preset: str = typer.Option("tiny-vae", help="model preset"),
          backend: str = typer.Option("auto", help="auto|numpy|mlx|cuda"),
          size: int = typer.Option(32, help="decoders: the latents' side (the images are 8x that for most "
                                   "VAEs); encoders take their own input size"),
          frames: int = typer.Option(3, help="latent frames (video decoders)"),
          batch: str = typer.Option("1,4", help="comma list of batch sizes"),
          seconds: float = typer.Option(3.0, help="time per batch size")):
    """A quick local throughput number for one preset (no HTTP)."""
    from models.contract import example_input, forward

    m = _load_local(settings_from_flags(), preset, None, backend).model
    rng = np.random.default_rng()
    typer.echo(f"{preset} ({m.kind}) on {m.card().get('backend', backend)}; machine: {_machine()}")
    for n in (int(b) for b in batch.split(",")):
        x = example_input(m, rng, n=n, latents=(size, size), frames=frames)
        run = lambda: forward(m, x)  # noqa: E731
        run()  # warm-up: path choice and allocation
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or calls == 0:
            run()
            calls += 1
        dt = (time.perf_counter() - t0) / calls
        typer.echo(f"batch {n:3d}: {dt * 1000:9.1f} ms/call  {n / dt:9.2f} items/s")


def _machine() -> str:
    import platform
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu(s) {platform.python_version()}"

