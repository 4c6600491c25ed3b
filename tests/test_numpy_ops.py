"""Every NumPy-backend op and conv path against torch.nn.functional (fp32, rel L2 < 1e-5)."""
from __future__ import annotations

import numpy as np
import pytest

from torch_reference import CONV_T_CASES, F, fresh_rng, from_t, ref_activation, ref_conv, ref_conv_transpose, rel_l2, to_t, torch

from convkernels import ConvKey, ConvSpec, get_backend
from convkernels import _cpu
from convkernels.backend import CONV_OPS
from convkernels.spec import upsample_conv_as_transpose

TOL = 1e-5


@pytest.fixture
def be():
    return get_backend("numpy")


# (nd, N, spatial, C_in, C_out, kernel, stride, padding (lo,hi) per axis, dilation, groups)
CONV_CASES = [
    (1, 2, (37,), 5, 7, (3,), (1,), ((1, 1),), (1,), 1),
    (1, 1, (29,), 6, 9, (5,), (2,), ((2, 0),), (2,), 3),
    (2, 2, (13, 11), 3, 5, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    (2, 1, (10, 13), 33, 17, (3, 3), (1, 1), ((1, 1), (1, 1)), (2, 1), 1),  # shift_gemm, dilation
    (2, 2, (9, 14), 37, 33, (3, 3), (1, 1), ((1, 1), (0, 2)), (1, 1), 1),  # winograd, odd tiles
    (2, 1, (16, 7), 32, 45, (3, 3), (1, 1), ((0, 0), (1, 1)), (1, 1), 1),  # winograd, unpadded rows
    (3, 1, (4, 6, 5), 35, 9, (3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (0, 2)), (1, 1, 1), 1),
    # Winograd in space, direct in time (Wan's CausalConv3d): causal time pad, odd tiles, tails
    (3, 2, (3, 9, 7), 33, 35, (3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (0, 2)), (1, 1, 1), 1),
    (3, 1, (1, 11, 6), 40, 32, (1, 3, 3), (1, 1, 1), ((0, 0), (1, 1), (1, 1)), (1, 1, 1), 1),  # first frame
    (3, 1, (4, 6, 10), 32, 48, (2, 3, 3), (1, 1, 1), ((0, 1), (0, 0), (1, 1)), (1, 1, 1), 1),
    (2, 1, (15, 17), 6, 10, (3, 3), (2, 2), ((0, 1), (0, 1)), (1, 1), 2),  # diffusers' downsample padding
    (2, 2, (19, 9), 8, 8, (3, 5), (1, 2), ((2, 1), (0, 3)), (2, 1), 4),
    (2, 1, (30, 30), 12, 12, (7, 7), (1, 1), ((3, 3), (3, 3)), (1, 1), 12),  # depthwise, not mult of 8
    (2, 2, (15, 15), 9, 9, (3, 3), (2, 2), ((1, 1), (1, 1)), (2, 2), 9),  # depthwise stride 2 dilation 2
    # depthwise with >= 16 channels: the C kernel's register-blocked interior columns, its bounds-
    # checked border columns and its scalar channel tail (40 = 2 vectors + 8)
    (2, 2, (17, 23), 40, 40, (7, 7), (1, 1), ((3, 3), (3, 3)), (1, 1), 40),
    (2, 1, (19, 29), 32, 32, (3, 3), (2, 2), ((1, 0), (2, 1)), (2, 1), 32),
    (2, 1, (11, 37), 48, 48, (5, 5), (1, 1), ((2, 2), (4, 4)), (1, 2), 48),
    (2, 2, (9, 21), 24, 24, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 24),  # stride-1 kernels: kw 3
    (2, 1, (13, 18), 33, 33, (5, 5), (1, 1), ((4, 0), (2, 2)), (2, 1), 33),  # kw 5, H dilation, tail
    (2, 1, (21, 23), 5, 11, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),  # pointwise
    (2, 2, (12, 13), 3, 7, (4, 4), (4, 4), ((0, 0), (0, 0)), (1, 1), 1),  # patchify stem
    (3, 2, (5, 9, 7), 3, 5, (3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (1, 1)), (1, 1, 1), 1),  # causal time pad
    (3, 1, (6, 7, 11), 4, 6, (3, 1, 1), (2, 1, 1), ((1, 1), (0, 0), (0, 0)), (1, 1, 1), 2),
    (3, 1, (4, 10, 9), 6, 6, (2, 3, 3), (1, 2, 2), ((0, 1), (1, 0), (2, 2)), (1, 2, 1), 6),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}d-{c[2]}-g{c[9]}")
@pytest.mark.parametrize("epilogue", ["plain", "bias_silu_residual"])
def test_conv_matches_torch(be, case, epilogue):
    nd, n, sp, cin, cout, k, stride, pad, dil, g = case
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    spec = ConvSpec.make(nd, stride, pad, dil, g)
    out_shape = (n, *spec.output_spatial(sp, k), cout)
    bias = residual = act = None
    if epilogue != "plain":
        bias = rng.standard_normal(cout).astype(np.float32)
        residual = rng.standard_normal(out_shape).astype(np.float32)
        act = "silu"
    ours = be.conv(x, w, spec, bias, residual=residual, activation=act)
    ref = ref_conv(x, w, bias, stride, pad, dil, g, residual, act)
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}d-{c[2]}-g{c[9]}")
def test_every_valid_path_matches_torch(case):
    """Force each path whose guard accepts the key, so no path hides behind the cost rule."""
    nd, n, sp, cin, cout, k, stride, pad, dil, g = case
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    spec = ConvSpec.make(nd, stride, pad, dil, g)
    ref = ref_conv(x, w, b, stride, pad, dil, g, None, "gelu")
    probe = get_backend("numpy")
    key = ConvKey(CONV_OPS[nd], x.shape, w.shape, "float32", spec, (True, False, "gelu"))
    names = [p.name for p in probe.paths.candidates(key)]
    assert names, "no path accepts the key"
    for name in names:
        be = get_backend("numpy")
        be.paths.forced = name
        ours = be.conv(x, w, spec, b, activation="gelu")
        assert be.conv_choices()[0]["path"] == name
        assert rel_l2(ours, ref) < TOL, f"path {name}, seed {seed}"


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


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_nd_entry_points(be, nd):
    rng, seed = fresh_rng()
    sp = (11, 9, 7)[:nd]
    x = rng.standard_normal((2, *sp, 6)).astype(np.float32)
    w = rng.standard_normal((4, *(3,) * nd, 3)).astype(np.float32)
    fn = {1: be.conv1d, 2: be.conv2d, 3: be.conv3d}[nd]
    ours = fn(x, w, stride=2, padding=1, groups=2, dilation=1)
    ref = ref_conv(x, w, None, (2,) * nd, ((1, 1),) * nd, (1,) * nd, 2)
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("case", CONV_T_CASES, ids=lambda c: f"t{c[0]}d-{c[2]}-s{c[6]}")
def test_conv_transpose_matches_torch(be, case):
    nd, n, sp, cin, cout, k, stride, pad, opad, dil, g = case
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    fn = {2: be.conv_transpose2d, 3: be.conv_transpose3d}[nd]
    ours = fn(x, w, b, stride=stride, padding=pad, output_padding=opad, dilation=dil, groups=g)
    ref = ref_conv_transpose(x, w, b, stride, pad, opad, dil, g)
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


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


