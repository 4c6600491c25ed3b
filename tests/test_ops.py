"""The non-conv ops of every backend (op_backends.py: numpy, mlx, cuda in float16/bfloat16/float32)
against torch.nn.functional and NumPy: norms, activations, resampling, padding, dense ops,
attention, array plumbing, host copies, dtypes and refusals. The convs: test_ops_conv.py."""
from __future__ import annotations

import numpy as np
import pytest

from op_backends import backend, put
from torch_reference import F, fresh_rng, from_t, ref_activation, ref_conv, rel_l2, to_t, torch

from convkernels import get_backend


def t64(a):
    return torch.from_numpy(np.asarray(a, np.float64))


# ---- normalisation and activations ------------------------------------------------------------

@pytest.mark.parametrize("shape,groups", [((2, 7, 5, 3, 12), 4), ((2, 13, 11, 32), 8), ((1, 5, 9, 7, 12), 4),
                                          ((3, 17, 6), 3), ((1, 64, 64, 128), 32),
                                          # 16-byte vectors spanning two groups (4 channels each)
                                          ((3, 7, 9, 48), 12),
                                          # many chunks per item, batch > 1, non-square
                                          ((2, 96, 75, 64), 32),
                                          # a row of more 16-byte columns than threads (fp32: 260)
                                          ((1, 3, 5, 1040), 8),
                                          # 40 channels: fp16 vectors, fp32 scalar-by-vector mix
                                          ((2, 11, 13, 40), 5)])
@pytest.mark.parametrize("activation", [None, "silu", "gelu"])
def test_group_norm(target, shape, groups, activation):
    be = backend(target)
    rng, seed = fresh_rng()
    c = shape[-1]
    x, xh = put(be, rng.standard_normal(shape) * 3 + 1.5)
    w, wh = put(be, rng.standard_normal(c))
    b, bh = put(be, rng.standard_normal(c))
    ours = be.to_host(be.group_norm(x, groups, w, b, 1e-6, activation=activation))
    ref = from_t(ref_activation(F.group_norm(to_t(xh), groups, t64(wh), t64(bh), 1e-6), activation))
    assert rel_l2(ours, ref) < target.tol, f"seed {seed}"


@pytest.mark.parametrize("shape,groups,cut", [((2, 13, 11, 32), 8, 5), ((1, 9, 7, 12), 3, 1),
                                              ((2, 7, 5, 3, 40), 5, 4)])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_group_norm_split_statistics_normalise_row_parts_as_the_whole(target, shape, groups, cut, activation):
    """group_norm_sums of two row parts, added, and group_norm_apply on each part with the whole
    count: the whole tensor's GroupNorm (what a sharded decode does across devices)."""
    be = backend(target)
    rng, seed = fresh_rng()
    c = shape[-1]
    xh = rng.standard_normal(shape) * 3 + 1.5
    xh[:, :cut] += 4.0  # the parts' own statistics differ clearly from the whole's (the guard below)
    w, wh = put(be, rng.standard_normal(c))
    b, bh = put(be, rng.standard_normal(c))
    held = [put(be, xh[:, :cut]), put(be, xh[:, cut:])]
    parts, xh = [d for d, _ in held], np.concatenate([h for _, h in held], axis=1)  # what the device holds
    sums = [be.group_norm_sums(p, groups) for p in parts]
    total = sums[0] + sums[1]
    count = np.prod(shape[1:]) // groups
    ours = np.concatenate([be.to_host(be.group_norm_apply(p, total, count, groups, w, b, 1e-6, activation))
                           for p in parts], axis=1)
    ref = from_t(ref_activation(F.group_norm(to_t(xh), groups, t64(wh), t64(bh), 1e-6),
                                activation))
    assert rel_l2(ours, ref) < target.tol, f"seed {seed}"
    # the vacuity guard: each part normalised by its own statistics is clearly not the whole's
    alone = np.concatenate([be.to_host(be.group_norm(p, groups, w, b, 1e-6, activation=activation)) for p in parts],
                           axis=1)
    assert rel_l2(alone, ref) > 10 * target.tol, f"seed {seed}"


