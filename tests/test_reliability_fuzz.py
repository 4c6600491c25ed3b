"""Schema fuzzing with schemathesis against the service's own OpenAPI document: every /v1 and /v2
operation (and the ops routes), on a real server with an API key, a bounded number of generated
requests per operation. Every answer must be a non-5xx status the schema documents, with a body
and content type the schema allows; afterwards the server is healthy, serves a good request
correctly, and its memory has not run away.

CI runs FUZZ_EXAMPLES per operation (default 30: about 1300 requests, ~30 s on 2 cores). A longer run:
    FUZZ_EXAMPLES=500 pytest tests/test_reliability_fuzz.py -s
"""
from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest

from live_server import from_npy, npy

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEY = "fuzz-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MODELS = ["tiny-vae", "tiny-convnext", "tiny-wan-vae"]
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))
#: generated requests sent, and how many came back 5xx (a failing check stops its operation)
TALLY = {"requests": 0, "server_errors": 0, "statuses": {}, "by_operation": {}, "structured_refusals": {}}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def fuzz_server(server_factory):
    # small limits keep whatever the fuzzer sends cheap to refuse or to run
    srv = server_factory(models=",".join(MODELS), api_key=KEY, max_body_bytes=1_000_000,
                         max_pixels=256 * 256, max_frames=9, max_batch=4, request_timeout_s=30)
    srv.rss_start_kib = rss_kib(srv.proc.pid)
    return srv


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", headers=AUTH)  # the key guards it too

    @schema.hook
    def flatmap_path_parameters(context, path_parameters):
        # mostly real model names, so requests get past the 404 and into the parsers
        if not isinstance(path_parameters, dict) or "name" not in path_parameters:
            return st.just(path_parameters)
        return st.sampled_from(MODELS + [path_parameters["name"]]).map(lambda n: {**path_parameters, "name": n})

    return schema


