"""Every MLX-backend op against torch.nn.functional (MLX CPU device here, fp32, rel L2 < 1e-5)."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from torch_reference import (CONV_T_CASES, F, fresh_rng, from_t, ref_activation, ref_conv, ref_conv_transpose,  # noqa: E402
                             rel_l2, to_t, torch)

from convkernels import ConvKey, ConvSpec, get_backend  # noqa: E402
from convkernels.backend import CONV_OPS  # noqa: E402

TOL = 1e-5


@pytest.fixture
def be():
    return get_backend("mlx")


def dev(be, a):
    return be.asarray(a)


# (nd, N, spatial, C_in, C_out, kernel, stride, padding (lo,hi) per axis, dilation, groups)
CONV_CASES = [
    (1, 2, (37,), 5, 7, (3,), (1,), ((1, 1),), (1,), 1),
    (1, 1, (29,), 6, 9, (5,), (2,), ((2, 0),), (2,), 3),
    (2, 2, (13, 11), 3, 5, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    (2, 1, (15, 17), 6, 10, (3, 3), (2, 2), ((0, 1), (0, 1)), (1, 1), 2),  # diffusers' downsample padding
    (2, 2, (19, 9), 8, 8, (3, 5), (1, 2), ((2, 1), (0, 3)), (2, 1), 4),
    (2, 1, (30, 30), 12, 12, (7, 7), (1, 1), ((3, 3), (3, 3)), (1, 1), 12),  # depthwise, not mult of 8
    (2, 2, (15, 15), 9, 9, (3, 3), (2, 2), ((1, 1), (1, 1)), (2, 2), 9),  # depthwise stride 2 dilation 2
    (2, 1, (21, 23), 5, 11, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),  # pointwise
    (2, 2, (12, 13), 3, 7, (4, 4), (4, 4), ((0, 0), (0, 0)), (1, 1), 1),  # patchify stem
    (3, 1, (4, 6, 5), 35, 9, (3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (0, 2)), (1, 1, 1), 1),
    (3, 2, (5, 9, 7), 3, 5, (3, 3, 3), (1, 2, 1), ((2, 0), (1, 1), (1, 1)), (1, 1, 2), 1),  # causal time pad
    (3, 1, (6, 7, 11), 4, 6, (3, 1, 1), (2, 1, 1), ((1, 1), (0, 0), (0, 0)), (1, 1, 1), 2),  # grouped 3D
    (3, 1, (4, 10, 9), 6, 6, (2, 3, 3), (1, 2, 2), ((0, 1), (1, 0), (2, 2)), (1, 2, 1), 6),
]


def _operands(rng, case, epilogue):
    nd, n, sp, cin, cout, k, stride, pad, dil, g = case
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    spec = ConvSpec.make(nd, stride, pad, dil, g)
    bias = residual = act = None
    if epilogue != "plain":
        bias = rng.standard_normal(cout).astype(np.float32)
        residual = rng.standard_normal((n, *spec.output_spatial(sp, k), cout)).astype(np.float32)
        act = "silu" if epilogue == "bias_silu_residual" else "gelu"
    return x, w, spec, bias, residual, act


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}d-{c[2]}-g{c[9]}")
@pytest.mark.parametrize("epilogue", ["plain", "bias_silu_residual"])
def test_conv_matches_torch(be, case, epilogue):
    rng, seed = fresh_rng()
    x, w, spec, bias, residual, act = _operands(rng, case, epilogue)
    nd, _, _, _, _, _, stride, pad, dil, g = case
    ours = be.conv(dev(be, x), dev(be, w), spec, None if bias is None else dev(be, bias),
                   residual=None if residual is None else dev(be, residual), activation=act)
    assert isinstance(ours, mx.array)
    ref = ref_conv(x, w, bias, stride, pad, dil, g, residual, act)
    assert rel_l2(be.to_host(ours), ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}d-{c[2]}-g{c[9]}")
def test_every_valid_path_matches_torch(case):
    """Force each path whose guard accepts the key, so no path hides behind its cost rule."""
    rng, seed = fresh_rng()
    x, w, spec, bias, _, _ = _operands(rng, case, "bias_gelu")
    nd, _, _, _, _, _, stride, pad, dil, g = case
    ref = ref_conv(x, w, bias, stride, pad, dil, g, None, "gelu")
    probe = get_backend("mlx")
    key = ConvKey(CONV_OPS[nd], x.shape, w.shape, "float32", spec, (True, False, "gelu"))
    names = [p.name for p in probe.paths.candidates(key)]
    assert names, "no path accepts the key"
    for name in names:
        be = get_backend("mlx")
        be.paths.forced = name
        ours = be.conv(dev(be, x), dev(be, w), spec, dev(be, bias), activation="gelu")
        assert be.conv_choices()[0]["path"] == name
        assert rel_l2(be.to_host(ours), ref) < TOL, f"path {name}, seed {seed}"


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_nd_entry_points(be, nd):
    rng, seed = fresh_rng()
    sp = (11, 9, 7)[:nd]
    x = rng.standard_normal((2, *sp, 6)).astype(np.float32)
    w = rng.standard_normal((4, *(3,) * nd, 3)).astype(np.float32)
    fn = {1: be.conv1d, 2: be.conv2d, 3: be.conv3d}[nd]
    ours = fn(dev(be, x), dev(be, w), stride=2, padding=1, groups=2, dilation=1)
    ref = ref_conv(x, w, None, (2,) * nd, ((1, 1),) * nd, (1,) * nd, 2)
    assert rel_l2(be.to_host(ours), ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("case", CONV_T_CASES, ids=lambda c: f"t{c[0]}d-{c[2]}-s{c[6]}")
def test_conv_transpose_matches_torch(case):
    nd, n, sp, cin, cout, k, stride, pad, opad, dil, g = case
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    ref = ref_conv_transpose(x, w, b, stride, pad, opad, dil, g)
    spec = ConvSpec.make(nd, stride, pad, dil, g, transpose=True, output_padding=opad)
    key = ConvKey(f"conv_transpose{nd}d", x.shape, w.shape, "float32", spec, (True, False, None))
    names = [p.name for p in get_backend("mlx").paths.candidates(key)]
    assert names
    for name in names:
        be = get_backend("mlx")
        be.paths.forced = name
        fn = {2: be.conv_transpose2d, 3: be.conv_transpose3d}[nd]
        ours = fn(dev(be, x), dev(be, w), dev(be, b), stride=stride, padding=pad, output_padding=opad,
                  dilation=dil, groups=g)
        assert be.conv_choices()[0]["path"] == name
        assert rel_l2(be.to_host(ours), ref) < TOL, f"path {name}, seed {seed}"


def test_upsample_conv2d(be):
    """nearest 2x + 3x3 conv (Upsample2D / Wan's Resample) vs torch: odd channels, non-square."""
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 7, 10, 13)).astype(np.float32)
    w = rng.standard_normal((11, 3, 3, 13)).astype(np.float32)
    b = rng.standard_normal(11).astype(np.float32)
    ours = be.to_host(be.upsample_conv2d(dev(be, x), dev(be, w), dev(be, b)))
    up = F.interpolate(to_t(x), scale_factor=2, mode="nearest")
    ref = from_t(F.conv2d(up, torch.from_numpy(w.astype(np.float64)).movedim(-1, 1).contiguous(),
                          torch.from_numpy(b.astype(np.float64)), padding=1))
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("activation", [None, "silu", "gelu"])
def test_group_norm(be, activation):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((2, 7, 5, 3, 12)) * 3 + 1).astype(np.float32)
    w, b = rng.standard_normal(12).astype(np.float32), rng.standard_normal(12).astype(np.float32)
    ours = be.group_norm(dev(be, x), 4, dev(be, w), dev(be, b), eps=1e-6, activation=activation)
    ref = ref_activation(F.group_norm(to_t(x), 4, torch.from_numpy(w.astype(np.float64)),
                                      torch.from_numpy(b.astype(np.float64)), eps=1e-6), activation)
    assert rel_l2(be.to_host(ours), from_t(ref)) < TOL, f"seed {seed}"


