"""8-bit pixels on the CUDA backend: to_host_async(uint8=True) runs the to_u8 kernel (read
fp16/bf16/fp32, widen, clip, scale, round to uint8) and must equal the service's to_uint8 of the
float32 array the same device array comes back as, bit for bit; asarray takes uint8 and widens it
on the device; an SD-VAE-style decode hands back uint8 through that kernel (eager and as a CUDA
graph replay), and ConvNeXt encodes uint8 pixels (the 1/255 folded into its stem) like float
pixels / 255. Odd sizes throughout. Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import cuda_or_skip
from pixel_cases import edge_values, host_to_uint8, pixel_array
from torch_reference import rel_l2

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]
_BACKENDS: dict = {}


def backend(dtype):
    cuda_or_skip()
    from convkernels import get_backend

    if dtype not in _BACKENDS:
        _BACKENDS[dtype] = get_backend("cuda", dtype=dtype)
    return _BACKENDS[dtype]


def spy_transfers(be):
    """Wrap be.to_host_async: every call also starts a float32 copy of the same device array
    (the values the uint8 ones must be the host formula of). Returns the list of (float
    transfer, uint8 asked); `del be.to_host_async` undoes it."""
    seen = []
    inner = be.to_host_async

    def spy(x, clip=None, *, uint8=False):
        seen.append((inner(x), uint8))
        return inner(x, clip, uint8=uint8)

    be.to_host_async = spy
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 37, 29, 3), (2, 3, 19, 11, 3), (5,), (0, 4, 3)])
def test_to_u8_is_the_host_formula_of_the_widened_values(dtype, shape):
    be = backend(dtype)
    x = be.asarray(pixel_array(np.random.default_rng(), shape))
    wide = be.to_host_async(x).result().copy()  # float32, widened on the device
    pending = be.to_host_async(x, uint8=True)
    x[...] = 0  # the kernel's output is a fresh array: overwriting x afterwards changes nothing
    got = pending.result()
    assert got.dtype == np.uint8 and got.shape == tuple(shape)
    np.testing.assert_array_equal(got, host_to_uint8(wide))
    assert pending.result() is got


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_u8_edges_nan_views_and_float64(dtype):
    be = backend(dtype)
    cp = be.cp
    # the edge values themselves, as exactly as the dtype holds them
    e = be.asarray(edge_values())
    np.testing.assert_array_equal(be.to_host_async(e, uint8=True).result(),
                                  host_to_uint8(be.to_host_async(e).result()))
    # NaN -> 0; clip is implied and ignored
    n = be.asarray(np.array([np.nan, 0.5, -np.nan, 3.0, -2.0], np.float32))
    assert be.to_host_async(n, (0.6, 0.7), uint8=True).result().tolist() == [0, 128, 0, 255, 0]
    # a strided view of a larger array (made contiguous first)
    big = be.asarray(pixel_array(np.random.default_rng(), (2, 13, 17, 3)))
    view = big[:, ::2, 1::3]
    np.testing.assert_array_equal(be.to_host_async(view, uint8=True).result(),
                                  host_to_uint8(be.to_host_async(view).result()))
    # float64 device arrays: cast to float32, then the float32 kernel
    x64 = pixel_array(np.random.default_rng(), (3, 7, 11)).astype(np.float64)
    x64[0, 0, :4] = [(0.5 + 3) / 255, 0.25, np.nextafter(np.float32(1), 2), -1e-300]
    got = be.to_host_async(cp.asarray(x64), uint8=True).result()
    np.testing.assert_array_equal(got, host_to_uint8(x64.astype(np.float32)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_asarray_widens_uint8_on_the_device(dtype):
    be = backend(dtype)
    u = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)[:, ::-1, 3:]  # a strided host view
    d = be.asarray(u)
    assert be.dtype_of(d) == dtype and d.shape == u.shape
    np.testing.assert_array_equal(be.to_host(d), u.astype(np.float32))
    assert be.dtype_of(be.asarray(u, "float32")) == "float32"
    with pytest.raises(ValueError, match="floating or uint8"):
        be.asarray(np.zeros(3, np.int32))


@pytest.mark.parametrize("dtype,lat", [("float16", (1, 4, 17, 23)), ("bfloat16", (2, 4, 13, 9)),
                                       ("float32", (1, 4, 11, 15))])
def test_sd_vae_uint8_decode(dtype, lat):
    """sd-vae (random init, SD's architecture): decode(uint8=True) asks the backend for uint8 and
    gets the host formula of the very device output (eager, then captured and replayed); against
    a second float decode it differs by at most one step (GroupNorm's statistics are summed with
    atomics, so two runs may differ in the last bit)."""
    from models import load_model

    be = backend(dtype)
    model = load_model("vae", "sd-vae", be)
    rng = np.random.default_rng()
    for call in ("eager", "graph"):
        latents = (rng.standard_normal(lat) * 2).astype(np.float32)
        seen = spy_transfers(be)
        try:
            ours = model.decode(latents, tiled=False, uint8=True)
        finally:
            del be.to_host_async
        assert ours.dtype == np.uint8 and ours.shape == (lat[0], lat[2] * 8, lat[3] * 8, 3)
        assert [asked for _, asked in seen] == [True], call
        np.testing.assert_array_equal(ours, host_to_uint8(seen[0][0].result()))
        again = host_to_uint8(model.decode(latents, tiled=False))
        assert np.abs(ours.astype(int) - again).max() <= 1 and (ours != again).mean() < 1e-3, call
        assert len(np.unique(ours)) > 64, "flat output: the check would prove little"
    stats = model._decode_device.stats()  # 4 calls: eager, captured (and replayed), 2 replays
    assert stats["ungraphable"] == {} and stats["captures"] == 1 and stats["replays"] == 3, stats
    # tiled: blended in float32 on the host, converted there (no uint8 transfer)
    model.tiling = model.smaller_tiling(model.tiling)
    latents = rng.standard_normal((1, 4, model.tiling.tile_px // model.spatial_factor + 9, 33)).astype(np.float32)
    seen = spy_transfers(be)
    try:
        ours = model.decode(latents, tiled=True, uint8=True)
    finally:
        del be.to_host_async
    assert len(seen) > 1 and not any(asked for _, asked in seen)
    assert ours.dtype == np.uint8 and ours.shape == (1, latents.shape[2] * 8, 264, 3)
    again = host_to_uint8(model.decode(latents, tiled=True))
    assert np.abs(ours.astype(int) - again).max() <= 1 and (ours != again).mean() < 1e-3


@pytest.mark.parametrize("preset,size,dtype", [("tiny-convnext", 97, "float16"), ("tiny-convnext", 65, "float32"),
                                               ("convnext-tiny", 225, "float16"), ("convnext-tiny", 97, "bfloat16")])
def test_convnext_uint8_encode(preset, size, dtype):
    """uint8 pixels cross as bytes (asarray sees uint8 where the stem folds the normalisation, not
    in bfloat16) and encode as close to the float32 CPU reference of pixels / 255 as the float
    route on the GPU does; the uint8 forward is captured and replayed like the float one."""
    from convkernels import get_backend
    from models import load_model

    be = backend(dtype)
    model = load_model("enc", preset, be)
    ref_model = load_model("enc", preset, get_backend("numpy"))
    rng = np.random.default_rng()
    for call in ("eager", "graph"):
        u8 = rng.integers(0, 256, (3, size, size + 2, 3), dtype=np.uint8)
        f = u8.astype(np.float32) / np.float32(255.0)
        seen = []
        inner = be.asarray
        be.asarray = lambda host, dtype=None: seen.append(np.asarray(host).dtype) or inner(host, dtype)
        try:
            ours = model.encode(u8)
        finally:
            del be.asarray
        assert seen == [np.float32 if dtype == "bfloat16" else np.uint8], (call, seen)
        floats, ref = model.encode(f), ref_model.encode(f)
        for name in ("embedding", "logits"):
            assert ours[name].dtype == np.float32 and ours[name].shape == ref[name].shape
            err, err_float = rel_l2(ours[name], ref[name]), rel_l2(floats[name], ref[name])
            bound = 2 * err_float + (1e-5 if dtype == "float32" else 1e-3)
            assert err < bound, f"{preset} {dtype} {call} {name}: uint8 {err:.2e}, float {err_float:.2e}"
    if dtype != "bfloat16":
        stats = model._encode_device_uint8.stats()
        assert stats["ungraphable"] == {} and stats["captures"] == 1 and stats["replays"] == 1, stats
