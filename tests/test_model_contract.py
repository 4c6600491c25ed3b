"""The model contract the service is written against (models/contract.py): every preset family
follows its kind's Protocol; a decoder's retry-smaller answers (smaller_tiling) shrink to a floor
and each is a tiling the model decodes in (tests/test_tiled_decode.py checks accepted tilings
against diffusers); `tile_size` reaches each decoder family as its own tile settings; every family
builds through one path that refuses an unknown preset or config with one error type."""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from convkernels import get_backend
from models import ModelConfigError, ModelOptions, load_model
from models.nn import tiling
from models.registry import FAMILIES
from models.contract import (IMAGE_DECODER, IMAGE_ENCODER, VIDEO_DECODER, ImageDecoder, ImageEncoder,
                             PerChannelLatents, TiledDecoder, VideoDecoder, example_input, forward)

PROTOCOLS = {IMAGE_DECODER: ImageDecoder, VIDEO_DECODER: VideoDecoder, IMAGE_ENCODER: ImageEncoder}


@pytest.fixture(scope="module")
def backend():
    return get_backend("numpy")


@pytest.mark.parametrize("preset", ["tiny-vae", "tiny-flux-vae", "tiny-flux2-vae", "tiny-wan-vae",
                                    "tiny-wan2.2-vae", "tiny-qwen-image-vae", "tiny-convnext", "tiny-taesd",
                                    "tiny-hunyuanimage-vae", "tiny-hunyuanvideo1.5-vae", "tiny-ltx2-vae",
                                    "tiny-qwen-image2.1-vae", "tiny-dc-ae"])
def test_each_family_follows_its_kinds_protocol(backend, preset):
    model = load_model(preset, preset, backend)
    assert isinstance(model, PROTOCOLS[model.kind])
    # only decoders answer retry-smaller
    assert isinstance(model, TiledDecoder) == (model.kind != IMAGE_ENCODER)


@pytest.mark.parametrize("preset", ["tiny-vae", "tiny-flux2-vae", "tiny-wan-vae", "tiny-wan2.2-vae",
                                    "tiny-qwen-image-vae", "tiny-taesd", "tiny-convnext", "tiny-hunyuanimage-vae", "tiny-hunyuanvideo1.5-vae", "tiny-ltx2-vae",
                                    "tiny-qwen-image2.1-vae", "tiny-dc-ae"])
def test_per_channel_latent_statistics_are_typed_and_match_the_card(backend, preset):
    """The Wan-family decoders (Wan 2.1, Wan 2.2, Qwen-Image) give their latents_mean/latents_std as
    `latent_stats` (what the service scales remote-VAE latents with), the values their card's config
    shows; the others, normalised by a scaling factor or not at all, do not claim it."""
    model = load_model(preset, preset, backend)
    per_channel = preset in ("tiny-wan-vae", "tiny-wan2.2-vae", "tiny-qwen-image-vae", "tiny-qwen-image2.1-vae",
                             "tiny-ltx2-vae")
    assert isinstance(model, PerChannelLatents) == per_channel
    if preset == "tiny-ltx2-vae":  # the checkpoint's buffers (random init: diffusers' zeros and ones), / scaling 1
        assert model.latent_stats == ((0.0,) * 8, (1.0,) * 8)
    elif per_channel:
        cfg = model.card()["config"]
        assert model.latent_stats == (tuple(cfg["latents_mean"]), tuple(cfg["latents_std"]))
        assert len(model.latent_stats[1]) == model.latent_channels


@pytest.mark.parametrize("module", FAMILIES)
def test_every_family_refuses_an_unknown_preset_or_config_with_one_error(backend, module):
    """One build path (ModelFamily.build): an unknown preset or config field is a ModelConfigError (a
    ValueError) naming what was asked and the choices, whichever family is asked (before, three
    families raised KeyError and four ValueError for an unknown preset)."""
    family = importlib.import_module(f"models.{module}").FAMILY
    with pytest.raises(ModelConfigError, match=r"unknown .*preset 'no-such-preset'; known: \["):
        family.build("x", "no-such-preset", backend)
    tiny = next(p for p in family.presets if p.startswith("tiny-"))
    with pytest.raises(ModelConfigError, match=r"not_a_field.*; (known|config fields): \["):
        family.build("x", tiny, backend, None, ModelOptions(config={"not_a_field": 1}))