def ref_upsample_conv(x, w, b):
    """nearest 2x then 3x3 conv, padding 1, in torch (float64); w: ours O,3,3,C."""
    up = F.interpolate(to_t(x), scale_factor=2, mode="nearest")
    wt = torch.from_numpy(np.asarray(w, np.float64)).movedim(-1, 1).contiguous()
    return from_t(F.conv2d(up, wt, None if b is None else torch.from_numpy(np.asarray(b, np.float64)), padding=1))


@pytest.mark.parametrize("shape,cout", [((2, 7, 10, 13), 11), ((1, 5, 3, 40), 33)])
def test_upsample_conv2d_matches_torch(be, shape, cout):
    rng, seed = fresh_rng()
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((cout, 3, 3, shape[-1])).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    assert rel_l2(be.upsample_conv2d(x, w, b), ref_upsample_conv(x, w, b)) < TOL, f"seed {seed}"
    with pytest.raises(ValueError, match="weight must be"):
        be.upsample_conv2d(x, w[:, :2], b)
    with pytest.raises(ValueError, match="bias must"):
        be.upsample_conv2d(x, w, b[:-1])


def test_upsample_conv_as_transpose_is_the_same_function(be):
    """The weight derivation the CUDA backend runs on the device (spec.upsample_conv_as_transpose,
    here with NumPy as its array module): the stride-2 transposed conv with the derived 4x4
    weight equals nearest 2x + the 3x3 conv."""
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 9, 6, 21)).astype(np.float32)
    w = rng.standard_normal((17, 3, 3, 21)).astype(np.float32)
    b = rng.standard_normal(17).astype(np.float32)
    w4 = upsample_conv_as_transpose(np, w.astype(np.float64))
    assert w4.shape == (17, 4, 4, 21)
    ours = be.conv_transpose2d(x, w4, b, stride=2, padding=1)
    assert rel_l2(ours, ref_upsample_conv(x, w, b)) < TOL, f"seed {seed}"


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


