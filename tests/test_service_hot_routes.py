"""The one-image encode request's shortcut past FastAPI's routing (service/frontend/routes/hot_routes.py):
it reads a query exactly as FastAPI does or not at all, keeps the API key, answers what FastAPI's
way answers byte for byte, and leaves every other request to FastAPI."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from live_server import from_npy, npy
from service.frontend.routes import hot_routes

KEY = "hot-route-key"


@pytest.mark.parametrize("query,want", [
    (b"", ("json", None)),
    (b"format=npy", ("npy", None)),
    (b"top_k=5&format=json", ("json", 5)),
    (b"top_k=1000", ("json", 1000)),
    (b"unknown=1&format=npy", ("npy", None)),  # FastAPI ignores keys it does not declare too
    # FastAPI's to read (and refuse, or read its own way)
    (b"format=xml", None), (b"format=", None), (b"top_k=0", None), (b"top_k=1001", None),
    (b"top_k=05", None), (b"top_k=+5", None), (b"top_k=5.0", None), (b"top_k=", None),
    (b"format=npy&format=json", None), (b"top_k=1&top_k=2", None),
])
def test_a_query_is_read_exactly_or_left_to_fastapi(query, want):
    assert hot_routes.encode_query(query) == want


def test_other_requests_reach_the_router_untouched():
    seen = []

    async def router(scope, receive, send):
        seen.append(scope["path"])

    hot = hot_routes.HotRoutes(router, router=None)
    base = {"type": "http", "method": "POST", "query_string": b"", "headers": []}
    cases = [dict(base, path="/v1/models/m/decode"), dict(base, path="/v1/models/m/encode/x"),
             dict(base, method="GET", path="/v1/models/m/encode"),
             dict(base, path="/v1/models/m/encode", query_string=b"format=xml"),
             dict(base, path="/v1/models/m/encode", headers=[(b"content-type", b"multipart/form-data; boundary=x")])]
    for scope in cases:
        asyncio.run(hot(scope, None, None))
    assert seen == [c["path"] for c in cases]


@pytest.fixture(scope="module")
def keyed(server_factory):
    return server_factory(models="tiny-convnext", api_key=KEY)


def test_the_shortcut_keeps_the_key_and_answers_as_fastapi_does(keyed):
    image = np.random.default_rng(7).integers(0, 256, (1, 41, 37, 3), dtype=np.uint8)
    body, head = npy(image), {"content-type": "application/x-npy"}
    url = f"{keyed.url}/v1/models/tiny-convnext/encode"
    with httpx.Client(timeout=60) as c:
        r = c.post(url, params={"format": "npy"}, content=body, headers=head)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        head["authorization"] = f"Bearer {KEY}"
        fast = c.post(f"{url}?format=npy", content=body, headers=head)
        slow = c.post(f"{url}?format=npy&format=npy", content=body, headers=head)  # a repeat: FastAPI's way
        assert fast.status_code == slow.status_code == 200, (fast.text, slow.text)
        assert fast.content == slow.content and from_npy(fast.content).shape[0] == 1
        as_json = c.post(url, content=body, headers=head).json()
        np.testing.assert_array_equal(np.float32(as_json["embeddings"]), from_npy(fast.content))
        for bad in ("format=xml", "top_k=0"):  # refused by FastAPI's own validation, one line
            r = c.post(f"{url}?{bad}", content=body, headers=head)
            assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
            assert "\n" not in r.json()["detail"]
        assert c.get(f"{keyed.url}/healthz").status_code == 200
