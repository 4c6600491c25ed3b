"""The MLX backend's service proof: `convserve serve` with CONVSERVE_BACKEND=mlx (Metal on a Mac, MLX's CPU device
elsewhere, so this runs in CI) serves decode and encode requests that match diffusers / transformers
in float32 (rel L2 < 1e-4), with every conv counted under backend="mlx" in /metrics.
The checks themselves live in tests/service_parity.py, shared with the CUDA test."""
from __future__ import annotations

import pytest

import service_parity as parity

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("mlx.core")

TOL = 1e-4


@pytest.fixture(scope="module")
def mlx_server(server_factory, tmp_path_factory):
    from convkernels import get_backend
    try:
        get_backend("mlx")
    except Exception as exc:  # mlx installed but unusable on this machine
        pytest.skip(f"mlx backend unavailable: {exc}")
    saved = parity.save_models(tmp_path_factory.mktemp("service_mlx"))
    server = server_factory(backend="mlx", dtype="float32", models=saved.models_setting())
    return server, saved


def test_service_on_mlx_matches_references(mlx_server):
    server, saved = mlx_server
    report = parity.run_all(server.url, saved, backend="mlx", dtype="float32", tol=TOL)
    print("\n".join(report.lines()))
