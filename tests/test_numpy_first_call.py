"""A new conv shape's first call on the NumPy backend: the cost model answers it, nothing is timed
inside the request, and the background tuner's measured choice is persisted and used from the
next call on. Outputs are checked against torch.nn.functional whichever path ran.

Deterministic: the tests that depend on which path wins set the machine rates (cost_model.NOMINAL)
or the timings the tuner sees, never a machine-speed threshold."""
from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest

from torch_reference import fresh_rng, ref_conv, rel_l2

from convkernels import ConvKey, ConvSpec, get_backend
from convkernels.backends.numpy import background, cost_model

TOL = 1e-5


@pytest.fixture
def nominal_rates(monkeypatch):
    monkeypatch.setattr(cost_model, "_rates", cost_model.NOMINAL)


def counting_runs(be) -> list:
    """Wrap every catalogue path's runner: (thread, path name) of each run is recorded."""
    runs = []

    def wrap(p):
        def run(*a, **k):
            runs.append((threading.get_ident(), p.name))
            return p.run(*a, **k)
        return dataclasses.replace(p, run=run)
    be.paths.catalogue = [wrap(p) for p in be.paths.catalogue]
    return runs


def conv_case(rng, be, shape=(1, 14, 13, 40), out=36, pad=1):
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((out, 3, 3, shape[-1])).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32)
    got = be.conv2d(x, w, b, padding=pad)
    assert rel_l2(got, ref_conv(x, w, b, (1, 1), ((pad, pad), (pad, pad)), (1, 1), 1)) < TOL
    return got


def test_a_new_shape_runs_one_path_in_the_request_and_times_none(monkeypatch):
    rng, seed = fresh_rng()
    be = get_backend("numpy", autotune_min_macs=1)  # every conv a measured one
    timed = []
    monkeypatch.setattr(be, "_time_paths", lambda key, valid: timed.append(key))
    be.choice.tuner.idle_s = 3600  # the tuner waits; only the request's own runs are counted
    runs = counting_runs(be)
    for shape in [(1, 14, 13, 40), (1, 9, 16, 48), (2, 8, 8, 40)]:
        conv_case(rng, be, shape)
    mine = [name for thread, name in runs if thread == threading.get_ident()]
    assert len(mine) == 3 and timed == [], (mine, seed)
    assert be.choice.estimated == 3
    be.choice.tuner.close()


def test_the_old_behaviour_times_inside_the_request(monkeypatch):
    """autotune="request": every valid path timed in the request (the setting still works)."""
    rng, _ = fresh_rng()
    be = get_backend("numpy", autotune_min_macs=1, autotune="request")
    runs = counting_runs(be)
    conv_case(rng, be)
    assert len(runs) > 1 and be.choice.tuner is None


