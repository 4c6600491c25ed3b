"""MLX conv paths forced where their guards allow, against torch.nn.functional; guards that
refuse fall back to mlx_native; the depthwise Metal kernel's tiling checked by emulating its
thread grid on the CPU; cost rules posed as older MLX releases; kernel metrics labels."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from torch_reference import fresh_rng, ref_conv, ref_conv_transpose, rel_l2  # noqa: E402

from convkernels import REGISTRY, ConvKey, ConvSpec, get_backend  # noqa: E402
from convkernels.backends.mlx import metal as mlx_metal  # noqa: E402
from convkernels.backends.mlx.backend import MlxBackend  # noqa: E402
from convkernels.backends.mlx.paths import MlxEnv, parse_version  # noqa: E402
from mlx_metal_emulation import emulate  # noqa: E402

TOL = 1e-5


def forced(name, **options):
    be = get_backend("mlx", **options)
    be.paths.forced = name
    return be


def only_path(be):
    paths = {c["path"] for c in be.conv_choices()}
    assert len(paths) == 1, paths
    return paths.pop()


# ---- depthwise_tail -----------------------------------------------------------------------------

# (size, kernel, stride, channels): the PR 3446 reproducer sizes (3x3) and ConvNeXt's 7x7 stages
DEPTHWISE_CASES = [(60, 3, 1, 16), (30, 3, 1, 32), (15, 3, 1, 16), (15, 3, 2, 16),
                   (56, 7, 1, 16), (28, 7, 1, 32), (14, 7, 1, 16), (7, 7, 1, 48)]


@pytest.mark.parametrize("size,k,stride,c", DEPTHWISE_CASES)
def test_depthwise_tail_forced_matches_torch(size, k, stride, c):
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, size, size, c)).astype(np.float32)
    w = rng.standard_normal((c, k, k, 1)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    p = k // 2
    be = forced("depthwise_tail")
    out = be.conv2d(be.asarray(x), be.asarray(w), be.asarray(b), stride=stride, padding=p, groups=c,
                    activation="gelu")
    out_size = (size + 2 * p - k) // stride + 1
    # 56x56 is already a multiple of 8: no tail, the guard refuses and native runs
    assert only_path(be) == ("depthwise_tail" if out_size % 8 else "mlx_native")
    ref = ref_conv(x, w, b, (stride,) * 2, ((p, p),) * 2, (1, 1), c, None, "gelu")
    assert rel_l2(be.to_host(out), ref) < TOL, f"seed {seed}"


def test_depthwise_tail_guard_refusals_fall_back_to_native():
    rng, seed = fresh_rng()
    cases = [  # (C, kernel, stride, dilation): channels not mod 16, kernel 9, stride 3, dilation 2
        (12, 3, 1, 1), (16, 9, 1, 1), (16, 3, 3, 1), (16, 3, 1, 2)]
    for c, k, s, d in cases:
        x = rng.standard_normal((1, 15, 13, c)).astype(np.float32)
        w = rng.standard_normal((c, k, k, 1)).astype(np.float32)
        be = forced("depthwise_tail")
        out = be.conv2d(be.asarray(x), be.asarray(w), stride=s, padding=d * (k // 2), dilation=d, groups=c)
        assert only_path(be) == "mlx_native", (c, k, s, d)
        ref = ref_conv(x, w, None, (s, s), ((d * (k // 2),) * 2,) * 2, (d, d), c)
        assert rel_l2(be.to_host(out), ref) < TOL, f"seed {seed}"


# ---- the Metal kernel's thread grid, emulated -------------------------------------------------

# (N, H, W, C, kernel, stride, pad_top, pad_left, pad_bottom, pad_right)
KERNEL_GRID_CASES = [
    (1, 60, 60, 16, 3, 1, 1, 1, 1, 1), (1, 30, 30, 16, 3, 1, 1, 1, 1, 1), (2, 15, 15, 8, 3, 1, 1, 1, 1, 1),
    (1, 56, 56, 16, 7, 1, 3, 3, 3, 3), (1, 28, 28, 16, 7, 1, 3, 3, 3, 3), (1, 14, 14, 24, 7, 1, 3, 3, 3, 3),
    (2, 7, 7, 16, 7, 1, 3, 3, 3, 3),
    (1, 15, 17, 20, 3, 2, 0, 1, 1, 0),  # stride 2, asymmetric padding, channels not a multiple of 8
    (1, 9, 13, 5, 5, 2, 2, 2, 2, 2),
]


@pytest.mark.parametrize("case", KERNEL_GRID_CASES, ids=lambda c: f"{c[1]}x{c[2]}-k{c[4]}-s{c[5]}-c{c[3]}")
def test_metal_kernel_grid_covers_every_output_once_and_reads_right_inputs(case):
    n, h, w, c, k, s, pt, pl, pb, pr = case
    oh, ow = (h + pt + pb - k) // s + 1, (w + pl + pr - k) // s + 1
    tiling = mlx_metal.DepthwiseTiling(k, k, s, s)
    grid, tg = tiling.grid(n, c, oh, ow), tiling.threadgroup
    assert all(g % t == 0 for g, t in zip(grid, tg)), "partial threadgroups would skip cooperative loads"
    assert grid[1] >= ow and grid[2] >= oh * n and grid[0] >= c
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, h, w, c))
    wt = rng.standard_normal((c, k, k, 1))
    b = rng.standard_normal(c)
    taps = wt.reshape(c, k * k).T  # (KH*KW, C), as the runner passes it
    res = emulate(tiling, n, h, w, c, oh, ow, pt, pl, x=x, taps=taps, bias=b)
    assert (res["stores"] == 1).all(), f"outputs stored {np.unique(res['stores'])} times"
    assert (res["tile_loads"] == 1).all(), "every shared-tile slot must be loaded exactly once"
    assert int(res["bad_reads"]) == 0
    ref = ref_conv(x, wt, b, (s, s), ((pt, pb), (pl, pr)), (1, 1), c)
    assert rel_l2(res["out"], ref) < 1e-12, f"seed {seed}"


def test_grid_emulation_catches_a_floor_div_grid(monkeypatch):
    """The check above can fail: the pre-fix grid (floor division, tails never launched)
    leaves outputs unstored, and a kernel that skips the halo reads wrong inputs."""
    tiling = mlx_metal.DepthwiseTiling(3, 3, 1, 1)
    monkeypatch.setattr(mlx_metal.DepthwiseTiling, "groups",
                        lambda self, n, c, oh, ow: (c // mlx_metal.TC, ow // mlx_metal.TW, oh // mlx_metal.TH * n))
    res = emulate(tiling, 1, 60, 60, 16, 60, 60, 1, 1)
    assert (res["stores"] == 0).any()
    monkeypatch.undo()
    monkeypatch.setattr(mlx_metal, "TAP_TILE", "((lid_z + kh) * TGW + lid_y + kw) * TC + lid_x")
    res = emulate(mlx_metal.DepthwiseTiling(3, 3, 2, 2), 1, 15, 15, 8, 8, 8, 1, 1)
    assert int(res["bad_reads"]) > 0


def test_metal_source_is_rendered_from_the_same_index_math():
    tiling = mlx_metal.DepthwiseTiling(7, 7, 1, 1)
    src = mlx_metal.render_source(tiling, has_bias=True)
    assert "//" not in src
    for name, expr in mlx_metal.GROUP_STMTS + mlx_metal.LOAD_STMTS + mlx_metal.STORE_STMTS:
        assert f"const int {name} = {expr.replace('//', '/')};" in src
    assert f"constexpr int TILE = {tiling.tile_elems};" in src
    # the early return comes after the barrier, so tail threads still take part in the load
    assert src.index("threadgroup_barrier") < src.index("return;") < src.index("out[")
    assert "float(bias[co])" in src and "float(bias[co])" not in mlx_metal.render_source(tiling, False)


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal (Apple silicon)")
def test_metal_kernel_matches_torch_on_metal():
    rng, seed = fresh_rng()
    for size, k in ((60, 3), (28, 7), (7, 7)):
        x = rng.standard_normal((1, size, size, 32)).astype(np.float32)
        w = rng.standard_normal((32, k, k, 1)).astype(np.float32)
        out = mlx_metal.depthwise_metal(mx.array(x), mx.array(w), None, (size, size), k // 2, k // 2, (1, 1))
        ref = ref_conv(x, w, None, (1, 1), ((k // 2,) * 2,) * 2, (1, 1), 32)
        assert rel_l2(np.array(out), ref) < TOL, f"seed {seed}"


# ---- small_kd_2d ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kd", [1, 2, 3, 5])
def test_small_kd_2d_forced_matches_torch(kd):
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, kd + 2, 9, 11, 16)).astype(np.float32)  # batch 2: folded into frames
    w = rng.standard_normal((32, kd, 3, 3, 16)).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    pad = ((0, 0), (1, 1), (2, 0))
    be = forced("small_kd_2d")
    out = be.conv3d(be.asarray(x), be.asarray(w), be.asarray(b), stride=(1, 2, 1), padding=pad,
                    dilation=(1, 1, 2), activation="silu")
    assert only_path(be) == "small_kd_2d"
    ref = ref_conv(x, w, b, (1, 2, 1), pad, (1, 1, 2), 1, None, "silu")
    assert rel_l2(be.to_host(out), ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("what,x_shape,w_shape,stride,pad,dil,groups,expect", [
    ("depth stride 2", (1, 7, 6, 5, 16), (16, 3, 3, 3, 16), (2, 1, 1), ((0, 0),) * 3, (1, 1, 1), 1, "mlx_native"),
    ("depth padding", (1, 4, 6, 5, 16), (16, 3, 3, 3, 16), (1, 1, 1), ((2, 0), (1, 1), (1, 1)), (1, 1, 1), 1,
     "mlx_native"),
    ("channels not mod 16", (1, 5, 6, 5, 24), (16, 3, 3, 3, 24), (1, 1, 1), ((0, 0),) * 3, (1, 1, 1), 1,
     "mlx_native"),
    ("depth dilation", (1, 7, 6, 5, 16), (16, 3, 3, 3, 16), (1, 1, 1), ((0, 0),) * 3, (2, 1, 1), 1, "mlx_native"),
    ("kernel depth 9", (1, 10, 5, 4, 16), (16, 9, 1, 1, 16), (1, 1, 1), ((0, 0),) * 3, (1, 1, 1), 1,
     "mlx_native"),
    ("groups 2", (1, 5, 6, 5, 32), (32, 3, 3, 3, 16), (1, 1, 1), ((0, 0),) * 3, (1, 1, 1), 2, "group_split"),
])
def test_small_kd_2d_guard_refusals_fall_back(what, x_shape, w_shape, stride, pad, dil, groups, expect):
    rng, seed = fresh_rng()
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    be = forced("small_kd_2d")
    out = be.conv3d(be.asarray(x), be.asarray(w), stride=stride, padding=pad, dilation=dil, groups=groups)
    assert only_path(be) == expect, what
    assert rel_l2(be.to_host(out), ref_conv(x, w, None, stride, pad, dil, groups)) < TOL, f"{what}, seed {seed}"


# ---- tiled_unfold --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["conv2d", "conv2d_grouped", "conv3d", "conv_transpose2d", "conv_transpose3d"])
def test_tiled_unfold_equals_untiled(kind):
    rng, seed = fresh_rng()
    small = get_backend("mlx", unfold_limit_bytes=4096)  # forces many row tiles
    big = get_backend("mlx")
    if kind == "conv2d":
        x = rng.standard_normal((2, 21, 19, 5)).astype(np.float32)
        w = rng.standard_normal((6, 3, 3, 5)).astype(np.float32)
        run = lambda be: be.conv2d(be.asarray(x), be.asarray(w), padding=((1, 0), (2, 1)), stride=(1, 2))  # noqa: E731
        ref = ref_conv(x, w, None, (1, 2), ((1, 0), (2, 1)), (1, 1), 1)
    elif kind == "conv2d_grouped":
        x = rng.standard_normal((1, 17, 15, 6)).astype(np.float32)
        w = rng.standard_normal((9, 3, 3, 2)).astype(np.float32)
        run = lambda be: be.conv2d(be.asarray(x), be.asarray(w), padding=2, dilation=2, groups=3)  # noqa: E731
        ref = ref_conv(x, w, None, (1, 1), ((2, 2), (2, 2)), (2, 2), 3)
    elif kind == "conv3d":
        x = rng.standard_normal((1, 5, 9, 7, 3)).astype(np.float32)
        w = rng.standard_normal((5, 3, 3, 3, 3)).astype(np.float32)
        pad = ((2, 0), (1, 1), (1, 1))
        run = lambda be: be.conv3d(be.asarray(x), be.asarray(w), padding=pad)  # noqa: E731
        ref = ref_conv(x, w, None, (1, 1, 1), pad, (1, 1, 1), 1)
    elif kind == "conv_transpose2d":
        x = rng.standard_normal((2, 9, 7, 5)).astype(np.float32)
        w = rng.standard_normal((4, 4, 4, 5)).astype(np.float32)
        run = lambda be: be.conv_transpose2d(be.asarray(x), be.asarray(w), stride=2, padding=1,  # noqa: E731
                                             output_padding=1)
        ref = ref_conv_transpose(x, w, None, (2, 2), (1, 1), (1, 1), (1, 1), 1)
    else:
        x = rng.standard_normal((1, 3, 5, 4, 4)).astype(np.float32)
        w = rng.standard_normal((3, 3, 3, 3, 4)).astype(np.float32)
        run = lambda be: be.conv_transpose3d(be.asarray(x), be.asarray(w), stride=(1, 2, 2),  # noqa: E731
                                             padding=1, output_padding=(0, 1, 0))
        ref = ref_conv_transpose(x, w, None, (1, 2, 2), (1, 1, 1), (0, 1, 0), (1, 1, 1), 1)
    tiled, untiled = small.to_host(run(small)), big.to_host(run(big))
    assert only_path(small) == "tiled_unfold"
    assert only_path(big) == "mlx_native"
    np.testing.assert_allclose(tiled, untiled, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    assert rel_l2(tiled, ref) < TOL, f"seed {seed}"


# ---- cost rules and guards read the MLX version ---------------------------------------------------

def _key(op, x_shape, w_shape, spec):
    return ConvKey(op, x_shape, w_shape, "float32", spec, (False, False, None))


def test_version_parsing():
    assert parse_version("0.32.4") == (0, 32, 4)
    assert parse_version("0.30.5.dev20260129+590b4f1c") == (0, 30, 5)
    assert parse_version("1.0") == (1, 0, 0)
    assert MlxEnv.detect().version == parse_version(mx.__version__)


def test_cost_rules_take_workaround_paths_only_on_older_mlx_with_metal(monkeypatch):
    monkeypatch.delenv("CONVSERVE_UNFOLD_LIMIT_BYTES", raising=False)
    dw = _key("conv2d", (1, 60, 60, 384), (384, 3, 3, 1), ConvSpec.make(2, 1, 1, 1, 384))
    c3 = _key("conv3d", (1, 19, 64, 64, 256), (256, 3, 3, 3, 256), ConvSpec.make(3, 1, ((0, 0), (1, 1), (1, 1))))
    # unfold 510*510*16*256*4 bytes > the 2 GiB default limit (padding 2: with padding 1 the
    # conv runs on subpixel everywhere)
    ct = _key("conv_transpose2d", (1, 256, 256, 256), (256, 4, 4, 256), ConvSpec.make(2, 2, 2, transpose=True))
    up = _key("conv_transpose2d", (1, 256, 256, 256), (256, 4, 4, 256), ConvSpec.make(2, 2, 1, transpose=True))
    old = MlxBackend(env=MlxEnv((0, 31, 2), True), autotune=False)
    new = MlxBackend(env=MlxEnv((0, 32, 4), True), autotune=False)
    cpu = MlxBackend(env=MlxEnv((0, 31, 2), False), autotune=False)
    assert old.unfold_limit_bytes == new.unfold_limit_bytes == 1 << 31  # no Metal device to ask here
    assert [old.paths.choose(k).name for k in (dw, c3, ct)] == ["depthwise_tail", "small_kd_2d", "tiled_unfold"]
    assert [new.paths.choose(k).name for k in (dw, ct)] == ["mlx_native", "mlx_native"]
    # a limit the caller sets is a memory bound: honoured on the fixed MLX too
    bounded = MlxBackend(env=MlxEnv((0, 32, 4), True), unfold_limit_bytes=1 << 20, autotune=False)
    assert bounded.paths.choose(ct).name == "tiled_unfold"
    assert cpu.paths.choose(dw).name == "mlx_native"  # padding only adds work off Metal
    assert {b.paths.choose(up).name for b in (old, new, cpu, bounded)} == {"subpixel"}
    # fixed Metal MLX decomposes by itself; on MLX CPU the decomposition showed no consistent win
    assert new.paths.choose(c3).name == "mlx_native"
    assert MlxBackend(env=MlxEnv((0, 32, 4), False), autotune=False).paths.choose(c3).name == "mlx_native"
    assert MlxEnv((0, 32, 0), True).depthwise_gate is False and MlxEnv((0, 31, 9), True).depthwise_gate
    assert MlxEnv((0, 32, 0), True).slow_conv3d and not MlxEnv((0, 32, 1), True).slow_conv3d


def test_autotune_picks_a_valid_path_and_stays_correct():
    rng, seed = fresh_rng()
    be = get_backend("mlx", autotune=True)
    x = rng.standard_normal((1, 5, 7, 6, 16)).astype(np.float32)
    w = rng.standard_normal((16, 3, 3, 3, 16)).astype(np.float32)
    out = be.conv3d(be.asarray(x), be.asarray(w), padding=((0, 0), (1, 1), (1, 1)))
    assert only_path(be) in ("mlx_native", "small_kd_2d")
    ref = ref_conv(x, w, None, (1, 1, 1), ((0, 0), (1, 1), (1, 1)), (1, 1, 1), 1)
    assert rel_l2(be.to_host(out), ref) < TOL, f"seed {seed}"


# ---- metrics -------------------------------------------------------------------------------------

def _scrape() -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _count(snap, op, path, name="convkernels_conv_total"):
    return snap.get((name, (("backend", "mlx"), ("op", op), ("path", path))), 0.0)


def test_conv_counts_by_path_carry_the_mlx_labels():
    rng = np.random.default_rng()
    before = _scrape()
    be = get_backend("mlx", timing_sample_rate=1.0)
    x = be.asarray(rng.standard_normal((1, 15, 13, 16)).astype(np.float32))
    for _ in range(2):
        be.conv2d(x, be.asarray(rng.standard_normal((16, 7, 7, 1)).astype(np.float32)), padding=3, groups=16)
    be.conv_transpose2d(x, be.asarray(rng.standard_normal((3, 4, 4, 16)).astype(np.float32)), stride=2, padding=1)
    be.conv3d(be.asarray(rng.standard_normal((1, 3, 5, 5, 4)).astype(np.float32)),
              be.asarray(rng.standard_normal((4, 3, 1, 1, 2)).astype(np.float32)), groups=2)
    tail = forced("depthwise_tail", timing_sample_rate=1.0)
    tail.conv2d(x, be.asarray(rng.standard_normal((16, 3, 3, 1)).astype(np.float32)), padding=1, groups=16)
    kd = forced("small_kd_2d", timing_sample_rate=1.0)
    kd.conv3d(be.asarray(rng.standard_normal((1, 4, 5, 5, 16)).astype(np.float32)),
              be.asarray(rng.standard_normal((16, 2, 3, 3, 16)).astype(np.float32)))
    tiled = get_backend("mlx", unfold_limit_bytes=1024, timing_sample_rate=1.0)
    tiled.conv2d(x, be.asarray(rng.standard_normal((5, 3, 3, 16)).astype(np.float32)), padding=1)
    after = _scrape()
    expected = {("conv2d", "mlx_native"): 2, ("conv_transpose2d", "subpixel"): 1, ("conv3d", "group_split"): 1,
                ("conv2d", "depthwise_tail"): 1, ("conv3d", "small_kd_2d"): 1, ("conv2d", "tiled_unfold"): 1}
    for (op, path), n in expected.items():
        assert _count(after, op, path) - _count(before, op, path) == n, (op, path)
        # sampled at rate 1.0: one latency observation per conv, same labels
        h = "convkernels_conv_seconds_count"
        assert _count(after, op, path, h) - _count(before, op, path, h) == n, (op, path)


def test_tiled_unfold_tiles_inner_axis_when_one_line_is_over_the_limit():
    """MLX PR 3084's case, conv_transpose1d laid out as H=1, scaled down: the single H line is
    over the limit, so tiles run along W (the tile plan itself: test_unfold.py)."""
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 1, 23, 3)).astype(np.float32)
    w = rng.standard_normal((2, 1, 64, 3)).astype(np.float32)
    be = get_backend("mlx", unfold_limit_bytes=64 * 3 * 4 * 5)  # five output positions a tile
    out = be.conv_transpose2d(be.asarray(x), be.asarray(w), stride=(1, 16), padding=(0, 3), output_padding=(0, 5))
    assert only_path(be) == "tiled_unfold"
    ref = ref_conv_transpose(x, w, None, (1, 16), (0, 3), (0, 5), (1, 1), 1)
    assert rel_l2(be.to_host(out), ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("path", ["depthwise_tail", "small_kd_2d", "tiled_unfold"])
def test_paths_in_half_precision(dtype, path):
    """Half inputs stay half through every path, within the half-precision tolerance (rel L2 < 1e-2)."""
    rng, seed = fresh_rng()
    be = forced(path, dtype=dtype, unfold_limit_bytes=2048 if path == "tiled_unfold" else None)
    if path == "small_kd_2d":
        x = rng.standard_normal((1, 4, 7, 9, 16)).astype(np.float32)
        w = (rng.standard_normal((16, 2, 3, 3, 16)) * 0.1).astype(np.float32)
        out = be.conv3d(be.asarray(x), be.asarray(w), padding=((0, 0), (1, 1), (1, 1)))
        ref = ref_conv(x, w, None, (1, 1, 1), ((0, 0), (1, 1), (1, 1)), (1, 1, 1), 1)
    elif path == "depthwise_tail":
        x = rng.standard_normal((1, 15, 15, 32)).astype(np.float32)
        w = rng.standard_normal((32, 3, 3, 1)).astype(np.float32)
        out = be.conv2d(be.asarray(x), be.asarray(w), padding=1, groups=32)
        ref = ref_conv(x, w, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 32)
    else:
        x = rng.standard_normal((1, 9, 11, 6)).astype(np.float32)
        w = rng.standard_normal((5, 3, 3, 6)).astype(np.float32)
        out = be.conv2d(be.asarray(x), be.asarray(w), padding=1)
        ref = ref_conv(x, w, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert only_path(be) == path
    assert be.dtype_of(out) == dtype
    assert rel_l2(be.to_host(out), ref) < 1e-2, f"seed {seed}"


def test_integer_arrays_are_refused():
    """A conv on an integer mlx array says which dtypes are accepted (asarray refuses integer host
    arrays already: test_ops.py)."""
    be = get_backend("mlx")
    with pytest.raises(ValueError, match="unsupported dtype"):
        be.conv2d(mx.zeros((1, 4, 4, 2), dtype=mx.int32), be.asarray(np.zeros((2, 1, 1, 2), np.float32)))
