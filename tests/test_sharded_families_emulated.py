"""The families built on the image VAE and Wan 2.1, and TAESD, decoded split by rows over N
emulated shards (threads of the NumPy backend joined by ThreadShards, NCCL's collective
semantics), each through its own forward with a row shard current (models/nn/row_shard.py):
FLUX.2 (the SD decoder behind BatchNorm de-normalisation and 2x2 unpatchify), Qwen-Image (the Wan
2.1 decoder on one frame), Wan 2.2 (residual up blocks with DupUp3D shortcuts, 2x2 output
patches), the Qwen-Image 2.1 VAE (Wan 2.2's residual blocks with 2-D frame convs, 16x), TAESD (plain
convs and ReLUs, its upsamplers' halo), the HunyuanImage 2.1 VAE (convs
with channel-repeating shortcuts, channel-to-space upsamplers, GroupNorm, attention) and the LTX-2 VAE
(non-causal 3-D convs with reflect padding, depth-to-space upsamplers, pixel norms) and SANA's DC-AE (depthwise
convs, RMS norms, linear attention with all-reduced sums) each equal the unsharded decode
and the diffusers class with the same fresh random weights, over odd row splits; with an exchange
kept shard-local, each visibly does not."""
from __future__ import annotations

import numpy as np
import pytest
import test_models_dc_ae as dc_ae
import test_models_flux2_vae as flux2
import test_models_hunyuanimage_vae as hunyuan
import test_models_hunyuanvideo15_vae as hunyuan15
import test_models_ltx2_vae as ltx2
import test_models_qwen_image21_vae as qwen21
import test_models_qwen_image_vae as qwen
import test_models_taesd as taesd
import test_models_wan22_vae as wan22
from test_sharded_decode_emulated import _OneLocal
from torch_reference import assert_informative, fresh_seed, rel_l2

from convkernels import get_backend
from models import load_model
from models.sharding import decode_emulated, frame_groups_emulated

UNSHARDED_TOL, DIFFUSERS_TOL, BROKEN_MIN = 1e-5, 1e-4, 1e-3


def _flux2(tmp, seed):
    vae = flux2.make_flux2_vae(flux2.SMALL, seed)
    vae.save_pretrained(tmp)
    # 5 patched rows (10 of the decoder's: 3 shards hold 2, 2, 1 patched rows), odd width
    lat = np.random.default_rng(seed).standard_normal((2, 4 * flux2.SMALL["latent_channels"], 5, 3))
    return "flux2-vae", lat.astype(np.float32), lambda z: flux2.pipeline_decode(vae, z)


def _qwen(tmp, seed):
    vae, folder, config = qwen.make_reference(tmp, qwen.QWEN_SMALL, seed)
    lat = np.random.default_rng(seed).standard_normal((2, config["z_dim"], 7, 3)).astype(np.float32)
    return "qwen-image-vae", lat, lambda z: qwen.reference_decode(vae, config, z), str(folder)


def _wan22(tmp, seed):
    # the real [1, 2, 4, 4] multipliers at odd widths: DupUp3D repeats unevenly
    vae, folder, config = wan22.make_reference(tmp, wan22.WAN22_ODD, seed)
    lat = np.random.default_rng(seed).standard_normal((1, config["z_dim"], 3, 5, 3)).astype(np.float32)
    return "wan2.2-vae", lat, lambda z: wan22.reference_decode(vae, config, z), str(folder)


def _taesd(tmp, seed):
    vae = taesd.make_tiny(taesd.SMALL, seed)
    vae.save_pretrained(tmp)
    # 7 latent rows (3 shards hold 3, 2, 2; 5 shards 2, 2, 1, 1, 1), odd width, 2x the unit scale
    lat = 2 * np.random.default_rng(seed).standard_normal((2, taesd.SMALL["latent_channels"], 7, 5))
    return "tiny-taesd", lat.astype(np.float32), lambda z: taesd.reference_decode(vae, z)