@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh"])
def test_layer_norm(be, activation):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((3, 5, 7, 13)) * 2 - 1).astype(np.float32)
    w, b = rng.standard_normal(13).astype(np.float32), rng.standard_normal(13).astype(np.float32)
    ours = be.layer_norm(dev(be, x), dev(be, w), dev(be, b), eps=1e-6, activation=activation)
    ref = ref_activation(F.layer_norm(torch.from_numpy(x.astype(np.float64)), (13,),
                                      torch.from_numpy(w.astype(np.float64)),
                                      torch.from_numpy(b.astype(np.float64)), eps=1e-6), activation)
    assert rel_l2(be.to_host(ours), ref.numpy()) < TOL, f"seed {seed}"


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh", "relu"])
def test_activations(be, name):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((4, 9, 11)) * 4).astype(np.float32)
    x[0, 0, :3] = [-100.0, 100.0, 0.0]  # tails must not overflow into NaN
    xd = dev(be, x)
    ours = {"silu": be.silu, "relu": be.relu, "gelu": be.gelu,
            "gelu_tanh": lambda v: be.gelu(v, approximate=True)}[name](xd)
    ref = ref_activation(torch.from_numpy(x.astype(np.float64)), name).numpy()
    ours = be.to_host(ours)
    assert np.isfinite(ours).all()
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("nd,scale", [(1, (3,)), (2, (2, 2)), (2, (1, 3)), (3, (1, 2, 2)), (3, (2, 2, 2))])
def test_upsample_nearest(be, nd, scale):
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, *(5, 7, 3)[:nd], 3)).astype(np.float32)
    ours = be.upsample_nearest(dev(be, x), scale)
    ref = from_t(F.interpolate(to_t(x), scale_factor=scale, mode="nearest"))
    assert rel_l2(be.to_host(ours), ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("mode,torch_mode", [("zeros", "constant"), ("replicate", "replicate")])
def test_pad(be, mode, torch_mode):
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 4, 5, 6, 3)).astype(np.float32)
    pads = ((2, 0), (1, 3), (0, 1))
    ours = be.pad(dev(be, x), pads, mode=mode)
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    ref = from_t(F.pad(to_t(x), flat, mode=torch_mode))
    assert rel_l2(be.to_host(ours), ref) < TOL, f"seed {seed}"


