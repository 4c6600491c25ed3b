"""A video decoder's latents prepared frame by frame (models/wan_vae/latents.py): each slice is
the de-normalised, channels-last clip's slice, computed here independently with NumPy; bad
latents (anywhere in the clip, or overflowing only once de-normalised) fail before any slice."""
from __future__ import annotations

import numpy as np
import pytest

from convkernels import get_backend
from models.wan_vae.latents import PreparedLatents
from models.wan_vae import build

STD = np.array([1.5, 0.8, 1.2, 2.0], np.float32).reshape(1, 4, 1, 1, 1)
MEAN = np.array([0.1, -0.2, 0.05, 0.3], np.float32).reshape(1, 4, 1, 1, 1)


def denormalise(x):
    return x * STD + MEAN


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_slices_are_the_whole_clips_slices(dtype):
    lat = np.random.default_rng(3).standard_normal((2, 4, 5, 7, 3)).astype(dtype)
    whole = (lat.astype(np.float32) * STD + MEAN).transpose(0, 2, 3, 4, 1)
    z = PreparedLatents(lat, denormalise, "m")
    assert z.shape == whole.shape == (2, 5, 7, 3, 4)
    for key in [(slice(None), slice(0, 1)), (slice(None), slice(1, 3)), (slice(None), slice(3, 9)),
                (slice(None), slice(2, 3), slice(1, 6), slice(0, 2))]:
        got = z[key]
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, whole[key])


@pytest.mark.parametrize("where, value", [((0, 2, 4, 6, 2), np.nan), ((1, 0, 0, 0, 0), np.inf),
                                          ((1, 3, 4, 0, 1), -np.inf),
                                          # finite, but not once multiplied by channel 3's std of 2
                                          ((0, 3, 1, 2, 0), 3.0e38)])
def test_bad_latents_anywhere_fail_up_front(where, value):
    lat = np.zeros((2, 4, 5, 7, 3), np.float32)
    lat[where] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        PreparedLatents(lat, denormalise, "m")


def test_large_latents_that_stay_finite_pass():
    lat = np.zeros((1, 4, 2, 2, 2), np.float32)
    lat[0, 1, 1, 1, 1] = 3.0e38  # channel 1's std is 0.8: still finite
    assert np.isfinite(PreparedLatents(lat, denormalise, "m")[:, 1:2]).all()


def test_integer_latents_are_refused():
    with pytest.raises(ValueError, match="floating point"):
        PreparedLatents(np.zeros((1, 4, 1, 2, 2), np.int32), denormalise, "m")


def test_a_bad_last_frame_fails_the_decode_before_its_first_group():
    model = build("tiny", "tiny-wan-vae", get_backend("numpy"), None)
    lat = np.zeros((1, model.latent_channels, 3, 2, 2), np.float32)
    lat[0, 0, 2, 1, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        model.decode_frames(lat)
