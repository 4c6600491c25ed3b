"""The half-precision criterion for the 2026 VAE families: ours in float16 / bfloat16 must be
within 1.5x of PyTorch's own error at that precision. Both are measured against the same reference,
the diffusers class in float32 on the GPU with TF32 off; PyTorch's half-precision run is the same
diffusers module cast to that dtype (the pipeline's de-normalisation and post-processing stay in
float32 on both sides, as ours does them on the host). The full published configs, random weights in
every parameter (the CPU parity tests' helpers), small odd latents. Skipped without a CUDA GPU."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gpu_support import OnDevice, cuda_backend as backend, cuda_or_skip, report_parity as report
from torch_reference import rel_l2, torch

pytestmark = pytest.mark.gpu
#: ours may be this many times PyTorch's own half-precision error, plus a floor for the rounding of
#: the output to float16/bfloat16 itself
RATIO, FLOOR = 1.5, 2e-4


@pytest.fixture(scope="module", autouse=True)
def cuda_available():
    cuda_or_skip()


def _taesd(tmp_path, seed):
    from test_models_taesd import make_tiny, reference_decode
    vae = make_tiny(dict(latent_channels=4, scaling_factor=0.7, shift_factor=0.15), seed)
    vae.save_pretrained(tmp_path)
    return vae, tmp_path, lambda v, lat: reference_decode(v, lat)


def _flux2(tmp_path, seed):
    import test_models_flux2_vae as ref
    cfg = {k: v for k, v in ref.PRESETS["flux2-vae"].config.items() if k not in ("down_block_types", "up_block_types")}
    vae = ref.make_flux2_vae(cfg, seed)
    vae.save_pretrained(tmp_path)
    return vae, tmp_path, lambda v, lat: ref.pipeline_decode(v, lat)


def _qwen(tmp_path, seed):
    import test_models_qwen_image_vae as ref
    vae, folder, config = ref.make_reference(tmp_path, dict(ref.PRESETS["qwen-image-vae"]), seed)
    return vae, folder, lambda v, lat: ref.reference_decode(v, config, lat)


def _qwen21(tmp_path, seed):
    import test_models_qwen_image21_vae as ref
    vae, folder, config = ref.make_reference(tmp_path, dict(ref.PRESETS["qwen-image2.1-vae"]), seed)
    # the served pixels are RGB: the pipeline's RGBA less alpha
    return vae, folder, lambda v, lat: ref.reference_decode(v, config, lat)[..., :3]


def _wan22(tmp_path, seed):
    import test_models_wan22_vae as ref
    vae, folder, config = ref.make_reference(tmp_path, dict(ref.PRESETS["wan2.2-vae"]), seed)
    return vae, folder, lambda v, lat: ref.reference_decode(v, config, lat)


def _hunyuan(tmp_path, seed):
    import test_models_hunyuanimage_vae as ref
    vae = ref.make_vae(dict(ref.PRESETS["hunyuanimage2.1-vae"].config), seed)
    vae.save_pretrained(tmp_path)
    return vae, tmp_path, lambda v, lat: ref.pipeline_decode(v, lat)


def _hunyuan15(tmp_path, seed):
    import test_models_hunyuanvideo15_vae as ref
    vae = ref.make_vae(dict(ref.PRESETS["hunyuanvideo1.5-vae"].config), seed)
    vae.save_pretrained(tmp_path)
    return vae, tmp_path, lambda v, lat: ref.pipeline_decode(v, lat)


def _ltx2(tmp_path, seed):
    import test_models_ltx2_vae as ref
    vae = ref.make_vae(dict(ref.PRESETS["ltx2-vae"].config), seed)
    vae.save_pretrained(tmp_path)
    return vae, tmp_path, lambda v, lat: ref.pipeline_decode(v, lat)


def _dc_ae(tmp_path, seed):
    import test_models_dc_ae as ref
    vae = ref.make_vae(dict(ref.PRESETS["dc-ae-f32c32"].config), seed)
    vae.save_pretrained(tmp_path)
    return vae, tmp_path, lambda v, lat: ref.pipeline_decode(v, lat)


FAMILIES = {"taesd": (_taesd, (1, 4, 23, 19)), "flux2-vae": (_flux2, (1, 128, 7, 5)),
            "qwen-image-vae": (_qwen, (1, 16, 11, 9)), "wan2.2-vae": (_wan22, (1, 48, 3, 5, 3)),
            "qwen-image2.1-vae": (_qwen21, (1, 64, 7, 5)),
            "hunyuanimage2.1-vae": (_hunyuan, (1, 64, 5, 3)),
            "ltx2-vae": (_ltx2, (1, 128, 2, 3, 2)),
            "hunyuanvideo1.5-vae": (_hunyuan15, (1, 32, 2, 5, 3)),
            "dc-ae-f32c32": (_dc_ae, (1, 32, 5, 3))}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_half_precision_within_pytorchs_own_error(tmp_path, preset, dtype):
    from models import load_model

    # one seed per case, the same every run: a ratio of two small errors moves with the inputs
    # (Qwen-Image bfloat16 measured 1.62x at seed 1241775327 on one H200, 2026-11-29), and a fresh
    # draw each run would pass on some runs and fail on others
    seed = zlib.crc32(f"{preset} {dtype}".encode())
    make, shape = FAMILIES[preset]
    vae, folder, decode = make(tmp_path, seed)
    latents = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    ref = decode(OnDevice(vae, torch.float32), latents)
    assert 0.02 < float(ref.std()), "reference decode is flat: the check would prove nothing"
    theirs = rel_l2(decode(OnDevice(vae, getattr(torch, dtype)), latents), ref)
    ours = rel_l2(load_model("m", preset, backend(dtype), weights=str(folder)).decode(latents, tiled=False), ref)
    report(f"{preset} {dtype} latents {shape}: ours {ours:.2e}, PyTorch's own {theirs:.2e} "
           f"({ours / theirs:.2f}x)")
    assert ours < RATIO * theirs + FLOOR, f"seed {seed}: ours {ours:.3e}, PyTorch {theirs:.3e}"