@pytest.mark.parametrize("preset,shape,call", [
    ("sd-vae", (1, 4, 32, 32), lambda m, x: m.decode(x, tiled=False)),
    ("convnext-tiny", (1, 224, 224, 3), lambda m, x: m.encode(x)),
    ("wan2.1-vae", (1, 16, 2, 16, 16), lambda m, x: m.decode(x)),
])
def test_the_cost_model_picks_every_conv_of_the_models(nominal_rates, preset, shape, call):
    """Every conv of an SD-VAE 256 decode, a ConvNeXt-T encode and a Wan 2.1 5 x 128 x 128 decode
    gets a valid path from the cost model where it has a choice (the path runners are stubbed: this
    is about the choice, not the arithmetic; ConvNeXt's depthwise convs are fused with their
    LayerNorm, no conv path), and SD-VAE's and Wan's take the paths measured fastest on a 2-core
    box: Winograd F(4x4) for their 3x3 (and kT x 3 x 3) convs, shift_gemm for the 3-channel output
    conv, the pointwise gemm for 1x1 (Wan's 3-D F(4x4) against F(2x2): 6.5 / 8.7 ms at 16 x 16 x 384,
    72 / 147 ms at 5 x 128 x 128 x 96, 2026-11-29)."""
    from models import load_model

    be = get_backend("numpy", autotune="off", autotune_min_macs=1)
    be.paths.catalogue = [dataclasses.replace(p, run=lambda x, w, key, *a: np.zeros(key.out_shape, np.float32))
                          for p in be.paths.catalogue]
    model = load_model("t", preset, be)
    call(model, np.random.default_rng(0).random(shape, dtype=np.float32))
    choices = be.conv_choices()
    # ConvNeXt's convs (stem, downsamplers) have one valid path each: nothing to estimate
    assert choices and (be.choice.estimated >= 10 if preset == "sd-vae" else True)
    for c in choices:
        spec = ConvSpec.make(len(c["weight_shape"]) - 2, c["stride"], [tuple(p) for p in c["padding"]],
                             c["dilation"], c["groups"])
        key = ConvKey(c["op"], tuple(c["input_shape"]), tuple(c["weight_shape"]), c["dtype"], spec, (False, False, None))
        assert c["path"] in {p.name for p in be.paths.candidates(key)}
        k, cin, cout = tuple(c["weight_shape"][1:-1]), c["input_shape"][-1], c["weight_shape"][0]
        if preset == "sd-vae" and k == (3, 3) and cin >= 128:
            assert c["path"] == ("winograd_f4x3" if cout >= 128 else "shift_gemm"), c
        if preset == "sd-vae" and k == (1, 1) and cin >= 128:
            assert c["path"] == "pointwise_gemm", c
        if preset == "wan2.1-vae" and k[-2:] == (3, 3) and cin >= 96 and cout >= 96:
            assert c["path"] == ("winograd_f4x3_3d" if len(k) == 3 else "winograd_f4x3"), c


def test_machine_rates_are_measured_once(monkeypatch):
    monkeypatch.setattr(cost_model, "_rates", None)
    r = cost_model.measure_rates()
    assert all(v > 0 and np.isfinite(v) for v in dataclasses.astuple(r))
    assert cost_model.measure_rates() is r


def test_background_measurement_is_persisted_and_then_used(tmp_path, monkeypatch, nominal_rates):
    """The model says Winograd; the tuner's (set) timings say shift_gemm is ten times faster: the
    store gets shift_gemm, the next call runs it, and a restarted backend takes it from the store
    without estimating or measuring. Both paths' outputs match torch and each other."""
    rng, seed = fresh_rng()
    fast = "shift_gemm"

    def fake_timing(p, key, x, w):
        p.run(x, w, key, None, None, None)
        return 0.001 if p.name == fast else 0.01
    monkeypatch.setattr(background, "run_timed", fake_timing)
    be = get_backend("numpy", autotune_min_macs=1, plan_cache_dir=str(tmp_path))
    be.choice.tuner.idle_s = 3600  # held back until the estimate has been seen
    runs = counting_runs(be)
    first = conv_case(rng, be)
    assert be.conv_choices()[0]["path"] != fast
    be.choice.tuner.idle_s, be.choice.tuner.max_load = 0.01, float("inf")  # not gated on the box's load
    assert be.choice.tuner.wait(60)
    (stored,) = tmp_path.glob("numpy-paths-*.json")
    assert list(json.loads(stored.read_text())["choices"].values()) == [fast]
    second = conv_case(np.random.default_rng(seed), be)  # the same operands again
    assert [c["path"] for c in be.conv_choices()] == [fast]  # listed as soon as measured, and run
    assert [name for _, name in runs[-1:]] == [fast] and rel_l2(second, first) < TOL

    restarted = get_backend("numpy", autotune_min_macs=1, plan_cache_dir=str(tmp_path))
    conv_case(np.random.default_rng(seed), restarted)
    assert [c["path"] for c in restarted.conv_choices()] == [fast]
    assert restarted.choice.estimated == 0 and restarted.choice.tuner.measured == 0


