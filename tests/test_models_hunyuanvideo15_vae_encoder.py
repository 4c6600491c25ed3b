"""HunyuanVideo 1.5 VAE encoder (diffusers AutoencoderKLHunyuanVideo15.encode + the image-to-video
pipeline's _get_image_latents: the posterior's mode * scaling_factor) on the NumPy backend and on MLX's
CPU device vs diffusers itself, same random weights in every parameter, through load_model: odd
latent sizes, 1, 5 and 9 frames, batches compared per sample (diffusers' own encode fails for a batch
of 2, as its decode does), a guard that a missing scaling fails; strict loading of the encoder,
a decoder-only checkpoint, and the refused frame counts and sides."""
from __future__ import annotations

import numpy as np
import pytest

from convkernels import get_backend
from models import WeightsError, load_model

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
from test_models_hunyuanvideo15_vae import C, PRESET, TINY, _folder, backend_named, make_vae  # noqa: E402
from torch_reference import assert_latents_informative, fresh_seed, rel_l2  # noqa: E402

TOL = 1e-4


def pipeline_encode(vae, video01: np.ndarray, *, scale: bool = True) -> np.ndarray:
    """HunyuanVideo15ImageToVideoPipeline._get_image_latents for frames N,F,H,W,3 in [0, 1], one
    sample at a time: x * 2 - 1 (the image processor), vae.encode, the posterior's mode (argmax), *
    scaling_factor -> N,C,T,h,w. scale=False: the guard's broken twin."""
    outs = []
    with torch.no_grad():
        for sample in np.split(video01, video01.shape[0]):
            x = torch.from_numpy(np.ascontiguousarray(sample)).permute(0, 4, 1, 2, 3) * 2 - 1
            mode = vae.encode(x).latent_dist.mode()
            outs.append(mode * vae.config.scaling_factor if scale else mode)
    return torch.cat(outs).numpy()


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    seed = fresh_seed()
    # a scaling factor far from one, so that an encode that skipped it is far from the reference
    vae = make_vae({**TINY, "scaling_factor": 0.55}, seed)
    folder = tmp_path_factory.mktemp("hunyuanvideo15_enc")
    vae.save_pretrained(folder)
    return vae, str(folder), seed


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_encode_matches_the_pipeline(tiny_vae, backend_name):
    vae, folder, seed = tiny_vae
    model = load_model("h", PRESET, backend_named(backend_name), weights=folder)
    assert model.has_encoder and model.card()["has_encoder"] is True and "encode" in model.card()
    rng = np.random.default_rng(seed)
    # latent sides 3x5, 1x3, 2x1 (odd), 1, 5 and 9 frames (every chunk kind: the lone first frame,
    # then 4 frames through both temporal downsamplers), a batch of 2
    for n, f, h, w in [(2, 5, 24, 40), (1, 1, 8, 24), (1, 9, 16, 8)]:
        video = rng.random((n, f, h, w, 3), dtype=np.float32)
        ours, ref = model.encode(video), pipeline_encode(vae, video)
        assert ours.shape == (n, C, 1 + (f - 1) // 4, h // 8, w // 8) and ours.dtype == np.float32
        assert_latents_informative(ref, f"seed {seed}")
        err = rel_l2(ours, ref)
        print(f"{backend_name} encode {(n, f, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{backend_name} {(n, f, h, w)} seed {seed}: rel L2 {err:.2e}"
        unscaled = rel_l2(ours, pipeline_encode(vae, video, scale=False))
        assert unscaled > 100 * TOL, f"dropping the scaling changes nothing (rel L2 {unscaled:.2e})"


def test_diffusers_own_encode_fails_for_a_batch_of_two(tiny_vae):
    """Why the references encode per sample (the mid-block attention's mask, as in decode). Should
    diffusers fix it, this says so."""
    vae, _, _ = tiny_vae
    with torch.no_grad(), pytest.raises(RuntimeError):
        vae.encode(torch.zeros(2, 3, 1, 8, 8))


def test_encoder_strict_loading_and_a_decoder_only_checkpoint(tiny_vae, tmp_path):
    vae, folder, _ = tiny_vae
    config = __import__("json").loads(open(f"{folder}/config.json").read())
    sd = vae.state_dict()
    gone = "encoder.down_blocks.1.downsamplers.0.conv.conv.weight"
    with pytest.raises(WeightsError, match=rf"encoder.*missing \(1\): {gone.replace('.', '[.]')}"):
        load_model("h", PRESET, get_backend("numpy"),
                   weights=_folder(tmp_path, "miss", {k: v for k, v in sd.items() if k != gone}, config))
    bent = "encoder.mid_block.attentions.0.to_v.weight"
    with pytest.raises(WeightsError, match=bent.replace(".", "[.]")):
        load_model("h", PRESET, get_backend("numpy"),
                   weights=_folder(tmp_path, "shape", {**sd, bent: torch.zeros(64, 64, 1, 1)}, config))
    decoder_only = {k: v for k, v in sd.items() if k.startswith("decoder.")}
    model = load_model("h", PRESET, get_backend("numpy"), weights=_folder(tmp_path, "dec", decoder_only, config))
    assert not model.has_encoder and model.card()["has_encoder"] is False
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 1, 8, 8, 3), np.float32))


def test_refused_frame_counts_and_sides(tiny_vae):
    _, folder, _ = tiny_vae
    model = load_model("h", PRESET, get_backend("numpy"), weights=folder)
    for shape, what in [((1, 4, 8, 8, 3), r"1 \+ 4k"), ((1, 2, 8, 8, 3), r"1 \+ 4k"),
                        ((1, 1, 12, 8, 3), "multiples of 8"), ((1, 1, 8, 8, 4), r"\(N, F, H, W, 3\)")]:
        with pytest.raises(ValueError, match=what):
            model.encode(np.zeros(shape, np.float32))


def test_random_init_has_an_encoder():
    model = load_model("h", PRESET, get_backend("numpy"))
    out = model.encode(np.random.default_rng(0).random((1, 5, 16, 16, 3), dtype=np.float32))
    assert out.shape == (1, C, 2, 2, 2) and np.isfinite(out).all() and out.std() > 0