def _hunyuan(tmp, seed):
    vae = hunyuan.make_vae(hunyuan.SMALL, seed)
    vae.save_pretrained(tmp)
    # 7 latent rows (3 shards hold 3, 2, 2; 5 shards 2, 2, 1, 1, 1), odd width: conv_in's and the
    # upsamplers' channel-repeating shortcuts and channel-to-space shuffles run on each band
    lat = np.random.default_rng(seed).standard_normal((2, hunyuan.SMALL["latent_channels"], 7, 3))
    return "hunyuanimage2.1-vae", lat.astype(np.float32), lambda z: hunyuan.pipeline_decode(vae, z)


def _qwen21(tmp, seed):
    vae, folder, config = qwen21.make_reference(tmp, qwen21.SMALL, seed)
    # 7 latent rows (3 shards hold 3, 2, 2; 5 shards 2, 2, 1, 1, 1), odd width: the frame convs' halos,
    # the DupUp3D shortcuts beside four upsamplers; the served RGB is the pipeline's RGBA less alpha
    lat = np.random.default_rng(seed).standard_normal((2, config["z_dim"], 7, 3)).astype(np.float32)
    return "qwen-image2.1-vae", lat, lambda z: qwen21.reference_decode(vae, config, z)[..., :3], folder


def _ltx2(tmp, seed):
    vae = ltx2.make_vae(ltx2.TINY, seed)
    vae.save_pretrained(tmp)
    # 7 latent rows (3 shards hold 3, 2, 2; 5 shards 2, 2, 1, 1, 1), odd width, 2 latent frames: the
    # 3-D convs' halos with reflection at the image's own edges, the depth-to-space upsamplers
    lat = np.random.default_rng(seed).standard_normal((1, ltx2.TINY["latent_channels"], 2, 7, 3))
    return "ltx2-vae", lat.astype(np.float32), lambda z: ltx2.pipeline_decode(vae, z)

def _hunyuan15(tmp, seed):
    vae = hunyuan15.make_vae(hunyuan15.TINY, seed)
    vae.save_pretrained(tmp)
    # 7 latent rows (3 shards hold 3, 2, 2; 5 shards 2, 2, 1, 1, 1), odd width, 3 latent frames, a batch
    # of 2: the causal convs' halos with replicated edges, the frame-causal attention's gathered keys
    lat = np.random.default_rng(seed).standard_normal((2, hunyuan15.C, 3, 7, 3))
    return "tiny-hunyuanvideo1.5-vae", lat.astype(np.float32), lambda z: hunyuan15.pipeline_decode(vae, z)


def _dc_ae(tmp, seed):
    vae = dc_ae.make_vae(dc_ae.SMALL, seed)
    vae.save_pretrained(tmp)
    # 7 latent rows (3 shards hold 3, 2, 2; 5 shards 2, 2, 1, 1, 1), odd width: the ResBlocks' and depthwise
    # convs' halos, the interpolating upsamplers' halo row beside their duplicated-channel shortcuts, and
    # the linear attention's sums all-reduced (the widest level's 21 tokens are spread over the shards)
    lat = np.random.default_rng(seed).standard_normal((2, dc_ae.SMALL["latent_channels"], 7, 3))
    return "dc-ae-f32c32", lat.astype(np.float32), lambda z: dc_ae.pipeline_decode(vae, z)


