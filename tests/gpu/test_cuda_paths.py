"""The CUDA backend's own paths and behaviours (the ops themselves on every backend, cuda included:
tests/test_ops_conv.py, tests/test_ops.py): the convs the hosted models are made of take cuDNN;
gemm_fallback and tiled_unfold forced (the metric label is the path that ran); small_kd_2d and
depthwise_direct forced; to_host_async's side-stream copy; sampled conv timings harvested after the
batch. float16/bfloat16 < 1e-2, float32 < 1e-5 (TF32 off). Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import cuda_or_skip
from op_backends import Target, backend, conv_operands, put, ref_forward, ref_transposed, scrape
from torch_reference import fresh_rng, rel_l2

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]
TOL = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-5}

# (nd, N, spatial, C_in, C_out, kernel, stride, padding (lo,hi) per axis, dilation, groups)
GROUPED_1D = (1, 1, (29,), 6, 9, (5,), (2,), ((2, 0),), (2,), 3)
PLAIN_2D = (2, 2, (13, 11), 3, 5, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
DOWNSAMPLE = (2, 1, (15, 17), 6, 10, (3, 3), (2, 2), ((0, 1), (0, 1)), (1, 1), 2)  # diffusers' padding
GROUPED_2D = (2, 2, (19, 9), 8, 8, (3, 5), (1, 2), ((2, 1), (0, 3)), (2, 1), 4)
DEPTHWISE = (2, 1, (30, 30), 12, 12, (7, 7), (1, 1), ((3, 3), (3, 3)), (1, 1), 12)
DEPTHWISE_S2 = (2, 2, (15, 15), 9, 9, (3, 3), (2, 2), ((1, 1), (1, 1)), (2, 2), 9)
POINTWISE = (2, 1, (21, 23), 5, 11, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1)
TENSOR_CORE = (2, 1, (33, 35), 64, 96, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
CAUSAL_3D = (3, 2, (5, 9, 7), 3, 5, (3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (1, 1)), (1, 1, 1), 1)
GROUPED_3D = (3, 1, (6, 7, 11), 4, 6, (3, 1, 1), (2, 1, 1), ((1, 1), (0, 0), (0, 0)), (1, 1, 1), 2)
WAN_3D = (3, 1, (7, 12, 10), 32, 48, (3, 3, 3), (1, 1, 1), ((0, 0), (1, 1), (1, 1)), (1, 1, 1), 1)
# (nd, N, spatial, C_in, C_out, kernel, stride, padding, output_padding, dilation, groups)
T_STRIDE2 = (2, 2, (7, 9), 5, 3, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1)
T_GROUPED = (2, 2, (5, 7), 6, 9, (3, 2), (3, 1), (0, 1), (2, 0), (1, 2), 3)
T_GROUPED_3D = (3, 2, (2, 4, 3), 6, 4, (2, 3, 3), (2, 1, 2), (0, 1, 0), (1, 0, 0), (1, 1, 1), 2)


def cuda(dtype, fresh=False, **options):
    cuda_or_skip()
    return backend(Target("cuda", dtype), fresh, **options)


def conv_count(snap, op, path):
    return snap.get(("convkernels_conv_total", (("backend", "cuda"), ("op", op), ("path", path))), 0.0)


def run_conv_case(be, case, epilogue, transpose=False):
    """(relative L2 error against torch, seed) of one conv through be.conv."""
    rng, seed = fresh_rng()
    spec, (x, w, b, r, act), hosts = conv_operands(be, rng, case, epilogue, transpose=transpose)
    ours = be.to_host(be.conv(x, w, spec, b, residual=r, activation=act))
    ref = (ref_transposed if transpose else ref_forward)(case, hosts, act)
    return rel_l2(ours, ref), seed


def ran_once(be, case, epilogue, path, transpose=False):
    """Run a conv; assert it counted once under `path`; return (error, seed)."""
    op = f"conv{'_transpose' if transpose else ''}{case[0]}d"
    before = scrape()
    err, seed = run_conv_case(be, case, epilogue, transpose)
    assert conv_count(scrape(), op, path) - conv_count(before, op, path) == 1, (case, path)
    return err, seed


@pytest.mark.parametrize("dtype", DTYPES)
def test_common_convs_take_cudnn(dtype):
    """The convs the hosted models are made of must not silently fall back."""
    be = cuda(dtype)
    for case in (PLAIN_2D, DOWNSAMPLE, POINTWISE, TENSOR_CORE, WAN_3D):
        for ep in ("plain", "bias_silu_residual"):
            err, seed = ran_once(be, case, ep, "cudnn")
            assert err < TOL[dtype], f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_depthwise_convs_take_the_measured_path(dtype):
    """A depthwise key is timed on cuDNN and on depthwise_direct at its first call, autotune or not,
    and runs the faster from then on."""
    be = cuda(dtype, fresh=True)
    assert not be.options.autotune
    for ep in ("plain", "bias_silu_residual"):
        err, seed = run_conv_case(be, DEPTHWISE, ep)
        assert err < TOL[dtype], f"seed {seed}"
    for key, times in be.measurements.items():
        assert set(times) == {"cudnn", "depthwise_direct"}, times
        assert be.conv_choices()[-1]["path"] in times
    assert len(be.measurements) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_pointwise_convs_take_our_kernel(dtype):
    """Grouped 1x1 convs of small groups (DC-AE's multiscale projection) run grouped_pointwise
    without measurement; wider groups, strides and kernels keep cuDNN."""
    be = cuda(dtype, fresh=True)
    dc_ae = (2, 1, (33, 31), 96, 96, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 3)
    uneven = (2, 2, (9, 13), 15, 21, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 3)
    for case in (dc_ae, uneven):
        for ep in ("plain", "bias_silu_residual", "bias_gelu"):
            err, seed = ran_once(be, case, ep, "grouped_pointwise")
            assert err < TOL[dtype], f"seed {seed}: {err}"
    wide = (2, 1, (9, 7), 160, 160, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 2)  # 80 channels a group
    err, seed = ran_once(be, wide, "bias_gelu", "cudnn")
    assert err < TOL[dtype], f"seed {seed}: {err}"
    assert not be.measurements


@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_fallback_and_tiled_unfold(dtype):
    for limit, path in ((1 << 30, "gemm_fallback"), (256, "tiled_unfold")):
        be = cuda(dtype, force_fallback=True, unfold_limit_bytes=limit)
        for case in (GROUPED_1D, GROUPED_2D, DEPTHWISE_S2, CAUSAL_3D):
            err, seed = ran_once(be, case, "bias_silu_residual", path)
            assert err < TOL[dtype], f"seed {seed}: {err} ({path})"
        for case in (T_STRIDE2, T_GROUPED, T_GROUPED_3D):
            err, seed = ran_once(be, case, "bias_silu_residual", path, transpose=True)
            assert err < TOL[dtype], f"seed {seed}: {err} ({path})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_kd_2d_path(dtype):
    be = cuda(dtype, fresh=True)
    be.paths.forced = "small_kd_2d"
    for case in (CAUSAL_3D, GROUPED_3D, WAN_3D):
        for ep in ("plain", "bias_silu_residual"):
            err, seed = ran_once(be, case, ep, "small_kd_2d")
            assert err < TOL[dtype], f"seed {seed}: {err}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_depthwise_direct_path(dtype):
    be = cuda(dtype, fresh=True)
    be.paths.forced = "depthwise_direct"
    extra = (2, 3, (16, 13), 24, 24, (7, 7), (1, 1), ((3, 3), (3, 3)), (1, 1), 24)
    # dw2d_vec (stride 1, channels a multiple of the vector): width not a multiple of 4 columns
    vec = (2, 2, (9, 14), 40, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 40)
    for case in (DEPTHWISE, DEPTHWISE_S2, extra, vec):
        for ep in ("plain", "bias_silu_residual", "bias_gelu"):
            err, seed = ran_once(be, case, ep, "depthwise_direct")
            assert err < TOL[dtype], f"seed {seed}: {err}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_host_async_reads_the_array_as_it_was_when_asked(dtype):
    """to_host_async's result is to_host's, in float32, even when the device array is
    overwritten right after the call (the copy reads a fresh widened array, on a side stream)."""
    be = cuda(dtype)
    rng, _ = fresh_rng()
    x, xh = put(be, rng.standard_normal((1, 3, 33, 17, 3)))
    pending = be.to_host_async(x)
    x[...] = 0
    got = pending.result()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, xh.astype(np.float32))
    assert pending.result() is got  # a second wait returns the same array


def test_sampled_conv_timings_are_harvested_after_the_batch():
    be = cuda("float16", timing_sample_rate=1.0)
    rng, _ = fresh_rng()
    x = be.asarray(rng.standard_normal((1, 9, 11, 8)).astype(np.float32))
    w = be.asarray(rng.standard_normal((8, 3, 3, 8)).astype(np.float32))
    key = ("convkernels_conv_seconds_count", (("backend", "cuda"), ("op", "conv2d"), ("path", "cudnn")))
    be.flush_timings()
    before = scrape().get(key, 0.0)
    for _ in range(3):
        be.conv2d(x, w, padding=1)
    assert scrape().get(key, 0.0) == before  # nothing observed until the flush: no sync per conv
    be.synchronize()
    be.flush_timings()
    assert scrape().get(key, 0.0) - before == 3
