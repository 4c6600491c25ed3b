"""The conv ops of every backend (op_backends.py: numpy, mlx, cuda in float16/bfloat16/float32)
against torch.nn.functional: the default path over the whole grid with every epilogue, then every
path each backend's guards accept, forced one at a time, so no path hides behind a cost rule.
Each backend's own path details: test_numpy_paths.py, test_mlx_paths.py, gpu/test_cuda_paths.py."""
from __future__ import annotations

import numpy as np
import pytest

from op_backends import EPILOGUES, backend, conv_counts, conv_operands, put, ref_forward, ref_transposed, scrape
from torch_reference import (CONV_CASES, CONV_T_CASES, F, conv_id, conv_t_id, fresh_rng, from_t, ref_conv,
                             rel_l2, to_t, torch)

from convkernels import ConvKey
from convkernels.backend import CONV_OPS, CONV_T_OPS
from convkernels.spec import upsample_conv_as_phases, upsample_conv_as_transpose

@pytest.mark.parametrize("case", CONV_CASES, ids=conv_id)
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_conv_matches_torch(target, case, epilogue):
    """The default path; each conv counted once, under a path of the backend's catalogue."""
    be = backend(target)
    rng, seed = fresh_rng()
    spec, (x, w, b, r, act), hosts = conv_operands(be, rng, case, epilogue)
    before = scrape()
    out = be.conv(x, w, spec, b, residual=r, activation=act)
    ran = conv_counts(before, scrape(), be.name, CONV_OPS[case[0]])
    assert type(out) is type(x)  # the backend's native array
    ours = be.to_host(out)
    assert sum(ran.values()) == 1 and set(ran) <= {p.name for p in be.paths.catalogue}, ran
    err = rel_l2(ours, ref_forward(case, hosts, act))
    assert err < target.tol, f"seed {seed}: {err} on {ran}"


@pytest.mark.parametrize("case", CONV_CASES, ids=conv_id)
def test_every_valid_path_matches_torch(target, case):
    rng, seed = fresh_rng()
    probe = backend(target)
    spec, (x, w, b, _, _), hosts = conv_operands(probe, rng, case, "bias_gelu")
    key = ConvKey(CONV_OPS[case[0]], tuple(x.shape), tuple(w.shape), target.dtype, spec, (True, False, "gelu"))
    names = [p.name for p in probe.paths.candidates(key)]
    assert names, "no path accepts the key"
    ref = ref_forward(case, hosts, "gelu")
    for name in names:
        be = backend(target, fresh=True)
        be.paths.forced = name
        ours = be.to_host(be.conv(x, w, spec, b, activation="gelu"))
        assert be.conv_choices()[0]["path"] == name
        assert rel_l2(ours, ref) < target.tol, f"path {name}, seed {seed}"


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_nd_entry_points(target, nd):
    be = backend(target)
    rng, seed = fresh_rng()
    sp = (11, 9, 7)[:nd]
    x, xh = put(be, rng.standard_normal((2, *sp, 6)))
    w, wh = put(be, rng.standard_normal((4, *(3,) * nd, 3)) / 5)
    fn = {1: be.conv1d, 2: be.conv2d, 3: be.conv3d}[nd]
    ours = be.to_host(fn(x, w, stride=2, padding=1, groups=2, dilation=1))
    ref = ref_conv(xh, wh, None, (2,) * nd, ((1, 1),) * nd, (1,) * nd, 2)
    assert rel_l2(ours, ref) < target.tol, f"seed {seed}"


@pytest.mark.parametrize("case", CONV_T_CASES, ids=conv_t_id)
@pytest.mark.parametrize("epilogue", ["plain", "bias_gelu", "bias_silu_residual"])
def test_conv_transpose_matches_torch(target, case, epilogue):
    be = backend(target)
    rng, seed = fresh_rng()
    spec, (x, w, b, r, act), hosts = conv_operands(be, rng, case, epilogue, transpose=True)
    ours = be.to_host(be.conv(x, w, spec, b, residual=r, activation=act))
    assert rel_l2(ours, ref_transposed(case, hosts, act)) < target.tol, f"seed {seed}"


@pytest.mark.parametrize("case", CONV_T_CASES, ids=conv_t_id)
def test_every_valid_transposed_path_matches_torch(target, case):
    """Through conv_transpose2d/3d, with a bias, every path the guards accept forced in turn."""
    nd, _, _, _, _, _, stride, pad, opad, dil, g = case
    rng, seed = fresh_rng()
    probe = backend(target)
    spec, (x, w, b, _, _), hosts = conv_operands(probe, rng, case, "bias_gelu", transpose=True)
    key = ConvKey(CONV_T_OPS[nd], tuple(x.shape), tuple(w.shape), target.dtype, spec, (True, False, None))
    names = [p.name for p in probe.paths.candidates(key)]
    assert names
    ref = ref_transposed(case, hosts, None)
    for name in names:
        be = backend(target, fresh=True)
        be.paths.forced = name
        fn = {2: be.conv_transpose2d, 3: be.conv_transpose3d}[nd]
        ours = be.to_host(fn(x, w, b, stride=stride, padding=pad, output_padding=opad, dilation=dil, groups=g))
        assert be.conv_choices()[0]["path"] == name
        assert rel_l2(ours, ref) < target.tol, f"path {name}, seed {seed}"


