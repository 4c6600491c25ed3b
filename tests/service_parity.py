"""Whole-service parity on any backend: a diffusers AutoencoderKL with the `tiny-vae` preset's config
and a transformers ConvNextForImageClassification with the `tiny-convnext` preset's architecture,
every parameter random, saved with `save_pretrained` and served by a real `convserve serve`
(CONVSERVE_MODELS=vae=tiny-vae:<folder>,enc=tiny-convnext:<folder>). Requests go over HTTP; the
references are diffusers / transformers run by PyTorch in float32 on the CPU.

Used by tests/test_service_mlx.py (MLX, CI) and tests/gpu/test_service_gpu.py (CUDA, device)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from live_server import from_npy, metric, metric_sum, npy, scrape
from reference_checks import assert_informative, fresh_seed, rel_l2  # noqa: F401 (shared with the service tests)

# Latents 9x13 (not multiples of 8), batch 2; VAE-encode pixels 37x53 (odd, so diffusers' asymmetric
# downsample padding is exercised); ConvNeXt pixels already at the preset's input size (no resize).
DECODE_LATENTS = (2, 4, 9, 13)
VAE_ENCODE_PIXELS = (2, 3, 37, 53)
ENCODE_BATCH = 2
# the ImageNet normalisation ConvNeXt checkpoints are trained with (HF's preprocessor config)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


# ---- reference models ------------------------------------------------------------------------------
def make_vae(seed: int):
    """diffusers AutoencoderKL from the tiny-vae preset's config, every parameter off its init value
    (norm gains away from 1, biases nonzero) so a dropped or misnamed tensor shows."""
    torch, diffusers = pytest.importorskip("torch"), pytest.importorskip("diffusers")
    from models import PRESETS

    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(**PRESETS["tiny-vae"].config).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.mul_(1.0 + 0.1 * torch.randn_like(p))
    return vae


def make_convnext(seed: int):
    """transformers ConvNextForImageClassification with the tiny-convnext preset's stages, widths and
    head; HF's init leaves layer scale at 1e-6, norms at 1 and biases at 0, so all are redrawn."""
    torch, transformers = pytest.importorskip("torch"), pytest.importorskip("transformers")
    from models import PRESETS

    p = PRESETS["tiny-convnext"].config
    n = p["num_classes"]
    labels = {i: f"class-{i}" for i in range(n)}
    cfg = transformers.ConvNextConfig(depths=list(p["depths"]), hidden_sizes=list(p["dims"]), num_labels=n,
                                      id2label=labels, label2id={v: k for k, v in labels.items()},
                                      image_size=p["input_size"])
    model = transformers.ConvNextForImageClassification(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.ndim >= 2:
                t.copy_(torch.randn(t.shape, generator=g) / t[0].numel() ** 0.5)
            elif name.endswith("layer_scale_parameter"):
                t.copy_(0.3 + 0.5 * torch.rand(t.shape, generator=g))
            elif name.endswith("weight"):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
    return model


def vae_decode_ref(vae, latents: np.ndarray) -> np.ndarray:
    """What /decode?format=npy must answer: diffusers' decode of latents / scaling_factor, to [0,1] NHWC."""
    import torch
    with torch.no_grad():
        out = vae.decode(torch.from_numpy(latents) / vae.config.scaling_factor).sample
    return (out / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def vae_encode_ref(vae, pixels_nchw_pm1: np.ndarray) -> np.ndarray:
    """What remote_encode with the model's scaling_factor must answer: the scaled posterior mean."""
    import torch
    with torch.no_grad():
        mean = vae.encode(torch.from_numpy(pixels_nchw_pm1)).latent_dist.mean
    return (mean * vae.config.scaling_factor).numpy()


def convnext_ref(model, pixels_nhwc01: np.ndarray, mean, std) -> tuple[np.ndarray, np.ndarray]:
    """Pooled embedding and logits of the transformers model on mean/std-normalised pixels."""
    import torch
    x = torch.from_numpy(((pixels_nhwc01 - mean) / std).transpose(0, 3, 1, 2).copy())
    with torch.no_grad():
        base = model.convnext(x)
        return base.pooler_output.numpy(), model.classifier(base.pooler_output).numpy()


def softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@dataclass
class SavedModels:
    seed: int
    root: Path
    vae: object
    convnext: object

    def models_setting(self) -> str:
        """CONVSERVE_MODELS for the two saved folders."""
        return f"vae=tiny-vae:{self.root / 'vae'},enc=tiny-convnext:{self.root / 'enc'}"


def save_models(root: Path, seed: int | None = None) -> SavedModels:
    seed = fresh_seed() if seed is None else seed
    print(f"service parity seed {seed}")
    vae, convnext = make_vae(seed), make_convnext(seed + 1)
    vae.save_pretrained(root / "vae")
    convnext.save_pretrained(root / "enc", safe_serialization=True)
    return SavedModels(seed, root, vae, convnext)


# ---- the checks over HTTP --------------------------------------------------------------------------
@dataclass
class ParityReport:
    backend: str
    dtype: str
    errors: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        return [f"{self.backend} {self.dtype} {k}: rel L2 {v:.2e}" for k, v in self.errors.items()]


def _post(url: str, **kw):
    import httpx
    r = httpx.post(url, timeout=120, **kw)
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:500]}"
    return r


