"""The MP4 answers' entropy coder (MP4_CABAC): CABAC by default, CAVLC when asked, or with `auto` at
high quality only, read back from what real x264 wrote. x264 writes its whole configuration into the
stream (an SEI message: "... options: cabac=0 ref=1 ..."), so the test reads the choice from the
encoder's own bytes, not from the options we passed."""
from __future__ import annotations

import io

import numpy as np
import pytest

from service.codecs.video import CAVLC_MAX_CRF, crf_for_quality, x264_options

av = pytest.importorskip("av")


def cabac_in(data: bytes) -> int:
    """x264's cabac=N from its SEI in `data` (asserts there is exactly one setting written)."""
    found = {flag for flag in (0, 1) if f"cabac={flag} ".encode() in data}
    assert len(found) == 1, f"x264's settings name cabac {found or 'nowhere'}"
    return found.pop()


def clip01(frames: int = 5, h: int = 46, w: int = 62) -> np.ndarray:
    """A moving pattern with some noise, [0,1] float32 F,H,W,3."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(3)
    rgb = np.stack([np.stack([(x * 3 + t * 5) % 256, (y * 4 + t) % 256, (x + y + 2 * t) % 256], -1)
                    for t in range(frames)]).astype(np.float32)
    return np.clip(rgb + rng.normal(0, 6, rgb.shape), 0, 255).astype(np.float32) / 255


def test_options_choose_cavlc_only_for_x264_at_high_quality_or_when_told():
    assert crf_for_quality(90) == 5 <= CAVLC_MAX_CRF < crf_for_quality(70)
    assert "x264-params" not in x264_options("libx264", 5, "veryfast", 4)  # the default: CABAC, as always
    assert x264_options("libx264", 5, "veryfast", 4, "auto")["x264-params"] == "cabac=0"
    assert x264_options("libx264", CAVLC_MAX_CRF, "veryfast", 0, "auto")["x264-params"] == "cabac=0"
    assert "x264-params" not in x264_options("libx264", CAVLC_MAX_CRF + 1, "veryfast", 0, "auto")
    assert "x264-params" not in x264_options("libx264", 5, "veryfast", 0, "on")
    assert x264_options("libx264", 30, "veryfast", 0, "off")["x264-params"] == "cabac=0"
    assert "x264-params" not in x264_options("h264", 5, "veryfast", 0, "off")  # another encoder: not x264's option
    assert x264_options("libx264", 20, "fast", 3) == {"crf": "20", "preset": "fast", "threads": "3"}
    assert "threads" not in x264_options("libx264", 20, "fast", 0)
    with pytest.raises(ValueError, match="auto, on or off"):
        x264_options("libx264", 5, "veryfast", 0, "maybe")


@pytest.mark.parametrize("quality, cabac, expected", [(90, "auto", 0), (50, "auto", 1), (90, "on", 1), (50, "off", 0)])
def test_the_fragmented_writer_encodes_with_the_chosen_coder_and_plays(quality, cabac, expected):
    from service.codecs.fmp4 import FragmentedMP4Writer

    if "libx264" not in av.codecs_available:
        pytest.skip("this PyAV's FFmpeg has no libx264")
    clip = clip01()
    writer = FragmentedMP4Writer(62, 46, 8.0, quality, threads=2, encoders=2, cabac=cabac)
    data = b"".join(writer.add_group(clip[a:b], last=b == 5) for a, b in ((0, 1), (1, 5)))
    assert cabac_in(data) == expected
    with av.open(io.BytesIO(data)) as container:
        got = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.float64)
    err = np.abs(got - clip * 255).mean()
    assert got.shape == (5, 46, 62, 3) and err < (4 if quality == 90 else 12), err


@pytest.mark.parametrize("quality, cabac, expected", [(90, "auto", 0), (40, "auto", 1), (90, "on", 1)])
def test_whole_files_follow_the_same_rule(quality, cabac, expected):
    from service.codecs.video import encode_videos, read_mp4_frames

    if "libx264" not in av.codecs_available:
        pytest.skip("this PyAV's FFmpeg has no libx264")
    data, media = encode_videos(clip01()[None], 8.0, quality, cabac=cabac)
    assert media == "video/mp4" and cabac_in(data) == expected
    assert read_mp4_frames(data).shape == (5, 46, 62, 3)


def test_the_setting_is_a_closed_choice_and_reaches_the_streamed_writer():
    from pydantic import ValidationError

    from service.frontend.group_encoders import mp4_fragments
    from service.settings import Settings

    assert Settings().mp4_cabac == "on"  # files as they always were, unless asked
    with pytest.raises(ValidationError):
        Settings(mp4_cabac="yes")
    if "libx264" not in av.codecs_available:
        pytest.skip("this PyAV's FFmpeg has no libx264")
    clip = clip01(frames=1)
    for setting, expected in (("on", 1), ("auto", 0), (None, 1)):
        settings = Settings(mp4_threads=1) if setting is None else Settings(mp4_cabac=setting, mp4_threads=1)
        encoder = mp4_fragments((1, 1, 46, 62, 3), 8.0, 90, settings)
        assert cabac_in(encoder.job(clip[None], True)()) == expected
