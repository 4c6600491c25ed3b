"""CONVSERVE_WARMUP_SIZES: each model runs the listed sizes before /readyz, so the first request
of such a size finds every conv path already chosen; a malformed list fails start-up by name."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from live_server import npy

from service.settings import Settings, parse_sizes


def choices(url: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/kernels", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["conv_choices"]


def input_shapes(chs: list[dict]) -> set[tuple]:
    return {tuple(c["input_shape"]) for c in chs}


def test_warmed_sizes_are_chosen_before_the_first_request(server_factory):
    srv = server_factory(models="tiny-vae,tiny-convnext", warmup_sizes="40x56, 72", max_batch=1)
    before = choices(srv.url)
    shapes = input_shapes(before)
    # tiny-vae's first conv sees the latent grid (8x smaller), tiny-convnext's stem the pixels
    assert (1, 5, 7, 4) in shapes and (1, 9, 9, 4) in shapes, sorted(shapes)
    assert (1, 40, 56, 3) in shapes and (1, 72, 72, 3) in shapes, sorted(shapes)

    rng = np.random.default_rng()
    r = httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=npy(rng.standard_normal((1, 4, 5, 7)).astype(np.float32)),
                   headers={"content-type": "application/x-npy"}, params={"format": "npy"}, timeout=60)
    assert r.status_code == 200, r.text
    assert np.load(__import__("io").BytesIO(r.content)).shape == (1, 40, 56, 3)
    after = choices(srv.url)
    # no new conv key: the request ran on paths chosen during warm-up
    assert len(after) == len(before)
    assert sum(c["calls"] for c in after) > sum(c["calls"] for c in before)


@pytest.mark.parametrize("spec, expected", [("", []), ("512", [(512, 512)]), (" 1024x768 ,64X32", [(1024, 768), (64, 32)])])
def test_sizes_parse(spec, expected):
    assert parse_sizes(spec) == expected


@pytest.mark.parametrize("spec", ["12y", "0", "64x", "x64", "-8"])
def test_bad_sizes_fail_settings_by_name(spec):
    with pytest.raises(ValueError, match="warm-up size"):
        Settings(warmup_sizes=spec)
