"""CUDA-graph replay of whole forwards (CONVSERVE_CUDA_GRAPHS, convkernels/backends/cuda_graphs.py):
every replay with fresh inputs matches the reference implementation (diffusers / transformers with
identical random weights, PyTorch fp32 on the same GPU), conv counters advance per replay as in an
eager run, the LRU bound evicts and recaptures correctly, and a forward that cannot be captured
(a host synchronisation inside it) still answers, eagerly. Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_support import cuda_or_skip
from torch_reference import rel_l2, torch

pytestmark = pytest.mark.gpu
TOL = 1e-2
TINY_VAE = dict(block_out_channels=(16, 32, 32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=4,
                sample_size=256, scaling_factor=0.18215)


@pytest.fixture(scope="module", autouse=True)
def gpu_reference_in_true_fp32():
    cuda_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here: the references run on the GPU")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def graphed_backend(capacity: int = 8, dtype: str = "float16"):
    from convkernels.backends.cuda_backend import CudaBackend
    return CudaBackend(dtype=dtype, cuda_graphs=True, graph_capacity=capacity)


def conv_count() -> float:
    """convkernels_conv_total summed over the cuda backend's series, read from the registry."""
    from convkernels import REGISTRY
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples
               if s.name == "convkernels_conv_total" and s.labels.get("backend") == "cuda")


def seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    diffusers = pytest.importorskip("diffusers")
    s = seed()
    torch.manual_seed(s)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, **TINY_VAE).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():  # every parameter away from its init value
            p.add_(0.05 * torch.randn_like(p)) if name.endswith("bias") else p.mul_(1.0 + 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_vae")
    vae.save_pretrained(path)
    return str(path), vae.cuda()


def reference_decode(vae, latents: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        ref = vae.decode(torch.from_numpy(latents).cuda() / TINY_VAE["scaling_factor"]).sample
    return (ref / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()


def test_replays_match_diffusers_and_count_their_convs(tiny_vae):
    from models import load_model

    path, vae = tiny_vae
    model = load_model("vae", "tiny-vae", graphed_backend(), weights=path)
    runner = model._decode_device
    rng = np.random.default_rng(seed())
    per_call = []
    for i in range(4):  # eager (plans), capture, replay, replay: fresh latents every time
        lat = rng.standard_normal((1, 4, 19, 13)).astype(np.float32)
        before = conv_count()
        ours = model.decode(lat, tiled=False)
        per_call.append(conv_count() - before)
        ref = reference_decode(vae, lat)
        assert 0.02 < float(ref.std())
        err = rel_l2(ours, ref)
        print(f"call {i}: rel L2 {err:.2e}, convs counted {per_call[-1]}")
        assert err < TOL, f"call {i}: {err:.3e}"
    assert runner.stats()["captures"] == 1 and runner.stats()["replays"] == 3, runner.stats()
    assert per_call[0] > 0 and len(set(per_call)) == 1, per_call  # replays count what an eager call counts


def test_lru_bound_evicts_and_recaptures_correctly(tiny_vae):
    from models import load_model

    path, vae = tiny_vae
    model = load_model("vae", "tiny-vae", graphed_backend(capacity=1), weights=path)
    rng = np.random.default_rng(seed())
    shapes = [(1, 4, 9, 11), (2, 4, 9, 11)] * 3
    for i, shape in enumerate(shapes):
        lat = rng.standard_normal(shape).astype(np.float32)
        err = rel_l2(model.decode(lat, tiled=False), reference_decode(vae, lat))
        assert err < TOL, f"call {i} {shape}: {err:.3e}"
    st = model._decode_device.stats()
    assert st["graphs"] == 1 and st["captures"] >= 3, st


def test_convnext_replays_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from models import load_model

    s = seed()
    torch.manual_seed(s)
    ref_model = transformers.ConvNextModel(transformers.ConvNextConfig(depths=[3, 3, 9, 3],
                                                                        hidden_sizes=[96, 192, 384, 768])).eval()
    g = torch.Generator().manual_seed(s)
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif name.endswith("layer_scale_parameter"):
                p.copy_(0.3 + 0.5 * torch.rand(p.shape, generator=g))
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    ref_model.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model("enc", "convnext-tiny", graphed_backend(), weights=str(tmp_path))
    ref_model = ref_model.cuda()
    rng = np.random.default_rng(s)
    for i in range(3):
        pixels = rng.random((2, 224, 224, 3), dtype=np.float32)
        out = model.encode(pixels)
        mean, std = np.asarray(model.mean, np.float32), np.asarray(model.std, np.float32)
        x = torch.from_numpy(((pixels - mean) / std).transpose(0, 3, 1, 2).copy()).cuda()
        with torch.no_grad():
            ref = ref_model(x).pooler_output.cpu().numpy()
        err = rel_l2(out["embedding"], ref)
        print(f"convnext call {i}: rel L2 {err:.2e}")
        assert err < TOL, f"call {i}: {err:.3e}"
    assert model._encode_device.stats()["replays"] == 2  # eager, capture + replay, replay


def test_a_forward_that_syncs_with_the_host_runs_eagerly():
    import cupy as cp

    be = graphed_backend()

    def forward(x):
        scale = float(x.max().get())  # a device -> host copy: illegal inside a capture
        return be.mul(x, 1.0 / scale)

    run = be.graphed(forward)
    for _ in range(3):
        x = cp.asarray(np.random.default_rng().random((4, 8), dtype=np.float32) + 0.5)
        want = cp.asnumpy(x) / float(cp.asnumpy(x).max())
        np.testing.assert_allclose(cp.asnumpy(run(x)), want, rtol=1e-6)
    st = run.stats()
    assert st["captures"] == 0 and len(st["ungraphable"]) == 1, st