@pytest.mark.parametrize("shape", [(3, 5, 7, 13), (2, 7, 9, 96), (3, 5, 37), (1, 1000)])
@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh"])
def test_layer_norm(target, shape, activation):
    be = backend(target)
    rng, seed = fresh_rng()
    c = shape[-1]
    x, xh = put(be, rng.standard_normal(shape) * 2 - 0.5)
    w, wh = put(be, rng.standard_normal(c))
    b, bh = put(be, rng.standard_normal(c))
    ours = be.to_host(be.layer_norm(x, w, b, 1e-6, activation=activation))
    ref = ref_activation(F.layer_norm(t64(xh), (c,), t64(wh), t64(bh), 1e-6), activation).numpy()
    assert rel_l2(ours, ref) < target.tol, f"seed {seed} {shape}"


@pytest.mark.parametrize("activation", [None, "silu"])
def test_rms_norm(target, activation):
    """The RMS norm (Wan's norm, eps as tiny as Wan's) vs torch's rms_norm."""
    be = backend(target)
    rng, seed = fresh_rng()
    for shape, eps in (((2, 3, 5, 7, 13), 1e-6), ((1, 2, 9, 33, 96), 1e-24 / 96), ((4, 1000), 1e-5)):
        c = shape[-1]
        x, xh = put(be, rng.standard_normal(shape) * 2 + 0.5)
        w, wh = put(be, rng.uniform(0.5, 1.5, c))
        ours = be.to_host(be.rms_norm(x, w, eps, activation=activation))
        ref = ref_activation(F.rms_norm(t64(xh), (c,), t64(wh), eps), activation).numpy()
        assert rel_l2(ours, ref) < target.tol, f"seed {seed} {shape}"


def test_rms_norm_behind_a_prefix(target):
    """rms_norm(x, prefix=frames): one video and two, odd channels, vs
    torch.cat([frames, silu(rms_norm(x))], 1); the prefix is copied bit for bit."""
    be = backend(target)
    rng, seed = fresh_rng()
    for n, t, t0, c in ((1, 4, 2, 97), (2, 3, 2, 13), (1, 1, 2, 96)):
        x, xh = put(be, rng.standard_normal((n, t, 5, 9, c)))
        pre, preh = put(be, rng.standard_normal((n, t0, 5, 9, c)))
        w, wh = put(be, rng.uniform(0.5, 1.5, c))
        ours = be.to_host(be.rms_norm(x, w, 1e-24 / c, activation="silu", prefix=pre))
        normed = F.silu(F.rms_norm(t64(xh), (c,), t64(wh), 1e-24 / c))
        np.testing.assert_array_equal(ours[:, :t0], preh)
        assert rel_l2(ours, torch.cat([t64(preh), normed], dim=1).numpy()) < target.tol, f"seed {seed} n={n}"


