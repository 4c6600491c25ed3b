"""8-bit pixels across the backend boundary: to_host_async(x, uint8=True) is the service's
to_uint8 of the float32 array the same backend would hand back, bit for bit (numpy, and MLX on
its CPU device where installed); asarray takes uint8 (0..255) and widens it exactly."""
from __future__ import annotations

import numpy as np
import pytest

from pixel_cases import edge_values, host_to_uint8, pixel_array

from convkernels import BackendBase, get_backend, pixels_to_uint8


def backends():
    out = [("numpy", "float32")]
    try:
        import mlx.core  # noqa: F401
        get_backend("mlx")
    except Exception:  # not installed, or unusable here
        return out
    return out + [("mlx", dt) for dt in ("float32", "float16", "bfloat16")]


def test_the_copied_host_formula_is_the_services():
    codecs = pytest.importorskip("service.codecs")
    x = pixel_array(np.random.default_rng(), (3, 41, 37, 3))
    np.testing.assert_array_equal(host_to_uint8(x), codecs.to_uint8(x))


def test_pixels_to_uint8_is_the_host_formula_and_the_edges_discriminate():
    x = edge_values()
    ours = pixels_to_uint8(x)
    assert ours.dtype == np.uint8 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, host_to_uint8(x))
    # the edge values tell the float32 formula from near misses, so a test on them can fail
    clipped = np.clip(x.astype(np.float64), 0, 1)
    assert (np.floor(clipped * 255 + 0.5).astype(np.uint8) != ours).sum() >= 100  # float64 arithmetic
    assert (np.rint(clipped * 255).astype(np.uint8) != ours).sum() >= 100  # round half to even
    assert ours[x < 0].max() == 0 and ours[x > 1].min() == 255
    assert pixels_to_uint8(np.array([np.nan, -np.nan], np.float32)).tolist() == [0, 0]
    # other float dtypes are taken as their float32 values
    h = x.astype(np.float16)
    np.testing.assert_array_equal(pixels_to_uint8(h), host_to_uint8(h.astype(np.float32)))


@pytest.mark.parametrize("name,dtype", backends())
@pytest.mark.parametrize("shape", [(1, 37, 29, 3), (2, 3, 19, 11, 3), (7,)])
def test_to_host_async_uint8_matches_to_uint8_of_the_float_copy(name, dtype, shape):
    be = get_backend(name, dtype=dtype)
    rng = np.random.default_rng()
    x = be.asarray(pixel_array(rng, shape))
    wide = be.to_host_async(x).result()
    assert wide.dtype == np.float32
    got = be.to_host_async(x, uint8=True).result()
    assert got.dtype == np.uint8 and got.shape == tuple(shape)
    np.testing.assert_array_equal(got, host_to_uint8(wide))
    # clip is implied (and ignored) with uint8
    np.testing.assert_array_equal(be.to_host_async(x, (0.25, 0.5), uint8=True).result(), got)


@pytest.mark.parametrize("name,dtype", backends())
def test_nan_becomes_zero(name, dtype):
    be = get_backend(name, dtype=dtype)
    x = be.asarray(np.array([np.nan, 0.5, np.nan, 2.0], np.float32))
    assert be.to_host_async(x, uint8=True).result().tolist() == [0, 128, 0, 255]


@pytest.mark.parametrize("name,dtype", backends())
def test_asarray_takes_uint8_pixels_exactly(name, dtype):
    be = get_backend(name, dtype=dtype)
    u = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)[:, ::-1]  # not contiguous
    d = be.asarray(u)
    assert be.dtype_of(d) == dtype
    np.testing.assert_array_equal(be.to_host(d), u.astype(np.float32))
    assert be.dtype_of(be.asarray(u, dtype="float32")) == "float32"
    with pytest.raises(ValueError, match="floating or uint8"):
        be.asarray(np.zeros((2, 3), np.int16))
    with pytest.raises(ValueError, match="floating or uint8"):
        be.asarray(np.zeros((2, 3), np.uint16))


def test_the_base_class_generic_route():
    """A host array handed to the base class's to_host_async (what a backend without its own
    conversion inherits)."""
    be = get_backend("numpy")
    x = pixel_array(np.random.default_rng(), (2, 9, 13, 3))
    got = BackendBase.to_host_async(be, x, uint8=True).result()
    np.testing.assert_array_equal(got, host_to_uint8(x))
    np.testing.assert_array_equal(BackendBase.to_host_async(be, x, (0.0, 1.0)).result(), np.clip(x, 0, 1))
