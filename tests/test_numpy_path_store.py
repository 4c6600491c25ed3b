"""The NumPy backend's measured path choices on disk (CONVSERVE_PLAN_CACHE_DIR): a second backend
(a restarted server) reuses them without timing anything; corrupt, foreign or stale entries are
ignored and measured again; an unwritable directory costs nothing but the persistence. Every
conv's output is checked against torch.nn.functional."""
from __future__ import annotations

import json

import numpy as np
import pytest

from torch_reference import fresh_rng, ref_conv, rel_l2

from convkernels import get_backend
from convkernels.backends.numpy.path_store import PathStore

TOL = 1e-5


def conv_once(be, rng):
    """A conv above the (lowered) autotune threshold, checked against torch; returns its path."""
    x = rng.standard_normal((1, 13, 11, 40)).astype(np.float32)
    w = rng.standard_normal((34, 3, 3, 40)).astype(np.float32)
    out = be.conv2d(x, w, padding=1)
    assert rel_l2(out, ref_conv(x, w, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)) < TOL
    return be.conv_choices()[0]["path"]


def counting_backend(monkeypatch, directory):
    # measured inside the request (autotune="request"), so the store is written when conv2d
    # returns; tests/test_numpy_first_call.py covers the background tuner's use of the store
    be = get_backend("numpy", autotune_min_macs=1, plan_cache_dir=str(directory), autotune="request")
    timed = []
    real = be._time_paths
    monkeypatch.setattr(be, "_time_paths", lambda key, valid: timed.append(key) or real(key, valid))
    return be, timed


def test_a_restarted_backend_reuses_the_measured_choice(tmp_path, monkeypatch):
    rng, seed = fresh_rng()
    first, timed = counting_backend(monkeypatch, tmp_path)
    path = conv_once(first, rng)
    assert len(timed) == 1
    (stored,) = tmp_path.glob("numpy-paths-*.json")
    assert path in json.loads(stored.read_text())["choices"].values()

    second, timed = counting_backend(monkeypatch, tmp_path)
    assert conv_once(second, rng) == path and timed == [], f"seed {seed}"


@pytest.mark.parametrize("damage", ["garbage", "foreign", "stale_path", "not_a_dict"])
def test_damaged_or_foreign_files_are_ignored_and_replaced(tmp_path, monkeypatch, damage):
    rng, _ = fresh_rng()
    first, _ = counting_backend(monkeypatch, tmp_path)
    conv_once(first, rng)
    (stored,) = tmp_path.glob("numpy-paths-*.json")
    data = json.loads(stored.read_text())
    if damage == "garbage":
        stored.write_bytes(b"\x00{not json")
    elif damage == "foreign":  # another CPU wrote it under this name: its choices do not apply
        data["fingerprint"]["cpu"] = "some other processor"
        stored.write_text(json.dumps(data))
    elif damage == "stale_path":  # a path this build does not have (say, no C compiler here)
        data["choices"] = {k: "no_such_path" for k in data["choices"]}
        stored.write_text(json.dumps(data))
    else:
        stored.write_text("[1, 2, 3]")
    second, timed = counting_backend(monkeypatch, tmp_path)
    again = conv_once(second, rng)
    assert len(timed) == 1  # measured again
    assert list(json.loads(stored.read_text())["choices"].values()) == [again]  # and the file is whole again


def test_an_unwritable_directory_only_loses_the_persistence(tmp_path, monkeypatch):
    rng, _ = fresh_rng()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    be, timed = counting_backend(monkeypatch, blocker / "plans")
    conv_once(be, rng)
    conv_once(be, rng)  # the in-process memo still holds
    assert len(timed) == 1


def test_fingerprint_names_the_hardware_and_build(tmp_path):
    a = PathStore(tmp_path)
    for key in ("cpu", "cpus", "numpy", "blas", "compiled_kernels", "convserve"):
        assert key in a.fingerprint
    b = PathStore(tmp_path, {**a.fingerprint, "cpus": (a.fingerprint["cpus"] or 1) + 1})
    assert a.path != b.path


def test_the_service_settings_reach_the_backend_and_the_environment_does_not(tmp_path, monkeypatch):
    """CONVSERVE_PLAN_CACHE_DIR / CONVSERVE_UNFOLD_LIMIT_BYTES are service settings: they reach
    the backend through Settings.backend_options(), never by the backend reading the environment."""
    from service.settings import Settings

    monkeypatch.setenv("CONVSERVE_PLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CONVSERVE_UNFOLD_LIMIT_BYTES", "12345")
    served = get_backend("numpy", **Settings().backend_options())
    assert served.path_store is not None and served.unfold_limit_bytes == 12345
    rng, _ = fresh_rng()
    conv_once(served, rng)
    # a direct constructor call sees the same environment and ignores it
    bare = get_backend("numpy")
    assert bare.path_store is None and bare.unfold_limit_bytes != 12345
