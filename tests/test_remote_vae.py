"""diffusers' own remote VAE client (`remote_decode` / `remote_encode`) against a real uvicorn
convserve on localhost, checked against diffusers' AutoencoderKL / AutoencoderKLWan (+ their image
and video processors) with the same random weights, saved with `save_pretrained` and served through
CONVSERVE_MODELS=name=preset:folder."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")
requests = pytest.importorskip("requests")

from diffusers.image_processor import VaeImageProcessor  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline  # noqa: E402
from diffusers.utils.remote_utils import remote_decode, remote_encode  # noqa: E402
from diffusers.video_processor import VideoProcessor  # noqa: E402
from PIL import Image  # noqa: E402

TOL = 1e-4  # rel L2, fp32

# SD: 4 latents, quant convs, encoder; FLUX: 16 latents, no quant convs, decoder-only checkpoint
SD_LIKE = dict(block_out_channels=(8, 16, 24, 24), layers_per_block=2, norm_num_groups=8, latent_channels=4,
               sample_size=512, scaling_factor=0.18215)
FLUX_LIKE = dict(block_out_channels=(8, 16, 16, 24), layers_per_block=1, norm_num_groups=4, latent_channels=16,
                 sample_size=512, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                 use_post_quant_conv=False)
WAN_SMALL = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                 temperal_downsample=[False, True, True])


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def rel_l2(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))


def max_level_diff(ours, ref) -> int:
    ours, ref = np.asarray(ours, np.int32), np.asarray(ref, np.int32)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    return int(np.abs(ours - ref).max())


def randomise(model) -> None:
    """Every parameter perturbed (norm gains/biases too) so no value sits where it hides a mistake."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if not name.endswith("bias") else 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.mul_(1.0 + 0.1 * torch.randn_like(p))


def make_kl(cfg: dict, seed: int):
    n = len(cfg["block_out_channels"])
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * n,
                                  up_block_types=("UpDecoderBlock2D",) * n, **cfg).eval()
    randomise(vae)
    return vae


def make_wan(seed: int):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    z = WAN_SMALL["z_dim"]
    cfg = {**WAN_SMALL, "latents_mean": rng.normal(0, 0.5, z).round(4).tolist(),
           "latents_std": rng.uniform(0.5, 3.0, z).round(4).tolist()}
    vae = diffusers.AutoencoderKLWan(**cfg).eval()
    randomise(vae)
    return vae


def drop_encoder(folder: os.PathLike) -> None:
    """A decoder-only checkpoint, as many published VAE exports are."""
    path = os.path.join(folder, "diffusion_pytorch_model.safetensors")
    tensors = safetensors_torch.load_file(path)
    safetensors_torch.save_file({k: v for k, v in tensors.items()
                                 if not k.startswith(("encoder.", "quant_conv."))}, path)


class Server:
    def __init__(self, base: str, sd, flux, wan):
        self.base, self.sd, self.flux, self.wan = base, sd, flux, wan

    def url(self, model: str, op: str = "decode") -> str:
        return f"{self.base}/v1/models/{model}/vae/{op}"


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory):
    """`convserve serve` (conftest's shared fixture) with the three diffusers folders as weights."""
    seed = fresh_seed()
    print(f"seed {seed}")
    root = tmp_path_factory.mktemp("remote_vae")
    sd, flux, wan = make_kl(SD_LIKE, seed), make_kl(FLUX_LIKE, seed + 1), make_wan(seed + 2)
    for name, vae in (("sd", sd), ("flux", flux), ("wan", wan)):
        vae.save_pretrained(root / name)
    drop_encoder(root / "flux")
    live = server_factory(models=f"sd=tiny-vae:{root / 'sd'},flux=tiny-flux-vae:{root / 'flux'},"
                                 f"wan=tiny-wan-vae:{root / 'wan'}", max_batch=4)
    return Server(live.url, sd, flux, wan)