def check_cards_and_kernels(url: str, backend: str, dtype: str) -> None:
    import httpx
    cards = {c["name"]: c for c in httpx.get(f"{url}/v1/models", timeout=10).json()["models"]}
    assert set(cards) == {"vae", "enc"}
    for c in cards.values():
        assert c["backend"] == backend and c["dtype"] == dtype, c
        assert c["weights"] != "random init", "the saved folder was not loaded"
    assert cards["vae"]["has_encoder"] is True
    k = httpx.get(f"{url}/v1/kernels", timeout=10).json()
    assert k["backend"]["backend"] == backend and k["backend"]["dtype"] == dtype, k["backend"]
    assert k["conv_choices"], "warm-up ran convs, so path choices are memoised"


def check_decode(url: str, saved: SavedModels, rng: np.random.Generator, tol: float) -> float:
    lat = rng.standard_normal(DECODE_LATENTS).astype(np.float32)
    r = _post(f"{url}/v1/models/vae/decode", content=npy(lat), headers={"content-type": "application/x-npy"},
              params={"format": "npy"})
    ours = from_npy(r.content)
    ref = vae_decode_ref(saved.vae, lat)
    n, _, h, w = DECODE_LATENTS
    assert ours.shape == (n, 8 * h, 8 * w, 3) and ours.dtype == np.float32
    assert r.headers["x-output-shape"] == ",".join(map(str, ours.shape))
    assert_informative(ref, f"decode seed {saved.seed}")
    err = rel_l2(ours, ref)
    assert err < tol, f"decode seed {saved.seed}: rel L2 {err:.3e}"
    return err


def check_vae_encode(url: str, saved: SavedModels, rng: np.random.Generator, tol: float) -> float:
    """diffusers' remote_encode wire format: raw N,3,H,W float32 in [-1,1], the model's scaling_factor."""
    x = rng.uniform(-1, 1, VAE_ENCODE_PIXELS).astype(np.float32)
    sf = saved.vae.config.scaling_factor
    r = _post(f"{url}/v1/models/vae/vae/encode", content=x.tobytes(), headers={"content-type": "tensor/binary"},
              params={"shape": list(x.shape), "dtype": "float32", "scaling_factor": sf})
    shape = json.loads(r.headers["shape"])
    ours = np.frombuffer(r.content, dtype=np.dtype(r.headers["dtype"]).newbyteorder("<")).reshape(shape)
    ref = vae_encode_ref(saved.vae, x)
    err = rel_l2(ours, ref)
    assert err < tol, f"vae encode seed {saved.seed}: rel L2 {err:.3e}"
    return err


def check_encode(url: str, saved: SavedModels, rng: np.random.Generator, tol: float) -> tuple[float, float]:
    """ConvNeXt embedding (format=npy) and class probabilities (json top_k over every class)."""
    import httpx
    card = httpx.get(f"{url}/v1/models/enc", timeout=10).json()
    size = saved.convnext.config.image_size
    assert card["inputs"][0]["resized_to"][:2] == [size, size]
    np.testing.assert_allclose(card["config"]["mean"], IMAGENET_MEAN, rtol=1e-6)
    np.testing.assert_allclose(card["config"]["std"], IMAGENET_STD, rtol=1e-6)
    px = rng.random((ENCODE_BATCH, size, size, 3), dtype=np.float32)
    emb_ref, logits_ref = convnext_ref(saved.convnext, px, IMAGENET_MEAN, IMAGENET_STD)
    assert emb_ref.std() > 0.05, "reference embedding is flat: the check would prove nothing"

    r = _post(f"{url}/v1/models/enc/encode", content=npy(px), headers={"content-type": "application/x-npy"},
              params={"format": "npy"})
    emb = from_npy(r.content)
    emb_err = rel_l2(emb, emb_ref)
    assert emb_err < tol, f"embedding seed {saved.seed}: rel L2 {emb_err:.3e}"

    n_cls = logits_ref.shape[1]
    doc = _post(f"{url}/v1/models/enc/encode", content=npy(px), headers={"content-type": "application/x-npy"},
                params={"top_k": n_cls}).json()
    probs = np.zeros((ENCODE_BATCH, n_cls))
    for i, row in enumerate(doc["top_k"]):
        for item in row:
            probs[i, item["index"]] = item["score"]
            assert item["label"] == f"class-{item['index']}"
    prob_err = rel_l2(probs, softmax(logits_ref))
    assert prob_err < tol, f"class probabilities seed {saved.seed}: rel L2 {prob_err:.3e}"
    return emb_err, prob_err


def check_kernel_metrics(url: str, backend: str, before: dict) -> None:
    """Every conv counted under the expected backend label, and the requests added to the count."""
    after = scrape(url)
    series = {dict(lab)["backend"] for (n, lab), v in after.items() if n == "convkernels_conv_total" and v > 0}
    assert series == {backend}, f"convkernels_conv_total backends {series}, expected only {backend!r}"
    ran = metric_sum(after, "convkernels_conv_total", backend=backend)
    assert ran > metric_sum(before, "convkernels_conv_total", backend=backend), "requests ran no counted convs"
    for model, endpoint in (("vae", "decode"), ("vae", "vae_encode"), ("enc", "encode")):
        assert metric(after, "convserve_requests_total", model=model, endpoint=endpoint, status="200") >= 1


def run_all(url: str, saved: SavedModels, backend: str, dtype: str, tol: float) -> ParityReport:
    check_cards_and_kernels(url, backend, dtype)
    before = scrape(url)
    rng = np.random.default_rng(saved.seed)
    rep = ParityReport(backend, dtype)
    rep.errors["decode 2x4x9x13"] = check_decode(url, saved, rng, tol)
    rep.errors["vae-encode 2x3x37x53"] = check_vae_encode(url, saved, rng, tol)
    rep.errors["encode embedding"], rep.errors["encode probabilities"] = check_encode(url, saved, rng, tol)
    check_kernel_metrics(url, backend, before)
    return rep