@pytest.mark.parametrize("preset", ["tiny-vae", "tiny-flux2-vae", "tiny-wan-vae", "tiny-wan2.2-vae",
                                    "tiny-qwen-image-vae", "tiny-taesd", "tiny-hunyuanimage-vae", "tiny-hunyuanvideo1.5-vae", "tiny-ltx2-vae",
                                    "tiny-qwen-image2.1-vae", "tiny-dc-ae"])
def test_smaller_tilings_shrink_to_a_floor_and_each_is_accepted(backend, preset):
    model = load_model(preset, preset, backend, options=ModelOptions(tile_size=256))
    chain, t = [], model.tiling
    while (t := model.smaller_tiling(t)) is not None:
        chain.append(t)
        assert len(chain) < 20
    assert chain, "a 256-pixel tile has smaller ones"
    sizes = [dataclasses.astuple(t)[0] for t in [model.tiling, *chain]]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    # every answer is a tiling the model accepts: a model built with it decodes to the right shape
    rng = np.random.default_rng()
    last = chain[-1]
    model.tiling = last
    if model.kind == IMAGE_DECODER:
        # AutoencoderKL's rule refuses some sizes; AutoencoderTiny's takes any, and the Qwen-Image
        # VAEs (1 and 2.1) tile by the Wan VAE's rule (checked by the decode below)
        if preset not in ("tiny-taesd", "tiny-qwen-image-vae", "tiny-qwen-image2.1-vae"):
            # tiles are of the decoder's own latents (FLUX.2's unpatchified ones: its config's factor)
            tiling.validate_image_tiles(model.tiling, model.config.spatial_factor)
        z = rng.standard_normal((1, model.latent_channels, 23, 19)).astype(np.float32)
        f = model.spatial_factor
        assert model.decode(z, tiled=True).shape == (1, 23 * f, 19 * f, 3)
    else:
        z = rng.standard_normal((1, model.latent_channels, 2, 11, 9)).astype(np.float32)
        f = model.spatial_factor
        assert model.decode(z, tiled=True).shape == (1, 1 + model.temporal_factor, 11 * f, 9 * f, 3)


def test_tile_size_becomes_each_decoders_own_setting(backend):
    vae = load_model("v", "tiny-vae", backend, options=ModelOptions(tile_size=96))
    assert vae.tiling.tile_px // vae.spatial_factor == 96 // vae.spatial_factor
    wan = load_model("w", "tiny-wan-vae", backend, options=ModelOptions(tile_size=96))
    assert (wan.tiling.tile_px, wan.tiling.stride_px) == (96, 72)
    taesd = load_model("t", "tiny-taesd", backend, options=ModelOptions(tile_size=96))
    assert (taesd.tiling.tile_px, taesd.tiling.stride_px) == (96, 88)  # 12 latents, blend int(12 / 8) = 1
    enc = load_model("e", "tiny-convnext", backend, options=ModelOptions(tile_size=96))  # encoders do not tile: ignored
    assert enc.kind == IMAGE_ENCODER


@pytest.mark.parametrize("preset", ["tiny-vae", "tiny-flux2-vae", "tiny-wan-vae", "tiny-wan2.2-vae",
                                    "tiny-qwen-image-vae", "tiny-convnext", "tiny-taesd",
                                    "tiny-hunyuanimage-vae", "tiny-hunyuanvideo1.5-vae", "tiny-ltx2-vae",
                                    "tiny-qwen-image2.1-vae", "tiny-dc-ae"])
def test_example_inputs_are_what_the_model_takes_at_the_asked_size(backend, preset):
    """Warm-up and the CLI bench build their inputs with example_input: a decoder's latents decode
    to the asked pixel size rounded down to its grid; an encoder takes images of that size."""
    model = load_model(preset, preset, backend)
    rng = np.random.default_rng()
    h, w = 37, 50
    out = forward(model, example_input(model, rng, n=2, pixels=(h, w)))
    if model.kind == IMAGE_ENCODER:
        assert out["embedding"].shape == (2, model.embed_dim)
        return
    f = model.spatial_factor
    frames = (1 + model.temporal_factor,) if model.kind == VIDEO_DECODER else ()
    assert out.shape == (2, *frames, h // f * f, w // f * f, 3)
    assert forward(model, example_input(model, rng, latents=(3, 5))).shape[-3:-1] == (3 * f, 5 * f)
