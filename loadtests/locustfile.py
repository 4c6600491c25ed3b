"""Locust scenarios against a convserve on localhost (run headless through loadtests/run.py).

  EncodeUser  - small PNG images -> /v1/models/$LOAD_ENCODER/encode   (default tiny-convnext)
  DecodeUser  - image latents    -> /v1/models/$LOAD_DECODER/decode   (default tiny-vae)
  MixedUser   - both, 1:1, plus an occasional model-card read

CONVSERVE_API_KEY, when set, is sent as a bearer token. Payloads are random and built once."""
from __future__ import annotations

import io
import os
from urllib.parse import urlparse

import numpy as np
from locust import HttpUser, between, events, task
from PIL import Image

ENCODER = os.environ.get("LOAD_ENCODER", "tiny-convnext")
DECODER = os.environ.get("LOAD_DECODER", "tiny-vae")
LATENT_SIDE = int(os.environ.get("LOAD_LATENT_SIDE", "8"))
IMAGE_SIDE = int(os.environ.get("LOAD_IMAGE_SIDE", "64"))
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}

_rng = np.random.default_rng()
_png = io.BytesIO()
Image.fromarray(_rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)).save(_png, format="PNG")
PNG = _png.getvalue()
_npy = io.BytesIO()
np.save(_npy, _rng.standard_normal((1, 4, LATENT_SIDE, LATENT_SIDE)).astype(np.float32))
LATENTS = _npy.getvalue()


def _headers(content_type: str) -> dict:
    h = {"content-type": content_type}
    if os.environ.get("CONVSERVE_API_KEY"):
        h["authorization"] = f"Bearer {os.environ['CONVSERVE_API_KEY']}"
    return h


@events.test_start.add_listener
def _localhost_only(environment, **_):
    host = urlparse(environment.host or "").hostname
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"load tests run against localhost only, not {environment.host!r}")


class _Convserve(HttpUser):
    abstract = True
    wait_time = between(0.01, 0.05)

    def encode(self):
        with self.client.post(f"/v1/models/{ENCODER}/encode", data=PNG, headers=_headers("image/png"),
                              name="encode", catch_response=True) as r:
            if r.status_code == 200 and not r.json().get("embeddings"):
                r.failure("no embeddings in the answer")

    def decode(self):
        with self.client.post(f"/v1/models/{DECODER}/decode", data=LATENTS, headers=_headers("application/x-npy"),
                              name="decode", catch_response=True) as r:
            if r.status_code == 200 and not r.content.startswith(b"\x89PNG"):
                r.failure("answer is not a PNG")


class EncodeUser(_Convserve):
    @task
    def encode_small_image(self):
        self.encode()


class DecodeUser(_Convserve):
    @task
    def decode_image_latents(self):
        self.decode()


class MixedUser(_Convserve):
    @task(10)
    def encode_small_image(self):
        self.encode()

    @task(10)
    def decode_image_latents(self):
        self.decode()

    @task(1)
    def model_cards(self):
        self.client.get("/v1/models", headers=_headers("application/json"), name="models")
