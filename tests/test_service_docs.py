"""The API's documentation routes (service/api_docs.py) on a real server: /docs and
/openapi.json follow the API key unless CONVSERVE_PUBLIC_DOCS says they are public, and the
Swagger page loads nothing from outside the server (it works offline)."""
from __future__ import annotations

import re

import httpx

KEY = "docs-key"


def test_docs_follow_the_api_key_and_load_only_local_assets(server_factory):
    srv = server_factory(models="tiny-vae", api_key=KEY)
    for path in ("/docs", "/openapi.json"):
        r = httpx.get(f"{srv.url}{path}")
        assert r.status_code == 401 and r.headers["content-type"].startswith("application/problem+json"), path
    auth = {"authorization": f"Bearer {KEY}"}
    spec = httpx.get(f"{srv.url}/openapi.json", headers=auth)
    assert spec.status_code == 200 and "/v1/models/{name}/decode" in spec.json()["paths"]
    page = httpx.get(f"{srv.url}/docs", headers=auth)
    assert page.status_code == 200
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text) + re.findall(r"url: *'([^']+)'", page.text)
    assert urls and all(u.startswith("/") for u in urls), urls  # nothing from a CDN
    for u in urls:
        assert httpx.get(f"{srv.url}{u}", headers=auth).status_code == 200, u
    assert httpx.get(f"{srv.url}/docs/assets/swagger-ui-bundle.js").status_code == 200  # static files: no key
    assert httpx.get(f"{srv.url}/redoc", headers=auth).status_code == 404  # its script lives only on a CDN


def test_public_docs_answer_without_the_key(server_factory):
    srv = server_factory(models="tiny-vae", api_key=KEY, public_docs="true")
    assert httpx.get(f"{srv.url}/docs").status_code == 200
    assert httpx.get(f"{srv.url}/openapi.json").status_code == 200
    r = httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=b"x")
    assert r.status_code == 401  # the models still need it