@pytest.mark.parametrize("n,t,t0,c", [(1, 3, 2, 96), (2, 2, 2, 13), (1, 1, 0, 97), (2, 3, 0, 16)])
@pytest.mark.parametrize("sides", ["both", "above", "below"])
def test_rms_norm_of_rows_joined_around_x(target, n, t, t0, c, sides):
    """rms_norm(x, rows=(above, below), prefix=frames): a sharded conv's halo rows (axis -3) joined
    to x's before the norm, behind the cached frames (t0 = 0: no prefix; 4-D x then too), vs
    torch.cat([frames, silu(rms_norm(torch.cat([above, x, below], rows)))], 1). Odd rows, odd and
    vectorisable channels, batch 2 (its rows of every frame lie apart in the buffer)."""
    be = backend(target)
    rng, seed = fresh_rng()
    h, w, halo = 5, 7, 1 if c != 16 else 2
    x, xh = put(be, rng.standard_normal((n, t, h, w, c)) * 2 + 0.5)
    above, ah = put(be, rng.standard_normal((n, t, halo, w, c)))
    below, bh = put(be, rng.standard_normal((n, t, halo, w, c)) - 1)
    rows = (above if sides != "below" else None, below if sides != "above" else None)
    joined = torch.cat([t64(p) for p in (ah if rows[0] is not None else None, xh, bh if rows[1] is not None else None)
                        if p is not None], dim=2)
    wt, wh = put(be, rng.uniform(0.5, 1.5, c))
    normed = F.silu(F.rms_norm(joined, (c,), t64(wh), 1e-24 / c))
    if t0:
        pre, preh = put(be, rng.standard_normal((n, t0, joined.shape[2], w, c)))
        ours = be.to_host(be.rms_norm(x, wt, 1e-24 / c, activation="silu", prefix=pre, rows=rows))
        np.testing.assert_array_equal(ours[:, :t0], preh)
        ref = torch.cat([t64(preh), normed], dim=1).numpy()
    else:  # no prefix: N,T,H,W,C as it is, and folded to N*T,H,W,C
        ours = be.to_host(be.rms_norm(x, wt, 1e-24 / c, activation="silu", rows=rows))
        ref = normed.numpy()
        flat = [None if r is None else be.reshape(r, (n * t, halo, w, c)) for r in rows]
        folded = be.to_host(be.rms_norm(be.reshape(x, (n * t, h, w, c)), wt, 1e-24 / c, activation="silu",
                                        rows=tuple(flat)))
        assert rel_l2(folded, ref.reshape(folded.shape)) < target.tol, f"seed {seed} folded"
    assert ours.shape == ref.shape and rel_l2(ours, ref) < target.tol, f"seed {seed} {sides}"
    with pytest.raises(ValueError, match="rows"):  # rows that do not match x elsewhere than axis -3
        be.rms_norm(x, wt, 1e-6, rows=(be.slice(above, 3, 0, 1), None))


@pytest.mark.parametrize("shape", [(4, 9, 11), (3, 17, 19, 5)])
@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh", "relu"])
def test_activations(target, shape, name):
    be = backend(target)
    rng, seed = fresh_rng()
    host = rng.standard_normal(shape) * 4
    host.reshape(-1)[:3] = [-100.0, 100.0, 0.0]  # tails must not overflow into NaN
    x, xh = put(be, host)
    fn = {"silu": be.silu, "relu": be.relu, "gelu": be.gelu, "gelu_tanh": lambda v: be.gelu(v, approximate=True)}
    ours = be.to_host(fn[name](x))
    assert np.isfinite(ours).all()
    assert rel_l2(ours, ref_activation(t64(xh), name).numpy()) < target.tol, f"seed {seed}"


# ---- resampling and padding: exact copies ---------------------------------------------------------

@pytest.mark.parametrize("nd,scale", [(1, (3,)), (2, (2, 2)), (2, 2), (2, (1, 3)), (3, (1, 2, 2)), (3, (2, 2, 2))])
def test_upsample_nearest(target, nd, scale):
    be = backend(target)
    rng, _ = fresh_rng()
    x, xh = put(be, rng.standard_normal((2, *(5, 7, 3)[:nd], 3)))
    ours = be.to_host(be.upsample_nearest(x, scale))
    factors = scale if isinstance(scale, tuple) else (scale,) * nd
    np.testing.assert_array_equal(ours, from_t(F.interpolate(to_t(xh), scale_factor=factors, mode="nearest")))