def test_a_measured_path_no_faster_than_the_estimate_does_not_replace_it(tmp_path, monkeypatch, nominal_rates):
    rng, _ = fresh_rng()
    monkeypatch.setattr(background, "run_timed", lambda p, key, x, w: 0.0095 if p.name == "shift_gemm" else 0.01)
    be = get_backend("numpy", autotune_min_macs=1, plan_cache_dir=str(tmp_path))
    be.choice.tuner.idle_s = 3600
    conv_case(rng, be)
    estimate = be.conv_choices()[0]["path"]
    assert estimate != "shift_gemm"
    be.choice.tuner.idle_s, be.choice.tuner.max_load = 0.01, float("inf")  # not gated on the box's load
    assert be.choice.tuner.wait(60)
    (stored,) = tmp_path.glob("numpy-paths-*.json")
    assert list(json.loads(stored.read_text())["choices"].values()) == [estimate]


def fake_paths(calls: list, activity: background.Activity, interrupt_first: str | None):
    from convkernels.paths import ConvPath

    def make(name):
        def run(x, w, key, *a):
            calls.append(name)
            if name == interrupt_first and calls.count(name) == 1:
                with activity:  # a request's conv starts while this run is being timed
                    pass
            return None
        return ConvPath(name, lambda k: True, lambda k: 1.0, run)
    return [make("a"), make("b")]


def small_key(n: int = 1) -> ConvKey:
    return ConvKey("conv2d", (n, 4, 4, 2), (2, 3, 3, 2), "float32", ConvSpec.make(2, 1, 1), (False, False, None))


@pytest.fixture
def every_round(monkeypatch):
    """Time every fake path in all three rounds: their microsecond runs differ by noise alone, and
    autotune drops a path AUTOTUNE_DROP_FACTOR slower than the leader after the second round, which
    noise on a busy box can reach (the counts below would then depend on the machine's load)."""
    from convkernels.backends.numpy import autotune

    monkeypatch.setattr(autotune, "AUTOTUNE_DROP_FACTOR", float("inf"))


def test_a_run_overlapping_a_request_is_thrown_away_and_repeated(every_round):
    activity, calls, results = background.Activity(), [], []
    tuner = background.BackgroundTuner(activity, lambda key, valid, win, t: results.append(t), idle_s=0.01)
    tuner.max_load = float("inf")
    assert tuner.submit(("k",), small_key(), fake_paths(calls, activity, "a"))
    assert tuner.wait(60)
    assert calls.count("a") == 4 and calls.count("b") == 3  # three rounds each, "a" once again
    assert len(results) == 1 and tuner.measured == 1


def test_the_queue_and_the_thread_are_bounded():
    activity, calls = background.Activity(), []
    tuner = background.BackgroundTuner(activity, lambda *a: None, idle_s=0.01)
    with activity:  # a long request: the tuner never finds the process idle
        accepted = sum(tuner.submit(("k", i), small_key(), fake_paths(calls, activity, None))
                       for i in range(background.MAX_PENDING + 10))
        assert accepted in (background.MAX_PENDING, background.MAX_PENDING + 1)  # + the one being measured
        assert not tuner.submit(("k", 0), small_key(), [])  # queued already
        assert sum(t.name == "convkernels-path-tuner" for t in threading.enumerate()) >= 1
        tuner.close()
    assert tuner.wait(10) and calls == []
    too_big = ConvKey("conv2d", (1, 8192, 8192, 4), (4, 3, 3, 4), "float32", ConvSpec.make(2, 1, 1), (False, False, None))
    assert not background.BackgroundTuner(activity, lambda *a: None).submit(("big",), too_big, [])


@pytest.mark.parametrize("mode", ["background", "request", "off"])
def test_the_service_setting_reaches_the_backend(mode):
    """CONVSERVE_NUMPY_AUTOTUNE, through Settings.backend_options() as every backend knob."""
    from service.settings import Settings

    be = get_backend("numpy", **Settings(numpy_autotune=mode).backend_options())
    assert be.choice.mode == mode and (be.choice.tuner is not None) == (mode == "background")
    assert be.describe()["autotune"] == mode