def test_matmul_linear_softmax(be):
    rng, seed = fresh_rng()
    a = rng.standard_normal((3, 7, 13)).astype(np.float32)
    b = rng.standard_normal((3, 13, 5)).astype(np.float32)
    t64 = lambda v: torch.from_numpy(v.astype(np.float64))  # noqa: E731
    assert rel_l2(be.to_host(be.matmul(dev(be, a), dev(be, b))), torch.matmul(t64(a), t64(b)).numpy()) < TOL
    w = rng.standard_normal((9, 13)).astype(np.float32)
    bias = rng.standard_normal(9).astype(np.float32)
    res = rng.standard_normal((3, 7, 9)).astype(np.float32)
    ref = F.gelu(F.linear(t64(a), t64(w), t64(bias))).numpy() + res
    ours = be.linear(dev(be, a), dev(be, w), dev(be, bias), residual=dev(be, res), activation="gelu")
    assert rel_l2(be.to_host(ours), ref) < TOL, f"seed {seed}"
    s = (rng.standard_normal((4, 11)) * 10).astype(np.float32)
    assert rel_l2(be.to_host(be.softmax(dev(be, s), -1)), torch.softmax(t64(s), -1).numpy()) < TOL
    assert rel_l2(be.to_host(be.softmax(dev(be, s), 0)), torch.softmax(t64(s), 0).numpy()) < TOL


