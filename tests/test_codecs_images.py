"""Image outputs: the NumPy+zlib PNG writer is lossless and readable by PIL (every shape, several
IDAT chunks, views that are not C-contiguous, RGBA); JPEG and WebP stay decodable at the new defaults."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from service.codecs import images


def _decode(data: bytes) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    img.load()
    return np.asarray(img)


def _smooth(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), (x + y) % 256], axis=-1)
    return img.astype(np.uint8)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (3, 5), (64, 48), (129, 257)])
def test_png_bytes_is_lossless(shape):
    rng = np.random.default_rng(sum(shape))
    for img in (rng.integers(0, 256, (*shape, 3), dtype=np.uint8), _smooth(*shape)):
        data = images.png_bytes(img)
        back = Image.open(io.BytesIO(data))
        assert back.format == "PNG" and back.mode == "RGB" and back.size == (shape[1], shape[0])
        np.testing.assert_array_equal(_decode(data), img)


@pytest.mark.parametrize("fmt", ["png", "webp"])
def test_rgba_images_keep_their_alpha(fmt):
    """An alpha decoder's RGBA (the Qwen-Image 2.1 VAE): PNG (the fast writer, colour type 6) is
    lossless; WebP keeps alpha exactly, its RGB lossy."""
    rng = np.random.default_rng(4)
    img = np.concatenate([_smooth(33, 17), rng.integers(0, 256, (33, 17, 1), dtype=np.uint8)], axis=-1)
    data = images.image_bytes(img, fmt, 90)
    back = Image.open(io.BytesIO(data))
    assert back.mode == "RGBA" and back.size == (17, 33)
    np.testing.assert_array_equal(_decode(data)[..., 3], img[..., 3])
    if fmt == "png":
        assert data == images.png_bytes(img)
        np.testing.assert_array_equal(_decode(data), img)


def test_png_bytes_matches_pil_pixels_and_size_on_noisy_images():
    # a decoded image is never exactly smooth: a gradient plus mild noise
    img = np.clip(_smooth(256, 256) + np.random.default_rng(0).normal(0, 2, (256, 256, 3)), 0, 255).astype(np.uint8)
    ours = images.png_bytes(img)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=1)
    np.testing.assert_array_equal(_decode(ours), _decode(buf.getvalue()))
    assert len(ours) <= 1.05 * len(buf.getvalue())


def test_png_bytes_on_exact_gradients_stays_below_raw():
    # Z_RLE finds no period-3 repeats: an exact synthetic gradient is far larger than PIL's (the
    # documented trade-off), still well below the raw pixels; the default strategy matches PIL
    img = _smooth(256, 256)
    assert len(images.png_bytes(img)) < img.nbytes / 4
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=1)
    assert len(images.png_bytes(img, strategy=0)) < 2 * len(buf.getvalue())


def test_png_bytes_takes_views_that_are_not_contiguous():
    img = np.random.default_rng(1).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    view = img.transpose(1, 0, 2)[::-1]
    np.testing.assert_array_equal(_decode(images.png_bytes(view)), view)


def test_png_bytes_splits_idat(monkeypatch):
    monkeypatch.setattr(images, "_IDAT_MAX", 100)
    img = np.random.default_rng(2).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    data = images.png_bytes(img)
    assert data.count(b"IDAT") > 10
    np.testing.assert_array_equal(_decode(data), img)


def test_image_bytes_png_uses_the_fast_writer_and_falls_back_to_pil():
    img = _smooth(32, 48)
    assert images.image_bytes(img, "png", 90) == images.png_bytes(img)
    np.testing.assert_array_equal(images.open_image(images.image_bytes(img, "png", 90), 10**6), img)
    gray = img[..., 0]  # not H,W,3: PIL's writer, as before (it raises for mode RGB)
    with pytest.raises((ValueError, TypeError)):
        images.image_bytes(gray, "png", 90)


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_lossy_defaults_decode_close(fmt):
    img = _smooth(64, 96)
    data = images.image_bytes(img, fmt, 90)
    back = images.open_image(data, 10**6)
    assert back.shape == img.shape
    mse = np.mean((back.astype(np.float64) - img) ** 2)
    assert 10 * np.log10(255 ** 2 / max(mse, 1e-12)) > 30
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=images.IMAGE_FORMATS[fmt][0], quality=90)
    assert abs(len(data) - len(buf.getvalue())) <= 0.5 * len(buf.getvalue())


def test_encode_images_zip_of_pngs_is_lossless():
    import zipfile
    imgs = np.random.default_rng(3).random((2, 16, 24, 3), dtype=np.float32)
    data, media = images.encode_images(imgs, "png", 90)
    assert media == images.ZIP_MEDIA
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for i, name in enumerate(sorted(zf.namelist())):
            np.testing.assert_array_equal(_decode(zf.read(name)), images.to_uint8(imgs[i]))


@pytest.mark.parametrize("mode,fmt", [("RGB", "JPEG"), ("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "PNG"),
                                      ("RGBA", "PNG"), ("P", "PNG"), ("L", "WEBP")])
def test_open_image_gives_rgb_in_every_mode(mode, fmt):
    """Whatever mode the body holds, the pixels come back H,W,3 uint8 as PIL's convert('RGB')
    makes them (an RGB image is taken as it is, every other mode converted)."""
    src = Image.fromarray(np.random.default_rng(3).integers(0, 256, (13, 21, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    src.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    got = images.open_image(buf.getvalue(), 10_000)
    want = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert got.shape == (13, 21, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)
