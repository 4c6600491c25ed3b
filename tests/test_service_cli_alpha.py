"""`convserve decode` of a decoder with alpha (the Qwen-Image 2.1 VAE, tiny config, real safetensors
weights saved by diffusers' AutoencoderKLQwenImage21 with every parameter random), locally (the model
in-process) and with --url: RGBA by default as the service answers (.npy N,H,W,4, RGBA PNG/WebP and
PNG frames, RGB JPEG), each compared with diffusers' decode (alpha on its own and the RGB part);
`--channels rgb` gives RGB; rgba asked of JPEG or of a model without alpha, and a bad value, are one
line on stderr and a non-zero exit, the server's words (service/alpha_option.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import test_models_qwen_image21_vae as ref  # noqa: E402
from reference_checks import assert_informative, fresh_seed, rel_l2  # noqa: E402
from test_service_cli import fails_in_one_line, invoke  # noqa: E402

C = ref.TINY["z_dim"]
F = 16
PRESET = "tiny-qwen-image2.1-vae"
JPEG_REFUSAL = "JPEG holds no alpha"


class Reference:
    def __init__(self, folder: str, vae, config: dict, lat_path, lat: np.ndarray):
        self.folder, self.vae, self.config, self.lat_path = folder, vae, config, lat_path
        self.rgba = ref.reference_decode(vae, config, lat)  # the pipeline's N,H,W,4 in [0, 1]
        assert self.rgba.shape == (*lat.shape[:1], lat.shape[2] * F, lat.shape[3] * F, 4)
        assert_informative(self.rgba[..., 3], "the reference's alpha")
        assert_informative(self.rgba[..., :3], "the reference's RGB")

    def decode(self, output, *flags) -> None:
        invoke("decode", self.lat_path, "-o", output, "--preset", PRESET, "--weights", self.folder,
               "--backend", "numpy", *flags)

    def uint8(self) -> np.ndarray:
        return np.round(np.clip(self.rgba, 0, 1) * 255).astype(np.int16)


@pytest.fixture(scope="module")
def q21(tmp_path_factory):
    seed = fresh_seed()
    print(f"seed {seed}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: an oversubscribed pool runs diffusers' small ops far slower
    folder = tmp_path_factory.mktemp("q21")
    vae, path, config = ref.make_reference(folder / "vae", ref.TINY, seed)
    assert (folder / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    lat = np.random.default_rng(seed).standard_normal((2, C, 3, 4)).astype(np.float32)
    np.save(folder / "lat.npy", lat)
    yield Reference(path, vae, config, folder / "lat.npy", lat)
    torch.set_num_threads(threads)


def open_image(path) -> tuple[str, np.ndarray]:
    with Image.open(path) as im:
        return im.mode, np.asarray(im, np.int16)


def test_local_decode_writes_rgba_as_diffusers_decodes(q21, tmp_path):
    q21.decode(tmp_path / "out.npy")
    got = np.load(tmp_path / "out.npy")
    assert got.shape == q21.rgba.shape and got.shape[-1] == 4
    assert rel_l2(got[..., 3], q21.rgba[..., 3]) < ref.TOL  # alpha on its own, not lost in RGB's error
    assert rel_l2(got[..., :3], q21.rgba[..., :3]) < ref.TOL
    expected = q21.uint8()
    q21.decode(tmp_path / "out.png")
    q21.decode(tmp_path / "out.webp")
    for i in range(2):
        for ext in ("png", "webp"):  # WebP's alpha plane is lossless; its RGB lossy: alpha compared
            mode, px = open_image(tmp_path / f"out_{i:03d}.{ext}")
            assert mode == "RGBA" and px.shape == expected[i].shape, (ext, mode, px.shape)
            assert np.abs(px[..., 3] - expected[i, ..., 3]).max() <= 1, ext
        assert np.abs(open_image(tmp_path / f"out_{i:03d}.png")[1] - expected[i]).max() <= 1
    q21.decode(tmp_path / "frames")  # a folder: PNG frames, RGBA
    mode, px = open_image(tmp_path / "frames" / "001_frame_0000.png")
    assert mode == "RGBA" and np.abs(px - expected[1]).max() <= 1
    q21.decode(tmp_path / "out.jpg")  # JPEG holds no alpha: RGB, as the server answers it
    mode, px = open_image(tmp_path / "out_000.jpg")
    assert mode == "RGB" and px.shape == expected[0, ..., :3].shape


def test_channels_rgb_gives_rgb(q21, tmp_path):
    q21.decode(tmp_path / "rgb.npy", "--channels", "rgb")
    got = np.load(tmp_path / "rgb.npy")
    assert got.shape == (*q21.rgba.shape[:3], 3) and rel_l2(got, q21.rgba[..., :3]) < ref.TOL
    q21.decode(tmp_path / "rgb.png", "--channels", "RGB")
    mode, px = open_image(tmp_path / "rgb_000.png")
    assert mode == "RGB" and np.abs(px - q21.uint8()[0, ..., :3]).max() <= 1
    q21.decode(tmp_path / "rgba.webp", "--channels", "rgba")
    assert open_image(tmp_path / "rgba_000.webp")[0] == "RGBA"


def test_refusals_are_one_line(q21, tmp_path):
    args = ("decode", q21.lat_path, "--preset", PRESET, "--weights", q21.folder, "--backend", "numpy")
    line = fails_in_one_line(*args, "-o", tmp_path / "a.jpg", "--channels", "rgba", code=2)
    assert JPEG_REFUSAL in line and "channels=rgb" in line, line
    line = fails_in_one_line(*args, "-o", tmp_path / "a.png", "--channels", "argb", code=2)
    assert "channels must be 'rgba' or 'rgb', not 'argb'" in line, line
    rgb_only = tmp_path / "taesd.npy"
    np.save(rgb_only, np.zeros((1, 4, 2, 3), np.float32))
    line = fails_in_one_line("decode", rgb_only, "-o", tmp_path / "b.png", "--preset", "tiny-taesd", "--backend",
                             "numpy", "--channels", "rgba", code=2)
    assert "tiny-taesd decodes RGB only" in line, line
    # --shards: decided from the model class before any GPU is looked for
    line = fails_in_one_line("decode", q21.lat_path, "-o", tmp_path / "c.jpg", "--preset", PRESET, "--shards", "2",
                             "--channels", "rgba", code=2)
    assert JPEG_REFUSAL in line, line
    assert not list(tmp_path.glob("[abc]*"))  # nothing written
    # the console script itself: stderr holds the one line, no traceback
    exe = os.path.join(os.path.dirname(sys.executable), "convserve")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "service.cli"]
    r = subprocess.run([*cmd, *map(str, args), "-o", str(tmp_path / "d.jpg"), "--channels", "rgba"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.stderr.strip().splitlines() == [f"convserve: error: {line.removeprefix('convserve: error: ')}"]


def test_url_passes_channels_to_the_server(q21, server_factory, tmp_path):
    live = server_factory(models=f"q21={PRESET}:{q21.folder}", max_batch=2)
    remote = ("decode", q21.lat_path, "--url", live.url, "--model", "q21")
    invoke(*remote, "-o", tmp_path / "rgba.npy")
    got = np.load(tmp_path / "rgba.npy")
    assert got.shape == q21.rgba.shape and rel_l2(got[..., 3], q21.rgba[..., 3]) < ref.TOL
    invoke(*remote, "-o", tmp_path / "rgb.npy", "--channels", "rgb")
    got = np.load(tmp_path / "rgb.npy")
    assert got.shape == (*q21.rgba.shape[:3], 3) and rel_l2(got, q21.rgba[..., :3]) < ref.TOL
    invoke(*remote, "-o", tmp_path / "rgb.png", "--channels", "rgb")
    assert open_image(tmp_path / "rgb_000.png")[0] == "RGB"
    line = fails_in_one_line(*remote, "-o", tmp_path / "a.jpg", "--channels", "rgba", code=1)
    assert "server answered 422" in line and JPEG_REFUSAL in line, line
    line = fails_in_one_line(*remote, "-o", tmp_path / "a.npy", "--channels", "argb", code=2)
    assert "channels must be" in line, line  # refused here, before anything is sent
