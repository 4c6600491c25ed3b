"""Write the committed tiny-vae golden fixtures into tests/golden/ (run by hand; needs torch and
diffusers): `python tests/make_golden.py`.

- tiny_vae_decoder.safetensors: a diffusers AutoencoderKL with the tiny-vae preset's config and
  random weights (norms randomised too), decoder + post_quant_conv only, stored as float16 to
  stay under 1 MB. diffusers ran on exactly these values (rounded to fp16, computed in fp32).
- tiny_vae_latents.npy: scaled latents (1, 4, 6, 10), float32.
- tiny_vae_diffusers_image.npy: diffusers' decode mapped as VaeImageProcessor does,
  (x / 2 + 0.5).clamp(0, 1), NHWC float32 (1, 48, 80, 3).
- tiny_vae_golden.json: provenance (seed, library versions).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden")
SEED = 20261123
LATENT_SHAPE = (1, 4, 6, 10)


def main() -> None:
    import diffusers
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.dirname(HERE))
    from models.autoencoder_kl import PRESETS

    cfg = dict(PRESETS["tiny-vae"])
    torch.manual_seed(SEED)
    vae = diffusers.AutoencoderKL(**cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.mul_(1.0 + 0.1 * torch.randn_like(p))
            # the fixture stores fp16: make the reference run on the very same values
            p.copy_(p.half().float())
    tensors = {k: v.detach().half().contiguous() for k, v in vae.state_dict().items()
               if k.startswith(("decoder.", "post_quant_conv."))}
    rng = np.random.default_rng(SEED)
    latents = rng.standard_normal(LATENT_SHAPE).astype(np.float32)
    with torch.no_grad():
        z = torch.from_numpy(latents) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = (vae.decode(z).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy().astype(np.float32)

    os.makedirs(GOLDEN, exist_ok=True)
    save_file(tensors, os.path.join(GOLDEN, "tiny_vae_decoder.safetensors"))
    np.save(os.path.join(GOLDEN, "tiny_vae_latents.npy"), latents)
    np.save(os.path.join(GOLDEN, "tiny_vae_diffusers_image.npy"), image)
    with open(os.path.join(GOLDEN, "tiny_vae_golden.json"), "w") as f:
        json.dump({"preset": "tiny-vae", "seed": SEED, "latent_shape": list(LATENT_SHAPE),
                   "weights_dtype": "float16 (reference computed in float32 on the same values)",
                   "torch": torch.__version__, "diffusers": diffusers.__version__,
                   "made_by": "tests/make_golden.py"}, f, indent=1)
    total = sum(os.path.getsize(os.path.join(GOLDEN, n)) for n in os.listdir(GOLDEN))
    print(f"wrote {GOLDEN}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