@pytest.mark.parametrize("lq,lk,d,chunk", [(37, 37, 17, 4096), (50, 23, 64, 16), (9, 61, 5, 4)])
def test_attention(lq, lk, d, chunk):
    be = get_backend("mlx", attention_chunk=chunk)
    rng, seed = fresh_rng()
    q = rng.standard_normal((2, 3, lq, d)).astype(np.float32)
    k = rng.standard_normal((2, 3, lk, d)).astype(np.float32)
    v = rng.standard_normal((2, 3, lk, 9)).astype(np.float32)
    ref = F.scaled_dot_product_attention(*(torch.from_numpy(t.astype(np.float64)) for t in (q, k, v))).numpy()
    ours = be.attention(dev(be, q), dev(be, k), dev(be, v))
    assert rel_l2(be.to_host(ours), ref) < TOL, f"seed {seed}"
    # 3-D input (the VAE mid-block: batch, tokens, channels) and an explicit scale
    ref3 = F.scaled_dot_product_attention(*(torch.from_numpy(t[0].astype(np.float64)) for t in (q, k, v)),
                                          scale=0.3).numpy()
    assert rel_l2(be.to_host(be.attention(dev(be, q[0]), dev(be, k[0]), dev(be, v[0]), scale=0.3)), ref3) < TOL


def test_concat_slice_mean_host_roundtrip(be):
    rng, seed = fresh_rng()
    a = rng.standard_normal((2, 3, 5)).astype(np.float32)
    b = rng.standard_normal((2, 3, 4)).astype(np.float32)
    c = be.concat([dev(be, a), dev(be, b)], axis=-1)
    assert c.shape == (2, 3, 9)
    np.testing.assert_array_equal(be.to_host(be.slice(c, -1, 5, 9)), b)
    ref = torch.from_numpy(np.concatenate([a, b], -1).astype(np.float64)).mean(dim=(1, 2)).numpy()
    assert rel_l2(be.to_host(be.mean(c, (1, 2))), ref) < TOL, f"seed {seed}"
    ref_k = torch.from_numpy(a.astype(np.float64)).mean(dim=-1, keepdim=True).numpy()
    assert rel_l2(be.to_host(be.mean(dev(be, a), -1, keepdims=True)), ref_k) < TOL, f"seed {seed}"


@pytest.mark.parametrize("dtype,mx_dtype,host", [("float32", "float32", np.float32),
                                                 ("float16", "float16", np.float32),
                                                 ("bfloat16", "bfloat16", np.float32)])
def test_dtypes_and_host_copies(dtype, mx_dtype, host):
    be = get_backend("mlx", dtype=dtype)
    rng, seed = fresh_rng()
    x = rng.standard_normal((1, 9, 10, 5)).astype(np.float32)
    w = rng.standard_normal((7, 3, 3, 5)).astype(np.float32)
    xd, wd = be.asarray(x), be.asarray(w)
    assert be.dtype_of(xd) == mx_dtype
    out = be.conv2d(xd, wd, padding=1)
    assert be.dtype_of(out) == mx_dtype
    h = be.to_host(out)
    assert h.dtype == host  # half types come back as float32, widened on the device
    ref = ref_conv(x, w, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert rel_l2(h, ref) < (TOL if dtype == "float32" else 1e-2), f"seed {seed}"
    gn = be.to_host(be.group_norm(out, 7, activation="silu"))
    gref = from_t(F.silu(F.group_norm(to_t(ref), 7)))
    assert rel_l2(gn, gref) < (TOL if dtype == "float32" else 1e-2), f"seed {seed}"


def test_refusals():
    with pytest.raises(ValueError, match="computes in"):
        get_backend("mlx", dtype="float64")
    be = get_backend("mlx")
    with pytest.raises(ValueError, match="floating"):
        be.asarray(np.zeros(3, dtype=np.int32))
    with pytest.raises(ValueError, match="unsupported dtype"):
        be.conv2d(mx.zeros((1, 4, 4, 2), dtype=mx.int32), be.asarray(np.zeros((2, 1, 1, 2), np.float32)))
    with pytest.raises(ValueError, match="input channels"):
        be.conv2d(be.asarray(np.zeros((1, 8, 8, 4), np.float32)), be.asarray(np.zeros((4, 3, 3, 3), np.float32)))