@pytest.mark.parametrize("cin,cout,ft,fs,first,shape", [
    (6, 3, 2, 2, False, (2, 3, 5, 7)),    # Wan 2.2's time-and-space up block: repeats 2, batch 2
    (6, 3, 2, 2, True, (1, 3, 5, 7)),     # its first chunk keeps the last time offset only
    (10, 5, 1, 2, False, (2, 2, 3, 5)),   # space only (TI2V's third up block): repeats 2
    (4, 8, 2, 2, True, (1, 1, 3, 3)),     # repeats 4, one latent frame
    (5, 5, 1, 1, False, (1, 2, 3, 4)),    # nothing moves
    # whole 16-byte vectors of channels (cuda's pixel_shuffle3_vec): channel o of o (16 -> 16) and
    # of 2o + s (32 -> 16), as Wan 2.2's up blocks read them
    (16, 16, 2, 2, True, (1, 2, 3, 5)),
    (32, 16, 1, 2, False, (2, 1, 3, 4))])
def test_pixel_shuffle_is_diffusers_dup_up3d(target, cin, cout, ft, fs, first, shape):
    """pixel_shuffle with repeats is Wan 2.2's DupUp3D (diffusers' own module): an exact copy."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    be = backend(target)
    rng, seed = fresh_rng()
    x, xh = put(be, rng.standard_normal((*shape, cin)))
    ref = from_t(DupUp3D(cin, cout, ft, fs)(to_t(xh), first_chunk=first))
    repeats = cout * ft * fs * fs // cin
    ours = be.to_host(be.pixel_shuffle(x, (ft, fs, fs), repeats, start=ft - 1 if first and ft > 1 else 0))
    np.testing.assert_array_equal(ours, ref, err_msg=f"seed {seed}")


@pytest.mark.parametrize("factors,repeats", [((2, 2), 1), ((3, 2), 1), ((2, 2), 3), ((1, 3), 2)])
def test_pixel_shuffle_of_images_is_torchs(target, factors, repeats):
    be = backend(target)
    rng, seed = fresh_rng()
    cin = 12 // repeats if repeats > 1 else 12
    x, xh = put(be, rng.standard_normal((2, 5, 7, cin)))
    wide = to_t(xh).repeat_interleave(repeats, dim=1)
    if factors[0] == factors[1]:
        ref = from_t(F.pixel_shuffle(wide, factors[0]))
    else:  # torch's pixel_shuffle is square; its channel order spelled out for unequal factors
        n, c, h, w = wide.shape
        co = c // (factors[0] * factors[1])
        ref = from_t(wide.reshape(n, co, *factors, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, co, h * factors[0], w * factors[1]))
    np.testing.assert_array_equal(be.to_host(be.pixel_shuffle(x, factors, repeats)), ref, err_msg=f"seed {seed}")


def test_pixel_shuffle_refuses_what_does_not_split():
    be = get_backend("numpy")
    x = be.asarray(np.zeros((1, 2, 3, 5), np.float32))
    for factors, repeats, start, why in [((2, 2), 1, 0, "blocks of 4"), ((2,), 1, 0, "2 spatial axes"),
                                         ((2, 2), 4, 9, "start 9")]:
        with pytest.raises(ValueError, match=why):
            be.pixel_shuffle(x, factors, repeats, start=start)


@pytest.mark.parametrize("shape,pads", [((2, 4, 5, 6, 3), ((2, 0), (1, 3), (0, 1))), ((2, 5, 7, 3), ((0, 1), (0, 1)))])
@pytest.mark.parametrize("mode,torch_mode", [("zeros", "constant"), ("replicate", "replicate")])
def test_pad(target, shape, pads, mode, torch_mode):
    be = backend(target)
    rng, _ = fresh_rng()
    x, xh = put(be, rng.standard_normal(shape))
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    np.testing.assert_array_equal(be.to_host(be.pad(x, pads, mode=mode)), from_t(F.pad(to_t(xh), flat, mode=torch_mode)))


@pytest.mark.parametrize("shape,pads,modes", [
    ((2, 4, 5, 6, 3), ((1, 1), (1, 1), (1, 1)), ("reflect",) * 3),
    ((1, 3, 5, 7, 8), ((1, 1), (1, 1), (1, 1)), ("replicate", "reflect", "reflect")),  # LTX-2's convs
    ((2, 4, 5, 6, 3), ((2, 0), (0, 2), (1, 0)), ("zeros", "reflect", "replicate")),
    ((2, 5, 7, 16), ((2, 1), (0, 3)), ("reflect", "zeros")),
    ((3, 9, 5), ((3, 2),), ("reflect",)),
])
def test_pad_reflect_and_a_mode_per_axis(target, shape, pads, modes):
    """Each axis in its own mode equals torch's F.pad of one axis at a time in that mode."""
    be = backend(target)
    rng, _ = fresh_rng()
    x, xh = put(be, rng.standard_normal(shape))
    want = to_t(xh)
    nd = len(pads)
    for axis, ((lo, hi), mode) in enumerate(zip(pads, modes)):
        flat = [0, 0] * nd
        flat[2 * (nd - 1 - axis):2 * (nd - axis)] = [lo, hi]
        if mode == "reflect" and nd == 1:
            want = F.pad(want, flat, mode="reflect")
        else:  # torch pads 2 or 3 trailing axes at once in reflect/replicate: the others' widths are 0
            want = F.pad(want, flat, mode={"zeros": "constant", "replicate": "replicate", "reflect": "reflect"}[mode])
    got = be.to_host(be.pad(x, pads, mode=modes if len(set(modes)) > 1 else modes[0]))
    np.testing.assert_array_equal(got, from_t(want))


