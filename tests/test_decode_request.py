"""A decode request's options are decided once (service/frontend/decode_request.py): what the
request derives (uint8 pixels off the device, the worker's options), and, through a real
`convserve serve` of two CPU devices, that every decoding route validates the latents and decides
`shards` exactly once per request."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import npy, wait_until_every_device_is_ready
from service.frontend.decode_request import DecodeRequest
from service.ipc import worker_protocol as wp

NPY = {"content-type": "application/x-npy"}

#: what the front end's calls are counted of: (module, function) -> the name a call is logged as
COUNTED = {("service.frontend.decode_request", "decide_shards"): "decide",
           ("service.frontend.validation", "latents"): "validate"}

#: loaded by every process of the server (PYTHONPATH): when a counted module is imported, its
#: function is wrapped to append a line to COUNT_CALLS_FILE per call. Nothing is imported at start,
#: so the server's own modules load as they always do.
SITECUSTOMIZE = '''
import importlib.abc, importlib.machinery, os, sys

COUNTED = {counted!r}
OUT = os.environ["COUNT_CALLS_FILE"]


def _counted(fn, label):
    def counted(*args, **kwargs):
        with open(OUT, "a") as f:
            f.write(label + "\\n")
        return fn(*args, **kwargs)
    return counted


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        names = [(fn, label) for (mod, fn), label in COUNTED.items() if mod == name]
        if not names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for fn, label in names:
                setattr(module, fn, _counted(getattr(module, fn), label))
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


class View:
    shard_family = None


class Hm:
    name, model = "m", View()

    @staticmethod
    def output_shape(shape):
        return (shape[0], 8 * shape[-2], 8 * shape[-1], 3)


@pytest.mark.parametrize("fmt,dtype,uint8", [
    ("png", "float32", True), ("jpeg", "float32", True), ("webp", "float32", True), ("mp4", "float32", True),
    ("npy", "float32", False), ("npy", "float16", False), ("npy", "uint8", True), ("tensor", "float32", False)])
def test_files_and_uint8_arrays_leave_the_device_as_uint8(fmt, dtype, uint8):
    req = DecodeRequest(Hm, np.zeros((1, 4, 3, 5), np.float32), fmt, dtype)
    assert req.uint8 is uint8
    assert req.worker_options() == wp.Options(tiled=None, clamp=True, uint8=uint8, shards=1)


def test_the_worker_options_of_a_sharded_decode_are_untiled():
    lat = np.zeros((1, 4, 3, 5), np.float32)
    assert DecodeRequest(Hm, lat, "npy", tiled=None, shards=2, clamp=False).worker_options() == \
        wp.Options(tiled=False, clamp=False, uint8=False, shards=2)
    assert DecodeRequest(Hm, lat, "npy", tiled=True).worker_options().tiled is True
    assert DecodeRequest(Hm, lat, "npy", shards=2).first_run_key == ("decode", lat.shape, None, 2)


@pytest.fixture(scope="module")
def counting_server(server_factory, tmp_path_factory):
    site = tmp_path_factory.mktemp("count-site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.replace("{counted!r}", repr(COUNTED)))
    calls = site / "calls.txt"
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    srv = server_factory(models="vae=tiny-vae,wan=tiny-wan-vae", devices="0,1", max_queue_delay_ms=0,
                         env_extra={"PYTHONPATH": path, "COUNT_CALLS_FILE": str(calls)})
    wait_until_every_device_is_ready(srv.url, "vae")
    return srv, calls


def _calls(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _rest(url, model, lat, path="decode", **params):
    return httpx.post(f"{url}/v1/models/{model}/{path}", content=npy(lat), headers=NPY, params=params, timeout=120)


def test_each_decode_route_validates_and_decides_shards_once_per_request(counting_server):
    """A batch of clips on /decode validated its latents and decided `shards` twice (the route
    for the clip-or-batch choice, then Service.decode again); every route now builds its request
    once and hands it on whole."""
    srv, calls = counting_server
    rng = np.random.default_rng(0)
    image, clip, clips = (rng.standard_normal(s).astype(np.float32)
                          for s in ((1, 4, 6, 7), (1, 4, 2, 5, 6), (2, 4, 2, 5, 6)))
    kserve = {"inputs": [{"name": "latents", "datatype": "FP32", "shape": list(image.shape),
                          "data": image.reshape(-1).tolist()}], "parameters": {"shards": 2}}
    requests = {
        "REST image, shards=2": lambda: _rest(srv.url, "vae", image, format="npy", shards="2"),
        "REST image png, shards=auto": lambda: _rest(srv.url, "vae", image, format="png", shards="auto"),
        "REST clip batch, shards=2": lambda: _rest(srv.url, "wan", clips, format="npy", shards="2"),
        "REST one clip, shards=2": lambda: _rest(srv.url, "wan", clip, format="npy", shards="2"),
        "stream, shards=2": lambda: _rest(srv.url, "wan", clip, "decode/stream", format="npy", shards="2"),
        "KServe, shards=2": lambda: httpx.post(f"{srv.url}/v2/models/vae/infer", json=kserve, timeout=120),
        "remote VAE": lambda: httpx.post(f"{srv.url}/v1/models/vae/vae/decode", content=image.tobytes(),
                                         params={"shape": list(image.shape), "dtype": "float32",
                                                 "output_type": "pt"}, timeout=120),
    }
    for what, send in requests.items():
        before = len(_calls(calls))
        r = send()
        assert r.status_code == 200, (what, r.status_code, r.text[:300])
        made = sorted(_calls(calls)[before:])
        assert made == ["decide", "validate"], (what, made)
    # a refusal is decided once too, and answers as before
    before = len(_calls(calls))
    r = _rest(srv.url, "wan", clips, format="npy", shards="3")
    assert r.status_code == 422 and r.json()["type"].endswith("too-many-shards"), r.text[:300]
    assert sorted(_calls(calls)[before:]) == ["decide", "validate"]