def test_nothing_is_timed_while_the_machine_is_oversubscribed(every_round):
    """Timings taken while other jobs load the cores are noise: the tuner waits for the load
    average to fall below its limit (here: never, then at once)."""
    activity, calls = background.Activity(), []
    tuner = background.BackgroundTuner(activity, lambda *a: None, idle_s=0.01)
    tuner.max_load = -1.0
    assert tuner.submit(("k",), small_key(), fake_paths(calls, activity, None))
    assert not tuner.wait(0.5) and calls == []
    tuner.max_load = float("inf")
    assert tuner.wait(60) and calls.count("a") == 3 and tuner.measured == 1


def _no_preparation(monkeypatch):
    from convkernels.backends.numpy.backend import NumpyBackend

    monkeypatch.setattr(NumpyBackend, "prepare_conv", lambda *a, **k: None)
    monkeypatch.setattr(NumpyBackend, "prepare_linear", lambda *a, **k: None)


def test_a_decoders_weights_are_transformed_at_load_and_its_first_call_transforms_none(nominal_rates, monkeypatch):
    """Loading a model transforms the weights its paths would transform on the first call (tiny-vae:
    Winograd's panels of its 3x3 convs, gemm.c's packing of its unfolded and 1x1 ones), choosing
    as a call at 64 x 64 would, with nothing memoised, timed or queued; the first decode then
    transforms nothing more, and gives the same floats as a model whose weights wait for their
    first call. The encoder's wait for it (module.py). F(4x4) is forced: at 8 x 9 latents the cost
    model takes F(2x2) for some convs that it would run with F(4x4) at 64 x 64."""
    from models import load_model

    be = get_backend("numpy", autotune="background")
    be.paths.forced = "winograd_f4x3"
    model = load_model("t", "tiny-vae", be)
    prepared = len(be._wino_cache)
    assert prepared >= 4, "tiny-vae's 3x3 convs of 32 and 64 channels take Winograd"
    assert be.conv_choices() == [] and be.choice.estimated == 0
    z = np.random.default_rng(0).standard_normal((1, 4, 8, 9)).astype(np.float32)
    out = model.decode(z, tiled=False)
    assert len(be._wino_cache) == prepared
    model.encode(np.random.default_rng(1).random((1, 64, 72, 3), dtype=np.float32))
    assert len(be._wino_cache) > prepared, "the encoder's convs are transformed on its first call"
    _no_preparation(monkeypatch)
    lazy = get_backend("numpy", autotune="background")
    lazy.paths.forced = "winograd_f4x3"
    later = load_model("t", "tiny-vae", lazy)
    assert len(lazy._wino_cache) == 0
    assert np.array_equal(later.decode(z, tiled=False), out)


def test_linear_and_unfolded_conv_weights_are_packed_at_load():
    """ConvNeXt's MLP linears, stem and downsamplers are packed into gemm.c's panels at load (its
    first call's 65 ms of packing on ConvNeXt-T, 2-core Xeon), one entry each, and its first call
    packs none (its depthwise convs are fused with their LayerNorm, no packing)."""
    from convkernels.backends.numpy import fused
    from models import load_model
    from models.nn.layers import Conv2d, Linear

    if not fused.panel_width():
        pytest.skip("no compiled gemm tiles here: linears run on NumPy's matmul, nothing to pack")
    be = get_backend("numpy", autotune="off")
    model = load_model("t", "tiny-convnext", be)
    modules = [m for _, m in model.tree.walk()]
    linears = sum(isinstance(m, Linear) for m in modules)
    dense_convs = sum(isinstance(m, Conv2d) and m.groups == 1 for m in modules)

    def packed() -> int:
        return sum(k[0] is fused.pack_panels for k in be._wino_cache.entries)
    assert linears >= 4 and dense_convs >= 2 and packed() == linears + dense_convs
    model.encode(np.random.default_rng(0).random((1, 64, 64, 3), dtype=np.float32))
    assert packed() == linears + dense_convs
