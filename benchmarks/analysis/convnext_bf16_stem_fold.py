"""Why the ConvNeXt stem does not fold (x - mean) / std into its conv in bfloat16
(models/convnext/model.py `folds_input_norm`). PyTorch alone, no convserve code: for random-weight tiny
ConvNeXts (tests/service_parity.make_convnext), the relative L2 error of transformers' own bf16 run
against its fp32 run, (A) as published (pixels normalised in fp32, then bf16) and (B) with the
normalisation folded into the stem conv in float64 and raw pixels in bf16, as our stem did.

Run: PYTHONPATH=. python benchmarks/analysis/convnext_bf16_stem_fold.py [--seeds 8]
2026-11-25, 2-core AMD EPYC, torch 2.13.0+cpu, 8 seeds: (B) / (A) = 1.27x (embedding) and 1.35x
(logits) on average, up to 1.6x; the folded bias is ~20x the unfolded one (1.2-2.1 vs 0.06-0.12).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from service_parity import convnext_ref, make_convnext  # noqa: E402
from torch_reference import rel_l2  # noqa: E402

MEAN = np.float32([0.485, 0.456, 0.406])
STD = np.float32([0.229, 0.224, 0.225])


def pooled_and_logits(model, x):
    with torch.no_grad():
        base = model.convnext(x)
        return base.pooler_output.float().numpy(), model.classifier(base.pooler_output).float().numpy()


def folded_stem_copy(ref):
    """The model with (x - mean) / std folded into its stem conv (float64), as our stem folds it."""
    model = copy.deepcopy(ref)
    conv = model.convnext.embeddings.patch_embeddings
    w, b = conv.weight.detach().double(), conv.bias.detach().double()
    mean, std = torch.tensor(MEAN, dtype=torch.float64), torch.tensor(STD, dtype=torch.float64)
    w_folded = w / std[None, :, None, None]
    b_folded = b - torch.einsum("oihw,i->o", w_folded, mean)
    with torch.no_grad():
        conv.weight.copy_(w_folded.float())
        conv.bias.copy_(b_folded.float())
    return model, float(b_folded.abs().mean()), float(b.abs().mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    ratios = []
    for seed in range(args.seeds):
        ref = make_convnext(1000 + seed)
        px = np.random.default_rng(seed).random((2, 64, 64, 3), dtype=np.float32)
        emb, logits = convnext_ref(ref, px, MEAN, STD)
        published = copy.deepcopy(ref).to(torch.bfloat16)
        x_norm = torch.from_numpy(((px - MEAN) / STD).transpose(0, 3, 1, 2).copy()).to(torch.bfloat16)
        ea, la = pooled_and_logits(published, x_norm)
        folded, b_folded, b = folded_stem_copy(ref)
        x_raw = torch.from_numpy(px.transpose(0, 3, 1, 2).copy()).to(torch.bfloat16)
        eb, lb = pooled_and_logits(folded.to(torch.bfloat16), x_raw)
        a, f = (rel_l2(ea, emb), rel_l2(la, logits)), (rel_l2(eb, emb), rel_l2(lb, logits))
        ratios.append((f[0] / a[0], f[1] / a[1]))
        print(f"seed {seed}: published bf16 {a[0]:.2e}/{a[1]:.2e}, folded stem bf16 {f[0]:.2e}/{f[1]:.2e} "
              f"(embedding/logits); mean |bias| folded {b_folded:.2f}, unfolded {b:.2f}", flush=True)
    r = np.array(ratios)
    print(f"folded / published error, mean over {len(r)} seeds: embedding {r[:, 0].mean():.2f}x, "
          f"logits {r[:, 1].mean():.2f}x (max {r.max():.2f}x)")


if __name__ == "__main__":
    main()