def test_path_choice_is_memoised_and_listed(be):
    x = np.ones((1, 9, 9, 4), np.float32)
    w = np.ones((4, 3, 3, 1), np.float32)
    for _ in range(3):
        be.conv2d(x, w, padding=1, groups=4)
    choices = be.conv_choices()
    assert len(choices) == 1
    assert choices[0]["path"] in ("depthwise_direct", "depthwise_shift") and choices[0]["calls"] == 3
    assert choices[0]["input_shape"] == [1, 9, 9, 4] and choices[0]["groups"] == 4
    assert choices[0]["macs"] == 9 * 9 * 4 * 3 * 3  # each output: 3x3 taps of its one input channel


@pytest.mark.parametrize("activation", [None, "silu", "gelu"])
def test_group_norm(be, activation):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((2, 7, 5, 3, 12)) * 3 + 1).astype(np.float32)
    w, b = rng.standard_normal(12).astype(np.float32), rng.standard_normal(12).astype(np.float32)
    ours = be.group_norm(x, 4, w, b, eps=1e-6, activation=activation)
    ref = ref_activation(F.group_norm(to_t(x), 4, torch.from_numpy(w.astype(np.float64)),
                                      torch.from_numpy(b.astype(np.float64)), eps=1e-6), activation)
    assert rel_l2(ours, from_t(ref)) < TOL, f"seed {seed}"


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_layer_norm(be, activation):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((3, 5, 7, 13)) * 2 - 1).astype(np.float32)
    w, b = rng.standard_normal(13).astype(np.float32), rng.standard_normal(13).astype(np.float32)
    ours = be.layer_norm(x, w, b, eps=1e-6, activation=activation)
    ref = ref_activation(F.layer_norm(torch.from_numpy(x.astype(np.float64)), (13,),
                                      torch.from_numpy(w.astype(np.float64)),
                                      torch.from_numpy(b.astype(np.float64)), eps=1e-6), activation)
    assert rel_l2(ours, ref.numpy()) < TOL, f"seed {seed}"


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh", "relu"])
def test_activations(be, name):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((4, 9, 11)) * 4).astype(np.float32)
    x[0, 0, :3] = [-100.0, 100.0, 0.0]  # tails must not overflow into NaN
    ours = {"silu": be.silu, "relu": be.relu, "gelu": be.gelu,
            "gelu_tanh": lambda v: be.gelu(v, approximate=True)}[name](x)
    ref = ref_activation(torch.from_numpy(x.astype(np.float64)), name).numpy()
    assert np.isfinite(ours).all()
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("nd,scale", [(1, (3,)), (2, (2, 2)), (2, (1, 3)), (3, (1, 2, 2)), (3, (2, 2, 2))])
def test_upsample_nearest(be, nd, scale):
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, *(5, 7, 3)[:nd], 3)).astype(np.float32)
    ours = be.upsample_nearest(x, scale)
    ref = from_t(F.interpolate(to_t(x), scale_factor=scale, mode="nearest"))
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("mode,torch_mode", [("zeros", "constant"), ("replicate", "replicate")])
def test_pad(be, mode, torch_mode):
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 4, 5, 6, 3)).astype(np.float32)
    pads = ((2, 0), (1, 3), (0, 1))
    ours = be.pad(x, pads, mode=mode)
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    ref = from_t(F.pad(to_t(x), flat, mode=torch_mode))
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


def test_matmul_linear_softmax(be):
    rng, seed = fresh_rng()
    a = rng.standard_normal((3, 7, 13)).astype(np.float32)
    b = rng.standard_normal((3, 13, 5)).astype(np.float32)
    assert rel_l2(be.matmul(a, b), torch.matmul(torch.from_numpy(a.astype(np.float64)),
                                                torch.from_numpy(b.astype(np.float64))).numpy()) < TOL
    w = rng.standard_normal((9, 13)).astype(np.float32)
    bias = rng.standard_normal(9).astype(np.float32)
    res = rng.standard_normal((3, 7, 9)).astype(np.float32)
    ref = F.gelu(F.linear(torch.from_numpy(a.astype(np.float64)), torch.from_numpy(w.astype(np.float64)),
                          torch.from_numpy(bias.astype(np.float64)))).numpy() + res
    assert rel_l2(be.linear(a, w, bias, residual=res, activation="gelu"), ref) < TOL, f"seed {seed}"
    s = (rng.standard_normal((4, 11)) * 10).astype(np.float32)
    assert rel_l2(be.softmax(s, -1), torch.softmax(torch.from_numpy(s.astype(np.float64)), -1).numpy()) < TOL