def ref_upsample_conv(x, w, b):
    """nearest 2x then 3x3 conv, padding 1, in torch (float64); w: ours O,3,3,C."""
    up = F.interpolate(to_t(x), scale_factor=2, mode="nearest")
    wt = torch.from_numpy(np.asarray(w, np.float64)).movedim(-1, 1).contiguous()
    return from_t(F.conv2d(up, wt, None if b is None else torch.from_numpy(np.asarray(b, np.float64)), padding=1))


@pytest.mark.parametrize("shape,cout", [((2, 7, 10, 13), 11), ((1, 5, 3, 40), 33), ((1, 16, 17, 32), 32)])
@pytest.mark.parametrize("phases", [False, True], ids=["default", "phases"])
def test_upsample_conv2d_matches_torch(target, shape, cout, phases):
    """nearest 2x + 3x3 conv (Upsample2D, Wan's Resample), each backend its own way: odd channels,
    non-square; a second call reads what the first derived (cuda: the transposed weight, or with
    the phase form forced, the phase weight and its bias)."""
    if phases and target.name != "cuda":
        pytest.skip("the phase form is an option of the cuda backend (cuda/upsample.py)")
    be = backend(target, upsample_form="phases") if phases else backend(target)
    rng, seed = fresh_rng()
    x, xh = put(be, rng.standard_normal(shape))
    w, wh = put(be, rng.standard_normal((cout, 3, 3, shape[-1])) / np.sqrt(9 * shape[-1]))
    b, bh = put(be, rng.standard_normal(cout))
    for _ in range(2):
        ours = be.to_host(be.upsample_conv2d(x, w, b))
        assert rel_l2(ours, ref_upsample_conv(xh, wh, bh)) < target.tol, f"seed {seed}"
    # a residual joins in the epilogue (Wan 2.2's shortcut); without a bias too
    n, h, wd, _ = shape
    r, rh = put(be, rng.standard_normal((n, 2 * h, 2 * wd, cout)))
    for bias, bias_h in ((b, bh), (None, None)):
        ours = be.to_host(be.upsample_conv2d(x, w, bias, residual=r))
        assert rel_l2(ours, ref_upsample_conv(xh, wh, bias_h) + rh) < target.tol, f"seed {seed}"
    with pytest.raises(ValueError, match="residual must"):
        be.upsample_conv2d(x, w, b, residual=be.slice(r, 1, 0, 2 * h - 1))
    with pytest.raises(ValueError, match="weight must be"):
        be.upsample_conv2d(x, be.slice(w, 1, 0, 2), b)
    with pytest.raises(ValueError, match="bias must"):
        be.upsample_conv2d(x, w, be.slice(b, 0, 0, cout - 1))


@pytest.mark.parametrize("cin,cout,ft,first,frames", [
    (16, 16, 2, False, 2), (16, 16, 2, True, 1),  # whole vectors, each channel read once (Wan 2.2's 1024 -> 1024)
    (32, 16, 1, False, 3),                         # whole vectors, every second channel (1024 -> 512)
    (16, 8, 2, True, 2),                           # a first chunk whose time offset picks the channel
    (10, 5, 1, False, 2), (6, 3, 2, True, 2)])     # odd channels: made first everywhere