FAMILIES = {"dc-ae": _dc_ae, "hunyuanvideo1.5": _hunyuan15, "qwen-image2.1": _qwen21, "flux2": _flux2, "qwen-image": _qwen, "wan2.2": _wan22, "taesd": _taesd, "hunyuanimage": _hunyuan,
            "ltx2": _ltx2}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    """(name, seed, model, latents, our unsharded decode, the diffusers decode of the latents)."""
    name, seed = request.param, fresh_seed()
    tmp = tmp_path_factory.mktemp(name)
    preset, lat, reference, *folder = FAMILIES[name](tmp, seed)
    model = load_model(name, preset, get_backend("numpy"), weights=folder[0] if folder else str(tmp))
    ref = reference(lat)
    assert_informative(ref, f"{name} seed {seed}")
    return name, seed, model, lat, model.decode(lat, tiled=False), ref


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_the_sharded_decode_equals_the_unsharded_one_and_diffusers(case, shards):
    name, seed, model, lat, ours, ref = case
    out = decode_emulated(model, lat, shards)
    assert out.dtype == np.float32 and out.shape == ours.shape == ref.shape
    err, err_ref = rel_l2(out, ours), rel_l2(out, ref)
    assert err < UNSHARDED_TOL, f"{name} {shards} shards seed {seed}: rel L2 {err:.2e} vs unsharded"
    assert err_ref < DIFFUSERS_TOL, f"{name} {shards} shards seed {seed}: rel L2 {err_ref:.2e} vs diffusers"


@pytest.mark.parametrize("local", ["halo", "norm", "attention"])
def test_each_exchange_matters(case, local):
    name, seed, model, lat, ours, _ = case
    # DC-AE's linear attention sums travel by all-reduce, as GroupNorm's statistics do ("norm"), and
    # it gathers no keys or values ("attention")
    if local == "norm" and name not in ("flux2", "hunyuanimage", "dc-ae"):
        pytest.skip("the Wan decoders' RMS norm is per position, TAESD has none: no statistics cross shards")
    if local == "attention" and name in ("taesd", "ltx2", "dc-ae"):
        pytest.skip("TAESD and the LTX-2 decoder have no attention; DC-AE's gathers nothing (its sums are all-reduced)")
    out = decode_emulated(model, lat, 3, comm_wrapper=lambda comm, rank: _OneLocal(comm, local))
    err = rel_l2(out, ours)
    assert err > BROKEN_MIN, f"{name} seed {seed}: keeping the {local} exchange local changed nothing ({err:.2e})"


def test_wan22_streams_the_unsharded_frame_groups(case):
    name, seed, model, lat, ours, _ = case
    if name not in ("wan2.2", "ltx2", "hunyuanvideo1.5"):
        pytest.skip("an image decoder has no frame groups")
    groups = list(frame_groups_emulated(model, lat, 3))
    assert [g.shape[1] for g in groups] == ([1, 4, 4] if name in ("wan2.2", "hunyuanvideo1.5") else [1, 8])
    assert rel_l2(np.concatenate(groups, axis=1), ours) < UNSHARDED_TOL, f"seed {seed}"


def test_qwen_image_takes_its_one_frame_latents_too(case):
    name, seed, model, lat, ours, _ = case
    if name not in ("qwen-image", "qwen-image2.1"):
        pytest.skip("N,C,1,h,w latents are Qwen-Image's (1 and 2.1)")
    assert rel_l2(decode_emulated(model, lat[:, :, None], 3), ours) < UNSHARDED_TOL, f"seed {seed}"


def test_qwen21_alpha_splits_by_rows_as_its_rgb(case):
    """The served RGBA (decode_band's alpha: decode_rgba on each band) equals the unsharded RGBA,
    alpha included (decode_rgba's own parity with diffusers is tests/test_models_qwen_image21_vae.py's)."""
    name, seed, model, lat, ours, _ = case
    if name != "qwen-image2.1":
        pytest.skip("alpha is the Qwen-Image 2.1 VAE's (an AlphaDecoder)")
    whole = model.decode_rgba(lat, tiled=False)
    assert_informative(whole[..., 3], f"alpha, seed {seed}")
    out = decode_emulated(model, lat, 3, alpha=True)
    assert out.shape == whole.shape == (*ours.shape[:-1], 4)
    assert rel_l2(out[..., 3], whole[..., 3]) < UNSHARDED_TOL and rel_l2(out, whole) < UNSHARDED_TOL, f"seed {seed}"