@pytest.mark.parametrize("lq,lk,chunk", [(37, 37, 2048), (50, 23, 16)])
def test_attention(lq, lk, chunk):
    be = get_backend("numpy", attention_chunk=chunk)
    rng, seed = fresh_rng()
    q = rng.standard_normal((2, 3, lq, 17)).astype(np.float32)
    k = rng.standard_normal((2, 3, lk, 17)).astype(np.float32)
    v = rng.standard_normal((2, 3, lk, 9)).astype(np.float32)
    ref = F.scaled_dot_product_attention(*(torch.from_numpy(t.astype(np.float64)) for t in (q, k, v))).numpy()
    assert rel_l2(be.attention(q, k, v), ref) < TOL, f"seed {seed}"


def test_concat_slice_mean_host_roundtrip(be):
    rng, _ = fresh_rng()
    a = rng.standard_normal((2, 3, 5)).astype(np.float32)
    b = rng.standard_normal((2, 3, 4)).astype(np.float32)
    c = be.concat([be.asarray(a), be.asarray(b)], axis=-1)
    assert c.shape == (2, 3, 9)
    np.testing.assert_array_equal(be.to_host(be.slice(c, -1, 5, 9)), b)
    np.testing.assert_allclose(be.mean(c, (1, 2)), np.concatenate([a, b], -1).mean(axis=(1, 2)), rtol=1e-6)


def test_half_inputs_are_computed_in_fp32(be):
    rng, seed = fresh_rng()
    x = rng.standard_normal((1, 9, 10, 4)).astype(np.float16)
    w = rng.standard_normal((5, 3, 3, 4)).astype(np.float16)
    out = be.conv2d(x, w, padding=1)
    assert out.dtype == np.float32
    ref = ref_conv(x.astype(np.float32), w.astype(np.float32), None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert rel_l2(out, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("bad,match", [
    (dict(x=(1, 8, 8, 4), w=(4, 3, 3, 3)), "input channels"),
    (dict(x=(1, 8, 8, 6), w=(4, 3, 3, 3), groups=4), "groups=4 must divide"),
    (dict(x=(8, 8, 4), w=(4, 3, 3, 4)), "channels-last"),
    (dict(x=(1, 2, 2, 4), w=(4, 5, 5, 4)), "output would be empty"),
    (dict(x=(1, 8, 8, 4), w=(4, 3, 3, 4), bias=(3,)), "bias must have shape"),
    (dict(x=(1, 8, 8, 4), w=(4, 3, 3, 4), stride=0), "stride must be >= 1"),
    (dict(x=(1, 8, 8, 4), w=(4, 3, 3, 4), activation="tanh"), "activation must be one of"),
])
def test_bad_shapes_raise_clear_errors(be, bad, match):
    x = np.zeros(bad["x"], np.float32)
    w = np.zeros(bad["w"], np.float32)
    bias = np.zeros(bad["bias"], np.float32) if "bias" in bad else None
    with pytest.raises(ValueError, match=match):
        be.conv2d(x, w, bias, stride=bad.get("stride", 1), groups=bad.get("groups", 1),
                  activation=bad.get("activation"))


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
    assert len(be._wino_cache) == 3  # all taps, the last, the first: one transform each


def test_autotune_times_a_conv_once_whatever_its_epilogue_and_padding_split(monkeypatch):
    """Measured path choice: keys that differ only in the epilogue or in how an axis's padding is
    split (SD-VAE's upsampling phase convs) share one timing; another total padding is timed anew.
    Every call still matches torch."""
    rng, seed = fresh_rng()
    be = get_backend("numpy", autotune_min_macs=1)
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
    dw = rng.standard_normal((45, 7, 7, 1)).astype(np.float32)
    ours = be.conv2d(x, dw, b, padding=3, groups=45)
    assert be.conv_choices()[-1]["path"] == ("depthwise_direct" if compiled else "depthwise_shift")
    assert rel_l2(ours, ref_conv(x, dw, b, (1, 1), ((3, 3), (3, 3)), (1, 1), 45)) < TOL, f"seed {seed}"


def test_gelu_float64_stays_float64_precise(be):
    x = np.linspace(-6, 6, 1001)
    ref = F.gelu(torch.from_numpy(x)).numpy()
    assert rel_l2(be.gelu(x), ref) < 1e-12
