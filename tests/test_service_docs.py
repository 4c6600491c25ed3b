"""The API's documentation routes (service/frontend/routes/api_docs.py) on a real server: /docs and
/openapi.json follow the API key unless CONVSERVE_PUBLIC_DOCS says they are public, and the
Swagger page loads nothing from outside the server (it works offline)."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

KEY = "docs-key"


@pytest.fixture(scope="module")
def keyed(server_factory):
    """A server with an API key and the docs behind it (the default); its tests only read."""
    return server_factory(models="tiny-vae", api_key=KEY)


def test_docs_follow_the_api_key_and_load_only_local_assets(keyed):
    srv = keyed
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


def test_root_points_at_the_docs_without_the_key(keyed):
    """/ is what a newcomer opens first: a small JSON naming the docs, never a bare 404, and it asks
    for no key (it says whether the rest does)."""
    srv = keyed
    r = httpx.get(f"{srv.url}/")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    doc = r.json()
    assert doc["docs"] == "/docs" and doc["openapi"] == "/openapi.json" and doc["health"] == "/healthz"
    assert doc["api_key_required"] is True and doc["docs_need_api_key"] is True
    assert httpx.get(f"{srv.url}{doc['docs']}", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{srv.url}{doc['health']}").status_code == 200
    assert "/" not in httpx.get(f"{srv.url}/openapi.json", headers={"authorization": f"Bearer {KEY}"}).json()["paths"]


# ---- problem types: `type` is the kind's anchor in docs/api.md ------------------------------------
REPO = Path(__file__).resolve().parents[1]
#: kinds the service passes through a variable rather than as Problem(status, "kind", ...)
PASSED_ON_KINDS = {"not-found", "method-not-allowed", "http-error", "invalid-parameters", "internal-error",
                   "wrong-model-kind", "no-vae-encoder", "non-finite-latents", "non-finite-pixels",
                   "model-rejected-input", "stream-closed", "shard-groups-off", "shards-not-on-this-backend",
                   "worker-died", "no-live-worker", "worker-unresponsive", "header-timeout",
                   "headers-too-large"}


def service_strings() -> tuple[set[str], set[str]]:
    """(kinds written as Problem(status, "kind", ...), every string of a kind's form) in service/."""
    text = "\n".join(p.read_text() for p in sorted((REPO / "service").rglob("*.py")))
    return (set(re.findall(r'Problem\(\s*[\w.]+,\s*"([a-z0-9-]+)"', text)),
            set(re.findall(r'"([a-z0-9]+(?:-[a-z0-9]+)*)"', text)))


def documented_kinds() -> set[str]:
    api = (REPO / "docs" / "api.md").read_text()
    section = api[api.index("### Problem types"):]
    return set(re.findall(r'<a id="([a-z0-9-]+)"></a>`\1`', section))


def test_every_problem_kind_has_its_entry_in_the_api_docs():
    """The type reference of every kind leads somewhere: an anchor of that name in docs/api.md's
    Problem types table; and the table names no kind that is gone from the service's sources."""
    from service.problems import PROBLEM_TYPE_BASE, Problem

    literal, quoted = service_strings()
    kinds, documented = literal | PASSED_ON_KINDS, documented_kinds()
    assert len(literal) > 50 and PASSED_ON_KINDS <= quoted, sorted(PASSED_ON_KINDS - quoted)
    assert not kinds - documented, f"kinds without an entry in docs/api.md: {sorted(kinds - documented)}"
    assert not documented - quoted, f"docs/api.md lists kinds gone from service/: {sorted(documented - quoted)}"
    assert PROBLEM_TYPE_BASE == "docs/api.md#" and (REPO / PROBLEM_TYPE_BASE.split("#")[0]).is_file()
    assert Problem(429, "queue-full", "x").body()["type"] == "docs/api.md#queue-full"


def test_problem_types_point_into_the_docs_over_http(live_server):
    srv = live_server  # the session's server (tiny-vae among its models, no key)
    for r, kind in ((httpx.get(f"{srv.url}/v1/models/nope"), "unknown-model"),
                    (httpx.get(f"{srv.url}/no/such/route"), "not-found"),
                    (httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=b"x",
                                headers={"content-type": "application/x-npy"}), "bad-npy")):
        assert r.headers["content-type"] == "application/problem+json", r.text
        assert r.json()["type"] == f"docs/api.md#{kind}", r.json()
        assert kind in documented_kinds()
