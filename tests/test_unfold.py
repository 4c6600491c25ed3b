"""convkernels/unfold.py, the one unfold (im2col) / fold (col2im) the numpy, mlx and cuda backends
run, here on NumPy as its array namespace, against torch.nn.functional in float64 -> fp32
tolerance: whole and in tiles, with the weight layouts both NumPy (transposed views) and the cuda
backend (contiguous copies) give the product. Runs everywhere (no GPU); the backends' own op
tests (test_ops.py) run it on MLX and CuPy."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from torch_reference import fresh_rng, ref_conv, ref_conv_transpose, rel_l2

from convkernels import ConvSpec
from convkernels.spec import prod
from convkernels.unfold import (NumpyLike, conv_transpose_col2im, conv_unfold_gemm, plan_tiles, unfold_bytes,
                                unfold_tiles)

TOL = 1e-5
NAMESPACES = {"numpy": NumpyLike(np), "contiguous-weights": NumpyLike(np, contiguous_weights=True)}

# (nd, N, spatial, C_in, C_out, kernel, stride, padding (lo,hi), dilation, groups)
FORWARD = [
    (1, 2, (23,), 5, 7, (3,), (2,), ((2, 0),), (1,), 1),
    (2, 2, (13, 11), 6, 9, (3, 3), (2, 2), ((0, 1), (1, 0)), (1, 1), 3),
    (2, 1, (15, 17), 7, 7, (5, 5), (1, 1), ((2, 2), (2, 2)), (2, 1), 7),  # depthwise, dilation
    (3, 1, (5, 9, 7), 3, 5, (3, 3, 3), (1, 2, 1), ((2, 0), (1, 1), (1, 1)), (1, 1, 1), 1),
    (3, 2, (4, 6, 5), 4, 6, (2, 3, 3), (1, 1, 2), ((1, 0), (1, 1), (0, 2)), (1, 2, 1), 2),
]


@pytest.mark.parametrize("ns", list(NAMESPACES))
@pytest.mark.parametrize("case", FORWARD, ids=lambda c: f"{c[0]}d-g{c[9]}")
@pytest.mark.parametrize("limit", [1 << 30, 600, 40], ids=["whole", "tiled", "one-position"])
def test_forward_matches_torch(ns, case, limit):
    nd, n, sp, cin, cout, k, stride, pad, dil, g = case
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    spec = ConvSpec.make(nd, stride, pad, dil, g)
    out_shape = (n, *spec.output_spatial(sp, k), cout)
    ours, tiled = conv_unfold_gemm(NAMESPACES[ns], x, w, spec, out_shape, limit)
    assert tiled == (limit < unfold_bytes(x.shape, w.shape, out_shape, spec))
    assert ours.dtype == np.float32 and ours.shape == out_shape
    assert rel_l2(ours, ref_conv(x, w, None, stride, pad, dil, g)) < TOL, f"seed {seed}"


# (nd, N, spatial, C_in, C_out, kernel, stride, padding, output_padding, dilation, groups)
TRANSPOSED = [
    (2, 2, (7, 9), 5, 3, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1),
    (2, 1, (6, 5), 4, 6, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 2),
    (3, 1, (3, 5, 4), 4, 5, (3, 3, 3), (1, 2, 2), (1, 1, 1), (0, 1, 1), (1, 1, 1), 1),
    (2, 2, (5, 7), 6, 9, (3, 2), (3, 1), (0, 1), (2, 0), (1, 2), 3),
]


@pytest.mark.parametrize("ns", list(NAMESPACES))
@pytest.mark.parametrize("case", TRANSPOSED, ids=lambda c: f"t{c[0]}d-g{c[10]}")
@pytest.mark.parametrize("limit", [1 << 30, 400, 40], ids=["whole", "tiled", "one-position"])
def test_transpose_matches_torch(ns, case, limit):
    nd, n, sp, cin, cout, k, stride, pad, opad, dil, g = case
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    spec = ConvSpec.make(nd, stride, pad, dil, g, transpose=True, output_padding=opad)
    out_shape = (n, *spec.output_spatial(sp, k), cout)
    ours, tiled = conv_transpose_col2im(NAMESPACES[ns], x, w, spec, out_shape, limit)
    assert tiled == (limit < unfold_bytes(x.shape, w.shape, out_shape, spec))
    ref = ref_conv_transpose(x, w, None, stride, pad, opad, dil, g)
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("positions,position_bytes,limit", [
    ((7, 9), 16, 1 << 20),      # everything fits: one tile, the whole batch
    ((7, 9), 16, 300),          # rows of the first axis
    ((3, 5, 4), 24, 200),       # a line of the first axis is over: tiles along the second
    ((1, 5281), 64, 4096),      # H = 1 (MLX PR 3084's conv_transpose1d): tiles along W
    ((4, 6), 100, 40),          # one position alone is over: one position a tile
])
def test_tiles_cover_every_position_once_under_the_limit(positions, position_bytes, limit):
    n = 2
    tiles, tiled = plan_tiles(n, positions, position_bytes, limit)
    assert tiled == (n * prod(positions) * position_bytes > limit)
    seen = np.zeros((n, *positions), np.int32)
    for batch, box in tiles:
        seen[(batch, *(slice(a, b) for a, b in box))] += 1
        size = (batch.stop - batch.start) * prod(b - a for a, b in box)
        assert size * position_bytes <= limit or size == 1, (batch, box)
    assert (seen == 1).all()


def test_tiles_run_along_the_inner_axis_when_one_line_is_over_the_limit():
    """MLX PR 3084's case (conv_transpose1d, L=5158, k=4096, stride 1024: ~86.6 GB unfold) laid
    out as H=1: the single H line is over the limit, so boxes run along W, each at the limit."""
    tiles = list(unfold_tiles((1, 5281792), 4096 * 4, 1 << 30))
    assert {t[0] for t in tiles} == {1} and max(t[3] - t[2] for t in tiles) == (1 << 30) // (4096 * 4)
    assert sum(t[3] - t[2] for t in tiles) == 5281792


def test_the_patch_matrix_is_taps_then_channels():
    """The column order the weight's (*kernel, C/g) layout flattens to: a 2x2 kernel that picks
    one tap and one channel reads exactly that neighbour of each output position."""
    x = np.arange(2 * 4 * 5 * 3, dtype=np.float32).reshape(2, 4, 5, 3)
    spec = ConvSpec.make(2, 1, 0, 1, 1)
    for (ty, tx), c in itertools.product(itertools.product(range(2), range(2)), range(3)):
        w = np.zeros((1, 2, 2, 3), np.float32)
        w[0, ty, tx, c] = 1.0
        out, _ = conv_unfold_gemm(NumpyLike(np), x, w, spec, (2, 3, 4, 1), 1 << 20)
        np.testing.assert_array_equal(out[..., 0], x[:, ty:ty + 3, tx:tx + 4, c])