def test_pad_refuses_a_reflection_as_wide_as_its_axis():
    be = get_backend("numpy")
    x = be.asarray(np.zeros((1, 3, 2, 4), np.float32))
    with pytest.raises(ValueError, match="narrower than its axis"):
        be.pad(x, ((1, 1), (2, 0)), mode="reflect")
    with pytest.raises(ValueError, match="one per spatial axis"):
        be.pad(x, ((1, 1), (1, 1)), mode=("reflect",))
    with pytest.raises(ValueError, match="mode must be"):
        be.pad(x, ((1, 1), (1, 1)), mode="circular")


# ---- dense ops ----------------------------------------------------------------------------------------

def test_matmul_linear_softmax_mean_add_mul(target):
    be = backend(target)
    tol = target.tol
    rng, seed = fresh_rng()
    a, ah = put(be, rng.standard_normal((3, 17, 33)))
    b, bh = put(be, rng.standard_normal((3, 33, 9)))
    assert rel_l2(be.to_host(be.matmul(a, b)), ah @ bh) < tol, f"seed {seed}"
    a4, a4h = put(be, rng.standard_normal((2, 1, 5, 33)))  # broadcast batch dims
    assert rel_l2(be.to_host(be.matmul(a4, b)), a4h @ bh) < tol, f"seed {seed}"
    w, wh = put(be, rng.standard_normal((9, 33)) / 6)
    bias, biash = put(be, rng.standard_normal(9))
    res, resh = put(be, rng.standard_normal((3, 17, 9)))
    ours = be.to_host(be.linear(a, w, bias, residual=res, activation="gelu"))
    ref = F.gelu(F.linear(t64(ah), t64(wh), t64(biash))).numpy() + resh
    assert rel_l2(ours, ref) < tol, f"seed {seed}"
    s, sh = put(be, rng.standard_normal((4, 6, 37)) * 4)
    for axis in (-1, 1, 0):
        assert rel_l2(be.to_host(be.softmax(s, axis=axis)), torch.softmax(t64(sh), axis).numpy()) < tol, f"seed {seed}"
    assert rel_l2(be.to_host(be.mean(a, (1, 2), keepdims=True)), ah.mean(axis=(1, 2), keepdims=True)) < tol
    assert rel_l2(be.to_host(be.mean(a, -1)), ah.mean(axis=-1)) < tol
    assert rel_l2(be.to_host(be.add(a, a)), ah + ah) < tol
    assert rel_l2(be.to_host(be.mul(a, a)), ah * ah) < tol
    assert be.dtype_of(be.add(a, a)) == target.dtype
    neg = be.mul(a, -1.0)  # a scalar operand (the Wan RMS norm's generic route uses this)
    assert be.dtype_of(neg) == target.dtype and np.array_equal(be.to_host(neg), -be.to_host(a))
    wide = be.astype(a, "float32")  # a layer computing in float32 on any backend, and back
    assert be.dtype_of(wide) == "float32" and np.array_equal(be.to_host(wide), be.to_host(a))
    back = be.astype(wide, target.dtype)
    assert be.dtype_of(back) == target.dtype and np.array_equal(be.to_host(back), be.to_host(a))


