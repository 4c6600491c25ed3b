"""`convserve serve | pull | decode | encode | bench`."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import typer

# show_locals off: an unexpected error's traceback must not print the locals (an API key, whole arrays)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="convserve: decode latents to images/video and encode images, over HTTP or locally.")

IMAGE_SUFFIXES = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
#: prometheus_client's multiprocess directory variable (service.metrics.MULTIPROC_ENV; not
#: imported from there, since importing it imports prometheus_client, which reads the variable)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def settings_from_flags(**flags):
    """The service's Settings, built once per command: the flags given (None = not given) over
    the CONVSERVE_* variables and the defaults. Every process of a server receives this object
    (service/supervisor.py hands it to the model workers and front ends it starts); an invalid
    value is one line."""
    from .settings import Settings

    try:
        return Settings(**{k: v for k, v in flags.items() if v is not None})
    except ValueError as exc:
        _fail(f"settings: {exc}")


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment while the block runs (children started meanwhile
    inherit them), the old ones back after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@app.command()
def serve(host: Optional[str] = typer.Option(None, help="bind address [CONVSERVE_HOST, 127.0.0.1]"),
          port: Optional[int] = typer.Option(None, help="port [CONVSERVE_PORT, 8000]"),
          models: Optional[str] = typer.Option(None, help="name=preset[:weights],...; weights: a folder, a "
                                               ".safetensors file or a Hub reference org/name/subfolder@revision "
                                               "(both optional) [CONVSERVE_MODELS]"),
          backend: Optional[str] = typer.Option(None, help="auto|numpy|mlx|cuda [CONVSERVE_BACKEND]"),
          dtype: Optional[str] = typer.Option(None, help="compute dtype [backend default]"),
          workers: Optional[int] = typer.Option(None, help="HTTP front-end processes; 0 = auto: 1 on CPU "
                                                "backends, half the cores (<= 16) with GPUs [CONVSERVE_WORKERS]"),
          devices: Optional[str] = typer.Option(None, help="GPUs that get a model worker each: all, or 0,1 "
                                                "[CONVSERVE_DEVICES]"),
          max_batch: Optional[int] = typer.Option(None, help="rows per model call [8]"),
          max_queue_delay_ms: Optional[float] = typer.Option(None, help="batching window [5]"),
          max_queue: Optional[int] = typer.Option(None, help="queued requests (per front end) before 429 [64]"),
          request_timeout_s: Optional[float] = typer.Option(None, help="per-request timeout [60]"),
          keep_alive_s: Optional[float] = typer.Option(None, help="idle kept-alive connections close after [75]"),
          api_key: Optional[str] = typer.Option(None, help="require 'Authorization: Bearer KEY'"),
          shutdown_grace_s: Optional[float] = typer.Option(None, help="drain time after SIGTERM [30]"),
          warmup_sizes: Optional[str] = typer.Option(None, help="image sizes run once before ready, e.g. 512,1024x768"),
          log_level: Optional[str] = typer.Option(None, help="debug|info|warning [info]")):
    """Run the HTTP server: one model worker per device, HTTP front ends in front (CPU default:
    tiny presets on NumPy, one front end, one worker)."""
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
        import uvicorn

        settings = settings_from_flags(host=host, port=port, models=models, backend=backend, dtype=dtype,
                                       workers=workers, devices=devices, max_batch=max_batch,
                                       max_queue_delay_ms=max_queue_delay_ms, max_queue=max_queue,
                                       request_timeout_s=request_timeout_s, keep_alive_s=keep_alive_s, api_key=api_key,
                                       shutdown_grace_s=shutdown_grace_s, warmup_sizes=warmup_sizes,
                                       log_level=log_level)
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        entries = _model_entries(settings.models)
        check_model_entries(entries)  # a typo'd preset or a missing path: one line, before anything starts
        # Hub weights resolved here are in the cache: the model workers (started now, or again after
        # one dies) load them from there, so they all get the commit resolved here even if a branch
        # moves meanwhile, and none waits on the Hub. huggingface_hub in those processes reads
        # HF_HUB_OFFLINE from the environment they inherit: the one setting that travels that way.
        offline = {"HF_HUB_OFFLINE": "1"} if _fetch_hub_weights(entries, hashes=False) else {}
        with _environment(offline):
            _serve(settings, uvicorn)
    finally:
        if own_dir:
            shutil.rmtree(os.environ.pop(MULTIPROC_ENV), ignore_errors=True)


def _serve(settings, uvicorn) -> None:
    from .server import frontend_main, run_frontend
    from .supervisor import Supervisor, frontends_for

    sock = uvicorn.Config("service.app:create_app", host=settings.host, port=settings.port).bind_socket()
    try:
        sup = Supervisor(settings)
    except ValueError as exc:
        _fail(str(exc))
    try:
        sup.start_workers()
        count = frontends_for(settings, sup.devices)
        for i in range(1, count):
            sup.add_frontend(f"convserve-frontend-{i}", frontend_main, (settings, sup.endpoints, [sock], os.getpid()))
        logging.getLogger("convserve").info("serving on http://%s:%d: %d front end(s), model workers on %s",
                                            settings.host, settings.port, count,
                                            ", ".join(d.label for d in sup.devices))
        run_frontend(settings, sup.endpoints, [sock], on_drain=sup.signal_frontends)
    finally:
        sup.stop(settings.shutdown_grace_s)
        sock.close()


def _fail(message: str, code: int = 2):
    """A start-up or usage error as one line on stderr and a non-zero exit, not a traceback."""
    typer.echo(f"convserve: error: {message}", err=True)
    raise typer.Exit(code)


def _input_file(path: Path) -> Path:
    """An input file the command reads; a missing one is a one-line error (typer's `exists=True`
    prints a multi-line usage panel instead)."""
    if not path.exists():
        _fail(f"{path}: no such file")
    if path.is_dir():
        _fail(f"{path}: is a folder, not a file")
    return path


def check_model_entries(entries) -> None:
    """Start-up checks of MODELS entries that need no loading and no network: every preset is a
    known one (a near miss is named: `sd-vea` -> did you mean sd-vae), and every local weights path
    exists. Problems end the command with one line naming each; an entry without a preset (a bare
    Hub reference for `pull`) has only its weights checked; an optional entry (`?`) only warns
    (the server starts without it, and says so in /readyz's `unavailable`)."""
    problems = []
    for entry in entries:
        found = _entry_problems(entry)
        if entry.optional:
            for p in found:
                typer.echo(f"convserve: warning: optional {p}", err=True)
        else:
            problems += found
    if problems:
        _fail("; ".join(problems))


def _entry_problems(entry) -> list[str]:
    import difflib

    from models import PRESETS
    from models.hub import parse_weights

    problems = []
    if entry.preset and entry.preset not in PRESETS:
        known = sorted(PRESETS)
        close = difflib.get_close_matches(entry.preset, known, n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        missing = "; ".join(f"{f}: {why}" for f, why in PRESETS.unavailable.items() if why != "not installed")
        problems.append(f"model {entry.name}: unknown preset {entry.preset!r}; {hint}known presets: "
                        f"{', '.join(known)}" + (f" (families unavailable: {missing})" if missing else ""))
    if not entry.weights:
        return problems
    try:
        parsed = parse_weights(entry.weights)
    except ValueError as exc:
        return problems + [f"model {entry.name}: {exc}"]
    if isinstance(parsed, str) and not Path(parsed).expanduser().exists():
        problems.append(f"model {entry.name}: weights {entry.weights!r}: no such file or folder (a local path: "
                        "a diffusers/HF model folder or a .safetensors file)")
    return problems


def _model_entries(spec: str):
    from .settings import parse_models

    try:
        return parse_models(spec)
    except ValueError as exc:
        _fail(f"models {spec!r}: {exc}")


def _fetch_hub_weights(entries, hashes: bool) -> list:
    """Resolve every Hub reference among `entries` into the Hub cache before anything loads, so a
    missing repository (offline, gated, a typo) stops start-up with one line naming it, and N
    workers find the files already there. Optional entries only warn."""
    from models.hub import HubRef, parse_weights, resolve

    resolved = []
    for entry in entries:
        try:
            ref = parse_weights(entry.weights) if entry.weights else None
            if isinstance(ref, HubRef):
                resolved.append((entry, resolve(ref, hashes=hashes)))
        except ValueError as exc:
            if not entry.optional:
                _fail(str(exc))
            typer.echo(f"convserve: warning: optional model {entry.name} skipped: {exc}", err=True)
    return resolved


@app.command()
def pull(models: Optional[list[str]] = typer.Argument(
        None, help="MODELS entries (name=preset:org/name, optionally org/name/subfolder@revision; comma "
                   "lists) or bare Hub references; default: CONVSERVE_MODELS")):
    """Download the Hub weights of MODELS into the Hugging Face cache (HF_HOME / HF_HUB_CACHE) ahead of
    time, e.g. while building an image or in a Kubernetes init container; `serve` with HF_HUB_OFFLINE=1
    then loads them without the network."""
    from .settings import ModelEntry

    specs = models or [settings_from_flags().models]
    entries = []
    for item in (i.strip() for spec in specs for i in spec.split(",")):
        if item.startswith("hf://") or ("/" in item and not {"=", ":"} & set(item)):  # a bare reference
            entries.append(ModelEntry(item, "", item))
        elif item:
            entries.extend(_model_entries(item))
    check_model_entries(entries)
    if not any(e.weights for e in entries):
        typer.echo("nothing to pull: no entry names Hub weights")
        return
    for entry, got in _fetch_hub_weights(entries, hashes=True):
        p = got.provenance
        size = sum(f["size"] for f in p["files"].values())
        typer.echo(f"pulled {got.source} (revision {p['revision']}): {len(p['files'])} files, "
                   f"{size / 1e6:.1f} MB in {p['path']}")


def _load_local(settings, preset: str, weights: Optional[str], backend: str):
    """The model loaded here as a model worker loads it: the backend knobs (unfold limit, plan
    cache, ...) and the tile size are the server's settings."""
    from convkernels import get_backend

    from .model_host import load_entry
    from .settings import ModelEntry

    entry = ModelEntry(preset, preset, weights)
    check_model_entries([entry])
    try:
        be = get_backend(backend, **settings.backend_options())
    except (ValueError, RuntimeError, ImportError) as exc:  # an unknown or unavailable backend
        _fail(f"backend {backend!r}: {exc}")
    try:
        return load_entry(entry, be, settings.tile_size)
    except (ValueError, KeyError) as exc:  # a WeightsError, a preset's refusal of the settings
        _fail(str(exc).strip("'\""))


def _validated(check, *args) -> np.ndarray:
    """The server's validation of a local input; what it rejects is a one-line error."""
    from .problems import Problem

    try:
        return check(*args)
    except Problem as p:
        _fail(p.detail)


def _read_tensor(path: Path, prefer: str) -> np.ndarray:
    from .codecs import read_tensor_body
    media = {".npy": "application/x-npy", ".safetensors": "application/vnd.safetensors",
             ".json": "application/json"}.get(path.suffix.lower(), "application/octet-stream")
    arr, _ = _validated(read_tensor_body, _input_file(path).read_bytes(), media, prefer)
    return arr


def _write_decoded(out: np.ndarray, output: Path, video: bool, quality: int, fps: float) -> list[Path]:
    from tqdm import tqdm

    from .codecs import image_bytes, npy_bytes, to_uint8
    from .video import crf_for_quality, mp4_bytes

    suffix = output.suffix.lower()
    written: list[Path] = []

    def name(i: int, ext: str) -> Path:
        return output if out.shape[0] == 1 else output.with_name(f"{output.stem}_{i:03d}{ext}")

    if suffix == ".npy":
        output.write_bytes(npy_bytes(out))
        return [output]
    if suffix == ".mp4":
        if not video:
            _fail("an image decoder gives images: write .png/.jpg/.webp/.npy or a folder")
        for i, v in enumerate(tqdm(out, desc="mp4", unit="video", disable=out.shape[0] < 2)):
            p = name(i, ".mp4")
            p.write_bytes(mp4_bytes(v, fps, crf_for_quality(quality)))
            written.append(p)
        return written
    if suffix in IMAGE_SUFFIXES and not video:
        for i, im in enumerate(tqdm(to_uint8(out), desc="images", unit="img", disable=out.shape[0] < 2)):
            p = name(i, suffix)
            p.write_bytes(image_bytes(im, IMAGE_SUFFIXES[suffix], quality))
            written.append(p)
        return written
    if suffix:
        _fail(f"cannot write {suffix}: use .png/.jpg/.webp, .mp4, .npy or a folder")
    # a folder of PNG frames
    output.mkdir(parents=True, exist_ok=True)
    frames = out if video else out[:, None]
    total = frames.shape[0] * frames.shape[1]
    with tqdm(total=total, desc="frames", unit="frame", disable=total < 2) as bar:
        for i, clip in enumerate(to_uint8(frames)):
            for f, im in enumerate(clip):
                p = output / (f"frame_{f:04d}.png" if frames.shape[0] == 1 else f"{i:03d}_frame_{f:04d}.png")
                p.write_bytes(image_bytes(im, "png", quality))
                written.append(p)
                bar.update()
    return written


@app.command()
def decode(latents: Path = typer.Argument(..., help=".npy, .safetensors or .json latents"),
           output: Path = typer.Option(..., "-o", "--output", help="out.png|.jpg|.webp, out.mp4, out.npy or a folder"),
           preset: Optional[str] = typer.Option(None, help="model preset [tiny-vae; tiny-wan-vae for 5-D latents]"),
           weights: Optional[str] = typer.Option(None, help="a .safetensors file, diffusers folder or Hub reference"),
           backend: str = typer.Option("auto", help="auto|numpy|mlx|cuda"),
           tiled: str = typer.Option("auto", help="on|off|auto"),
           tile_size: Optional[int] = typer.Option(None, help="output pixels per tile side [CONVSERVE_TILE_SIZE; "
                                                   "the model's own]"),
           quality: int = typer.Option(90, min=1, max=100),
           fps: float = typer.Option(16.0),
           url: Optional[str] = typer.Option(None, help="decode on a running server instead (e.g. http://127.0.0.1:8000)"),
           model: Optional[str] = typer.Option(None, help="with --url: the served model name"),
           api_key: Optional[str] = typer.Option(None, envvar="CONVSERVE_API_KEY")):
    """Decode latents to images, an MP4, .npy or a folder of frames. Locally the decode takes the
    server's path: its tile size and, on running out of memory, its retries in smaller tiles."""
    from tqdm import tqdm

    from . import oom_recovery, validation

    lat = _read_tensor(latents, "latents")
    video = lat.ndim == 5
    _check_output(output, video, local=not url)
    if url:
        _remote_decode(url, model or preset or ("tiny-wan-vae" if video else "tiny-vae"), lat, output,
                       tiled, quality, fps, api_key)
        return
    hm = _load_local(settings_from_flags(tile_size=tile_size), preset or ("tiny-wan-vae" if video else "tiny-vae"),
                     weights, backend)
    lat = _validated(validation.latents, hm, lat)
    t = {"on": True, "off": False}.get(tiled)
    t0 = time.perf_counter()
    try:
        if hm.is_video:
            # the causal decoder yields frames in order: 1 for the first latent frame, 4 per later one
            chunks = list(tqdm(oom_recovery.frames(hm, lat, t), total=lat.shape[2], desc="decode",
                               unit="latent frame"))
            out = np.concatenate(chunks, axis=1)
        else:
            out = np.concatenate([oom_recovery.decode(hm, lat[i:i + 1], tiled=t, clamp=True)
                                  for i in tqdm(range(lat.shape[0]), desc="decode", unit="img",
                                                disable=lat.shape[0] < 2)])
    except oom_recovery.DeviceOutOfMemory as exc:
        _fail(str(exc), 1)
    secs = time.perf_counter() - t0
    written = _validated(_write_decoded, out, output, hm.is_video, quality, fps)
    typer.echo(f"decoded {list(lat.shape)} -> {list(out.shape)} in {secs:.2f}s; wrote {len(written)} file(s): "
               f"{', '.join(map(str, written[:4]))}{' ...' if len(written) > 4 else ''}")


def _check_output(output: Path, video: bool, local: bool) -> None:
    """What the command will write, checked before any work: a known suffix for the model kind,
    an existing folder to write into, and PyAV for a local MP4."""
    suffix = output.suffix.lower()
    if suffix and not output.parent.is_dir():  # a frames folder is made with its parents
        _fail(f"{output}: the folder {output.parent} does not exist")
    if suffix == ".mp4" and not video:
        _fail("an image decoder gives images: write .png/.jpg/.webp/.npy or a folder")
    if suffix in IMAGE_SUFFIXES and video:
        _fail("a video decoder gives frames: write .mp4, .npy or a folder")
    if suffix and suffix not in (".npy", ".mp4", *IMAGE_SUFFIXES):
        _fail(f"cannot write {suffix}: use .png/.jpg/.webp, .mp4, .npy or a folder")
    if suffix == ".mp4" and local:
        from .video import require_av
        _validated(require_av, " (or write .npy or a folder of frames)")


def _problem_text(r) -> str:
    """A server's error answer in one line: its problem+json detail, else the start of the body."""
    try:
        doc = r.json()
        detail = doc.get("detail") or doc.get("error") if isinstance(doc, dict) else None
    except ValueError:
        detail = None
    text = str(detail) if detail else " ".join(r.text.split())[:300]
    return f"server answered {r.status_code} {r.reason_phrase}: {text}"


def _post(url: str, api_key: Optional[str], headers: dict | None = None, **kwargs):
    """A request to a running server; an error answer, or no answer, ends the command with one line."""
    try:
        import httpx
    except ImportError:  # a runtime dependency; an environment missing it gets the fix, not a traceback
        _fail("--url needs the httpx package: pip install httpx")

    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(url, headers={**(headers or {}), **auth}, timeout=600, **kwargs)
    except httpx.HTTPError as exc:
        _fail(f"no answer from {url}: {exc.__class__.__name__}: {exc}", 1)
    if r.status_code != 200:
        _fail(_problem_text(r), 1)
    return r


def _remote_decode(url, model, lat, output: Path, tiled, quality, fps, api_key) -> None:
    from .codecs import npy_bytes
    suffix = output.suffix.lower()
    if suffix not in (".npy", ".mp4", *IMAGE_SUFFIXES):
        _fail("with --url, write .png/.jpg/.webp, .mp4 or .npy (frame folders are local only)")
    fmt = "npy" if suffix == ".npy" else "mp4" if suffix == ".mp4" else IMAGE_SUFFIXES[suffix]
    r = _post(f"{url.rstrip('/')}/v1/models/{model}/decode", api_key, {"content-type": "application/x-npy"},
              content=npy_bytes(np.asarray(lat, np.float32)),
              params={"format": fmt, "quality": quality, "tiled": tiled, "fps": fps})
    shape = r.headers.get("x-output-shape")
    if r.headers.get("content-type") == "application/zip":  # several: out_000.png, out_001.png, ...
        import io
        import zipfile
        with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
            names = zf.namelist()
            for i, member in enumerate(names):
                output.with_name(f"{output.stem}_{i:03d}{suffix}").write_bytes(zf.read(member))
        typer.echo(f"wrote {len(names)} files {output.stem}_000{suffix} ... (shape {shape})")
        return
    output.write_bytes(r.content)
    typer.echo(f"wrote {output} ({len(r.content)} bytes, shape {shape})")


@app.command()
def encode(images: list[Path] = typer.Argument(..., help="JPEG/PNG/WebP files"),
           preset: str = typer.Option("tiny-convnext", help="encoder preset"),
           weights: Optional[str] = typer.Option(None, help="an HF folder, .safetensors file or Hub reference"),
           backend: str = typer.Option("auto"),
           top_k: Optional[int] = typer.Option(None, "--top-k", min=1, help="print the k most likely labels"),
           output: Optional[Path] = typer.Option(None, "-o", "--output", help="save embeddings as .npy"),
           url: Optional[str] = typer.Option(None, help="encode on a running server instead"),
           model: Optional[str] = typer.Option(None, help="with --url: the served model name"),
           api_key: Optional[str] = typer.Option(None, envvar="CONVSERVE_API_KEY")):
    """Encode images to embeddings (and top-k labels when the checkpoint has a head)."""
    from tqdm import tqdm

    from . import validation
    from .codecs import npy_bytes, open_image, preprocess
    from .codecs import top_k as rank

    for p in images:
        _input_file(p)
    if output and not output.parent.is_dir():
        _fail(f"{output}: the folder {output.parent} does not exist")
    if url:
        files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in images]
        doc = _post(f"{url.rstrip('/')}/v1/models/{model or preset}/encode", api_key, files=files,
                    params={"top_k": top_k} if top_k else {}).json()
        emb = np.asarray(doc["embeddings"], np.float32)
        ranks = doc.get("top_k")
    else:
        hm = _load_local(settings_from_flags(), preset, weights, backend)
        size = int(hm.model.input_size)
        px = np.stack([preprocess(_validated(open_image, p.read_bytes(), 1 << 62, str(p)), size)
                       for p in tqdm(images, desc="load", unit="img", disable=len(images) < 2)])
        out = hm.model.encode(_validated(validation.encoder_pixels, hm, px))
        emb = np.asarray(out["embedding"], np.float32)
        ranks = None
        if top_k:
            if out.get("logits") is None:
                _fail(f"{preset} has no classifier head: no labels")
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


@app.command()
def bench(preset: str = typer.Option("tiny-vae", help="model preset"),
          backend: str = typer.Option("auto"),
          size: int = typer.Option(32, help="latent side (decoders) or image side is the model's input size"),
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


if __name__ == "__main__":
    app()
    sys.exit(0)