@pytest.mark.parametrize("phases", [False, True], ids=["default", "phases"])
def test_upsample_conv2d_adds_a_shuffled_residual_as_diffusers_dup_up3d(target, cin, cout, ft, first, frames, phases):
    """Wan 2.2's residual up block: the upsampler's op with the block input's DupUp3D shortcut as a
    ShuffledResidual (read where it lies by cuda's phase form), against torch's nearest 2x + 3x3
    conv plus diffusers' own DupUp3D module, frame by frame."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    from convkernels import ShuffledResidual
    if phases and target.name != "cuda":
        pytest.skip("the phase form is an option of the cuda backend (cuda/upsample.py)")
    be = backend(target, upsample_form="phases") if phases else backend(target)
    rng, seed = fresh_rng()
    n, h, w = 2, 3, 5
    start = ft - 1 if first and ft > 1 else 0
    to = frames * ft - start
    src, src_h = put(be, rng.standard_normal((n, frames, h, w, cin)))
    x, xh = put(be, rng.standard_normal((n * to, h, w, cout)))
    wt, wh = put(be, rng.standard_normal((cout, 3, 3, cout)) / np.sqrt(9 * cout))
    b, bh = put(be, rng.standard_normal(cout))
    short = from_t(DupUp3D(cin, cout, ft, 2)(to_t(src_h), first_chunk=first)).reshape(n * to, 2 * h, 2 * w, cout)
    residual = ShuffledResidual(src, (ft, 2, 2), cout * ft * 4 // cin, start)
    ours = be.to_host(be.upsample_conv2d(x, wt, b, residual=residual))
    assert rel_l2(ours, ref_upsample_conv(xh, wh, bh) + short) < target.tol, f"seed {seed}"
    with pytest.raises(ValueError, match="residual must"):
        be.upsample_conv2d(be.slice(x, 0, 0, n * to - 1), wt, b, residual=residual)


def test_upsample_conv_as_transpose_is_the_same_function(target):
    """The weight derivation the mlx and cuda backends run (spec.upsample_conv_as_transpose, here
    on the host with NumPy as its array module): the stride-2 transposed conv with the derived 4x4
    weight equals nearest 2x + the 3x3 conv."""
    be = backend(target)
    rng, seed = fresh_rng()
    x, xh = put(be, rng.standard_normal((2, 9, 6, 21)))
    wh = rng.standard_normal((17, 3, 3, 21)) / 14
    b, bh = put(be, rng.standard_normal(17))
    w4 = upsample_conv_as_transpose(np, wh)
    assert w4.shape == (17, 4, 4, 21)
    w4d, _ = put(be, w4)
    ours = be.to_host(be.conv_transpose2d(x, w4d, b, stride=2, padding=1))
    assert rel_l2(ours, ref_upsample_conv(xh, wh, bh)) < target.tol, f"seed {seed}"


def test_upsample_conv_as_phases_is_the_same_function(target):
    """The phase form's weight (spec.upsample_conv_as_phases, derived on the host): each backend's
    2x2 conv with padding 1 writes the four output phases as channel blocks; placed where the
    docstring says, they are nearest 2x + the 3x3 conv."""
    be = backend(target)
    rng, seed = fresh_rng()
    n, h, w, cin, cout = 2, 9, 6, 21, 17
    x, xh = put(be, rng.standard_normal((n, h, w, cin)))
    wh = rng.standard_normal((cout, 3, 3, cin)) / 14
    b, bh = put(be, np.tile(rng.standard_normal(cout), 4))
    wp = upsample_conv_as_phases(np, wh)
    assert wp.shape == (4 * cout, 2, 2, cin)
    wpd, _ = put(be, wp)
    y = be.to_host(be.conv2d(x, wpd, b, padding=1))
    assert y.shape == (n, h + 1, w + 1, 4 * cout)
    ours = np.empty((n, 2 * h, 2 * w, cout))
    for a in (0, 1):
        for c in (0, 1):
            p = 2 * a + c
            ours[:, a::2, c::2] = y[:, a:a + h, c:c + w, p * cout:(p + 1) * cout]
    assert rel_l2(ours, ref_upsample_conv(xh, wh, bh[:cout])) < target.tol, f"seed {seed}"


def test_path_choice_is_memoised_and_listed(target):
    be = backend(target, fresh=True)
    x, _ = put(be, np.ones((1, 9, 9, 4)))
    w, _ = put(be, np.ones((4, 3, 3, 1)))
    for _ in range(3):
        be.conv2d(x, w, padding=1, groups=4)
    choices = be.conv_choices()
    assert len(choices) == 1
    assert choices[0]["path"] in {p.name for p in be.paths.catalogue} and choices[0]["calls"] == 3
    assert choices[0]["input_shape"] == [1, 9, 9, 4] and choices[0]["groups"] == 4
    assert choices[0]["macs"] == 9 * 9 * 4 * 3 * 3  # each output: 3x3 taps of its one input channel


@pytest.mark.parametrize("bad,match", [
    (dict(x=(1, 8, 8, 4), w=(4, 3, 3, 3)), "input channels"),
    (dict(x=(1, 8, 8, 6), w=(4, 3, 3, 3), groups=4), "groups=4 must divide"),
    (dict(x=(8, 8, 4), w=(4, 3, 3, 4)), "channels-last"),
    (dict(x=(1, 2, 2, 4), w=(4, 5, 5, 4)), "output would be empty"),
    (dict(x=(1, 8, 8, 4), w=(4, 3, 3, 4), bias=(3,)), "bias must have shape"),
    (dict(x=(1, 8, 8, 4), w=(4, 3, 3, 4), stride=0), "stride must be >= 1"),
    (dict(x=(1, 8, 8, 4), w=(4, 3, 3, 4), activation="tanh"), "activation must be one of"),
])
def test_bad_shapes_raise_clear_errors(target, bad, match):
    be = backend(target)
    x = be.asarray(np.zeros(bad["x"], np.float32))
    w = be.asarray(np.zeros(bad["w"], np.float32))
    bias = be.asarray(np.zeros(bad["bias"], np.float32)) if "bias" in bad else None
    with pytest.raises(ValueError, match=match):
        be.conv2d(x, w, bias, stride=bad.get("stride", 1), groups=bad.get("groups", 1),
                  activation=bad.get("activation"))