@pytest.mark.parametrize("lq,lk,d,lead", [(37, 37, 29, (1, 2)), (37, 37, 17, (2, 3)), (50, 23, 64, (2, 3)),
                                           (9, 61, 5, (2, 3)), (4096, 4096, 64, (1, 2)), (5, 300, 512, (3,)),
                                           (9, 11, 16, (70,))])
def test_attention(target, lq, lk, d, lead):
    be = backend(target)
    rng, seed = fresh_rng()
    q, qh = put(be, rng.standard_normal((*lead, lq, d)))
    k, kh = put(be, rng.standard_normal((*lead, lk, d)))
    v, vh = put(be, rng.standard_normal((*lead, lk, 9)))
    ref = F.scaled_dot_product_attention(t64(qh), t64(kh), t64(vh)).numpy()
    assert rel_l2(be.to_host(be.attention(q, k, v)), ref) < target.tol, f"seed {seed}"


@pytest.mark.parametrize("lq,lk,d,chunk", [(37, 37, 17, 2048), (37, 37, 17, 4096), (50, 23, 17, 16),
                                            (50, 23, 64, 16), (9, 61, 5, 4)])
def test_attention_in_row_chunks(target, lq, lk, d, chunk):
    """Backends that bound the score matrix by query rows (attention_chunk): several chunks, the
    last one short; a 3-d input (the VAE mid-block: batch, tokens, channels) with an explicit scale."""
    if backend(target).attention_chunk is None:
        pytest.skip(f"{target.name} bounds attention scores by bytes, not a row count")
    be = backend(target, attention_chunk=chunk)
    assert be.attention_chunk == chunk
    rng, seed = fresh_rng()
    q, qh = put(be, rng.standard_normal((2, 3, lq, d)))
    k, kh = put(be, rng.standard_normal((2, 3, lk, d)))
    v, vh = put(be, rng.standard_normal((2, 3, lk, 9)))
    ref = F.scaled_dot_product_attention(t64(qh), t64(kh), t64(vh)).numpy()
    assert rel_l2(be.to_host(be.attention(q, k, v)), ref) < target.tol, f"seed {seed}"
    ref3 = F.scaled_dot_product_attention(t64(qh[0]), t64(kh[0]), t64(vh[0]), scale=0.3).numpy()
    q3, k3, v3 = (be.slice(t, 0, 0, 1) for t in (q, k, v))
    ours = be.attention(*(be.reshape(t, t.shape[1:]) for t in (q3, k3, v3)), scale=0.3)
    assert rel_l2(be.to_host(ours), ref3) < target.tol, f"seed {seed}"


# ---- array plumbing ------------------------------------------------------------------------------------

