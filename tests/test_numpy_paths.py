"""The NumPy backend's own paths and behaviours against torch.nn.functional (fp32, rel L2 < 1e-5):
every path of its catalogue reached by the shared grid, sub-pixel and Winograd row tiles, the
tiled unfold, measured path choice, the compiled kernels and their pure-NumPy fallbacks, half
inputs computed in float32, float64. The ops themselves on every backend: test_ops*.py."""
from __future__ import annotations

import numpy as np
import pytest

from torch_reference import CONV_CASES, F, fresh_rng, from_t, ref_activation, ref_conv, ref_conv_transpose, rel_l2, to_t, torch

from convkernels import ConvKey, ConvSpec, get_backend
from convkernels import _cpu
from convkernels.backend import CONV_OPS

TOL = 1e-5


@pytest.fixture
def be():
    return get_backend("numpy")


def test_catalogue_paths_all_exercised_by_the_grid():
    probe = get_backend("numpy")
    seen = set()
    for nd, n, sp, cin, cout, k, stride, pad, dil, g in CONV_CASES:
        key = ConvKey(CONV_OPS[nd], (n, *sp, cin), (cout, *k, cin // g), "float32",
                      ConvSpec.make(nd, stride, pad, dil, g), (False, False, None))
        seen |= {p.name for p in probe.paths.candidates(key)}
    expected = {"pointwise_gemm", "depthwise_shift", "shift_gemm", "im2col_gemm", "winograd_f2x3"}
    if _cpu.AVAILABLE:
        expected |= {"depthwise_direct", "winograd_f2x3_3d", "winograd_f4x3", "winograd_f4x3_3d"}
    assert expected <= seen, expected - seen


@pytest.mark.parametrize("limit", [4096, None])
def test_subpixel_path_writes_phases_in_place(limit):
    """A kernel-4 stride-2 padding-1 transposed conv on subpixel_gemm,
    whole and in row tiles (limit 4096 B: one row per tile), with the full epilogue."""
    rng, seed = fresh_rng()
    be = get_backend("numpy", unfold_limit_bytes=limit)
    x = rng.standard_normal((2, 9, 14, 37)).astype(np.float32)
    w = rng.standard_normal((21, 4, 4, 37)).astype(np.float32)
    b = rng.standard_normal(21).astype(np.float32)
    res = rng.standard_normal((2, 18, 28, 21)).astype(np.float32)
    ours = be.conv_transpose2d(x, w, b, stride=2, padding=1, residual=res, activation="silu")
    assert [c["path"] for c in be.conv_choices()] == ["subpixel_gemm"]
    ref = ref_conv_transpose(x, w, b, (2, 2), (1, 1), (0, 0), (1, 1), 1)
    ref = from_t(ref_activation(to_t(ref), "silu")) + res
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"
    again = be.conv_transpose2d(x, w, b, stride=2, padding=1, residual=res, activation="silu")
    assert np.array_equal(ours, again)  # the cached phase weights give the same answer


@pytest.mark.parametrize("transpose", [False, True])
def test_tiled_unfold_equals_untiled(transpose):
    rng, seed = fresh_rng()
    big = get_backend("numpy")
    small = get_backend("numpy", unfold_limit_bytes=4096)
    x = rng.standard_normal((2, 21, 19, 5)).astype(np.float32)
    if transpose:
        # padding 2: kernel 4, stride 2, padding 1 would run on subpixel_gemm
        w = rng.standard_normal((4, 4, 4, 5)).astype(np.float32)
        run = lambda b: b.conv_transpose2d(x, w, stride=2, padding=2)
        ref = ref_conv_transpose(x, w, None, (2, 2), (2, 2), (0, 0), (1, 1), 1)
    else:
        w = rng.standard_normal((6, 3, 3, 5)).astype(np.float32)
        run = lambda b: b.conv2d(x, w, padding=((1, 0), (2, 1)), stride=(1, 2))
        ref = ref_conv(x, w, None, (1, 2), ((1, 0), (2, 1)), (1, 1), 1)
    tiled, untiled = run(small), run(big)
    kinds = {c["path"] for c in small.conv_choices()}
    assert kinds == {"tiled_unfold"}, kinds
    assert {c["path"] for c in big.conv_choices()} == {"im2col_gemm"}
    assert np.allclose(tiled, untiled, rtol=1e-5, atol=1e-5), f"seed {seed}"
    assert rel_l2(tiled, ref) < TOL, f"seed {seed}"


def test_forced_path_runs_and_matches(be):
    rng, seed = fresh_rng()
    x = rng.standard_normal((1, 15, 14, 6)).astype(np.float32)
    w = rng.standard_normal((6, 7, 7, 1)).astype(np.float32)
    be.paths.forced = "im2col_gemm"  # depthwise conv forced onto the generic grouped gemm
    ours = be.conv2d(x, w, padding=3, groups=6)
    assert be.conv_choices()[0]["path"] == "im2col_gemm"
    assert rel_l2(ours, ref_conv(x, w, None, (1, 1), ((3, 3), (3, 3)), (1, 1), 6)) < TOL, f"seed {seed}"


def test_half_inputs_are_computed_in_fp32(be):
    rng, seed = fresh_rng()
    x = rng.standard_normal((1, 9, 10, 4)).astype(np.float16)
    w = rng.standard_normal((5, 3, 3, 4)).astype(np.float16)
    out = be.conv2d(x, w, padding=1)
    assert out.dtype == np.float32
    ref = ref_conv(x.astype(np.float32), w.astype(np.float32), None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert rel_l2(out, ref) < TOL, f"seed {seed}"


def test_unsupported_dtype_is_refused(be):
    with pytest.raises(ValueError, match="unsupported dtype"):
        be.conv2d(np.zeros((1, 4, 4, 2), np.int32), np.zeros((2, 1, 1, 2), np.float32))
    with pytest.raises(ValueError, match="floating"):
        be.asarray(np.zeros(3, dtype=object))
    with pytest.raises(ValueError, match="groups must divide"):
        be.group_norm(np.zeros((1, 4, 4, 6), np.float32), 4)


def test_shift_gemm_row_tiles_match_torch():
    rng, seed = fresh_rng()
    be = get_backend("numpy", unfold_limit_bytes=2048)  # forces several row tiles
    x = rng.standard_normal((2, 11, 9, 40)).astype(np.float32)
    w = rng.standard_normal((7, 3, 3, 40)).astype(np.float32)
    ours = be.conv2d(x, w, padding=((2, 0), (1, 1)), dilation=(1, 2))
    assert be.conv_choices()[0]["path"] == "shift_gemm"
    assert rel_l2(ours, ref_conv(x, w, None, (1, 1), ((2, 0), (1, 1)), (1, 2), 1)) < TOL, f"seed {seed}"


@pytest.mark.parametrize("path", ["winograd_f2x3", "winograd_f4x3"])
def test_winograd_row_tiles_match_torch(path):
    if path == "winograd_f4x3" and not _cpu.AVAILABLE:
        pytest.skip("F(4x4, 3x3) has only the compiled transforms (no compiler at install time)")
    rng, seed = fresh_rng()
    be = get_backend("numpy", unfold_limit_bytes=16 * 1024)  # several tile rows
    be.paths.forced = path
    x = rng.standard_normal((2, 13, 11, 36)).astype(np.float32)
    w = rng.standard_normal((34, 3, 3, 36)).astype(np.float32)
    ours = be.conv2d(x, w, padding=1)
    assert be.conv_choices()[0]["path"] == path
    assert rel_l2(ours, ref_conv(x, w, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)) < TOL, f"seed {seed}"


@pytest.mark.skipif(not _cpu.AVAILABLE, reason="the optional C extension was not built here (no compiler)")
@pytest.mark.parametrize("path", ["winograd_f2x3_3d", "winograd_f4x3_3d"])
def test_winograd_3d_row_tiles_and_tap_views_match_torch(path):
    """Several tile rows; and the transformed-weight cache keeps slices of one weight apart (Wan's
    first latent frame convolves with a fresh view of the last time tap on every call)."""
    rng, seed = fresh_rng()
    be = get_backend("numpy", unfold_limit_bytes=16 * 1024)
    be.paths.forced = path
    x = rng.standard_normal((1, 3, 13, 11, 36)).astype(np.float32)
    w = rng.standard_normal((34, 3, 3, 3, 36)).astype(np.float32)
    pad = ((2, 0), (1, 1), (1, 1))
    for taps in (slice(None), slice(2, 3), slice(0, 1), slice(2, 3), slice(None)):
        wv = w[:, taps]
        tpad = pad if wv.shape[1] == 3 else ((0, 0), (1, 1), (1, 1))
        ours = be.conv3d(x, wv, padding=tpad)
        ref = ref_conv(x, np.ascontiguousarray(wv), None, (1, 1, 1), tpad, (1, 1, 1), 1)
        assert rel_l2(ours, ref) < TOL, f"taps {taps}, seed {seed}"
    assert {c["path"] for c in be.conv_choices()} == {path}
    # all taps, the last, the first: one transform each (as gemm.c's panels, or as U without them)
    assert len(be._wino_cache.entries) == 3


def test_autotune_times_a_conv_once_whatever_its_epilogue_and_padding_split(monkeypatch):
    """Measured path choice: keys that differ only in the epilogue or in how an axis's padding is
    split (SD-VAE's upsampling phase convs) share one timing; another total padding is timed anew.
    Every call still matches torch. (Timed inside the request here, autotune="request", so that
    the count is deterministic; the background tuner dedupes by the same work key.)"""
    rng, seed = fresh_rng()
    be = get_backend("numpy", autotune_min_macs=1, autotune="request")
    timings = []
    real = be._time_paths
    monkeypatch.setattr(be, "_time_paths", lambda key, valid: timings.append(key) or real(key, valid))
    x = rng.standard_normal((1, 12, 11, 40)).astype(np.float32)
    w = rng.standard_normal((36, 2, 2, 40)).astype(np.float32)
    b = rng.standard_normal(36).astype(np.float32)
    for pad, bias in [(((1, 0), (1, 0)), None), (((0, 1), (1, 0)), b), (((1, 0), (0, 1)), None),
                      (((0, 1), (0, 1)), b), (((1, 1), (1, 1)), None)]:
        ours = be.conv2d(x, w, bias, padding=pad)
        assert rel_l2(ours, ref_conv(x, w, bias, (1, 1), pad, (1, 1), 1)) < TOL, f"pad {pad}, seed {seed}"
    assert len(be.conv_choices()) == 5 and len(timings) == 2, [k.spec.padding for k in timings]


def test_winograd_3d_declines_a_long_clip_in_one_call():
    """One row of tiles over all frames must fit WINOGRAD_3D_ROW_MAX_BYTES; past it the per-tap
    paths take the conv (no multi-hundred-MiB transform buffer)."""
    be = get_backend("numpy")
    spec = ConvSpec.make(3, 1, ((2, 0), (1, 1), (1, 1)))
    short = ConvKey("conv3d", (1, 5, 128, 128, 96), (96, 3, 3, 3, 96), "float32", spec, (False, False, None))
    long = ConvKey("conv3d", (1, 100, 64, 832, 96), (96, 3, 3, 3, 96), "float32", spec, (False, False, None))
    names = lambda k: {p.name for p in be.paths.candidates(k)}  # noqa: E731
    assert ("winograd_f2x3_3d" in names(short)) == _cpu.AVAILABLE
    assert "winograd_f2x3_3d" not in names(long) and "shift_gemm" in names(long)


@pytest.mark.parametrize("compiled", [True, False])
def test_gelu_norms_depthwise_with_and_without_the_compiled_kernels(monkeypatch, compiled):
    """The C kernels and the pure-NumPy fallbacks (machines without a compiler) both match torch."""
    if compiled and not _cpu.AVAILABLE:
        pytest.skip("the optional C extension was not built here (no compiler at install time)")
    monkeypatch.setattr(_cpu, "AVAILABLE", compiled)
    be = get_backend("numpy")
    rng, seed = fresh_rng()
    x = (rng.standard_normal((2, 9, 7, 45)) * 3).astype(np.float32)
    w = rng.standard_normal(45).astype(np.float32)
    b = rng.standard_normal(45).astype(np.float32)
    xt = torch.from_numpy(x.astype(np.float64))
    assert rel_l2(be.gelu(x), F.gelu(xt).numpy()) < TOL, f"seed {seed}"
    ln = F.layer_norm(xt, (45,), torch.from_numpy(w.astype(np.float64)), torch.from_numpy(b.astype(np.float64)),
                      eps=1e-6)
    assert rel_l2(be.layer_norm(x, w, b, eps=1e-6), ln.numpy()) < TOL, f"seed {seed}"
    lin_w = rng.standard_normal((13, 45)).astype(np.float32)
    ref = F.gelu(F.linear(xt, torch.from_numpy(lin_w.astype(np.float64)), torch.from_numpy(b[:13].astype(np.float64))))
    assert rel_l2(be.linear(x, lin_w, b[:13], activation="gelu"), ref.numpy()) < TOL, f"seed {seed}"
    big = (rng.standard_normal((2, 33, 17, 45)) * 2 + 5).astype(np.float32)  # offset mean: variance must not cancel
    gn = F.silu(F.group_norm(to_t(big), 5, torch.from_numpy(w.astype(np.float64)),
                             torch.from_numpy(b.astype(np.float64)), eps=1e-6))
    assert rel_l2(be.group_norm(big, 5, w, b, eps=1e-6, activation="silu"), from_t(gn)) < TOL, f"seed {seed}"
    # RMSNorm (+ SiLU), Wan's eps: 45 channels leave a part vector; 25 K rows split over the pool
    for eps in (1e-6, 1e-24 / 45):
        rms = F.rms_norm(torch.from_numpy(big.astype(np.float64)), (45,), torch.from_numpy(w.astype(np.float64)), eps)
        assert rel_l2(be.rms_norm(big, w, eps), rms.numpy()) < TOL, f"seed {seed}"
        assert rel_l2(be.rms_norm(big, w, eps, activation="silu"), F.silu(rms).numpy()) < TOL, f"seed {seed}"
    dw = rng.standard_normal((45, 7, 7, 1)).astype(np.float32)
    ours = be.conv2d(x, dw, b, padding=3, groups=45)
    assert be.conv_choices()[-1]["path"] == ("depthwise_direct" if compiled else "depthwise_shift")
    assert rel_l2(ours, ref_conv(x, dw, b, (1, 1), ((3, 3), (3, 3)), (1, 1), 45)) < TOL, f"seed {seed}"


def test_gelu_float64_stays_float64_precise(be):
    x = np.linspace(-6, 6, 1001)
    ref = F.gelu(torch.from_numpy(x)).numpy()
    assert rel_l2(be.gelu(x), ref) < 1e-12
