"""Service settings: environment variables with the CONVSERVE_ prefix (docs/interfaces.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.hub import parse_weights

MIB = 1024 * 1024

#: Served when CONVSERVE_MODELS is unset. The video VAE is optional here so a partial checkout
#: (or a model that fails to build) still leaves a working default server.
DEFAULT_MODELS = "tiny-vae,tiny-convnext,tiny-wan-vae?"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    preset: str
    weights: str | None = None
    optional: bool = False


def parse_models(spec: str) -> list[ModelEntry]:
    """`name=preset[:weights]` entries, comma separated. A bare `preset` names itself; weights
    are a local path or a Hub reference `org/name[/subfolder][@revision]` (models/hub.py); a
    trailing `?` marks an entry whose load failure is logged instead of fatal."""
    entries: list[ModelEntry] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        optional = item.endswith("?")
        item = item.rstrip("?")
        name, sep, rest = item.partition("=")
        if not sep:
            rest = name
        preset, _, weights = rest.partition(":")
        name, preset = name.strip(), preset.strip()
        if not name or not preset:
            raise ValueError(f"bad model entry {raw!r}: expected name=preset[:weights]")
        weights = weights.strip() or None
        if weights is not None:
            parse_weights(weights)  # a malformed or ambiguous Hub reference fails here, naming the forms
        entries.append(ModelEntry(name, preset, weights, optional))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate model names in {spec!r}")
    if not entries:
        raise ValueError("no models configured")
    return entries


def parse_sizes(spec: str) -> list[tuple[int, int]]:
    """'512,1024x768' -> [(512, 512), (1024, 768)] as (height, width)."""
    sizes = []
    for raw in spec.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        h, sep, w = item.partition("x")
        try:
            size = (int(h), int(w) if sep else int(h))
        except ValueError:
            raise ValueError(f"bad warm-up size {raw!r}: expected N or HxW, e.g. 512 or 1024x768") from None
        if min(size) < 1:
            raise ValueError(f"bad warm-up size {raw!r}: sides must be positive")
        sizes.append(size)
    return sizes


def parse_devices(spec: str) -> list[int] | None:
    """"all" -> None (every visible GPU); "0,2" -> [0, 2]."""
    spec = spec.strip().lower()
    if spec in ("", "all"):
        return None
    try:
        ordinals = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"bad device list {spec!r}: expected 'all' or GPU ordinals like 0,1") from None
    if not ordinals or min(ordinals) < 0 or len(set(ordinals)) != len(ordinals):
        raise ValueError(f"bad device list {spec!r}: expected distinct GPU ordinals like 0,1")
    return ordinals


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVSERVE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    backend: Literal["auto", "numpy", "mlx", "cuda"] = "auto"
    #: the backend's compute dtype (each takes some: numpy float32|float64, and bfloat16 products on
    #: CPUs with AVX-512 BF16; mlx and cuda float16|bfloat16|float32); None = the backend's default
    dtype: Literal["float16", "bfloat16", "float32", "float64"] | None = None
    models: str = DEFAULT_MODELS
    max_batch: int = Field(8, ge=1)
    max_queue_delay_ms: float = Field(5.0, ge=0)
    max_queue: int = Field(64, ge=1)
    request_timeout_s: float = Field(60.0, gt=0)
    #: a connection must deliver each request's complete headers this soon (slowloris guard)
    header_timeout_s: float = Field(10.0, gt=0)
    #: a request's head (request line and headers) may have this many bytes and header fields,
    #: under either parser; past either: 431 at once, connection closed (service/frontend/http/http_heads.py)
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    max_headers: int = Field(100, ge=1)
    #: how long an idle kept-alive connection stays open; well above client pools' idle expiry
    #: (httpx 5 s, requests/urllib3 none) so the server never closes a connection a client is reusing
    keep_alive_s: float = Field(75.0, gt=0)
    #: uvicorn HTTP/1.1 parser, both with the header deadline (service/frontend/http/http_protocol.py):
    #: httptools (llhttp, faster) where installed under "auto", else h11
    http: Literal["auto", "h11", "httptools"] = "auto"
    max_body_bytes: int = Field(64 * MIB, ge=1)
    #: bytes of admitted bodies, and of the arrays made from them, one front end may hold at once
    #: (service/frontend/memory_budget.py); 0 = auto: 1/16 of the container's or machine's memory, within
    #: 256 MiB..4 GiB, shared by the front ends. Beyond it: 503 with Retry-After
    memory_budget_bytes: int = Field(0, ge=0)
    #: after `min_body_rate_grace_s` of the server waiting on it, an admitted body must arrive at
    #: this many bytes per second the server waited for them, or its request gets 408 and its
    #: queue place goes (0 = no minimum). Only waiting with none of the client's bytes at the
    #: server counts, never time the server took to read them (service/frontend/http/body_wait.py)
    min_body_rate: int = Field(64 * 1024, ge=0)
    min_body_rate_grace_s: float = Field(5.0, ge=0)
    #: a response the client stops reading is dropped after this many seconds with no progress
    #: (its connection is aborted and the memory it held goes back)
    write_timeout_s: float = Field(30.0, gt=0)
    #: most output pixels (frames x height x width, over the batch) one request may ask a
    #: model for: work past it is refused up front with 413 instead of holding a device for
    #: minutes. 0 = auto by backend: numpy 1 Mpx (1024x1024), mlx 64 Mpx, cuda 512 Mpx
    max_request_pixels: int = Field(0, ge=0)
    #: a new input shape's first run measures its conv paths; where that would be past the cap
    #: (service/frontend/compute_cap.py) such runs go one at a time, spending a credit of this many seconds
    #: that refills at half a second a second; past it: 429 `new-shape-limit` with Retry-After
    new_shape_burst_s: float = Field(60.0, ge=0)
    #: output pixels per image/frame (H*W); decode input is checked against it before any work
    max_pixels: int = Field(4096 * 4096, ge=1)
    #: long side / short side of an image to encode; a thin strip is no picture (and the resize
    #: to the model's input would stretch one source row over all of it)
    max_aspect_ratio: float = Field(32.0, ge=1)
    #: video frames per request (after temporal upsampling)
    max_frames: int = Field(256, ge=1)
    api_key: str | None = None
    #: /docs and /openapi.json answer without the API key (they follow it by default)
    public_docs: bool = False
    plan_cache_dir: str | None = None
    #: NumPy backend: how a new conv shape's path is chosen. background: a cost model answers at
    #: once and the candidates are timed later, while the worker is idle; request: timed inside
    #: the first request (several steady calls' time); off: the cost model alone
    numpy_autotune: Literal["background", "request", "off"] = "background"
    plan_cache_capacity: int = Field(128, ge=1)
    unfold_limit_bytes: int | None = None
    tile_size: int | None = None
    shutdown_grace_s: float = Field(30.0, ge=0)
    #: a model worker with no heartbeat for this long (stopped, deadlocked, a call holding the
    #: interpreter lock) is unresponsive: not ready, its requests 503 `worker-unresponsive`
    #: with Retry-After, or sent to another device's worker (service/ipc/heartbeat.py)
    worker_heartbeat_s: float = Field(3.0, gt=0)
    #: a worker silent, or in one model call, for this long is hung: the supervisor kills it
    #: (SIGKILL) and starts another. 0 = auto: max(180 s, 3x request_timeout_s), past the
    #: request timeout and a shard group's deadline (heartbeat.hang_limit)
    worker_hang_s: float = Field(0.0, ge=0)
    log_level: str = "info"
    #: threads (per front-end process) that encode PNG/JPEG/WebP/MP4 and decode uploaded images
    #: off the event loop
    codec_threads: int = Field(2, ge=1)
    #: x264's speed preset for MP4 answers (streamed and whole): the encoder must keep pace
    #: with the decode. veryfast: 16 ms a 4-frame 480x832 group of smooth frames on a 16-core
    #: host, 40-44 ms on noise-like frames (a random-init decoder's), where ultrafast takes 21 ms
    #: for 42 % more bytes (benchmarks/service/video_encoder.py, 2026-11-30)
    mp4_preset: Literal["ultrafast", "superfast", "veryfast", "faster", "fast", "medium"] = "veryfast"
    #: x264's threads per MP4 encoder context (0: x264's own count, by the cores). With two contexts
    #: of 4 threads, Wan 2.1 81x480x832 from a random-init decoder left the 16-core H200 host's
    #: cores to the decode: /decode?format=mp4 and the stream at 0.86 and 0.91 of the raw decode,
    #: against 0.79 and 0.85 with one context of x264's own count in the same call, and 0.80 / 0.84
    #: against 0.78 / 0.77 in another (2026-11-30)
    mp4_threads: int = Field(4, ge=0, le=64)
    #: x264 contexts per MP4 answer, taking its frame groups in turn, that many encoded at once
    #: (each group starts with an IDR frame). One context of 4 threads took 49 ms a 4-frame group of
    #: noise-like frames there, against the decode's 37.5: it set the clip's pace (0.67 of raw)
    mp4_encoders: int = Field(2, ge=1, le=8)
    #: x264's entropy coder: CABAC (on), CAVLC (off), or auto: CAVLC at quality >= 80 (CRF <= 10),
    #: where CABAC's serial coding is most of the encode. CAVLC halves x264's time a group at the
    #: default quality 90 (480x832 noise-like frames on the H200 host: 20 ms against 52 with 4
    #: threads) for 12-19 % more bytes; one clip's answer did not need it once the encoder was loaded
    #: ahead (Wan 2.1 MP4 against raw, four interleaved pairs: mean 0.90 against 0.89, within the
    #: runs' spread; 2026-12-01). So on by default: every client's files stay as they were; off or
    #: auto buys encoder CPU with bytes
    mp4_cabac: Literal["auto", "on", "off"] = "on"
    #: how much lower the front ends run than the model workers (a nice increment, 0-19): under a
    #: full host, the device thread that feeds the GPU gets a core before bodies and codecs do.
    #: The model workers keep the server's own priority. Off by default: at 10, ConvNeXt-T one image
    #: a request on one H200 had p99 at 2.9x p50 against 4.2-4.3x in two interleaved pairs, but 3.7x
    #: against 3.5x in a third, throughput within run-to-run noise; Wan's video routes did not move
    #: (2026-11-30). Leave it at 0 on a CPU backend, whose worker takes every core: the front ends
    #: would starve
    frontend_nice: int = Field(0, ge=0, le=19)
    #: freeze what a front end or model worker holds once it can serve out of Python's later
    #: garbage collections (service/gc_pauses.py): a full collection otherwise walks every start-up
    #: object with the process's threads held still; false keeps the collector as Python ships it
    gc_freeze: bool = True
    #: where an encode request's JPEG file is decoded (service/worker/jpeg_bodies.py): frontend =
    #: the front end's PIL; auto = the model worker, on the GPU's hardware JPEG engines where it
    #: has them (nvImageCodec, the cuda-jpeg extra), else the front end; worker = always the model
    #: worker (PIL there without the engines). Only baseline YCbCr JPEGs of exactly the model's
    #: input size go to a worker (service/codecs/jpeg_header.py). frontend by default: on one H200
    #: (16-core host, ConvNeXt-T one 224x224 JPEG a request) the engines in the worker gave
    #: 0.57-0.72 of the raw model against the front ends' 0.78 and 0.86 in the same call, with
    #: ~6 fewer host cores busy: the worker's one interpreter is the limit (benchmarks/HISTORY.md)
    jpeg_decode: Literal["frontend", "auto", "worker"] = "frontend"
    #: how the front ends listen (service/listen_sockets.py): own = each on a socket of its own in one
    #: SO_REUSEPORT group (Linux: the kernel spreads new connections over them evenly; elsewhere as
    #: shared); shared = all on one socket, each new connection to whichever idle front end takes it
    #: first, which left the busiest of 14 front ends a whole core's work and the median half of one
    frontend_sockets: Literal["own", "shared"] = "own"
    #: HTTP front-end processes (--workers); 0 = auto: one on CPU backends (the cores compute),
    #: on GPUs every usable core but one per GPU and one more, at most 32 (they parse bodies and
    #: encode images: what limits small requests)
    workers: int = Field(0, ge=0)
    #: the GPUs that get a model worker each: "all" (every visible one) or ordinals "0,2"
    devices: str = "all"
    #: each front end's shared-memory arena (inputs and outputs in flight travel in it): a sparse
    #: file, so memory is taken only as requests use it; a request needing more is refused (413)
    shm_bytes: int = Field(4 << 30, ge=1 << 20)
    #: a front end sends the requests one turn of its event loop has for a model worker in one
    #: message (service/frontend/engine.py); off: one message each (to measure what it saves)
    bulk_submit: bool = True
    #: on a device that runs ahead (CUDA), a model worker stacks and starts the next batch while
    #: this one's results are on their way back (service/worker/batcher.py `Later`); off: each
    #: batch is waited for before the next is started (to measure what it saves)
    run_ahead: bool = True
    #: a model call whose outputs come to at most this many bytes (ConvNeXt-T's embeddings: 3 KB a
    #: request) is answered by the model worker's device thread itself, not handed to its delivery
    #: thread (service/worker/model_worker.py `_done`); 0: every call goes to the delivery thread
    deliver_inline_bytes: int = Field(1 << 20, ge=0)
    #: "on": on Linux with GPUs, each GPU's model worker runs on a core of its own (the last of the
    #: cores the server may use, one per GPU) and every other process of the server on the rest,
    #: where at least 4 cores a GPU worker are there (service/process_plan.py `pins`): the worker's
    #: threads then hand the interpreter lock over on one core. Off by default: two servers that
    #: share a host's cores (pods on one node without exclusive CPUs) would pin to the same core
    pin_workers: Literal["off", "on"] = "off"
    #: `shards=N` requests on GPUs: the first N GPUs' workers joined by NCCL (docs/sharding.md).
    #: Off: on GPUs `shards=N` is a 501 and `auto` is 1 (a host whose GPUs must never wait on each
    #: other). CPU backends serve sharded requests always (emulated shards, or `shard_comm`)
    shard_groups: bool = True
    #: how a CPU backend's workers form a shard group, a closed choice. "auto": NCCL on GPUs (per
    #: `shard_groups`), emulated shards (threads in the first worker) on CPU backends.
    #: "test-gloo", test-only: the CPU workers join one real multi-process group over torch's gloo
    #: (GlooShards of tests/gloo_shards.py, found as module `gloo_shards`: the repository's tests/
    #: must be on PYTHONPATH and torch, a test dependency, installed), so CI runs the leader/follower
    #: path without GPUs. No other import string is accepted.
    shard_comm: Literal["auto", "test-gloo"] = "auto"
    #: image sizes to run once per model before /readyz turns true ("512,1024x768"): decoders
    #: produce them, encoders take them. A new shape pays for path choice (measured on the CPU
    #: backend, autotuned cuDNN plans on CUDA) on first use; this moves that cost to start-up.
    warmup_sizes: str = ""
    #: CUDA backend: replay each model forward as one CUDA graph from its second call per input
    #: shape (convkernels/backends/cuda/graphs.py); graphs held at most, LRU over all models
    cuda_graphs: bool = True
    cuda_graph_capacity: int = Field(16, ge=1)
    #: CUDA backend: a graph whose memory pool would hold more bytes is dropped after capture and
    #: its shape runs eagerly (large forwards gain nothing from a replay and would double memory)
    cuda_graph_max_bytes: int = Field(4 << 30, ge=0)
    #: CUDA backend: time the first cuDNN plans of each new conv key instead of taking the
    #: heuristic's first one (the winner persists in plan_cache_dir)
    cuda_autotune: bool = False
    #: GPU workers pin the lowest this many bytes of each front end's arena in place
    #: (cudaHostRegister) and gather a batch of uint8 pixels on the device from its requests' own
    #: blocks, with no host copy (0: batches are stacked in pinned buffers first). Memory pinned:
    #: this x front ends, per GPU worker (16 MiB x 14 front ends on a 16-core host: 224 MiB); the
    #: arena fills from the bottom, so 16 MiB holds ~100 in-flight 224x224 images a front end,
    #: and a block above it is stacked the old way. ConvNeXt-T one image a request, one H200,
    #: 2026-11-30, three interleaved pairs: the device thread's CPU 81.6-84.2 -> 61.5-73.2 us a
    #: request, the worker's 138-139 -> 116-139, throughput 8,185-8,523 -> 8,103-9,281 img/s
    cuda_pinned_arena_bytes: int = Field(16 << 20, ge=0)
    #: CUDA backend with autotune on (CONVSERVE_CUDA_AUTOTUNE): cuDNN plans timed per conv key,
    #: the heuristic's first ones; bounds a new shape's first call
    cuda_autotune_plans: int = Field(4, ge=1)
    #: CUDA backend, ConvNeXt block fusions (A/B switches; the defaults are the measured best,
    #: benchmarks/gpu/convnext_fusion_ab.py): the depthwise conv + bias + LayerNorm as one kernel;
    #: else the depthwise conv's bias added by the LayerNorm; linear bias / GELU / residual in
    #: cuBLASLt's GEMM; cuBLASLt's tanh GELU for erf-GELU layers (float16 only); LayerNorm with
    #: the row in registers where it fits
    cuda_dw_ln: bool = False
    cuda_dw_bias_in_ln: bool = True
    cuda_lt_epilogues: bool = True
    cuda_lt_gelu_approx: bool = True
    cuda_ln_vec: bool = True
    #: CUDA backend: the decoders' upsamplers (nearest 2x + 3x3 conv) as a forward 2x2 conv and a
    #: copy placing its four phases ("phases"), as one transposed conv ("transposed"), or by the
    #: input's size ("auto"; convkernels/backends/cuda/upsample.py says when each is faster)
    cuda_upsample_form: Literal["auto", "phases", "transposed"] = "auto"

    @field_validator("warmup_sizes")
    @classmethod
    def _sizes_parse(cls, v: str) -> str:
        parse_sizes(v)  # a typo fails start-up with the offending entry named
        return v

    @field_validator("devices")
    @classmethod
    def _devices_parse(cls, v: str) -> str:
        parse_devices(v)
        return v

    def model_entries(self) -> list[ModelEntry]:
        return parse_models(self.models)

    def warmup_shapes(self) -> list[tuple[int, int]]:
        return parse_sizes(self.warmup_sizes)

    def backend_options(self) -> dict:
        """Constructor options for convkernels.get_backend: every backend knob comes from here
        (no backend reads the environment). The dtype and unfold limit apply to every backend;
        `numpy_options` / `cuda_options` only where that backend is the one chosen."""
        opts: dict = {"dtype": self.dtype} if self.dtype else {}
        if self.unfold_limit_bytes:
            opts["unfold_limit_bytes"] = self.unfold_limit_bytes
        opts["numpy_options"] = {"plan_cache_dir": self.plan_cache_dir, "autotune": self.numpy_autotune}
        opts["cuda_options"] = {"cuda_graphs": self.cuda_graphs, "graph_capacity": self.cuda_graph_capacity,
                                "graph_max_bytes": self.cuda_graph_max_bytes,
                                "autotune": self.cuda_autotune, "autotune_max_plans": self.cuda_autotune_plans,
                                "plan_cache_dir": self.plan_cache_dir,
                                "plan_cache_capacity": self.plan_cache_capacity,
                                "dw_ln": self.cuda_dw_ln, "dw_bias_in_ln": self.cuda_dw_bias_in_ln,
                                "lt_epilogues": self.cuda_lt_epilogues, "lt_gelu_approx": self.cuda_lt_gelu_approx,
                                "ln_vec": self.cuda_ln_vec, "upsample_form": self.cuda_upsample_form}
        return opts


class FaultSettings(BaseSettings):
    """Injected faults for tests and chaos drills (CONVSERVE_FAULT_*, service/worker/fault_injection.py).

    A class of its own rather than fields of Settings: a model worker reads these, and only these,
    from the environment it inherited, when it arms them after warm-up
    (fault_injection.arm_if_configured), so a test or drill sets them in a server's environment and
    no flag or deployment setting carries them. Every other setting reaches the worker as the
    Settings object the CLI built from its flags and environment; building a second Settings from
    the environment there could contradict it (a flag wins over its variable)."""

    model_config = SettingsConfigDict(env_prefix="CONVSERVE_FAULT_", extra="ignore")

    oom_above_bytes: int | None = None
    poison_value: float | None = None
    hold_value: float | None = None
    hold_release_file: str | None = None
    #: a held call first keeps the interpreter lock this many whole seconds, as a C call that holds
    #: it would (NVRTC or the cuDNN frontend compiling for a new shape): the heartbeat thread is
    #: silent meanwhile, yet the worker is busy, not hung
    hold_lock_s: int | None = None
    #: rank k of every sharded decode fails at its first collective (service/worker/shard_leader.py);
    #: with shard_fail_file, only while that file exists (a test ends the fault by removing it)
    shard_fail_rank: int | None = None
    shard_fail_file: str | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.oom_above_bytes, self.poison_value, self.hold_value))
