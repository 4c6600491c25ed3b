"""The LTX-2 video VAE's encoder (diffusers LTX2VideoEncoder3d) on the NumPy backend and on MLX's CPU
device vs diffusers' AutoencoderKLLTX2Video.encode + the LTX-2 image-to-video pipeline's own
retrieve_latents("argmax") and _normalize_latents, same random weights and latent statistics,
through the public load_model path: odd latent sizes, a batch of 2, a single frame (what the
image-to-video pipeline encodes) and clips; the refusals (frame count, sides, dtype, NaN), strict
loading of the encoder half, and an encoder config diffusers' class builds differently refused."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from convkernels import get_backend
from models import ModelConfigError, WeightsError, load_model

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
import test_models_ltx2_vae as ref  # noqa: E402
from test_models_ltx2_vae import _folder, backend_named  # noqa: E402
from torch_reference import assert_latents_informative, fresh_seed, rel_l2  # noqa: E402

TOL = ref.TOL


def pipeline_encode(vae, video01: np.ndarray, normalise: bool = True) -> np.ndarray:
    """LTX2ImageToVideoPipeline.prepare_latents' encode of frames N,F,H,W,3 in [0, 1] (its video
    processor's x * 2 - 1, vae.encode, retrieve_latents "argmax", _normalize_latents as it calls it)
    -> N,C,T,h,w. normalise=False: the vacuity guard's broken twin (the bare posterior mean)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import LTX2ImageToVideoPipeline, retrieve_latents

    x = torch.from_numpy(np.ascontiguousarray(video01, np.float32)).permute(0, 4, 1, 2, 3) * 2.0 - 1.0
    with torch.no_grad():
        mean = retrieve_latents(vae.encode(x), None, "argmax")
        if normalise:
            mean = LTX2ImageToVideoPipeline._normalize_latents(mean, vae.latents_mean, vae.latents_std)
    return mean.numpy()


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    seed = fresh_seed()
    vae = ref.make_vae(ref.TINY, seed)
    folder = tmp_path_factory.mktemp("ltx2_enc")
    vae.save_pretrained(folder)
    return vae, str(folder), seed


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_encode_matches_the_pipeline(tiny_vae, backend_name):
    vae, folder, seed = tiny_vae
    model = load_model("l", "tiny-ltx2-vae", backend_named(backend_name), weights=folder)
    assert model.has_encoder and model.card()["has_encoder"] and "latents_std" in model.card()["encode"]
    rng = np.random.default_rng(seed)
    # a batch of 2 of 9-frame clips at 3x2 latents; one frame (image-to-video's encode) at 1x5; 17 frames
    for n, f, h, w in [(2, 9, 96, 64), (1, 1, 32, 160), (1, 17, 64, 32)]:
        video = rng.random((n, f, h, w, 3), dtype=np.float32)
        ours, want = model.encode(video), pipeline_encode(vae, video)
        assert ours.shape == want.shape == (n, 8, 1 + (f - 1) // 8, h // 32, w // 32) and ours.dtype == np.float32
        assert_latents_informative(want, f"seed {seed}")
        err = rel_l2(ours, want)
        print(f"{backend_name} encode {(n, f, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{backend_name} {(n, f, h, w)} seed {seed}: rel L2 {err:.2e}"
        broken = rel_l2(ours, pipeline_encode(vae, video, normalise=False))
        assert broken > 100 * TOL, f"dropping the normalisation changes nothing (rel L2 {broken:.2e})"


def test_bad_clips_are_refused(tiny_vae):
    _, folder, _ = tiny_vae
    model = load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=folder)
    for shape, dtype, what in [((1, 4, 32, 32, 3), np.float32, r"1 \+ 8k"), ((1, 2, 32, 32, 3), np.float32, r"1 \+ 8k"),
                               ((1, 1, 48, 32, 3), np.float32, "multiples of 32"),
                               ((1, 1, 32, 32, 4), np.float32, r"\(N, F, H, W, 3\)"),
                               ((1, 1, 32, 32, 3), np.uint8, "floating point")]:
        with pytest.raises(ValueError, match=what):
            model.encode(np.zeros(shape, dtype))
    with pytest.raises(ValueError, match="NaN"):
        model.encode(np.full((1, 1, 32, 32, 3), np.nan, np.float32))


def test_strict_loading_of_the_encoder(tiny_vae, tmp_path):
    vae, folder, seed = tiny_vae
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    sd = vae.state_dict()
    # a decoder-only checkpoint decodes and has no encoder
    decoder_only = {k: v for k, v in sd.items() if not k.startswith("encoder.")}
    model = load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=_folder(tmp_path, "dec", decoder_only, config))
    assert not model.has_encoder and not model.card()["has_encoder"] and "encode" not in model.card()
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 1, 32, 32, 3), np.float32))
    # a partial encoder is named, as is a mis-shaped tensor
    name = "encoder.down_blocks.2.downsamplers.0.conv.conv.weight"
    missing = {k: v for k, v in sd.items() if k != name}
    with pytest.raises(WeightsError, match=rf"encoder.*missing \(1\): {name.replace('.', '[.]')}"):
        load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=_folder(tmp_path, "miss", missing, config))
    bad = {**sd, "encoder.conv_out.conv.weight": torch.zeros(8, 64, 3, 3, 3)}  # 8 rows: the log-variance's lost
    with pytest.raises(WeightsError, match=r"encoder\.conv_out\.conv\.weight"):
        load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=_folder(tmp_path, "shape", bad, config))
    # the strided-conv downsampler diffusers also builds is not offered: refused, not run differently
    conv = {**config, "downsample_type": ["conv", "temporal", "spatiotemporal", "spatiotemporal"]}
    with pytest.raises(ModelConfigError, match="downsample_type"):
        load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=_folder(tmp_path, "conv", sd, conv))


def test_random_init_has_an_encoder():
    model = load_model("l", "tiny-ltx2-vae", get_backend("numpy"))
    assert model.has_encoder
    out = model.encode(np.random.default_rng(0).random((1, 9, 64, 64, 3), dtype=np.float32))
    assert out.shape == (1, 8, 2, 2, 2) and np.isfinite(out).all()