# diffusers' remote VAE protocol sends raw tensor bytes as tensor/binary
schemathesis.serializer.alias("tensor/binary", "application/octet-stream")
schema = schemathesis.pytest.from_fixture("fuzz_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=False, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_fuzz_operation(case, fuzz_server):
    response = case.call(headers=AUTH, timeout=60)
    TALLY["requests"] += 1
    TALLY["statuses"][response.status_code] = TALLY["statuses"].get(response.status_code, 0) + 1
    op = TALLY["by_operation"].setdefault(case.operation.label, {})
    op[response.status_code] = op.get(response.status_code, 0) + 1
    if response.status_code >= 500:
        TALLY["server_errors"] += 1
    case.validate_response(response, headers=AUTH,
                           excluded_checks=[schemathesis.checks.positive_data_acceptance])


# ---- structure-aware: well-formed tensors of any shape, dtype and value reach the models ------------
def _values(draw, shape, dtype):
    kind = draw(st.sampled_from(["normal", "normal", "zeros", "huge", "tiny", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    x = {"normal": lambda: rng.standard_normal(shape),
         "zeros": lambda: np.zeros(shape),
         "huge": lambda: rng.standard_normal(shape) * 6e4,  # near float16's max
         "tiny": lambda: rng.standard_normal(shape) * 1e-40,  # float32 denormals
         "mixed": lambda: rng.choice([0.0, -0.0, 1e-45, -3.0, 65504.0, 1e30], size=shape)}[kind]()
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@st.composite
def latents(draw, video: bool):
    # mostly acceptable shapes (so the models run), sometimes empty, too many or wrong
    n = draw(st.sampled_from([1, 1, 1, 2, 3, 4, 0, 5]))
    c = draw(st.sampled_from([4, 4, 4, 4, 3, 16]))
    t = (draw(st.sampled_from([1, 2, 3, 0])),) if video else ()
    hi = 6 if video else 20
    h, w = (draw(st.integers(1, hi) | st.just(0)) for _ in range(2))
    shape = (n, c, *t, h, w)[draw(st.sampled_from([0, 0, 0, 1])):]  # sometimes no batch axis
    return _values(draw, shape, draw(st.sampled_from([np.float32, np.float16, np.float64])))


def _ok_or_4xx(r, what) -> None:
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    TALLY["requests"] += 1
    TALLY["statuses"][r.status_code] = TALLY["statuses"].get(r.status_code, 0) + 1
    if r.status_code != 200:
        assert r.headers["content-type"] == "application/problem+json", what
        kind = r.json()["type"].rsplit("/", 1)[-1]
        TALLY["structured_refusals"][kind] = TALLY["structured_refusals"].get(kind, 0) + 1


STRUCTURED = settings(max_examples=max(EXAMPLES, 10), deadline=None, suppress_health_check=list(HealthCheck),
                      phases=[Phase.generate])


@STRUCTURED
@given(x=latents(video=False), tiled=st.sampled_from(["auto", "on", "off"]))
def test_structured_image_latents(fuzz_server, x, tiled):
    r = httpx.post(f"{fuzz_server.url}/v1/models/tiny-vae/decode", content=npy(x),
                   params={"format": "npy", "tiled": tiled},
                   headers={"content-type": "application/x-npy", **AUTH}, timeout=60)
    _ok_or_4xx(r, f"latents {x.shape} {x.dtype}")
    if r.status_code == 200:
        out = from_npy(r.content)
        x4 = x if x.ndim == 4 else x[None]
        assert out.shape == (x4.shape[0], 8 * x4.shape[2], 8 * x4.shape[3], 3)
        assert np.isfinite(out).all() and out.min() >= 0 and out.max() <= 1


@STRUCTURED
@given(x=latents(video=True))
def test_structured_video_latents(fuzz_server, x):
    r = httpx.post(f"{fuzz_server.url}/v1/models/tiny-wan-vae/decode", content=npy(x), params={"format": "npy"},
                   headers={"content-type": "application/x-npy", **AUTH}, timeout=60)
    _ok_or_4xx(r, f"video latents {x.shape} {x.dtype}")
    if r.status_code == 200:
        out = from_npy(r.content)
        assert np.isfinite(out).all() and out.min() >= 0 and out.max() <= 1


@st.composite
def pixels(draw):
    shape = (draw(st.integers(0, 3)), draw(st.integers(0, 90)), draw(st.integers(0, 90)),
             draw(st.sampled_from([3, 3, 3, 1, 4])))
    dtype = draw(st.sampled_from([np.uint8, np.float32, np.float16, np.int16]))
    if dtype == np.uint8 or dtype == np.int16:
        return np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1))).integers(0, 256, shape).astype(dtype)
    return _values(draw, shape, dtype)


@STRUCTURED
@given(px=pixels(), via=st.sampled_from(["v1", "kserve"]))
def test_structured_pixels(fuzz_server, px, via):
    if via == "v1":
        r = httpx.post(f"{fuzz_server.url}/v1/models/tiny-convnext/encode", content=npy(px),
                       headers={"content-type": "application/x-npy", **AUTH}, timeout=60)
    else:
        dt = {"uint8": "UINT8", "float32": "FP32", "float16": "FP16", "int16": "INT16"}[px.dtype.name]
        head = json.dumps({"inputs": [{"name": "pixels", "datatype": dt, "shape": list(px.shape),
                                       "parameters": {"binary_data_size": px.nbytes}}]}).encode()
        r = httpx.post(f"{fuzz_server.url}/v2/models/tiny-convnext/infer", content=head + px.tobytes(),
                       headers={"content-type": "application/octet-stream", "inference-header-content-length":
                                str(len(head)), **AUTH}, timeout=60)
    _ok_or_4xx(r, f"pixels {px.shape} {px.dtype} via {via}")


@STRUCTURED
@given(x=latents(video=False), output_type=st.sampled_from(["pt", "pt", "pil"]), partial=st.booleans(),
       packed=st.sampled_from([False, False, True]), scaling=st.sampled_from([None, 0.18215, 1e-30, -2.0]))
def test_structured_remote_vae_decode(fuzz_server, x, output_type, partial, packed, scaling):
    """diffusers' remote_decode wire format: raw bytes + shape/dtype query, FLUX-packed 3-D latents too."""
    query = {"dtype": {"float32": "float32", "float16": "float16", "float64": "float64"}[x.dtype.name],
             "output_type": output_type, "partial_postprocess": str(partial).lower()}
    if scaling is not None:
        query["scaling_factor"] = scaling
    shape = list(x.shape)
    if packed and x.ndim == 4:  # (B, h/2*w/2, 4C) as FLUX pipelines hand them, height/width in pixels
        shape = [x.shape[0], (x.shape[2] // 2) * (x.shape[3] // 2), 4 * x.shape[1]]
        query.update(height=8 * x.shape[2], width=8 * x.shape[3])
        x = x.ravel()[: int(np.prod(shape))]
    r = httpx.post(f"{fuzz_server.url}/v1/models/tiny-vae/vae/decode", content=x.tobytes(),
                   params={**query, "shape": shape}, headers={"content-type": "tensor/binary", **AUTH}, timeout=60)
    _ok_or_4xx(r, f"remote_decode {shape} {query}")


PUBLIC = {"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"}


def test_every_guarded_operation_needs_the_key(fuzz_server):
    """Every operation in the schema but health and metrics answers 401 problem+json without the
    key, with a wrong one, or with another scheme, and documents that 401."""
    u = fuzz_server.url
    assert httpx.get(f"{u}/openapi.json").status_code == 401  # the schema itself is guarded
    doc = httpx.get(f"{u}/openapi.json", headers=AUTH).json()
    tried = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            url = u + path.replace("{name}", "tiny-vae")
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                            {"authorization": f"Bearer {KEY}x"}):
                r = httpx.request(method.upper(), url, headers=headers, content=b"x" if method == "post" else None,
                                  timeout=30)
                tried += 1
                if path in PUBLIC:
                    assert r.status_code == 200, (method, path)
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.headers["content-type"] == "application/problem+json"
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert "401" in op["responses"], (method, path)
    print(f"RELIABILITY auth sweep: {tried} unauthenticated requests over {len(doc['paths'])} paths")


def test_fuzzed_server_is_healthy_after(fuzz_server):
    """Runs after the fuzzing above (file order): zero 5xx, ready, correct, memory bounded."""
    u = fuzz_server.url
    print(f"RELIABILITY fuzz examples_per_operation={EXAMPLES} requests={TALLY['requests']} "
          f"server_errors={TALLY['server_errors']} statuses={dict(sorted(TALLY['statuses'].items()))}")
    for label, statuses in sorted(TALLY["by_operation"].items()):
        print(f"  {label}: {dict(sorted(statuses.items()))}")
    assert TALLY["requests"] > 0 or EXAMPLES == 0
    assert TALLY["server_errors"] == 0
    assert fuzz_server.proc.poll() is None
    assert httpx.get(f"{u}/readyz", timeout=10).status_code == 200
    x = np.random.default_rng().standard_normal((1, 4, 5, 3)).astype(np.float32)
    r = httpx.post(f"{u}/v1/models/tiny-vae/decode", content=npy(x), params={"format": "npy"},
                   headers={"content-type": "application/x-npy", **AUTH}, timeout=60)
    assert r.status_code == 200
    out = from_npy(r.content)
    assert out.shape == (1, 40, 24, 3) and np.isfinite(out).all() and out.min() >= 0 and out.max() <= 1
    grown = rss_kib(fuzz_server.proc.pid) - fuzz_server.rss_start_kib
    print(f"RELIABILITY fuzz rss_growth_mib={grown / 1024:.1f} structured refusals: {TALLY['structured_refusals']}")
    assert grown < 300 * 1024, f"server RSS grew {grown / 1024:.0f} MiB during fuzzing"