# ---- references ------------------------------------------------------------------------------------
def kl_sample(vae, z_unscaled: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(z_unscaled).sample


def pil_u8(images) -> np.ndarray:
    images = images if isinstance(images, list) else [images]
    return np.stack([np.asarray(im.convert("RGB")) for im in images])


# ---- SD-style image VAE --------------------------------------------------------------------------
def sd_latents(n=1, h=5, w=7):
    return torch.randn(n, 4, h, w)


def test_sd_pt_raw_equals_vae_decode_sample(server):
    lat = sd_latents(n=2, h=5, w=7)
    out = remote_decode(server.url("sd"), lat, scaling_factor=0.18215, output_type="pt", return_type="pt")
    ref = kl_sample(server.sd, lat / 0.18215)
    assert out.dtype == torch.float32 and tuple(out.shape) == (2, 3, 40, 56)
    # the decoder's output is not clipped: random weights push some of it outside [-1, 1]
    assert float(ref.abs().max()) > 1.0, "test weights never leave [-1, 1]: the clamp check proves nothing"
    assert rel_l2(out, ref) < TOL


def test_sd_client_scaling_is_applied_not_the_models(server):
    """The client's factors win over the model config's (0.18215): undo/redo is exact."""
    lat = sd_latents(h=6, w=3)
    out = remote_decode(server.url("sd"), lat, scaling_factor=0.5, shift_factor=-0.25, output_type="pt",
                        return_type="pt")
    assert rel_l2(out, kl_sample(server.sd, lat / 0.5 - 0.25)) < TOL
    # no factors, no do_scaling: the latents are already unscaled
    out = remote_decode(server.url("sd"), lat, do_scaling=False, output_type="pt", return_type="pt")
    assert rel_l2(out, kl_sample(server.sd, lat)) < TOL
    # deprecated do_scaling=True alone: the model's own scaling_factor
    with pytest.warns(FutureWarning):
        out = remote_decode(server.url("sd"), lat, do_scaling=True, output_type="pt", return_type="pt")
    assert rel_l2(out, kl_sample(server.sd, lat / 0.18215)) < TOL


def test_sd_pt_partial_postprocess_uint8(server):
    lat = sd_latents(n=2, h=3, w=5)
    proc = VaeImageProcessor(vae_scale_factor=8)
    ref = pil_u8(proc.postprocess(kl_sample(server.sd, lat / 0.18215), output_type="pil"))
    out = remote_decode(server.url("sd"), lat, scaling_factor=0.18215, output_type="pt",
                        partial_postprocess=True, return_type="pt")
    assert out.dtype == torch.uint8 and tuple(out.shape) == (2, 24, 40, 3)
    assert max_level_diff(out.numpy(), ref) <= 1
    one = remote_decode(server.url("sd"), lat[:1], scaling_factor=0.18215, output_type="pt",
                        partial_postprocess=True, return_type="pil")
    assert isinstance(one, Image.Image) and max_level_diff(pil_u8(one), ref[:1]) <= 1


def test_sd_pil_png_and_jpg(server):
    lat = sd_latents(h=5, w=6)
    proc = VaeImageProcessor(vae_scale_factor=8)
    ref_img = proc.postprocess(kl_sample(server.sd, lat / 0.18215), output_type="pil")[0]
    ref = pil_u8(ref_img)
    png = remote_decode(server.url("sd"), lat, scaling_factor=0.18215, output_type="pil", image_format="png")
    assert png.format == "png" and png.size == (48, 40)
    assert max_level_diff(pil_u8(png), ref) <= 1
    jpg = remote_decode(server.url("sd"), lat, scaling_factor=0.18215, output_type="pil", image_format="jpg")
    assert jpg.format == "jpeg" and jpg.size == (48, 40)
    # lossy: compare with the reference through the same JPEG encoder
    buf = io.BytesIO()
    ref_img.save(buf, format="JPEG", quality=90)
    ref_jpg = pil_u8(Image.open(buf))
    assert np.abs(pil_u8(jpg).astype(int) - ref_jpg.astype(int)).mean() < 1.0


def test_sd_pil_with_processor_gets_postprocessed_tensor(server):
    lat = sd_latents(n=2, h=4, w=5)
    proc = VaeImageProcessor(vae_scale_factor=8)
    sample = kl_sample(server.sd, lat / 0.18215)
    out = remote_decode(server.url("sd"), lat, processor=proc, scaling_factor=0.18215, output_type="pil",
                        return_type="pt")
    assert rel_l2(out, proc.postprocess(sample, output_type="pt")) < TOL
    imgs = remote_decode(server.url("sd"), lat, processor=proc, scaling_factor=0.18215, output_type="pil")
    assert max_level_diff(pil_u8(imgs), pil_u8(proc.postprocess(sample, output_type="pil"))) <= 1
    # pt + processor + return_type pil: the client post-processes the raw sample itself
    img = remote_decode(server.url("sd"), lat[:1], processor=proc, scaling_factor=0.18215, output_type="pt")
    assert max_level_diff(pil_u8(img), pil_u8(proc.postprocess(sample[:1], output_type="pil"))) <= 1


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_sd_half_precision_latents(server, dtype, tol):
    lat = sd_latents(h=5, w=3).to(dtype)
    out = remote_decode(server.url("sd"), lat, scaling_factor=0.18215, output_type="pt", return_type="pt")
    assert out.dtype == dtype
    assert rel_l2(out.float(), kl_sample(server.sd, lat.float() / 0.18215)) < tol


def test_sd_remote_encode_png_and_tensor(server):
    rng = np.random.default_rng(fresh_seed())
    rgb = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
    proc = VaeImageProcessor(vae_scale_factor=8)
    x = proc.preprocess(Image.fromarray(rgb))  # 1,3,40,56 in [-1, 1]
    with torch.no_grad():
        mean = server.sd.encode(x).latent_dist.mean
    out = remote_encode(server.url("sd", "encode"), Image.fromarray(rgb), scaling_factor=0.18215)
    assert tuple(out.shape) == (1, 4, 5, 7) and out.dtype == torch.float32
    assert rel_l2(out, mean * 0.18215) < TOL
    # a tensor (sizes not multiples of 8, batch of 2), with a shift, unlike the model's config
    xt = torch.rand(2, 3, 44, 30) * 2 - 1
    with torch.no_grad():
        mean_t = server.sd.encode(xt).latent_dist.mean
    out = remote_encode(server.url("sd", "encode"), xt, scaling_factor=0.7, shift_factor=0.05)
    assert rel_l2(out, (mean_t - 0.05) * 0.7) < TOL
    out = remote_encode(server.url("sd", "encode"), xt)  # no factors: the unscaled mean
    assert rel_l2(out, mean_t) < TOL


def test_sd_encode_of_npy_pixels_equals_the_png(server):
    """.npy pixels (channels last, uint8 or float in [0,1], as /v1's encode takes them) give the bytes
    the same image as a PNG gives."""
    rgb = np.random.default_rng(fresh_seed()).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    want = requests.post(server.url("sd", "encode"), data=buf.getvalue())
    assert want.status_code == 200 and want.headers["shape"] == "[1, 4, 3, 5]", want.text
    for arr in (rgb, rgb[None], (rgb.astype(np.float32) / 255)[None]):
        buf = io.BytesIO()
        np.save(buf, arr)
        r = requests.post(server.url("sd", "encode"), data=buf.getvalue(), headers={"content-type": "application/x-npy"})
        assert r.status_code == 200 and r.headers["shape"] == want.headers["shape"], r.text
        assert r.content == want.content, f"{arr.dtype} {arr.shape}"


# ---- FLUX-style image VAE ------------------------------------------------------------------------
def test_flux_packed_latents(server):
    height, width = 50, 70  # the pipeline rounds down to whole 2x2 latent patches: 6 x 8 latents
    packed = torch.randn(2, 3 * 4, 16 * 4)
    z = FluxPipeline._unpack_latents(packed, height, width, 8)
    sample = kl_sample(server.flux, z / 0.3611 + 0.1159)
    out = remote_decode(server.url("flux"), packed, scaling_factor=0.3611, shift_factor=0.1159,
                        output_type="pt", return_type="pt", height=height, width=width)
    assert tuple(out.shape) == (2, 3, 48, 64)
    assert rel_l2(out, sample) < TOL
    png = remote_decode(server.url("flux"), packed[:1], scaling_factor=0.3611, shift_factor=0.1159,
                        output_type="pil", image_format="png", height=height, width=width)
    ref = pil_u8(VaeImageProcessor(vae_scale_factor=8).postprocess(sample[:1], output_type="pil"))
    assert max_level_diff(pil_u8(png), ref) <= 1
    u8 = remote_decode(server.url("flux"), packed, scaling_factor=0.3611, shift_factor=0.1159,
                       output_type="pt", partial_postprocess=True, return_type="pt", height=height, width=width)
    ref = pil_u8(VaeImageProcessor(vae_scale_factor=8).postprocess(sample, output_type="pil"))
    assert max_level_diff(u8.numpy(), ref) <= 1


def test_flux_unpacked_latents_and_decoder_only_card(server):
    lat = torch.randn(1, 16, 5, 7)
    out = remote_decode(server.url("flux"), lat, scaling_factor=0.3611, shift_factor=0.1159,
                        output_type="pt", return_type="pt")
    assert rel_l2(out, kl_sample(server.flux, lat / 0.3611 + 0.1159)) < TOL
    assert requests.get(f"{server.base}/v1/models/flux").json()["has_encoder"] is False
    assert requests.get(f"{server.base}/v1/models/sd").json()["has_encoder"] is True
    with pytest.raises(RuntimeError, match="no VAE encoder"):
        remote_encode(server.url("flux", "encode"), Image.new("RGB", (16, 16)))


def test_flux_packed_latents_that_do_not_fit(server):
    with pytest.raises(RuntimeError, match="do not fit"):
        remote_decode(server.url("flux"), torch.randn(1, 11, 64), scaling_factor=0.3611, output_type="pt",
                      return_type="pt", height=48, width=64)


# ---- Wan video VAE -------------------------------------------------------------------------------
def wan_stats(vae):
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return mean, std


@pytest.fixture(scope="module")
def wan_case(server):
    """Normalised latents as the Wan pipeline holds them, and diffusers' decode of them."""
    lat = torch.randn(1, 4, 3, 5, 6)
    mean, std = wan_stats(server.wan)
    with torch.no_grad():
        sample = server.wan.decode(lat * std + mean).sample  # 1,3,9,40,48 in [-1, 1]
    return lat, sample


def denormalised(server, lat):
    """What the Wan pipeline hands its VAE, and what diffusers' client now sends (do_scaling=False):
    its latents times the VAE's std plus its mean, per channel. do_scaling=True alone, the server
    applying them, is deprecated in the client (test_wan_pt_raw_and_unscaled checks it still works)."""
    mean, std = wan_stats(server.wan)
    return lat * std + mean


def test_wan_pt_raw_and_unscaled(server, wan_case):
    lat, sample = wan_case
    with pytest.warns(FutureWarning):  # do_scaling=True alone: the model's own mean/std
        out = remote_decode(server.url("wan"), lat, do_scaling=True, output_type="pt", return_type="pt")
    assert tuple(out.shape) == (1, 3, 9, 40, 48)
    assert rel_l2(out, sample) < TOL
    mean, std = wan_stats(server.wan)
    out = remote_decode(server.url("wan"), lat * std + mean, do_scaling=False, output_type="pt", return_type="pt")
    assert rel_l2(out, sample) < TOL


def test_wan_frames_uint8_and_pil(server, wan_case):
    lat, sample = wan_case
    vp = VideoProcessor(vae_scale_factor=8)
    ref_frames = vp.postprocess_video(sample, output_type="pil")[0]
    ref = pil_u8(ref_frames)
    z = denormalised(server, lat)
    u8 = remote_decode(server.url("wan"), z, do_scaling=False, output_type="pt", partial_postprocess=True,
                       return_type="pt")
    assert u8.dtype == torch.uint8 and tuple(u8.shape) == (9, 40, 48, 3)
    assert max_level_diff(u8.numpy(), ref) <= 1
    frames = remote_decode(server.url("wan"), z, do_scaling=False, output_type="pt", partial_postprocess=True)
    assert len(frames) == 9 and max_level_diff(pil_u8(frames), ref) <= 1
    frames = remote_decode(server.url("wan"), z, processor=vp, do_scaling=False, output_type="pil")
    assert len(frames) == 9 and max_level_diff(pil_u8(frames), ref) <= 1
    frames = remote_decode(server.url("wan"), z, processor=vp, do_scaling=False, output_type="pt")
    assert len(frames) == 9 and max_level_diff(pil_u8(frames), ref) <= 1


def test_wan_mp4(server, wan_case):
    pytest.importorskip("av")
    from service.codecs.video import read_mp4_frames

    lat, sample = wan_case
    data = remote_decode(server.url("wan"), denormalised(server, lat), do_scaling=False, output_type="mp4",
                         return_type="mp4")
    assert isinstance(data, bytes) and data[4:8] == b"ftyp"
    frames = read_mp4_frames(data)
    ref = pil_u8(VideoProcessor(vae_scale_factor=8).postprocess_video(sample, output_type="pil")[0])
    assert frames.shape == ref.shape == (9, 40, 48, 3)
    # H.264 4:2:0 halves chroma resolution, which noise-like random-weight frames feel a lot;
    # luma keeps full resolution and, at the default quality (CRF 5), nearly every level
    luma = np.array([0.299, 0.587, 0.114])
    y, y_ref = frames @ luma, ref @ luma
    err = np.abs(y - y_ref).mean()
    print(f"mp4 luma mean abs error {err:.2f} levels")
    assert err < 2.5, f"luma mean abs error {err:.2f} levels"
    assert err < np.abs(y - y_ref[::-1]).mean() / 4, "frames out of order"


def test_wan_errors_reach_the_client(server, wan_case):
    lat, _ = wan_case
    with pytest.raises(RuntimeError, match="video VAE"):  # an image file cannot hold a video
        remote_decode(server.url("wan"), denormalised(server, lat), do_scaling=False, output_type="pil")
    with pytest.raises(RuntimeError, match="latent channels"):
        remote_decode(server.url("wan"), torch.randn(1, 5, 2, 4, 4), do_scaling=False, output_type="pt",
                      return_type="pt")
    with pytest.raises(RuntimeError, match="no VAE encoder"):
        remote_encode(server.url("wan", "encode"), Image.new("RGB", (16, 16)))
    with pytest.raises(RuntimeError, match="image VAE"):
        remote_decode(server.url("sd"), torch.randn(1, 4, 4, 4), scaling_factor=0.18215, output_type="mp4",
                      return_type="mp4")
    with pytest.raises(RuntimeError, match="no model named"):
        remote_decode(server.url("nope"), torch.randn(1, 4, 4, 4), do_scaling=False, output_type="pt",
                      return_type="pt")


# ---- the wire format, without the diffusers client -------------------------------------------------
def test_plain_http_gets_an_image_file_and_problem_json(server):
    lat = np.random.default_rng(fresh_seed()).standard_normal((1, 4, 3, 5)).astype("<f4")
    params = {"shape": list(lat.shape), "dtype": "float32", "scaling_factor": 0.18215, "image_format": "png"}
    r = requests.post(server.url("sd"), data=lat.tobytes(), params=params)  # no Accept: as curl sends
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(r.content)).size == (40, 24)
    r = requests.post(server.url("sd"), data=lat.tobytes()[:-4], params=params)
    assert r.status_code == 400 and "do not hold shape" in r.json()["detail"]
    r = requests.post(server.url("sd"), data=lat.tobytes(), params={**params, "dtype": "int7"})
    assert r.status_code == 415 and r.headers["content-type"] == "application/problem+json"


def test_bfloat16_replies_round_like_torch():
    from service.frontend.routes.remote_vae import f32_to_bf16_bits

    rng = np.random.default_rng(fresh_seed())
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 4096),
                        # exact ties between two bf16 values, both parities, and the specials
                        np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8), 0.0, -0.0,
                                  np.inf, -np.inf, 3.4e38], np.float32)])
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(f32_to_bf16_bits(x), ref)
    assert np.isnan(torch.from_numpy(f32_to_bf16_bits(np.array([np.nan], np.float32)).view(np.int16))
                    .view(torch.bfloat16).float().numpy()).all()