def test_concat_by_blocks_and_by_strides_is_exact(target):
    """concat of contiguous blocks, of a strided view and of a block of a larger array gives numpy's
    concatenate bit for bit; slices and means as numpy's."""
    be = backend(target)
    rng, seed = fresh_rng()
    parts = [put(be, rng.standard_normal((1, t, 3, 5, 7))) for t in (2, 1, 3)]
    ours = be.to_host(be.concat([d for d, _ in parts], axis=1))
    np.testing.assert_array_equal(ours, np.concatenate([h for _, h in parts], axis=1))
    a, ah = put(be, rng.standard_normal((2, 3, 4, 6)))
    b, bh = put(be, rng.standard_normal((2, 3, 4, 5)))
    view = be.slice(a, 3, 0, 6, 2)  # every other channel: not a block
    np.testing.assert_array_equal(be.to_host(be.concat([view, b], axis=-1)), np.concatenate([ah[..., ::2], bh], -1))
    np.testing.assert_array_equal(be.to_host(be.concat([be.slice(a, 1, 1, 3)], axis=1)), ah[:, 1:3])
    c = be.concat([a, b], axis=-1)
    assert tuple(c.shape) == (2, 3, 4, 11)
    np.testing.assert_array_equal(be.to_host(be.slice(c, -1, 6, 11)), bh)
    whole = np.concatenate([ah, bh], -1)
    assert rel_l2(be.to_host(be.mean(c, (1, 2))), whole.mean(axis=(1, 2))) < target.tol, f"seed {seed}"
    np.testing.assert_array_equal(be.to_host(be.transpose(b, (0, 3, 1, 2))), bh.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(be.to_host(be.reshape(b, (6, 20))), bh.reshape(6, 20))


# ---- host copies, dtypes, refusals --------------------------------------------------------------------

def test_to_host_async_widens_and_clips_as_numpy_does(target):
    """to_host_async's result is to_host's in float32; with clip=, clipped as np.clip would (NaN
    stays NaN)."""
    be = backend(target)
    rng, _ = fresh_rng()
    x, xh = put(be, rng.standard_normal((1, 3, 33, 17, 3)))
    got = be.to_host_async(x).result()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, xh.astype(np.float32))
    host = rng.standard_normal((2, 5, 7))
    host[0, 0, 0] = np.nan
    y, yh = put(be, host)
    got = be.to_host_async(y, clip=(-0.5, 0.25)).result()
    assert np.isnan(got[0, 0, 0])
    np.testing.assert_array_equal(got, np.clip(yh.astype(np.float32), -0.5, 0.25))


def test_half_precision_storage_and_host_copies(half_target):
    """Arrays stay in the half dtype through a conv and a group norm; they come to the host as
    float32 (widened on the device); bfloat16 rounds as torch does."""
    be = backend(half_target)
    rng, seed = fresh_rng()
    x, xh = put(be, rng.standard_normal((1, 9, 10, 5)))
    w, wh = put(be, rng.standard_normal((7, 3, 3, 5)) / 7)
    assert be.dtype_of(x) == half_target.dtype
    out = be.conv2d(x, w, padding=1)
    assert be.dtype_of(out) == half_target.dtype
    host = be.to_host(out)
    assert host.dtype == np.float32
    ref = ref_conv(xh, wh, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert rel_l2(host, ref) < half_target.tol, f"seed {seed}"
    gn = be.to_host(be.group_norm(out, 7, activation="silu"))
    assert rel_l2(gn, from_t(F.silu(F.group_norm(to_t(ref), 7)))) < half_target.tol, f"seed {seed}"
    if half_target.dtype == "bfloat16":
        v = rng.standard_normal((4, 5)).astype(np.float32)
        np.testing.assert_array_equal(be.to_host(be.asarray(v)), torch.from_numpy(v).bfloat16().float().numpy())
    assert be.dtype_of(be.asarray(np.zeros(3, np.float32), dtype="float32")) == "float32"


def test_refusals(target):
    be = backend(target)
    if "float64" not in type(be).supported_dtypes:
        with pytest.raises(ValueError, match="computes in"):
            get_backend(target.name, dtype="float64")
    for bad in (np.zeros(3, dtype=object), np.zeros(3, dtype=np.int32)):
        with pytest.raises(ValueError, match="floating"):
            be.asarray(bad)
    with pytest.raises(ValueError, match="groups must divide"):
        be.group_norm(be.asarray(np.zeros((1, 4, 4, 6), np.float32)), 4)
    with pytest.raises(ValueError, match="activation must be one of"):
        be.layer_norm(be.asarray(np.zeros((2, 6), np.float32)), activation="tanh")
