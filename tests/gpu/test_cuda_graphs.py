"""CUDA-graph replay of whole forwards (CONVSERVE_CUDA_GRAPHS, on by default,
convkernels/backends/cuda/graphs.py): every replay with fresh inputs matches the reference
implementation (diffusers / transformers with identical random weights, PyTorch fp32 on the CPU),
every model forward in every dtype and path setting is captured (none falls back to eager), the
cuBLAS C-API matmuls capture, conv counters advance per replay as in an eager run, the LRU bound
evicts and recaptures correctly, a plan cache too small to hold a forward's plans defers and then
gives up capturing (still answering), and a forward that cannot be captured (a host
synchronisation inside it) still answers, eagerly. Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import cuda_or_skip
from service_parity import convnext_ref, fresh_seed, rel_l2, save_models, vae_decode_ref

pytestmark = pytest.mark.gpu
TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def needs_cuda():
    cuda_or_skip()


def graphed_backend(capacity: int = 8, dtype: str = "float16", **options):
    from convkernels.backends.cuda.backend import CudaBackend
    from convkernels.backends.cuda.options import CudaOptions
    return CudaBackend(CudaOptions(dtype=dtype, cuda_graphs=True, graph_capacity=capacity, **options))


def replays_total() -> float:
    from convkernels import REGISTRY
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples
               if s.name == "convkernels_cuda_graph_replays_total" and s.labels.get("backend") == "cuda")


def test_graphs_are_on_by_default():
    from convkernels import get_backend
    from convkernels.backends.cuda.graphs import GraphedForward

    be = get_backend("cuda")
    assert be.cuda_graphs and isinstance(be.graphed(lambda x: x), GraphedForward)
    assert not get_backend("cuda", cuda_options={"cuda_graphs": False}).cuda_graphs


@pytest.mark.parametrize("dtype,options", [
    ("float16", {}),
    ("bfloat16", {}),
    ("float32", {}),
    ("float16", {"force_fallback": True}),   # gemm_fallback: im2col + cuBLAS C-API matmuls
    ("float16", {"autotune": True}),         # path measurement and plan autotune before capture
], ids=["fp16", "bf16", "fp32", "fp16-fallback", "fp16-autotune"])
def test_every_vae_forward_is_captured_and_replays_match_diffusers(saved, dtype, options):
    from models import load_model

    model = load_model("vae", "tiny-vae", graphed_backend(dtype=dtype, **options), weights=str(saved.root / "vae"))
    rng = np.random.default_rng(fresh_seed())
    before = replays_total()
    for i in range(3):  # eager, capture + replay, replay
        lat = rng.standard_normal((1, 4, 13, 11)).astype(np.float32)
        err = rel_l2(model.decode(lat, tiled=False), vae_decode_ref(saved.vae, lat))
        print(f"{dtype} {options} call {i}: rel L2 {err:.2e}")
        assert err < TOL, f"call {i}: {err:.3e}"
    stats = model._decode_device.stats()
    assert stats["ungraphable"] == {} and stats["captures"] == 1 and stats["replays"] == 2, stats
    assert replays_total() - before == 2
    assert stats["pool_bytes"] > 0


def test_captured_matmuls_linear_and_attention_match_torch():
    """cuBLAS through its C API inside a capture: a transposed-weight linear and a chunked
    attention (strided-batched products on views), replayed with fresh inputs."""
    import cupy as cp
    import torch

    be = graphed_backend()
    rng = np.random.default_rng(fresh_seed())
    w = rng.standard_normal((24, 40)).astype(np.float32) / 6
    wd = be.asarray(w)

    def forward(x):
        h = be.linear(x, wd)
        return be.attention(h, h, h)

    run = be.graphed(forward)
    for i in range(3):
        xh = rng.standard_normal((3, 37, 40)).astype(np.float32)
        ours = be.to_host(run(be.asarray(xh)))
        ht = torch.from_numpy(xh.astype(np.float64)) @ torch.from_numpy(w.astype(np.float64)).T
        ref = torch.nn.functional.scaled_dot_product_attention(ht, ht, ht).numpy()
        assert rel_l2(ours, ref) < TOL, f"call {i}"
    stats = run.stats()
    assert stats["ungraphable"] == {} and stats["replays"] == 2, stats
    cp.cuda.get_current_stream().synchronize()


def test_a_plan_cache_too_small_for_the_forward_defers_then_gives_up_capturing(saved):
    """Every capture meets a plan the LRU plan cache dropped: building it is eager-only work,
    so the capture is deferred (that call runs eagerly) and, after a few tries, abandoned for
    the shape. Every answer stays right."""
    from convkernels.backends.cuda.graphs import MAX_MISSED_CAPTURES
    from models import load_model

    model = load_model("vae", "tiny-vae", graphed_backend(plan_cache_capacity=1), weights=str(saved.root / "vae"))
    rng = np.random.default_rng(fresh_seed())
    for i in range(MAX_MISSED_CAPTURES + 2):
        lat = rng.standard_normal((1, 4, 7, 9)).astype(np.float32)
        err = rel_l2(model.decode(lat, tiled=False), vae_decode_ref(saved.vae, lat))
        assert err < TOL, f"call {i}: {err:.3e}"
    stats = model._decode_device.stats()
    assert stats["captures"] == 0 and len(stats["ungraphable"]) == 1, stats
    assert "CaptureMissed" in next(iter(stats["ungraphable"].values()))


def conv_count() -> float:
    """convkernels_conv_total summed over the cuda backend's series, read from the registry."""
    from convkernels import REGISTRY
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples
               if s.name == "convkernels_conv_total" and s.labels.get("backend") == "cuda")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny-vae and tiny-convnext presets as diffusers / transformers models with random
    weights, saved and reloadable by models.load_model (tests/service_parity.py)."""
    return save_models(tmp_path_factory.mktemp("graph_models"))


def test_replays_match_diffusers_and_count_their_convs(saved):
    from models import load_model

    model = load_model("vae", "tiny-vae", graphed_backend(), weights=str(saved.root / "vae"))
    rng = np.random.default_rng(fresh_seed())
    per_call = []
    for i in range(4):  # eager (plans), capture + replay, replay, replay: fresh latents every time
        lat = rng.standard_normal((1, 4, 19, 13)).astype(np.float32)
        before = conv_count()
        ours = model.decode(lat, tiled=False)
        per_call.append(conv_count() - before)
        ref = vae_decode_ref(saved.vae, lat)
        assert 0.02 < float(ref.std())
        err = rel_l2(ours, ref)
        print(f"call {i}: rel L2 {err:.2e}, convs counted {per_call[-1]}")
        assert err < TOL, f"call {i}: {err:.3e}"
    stats = model._decode_device.stats()
    assert stats["captures"] == 1 and stats["replays"] == 3, stats
    assert per_call[0] > 0 and len(set(per_call)) == 1, per_call  # replays count what an eager call counts


def test_lru_bound_evicts_and_recaptures_correctly(saved):
    from models import load_model

    model = load_model("vae", "tiny-vae", graphed_backend(capacity=1), weights=str(saved.root / "vae"))
    rng = np.random.default_rng(fresh_seed())
    for i, shape in enumerate([(1, 4, 9, 11), (2, 4, 9, 11)] * 3):
        lat = rng.standard_normal(shape).astype(np.float32)
        err = rel_l2(model.decode(lat, tiled=False), vae_decode_ref(saved.vae, lat))
        assert err < TOL, f"call {i} {shape}: {err:.3e}"
    stats = model._decode_device.stats()
    assert stats["graphs"] == 1 and stats["captures"] >= 3, stats


def test_a_graph_over_the_byte_bound_is_dropped_and_its_shape_runs_eagerly(saved):
    from models import load_model

    model = load_model("vae", "tiny-vae", graphed_backend(graph_max_bytes=1), weights=str(saved.root / "vae"))
    rng = np.random.default_rng(fresh_seed())
    for i in range(4):  # eager, capture (dropped: over the bound) and eager, then eager twice
        lat = rng.standard_normal((1, 4, 9, 11)).astype(np.float32)
        err = rel_l2(model.decode(lat, tiled=False), vae_decode_ref(saved.vae, lat))
        assert err < TOL, f"call {i}: {err:.3e}"
    stats = model._decode_device.stats()
    assert stats["captures"] == 0 and stats["replays"] == 0 and stats["graphs"] == 0, stats
    assert list(stats["too_large"].values())[0] > 1 and stats["ungraphable"] == {}, stats


def test_convnext_replays_match_transformers(saved):
    from models import load_model

    model = load_model("enc", "tiny-convnext", graphed_backend(), weights=str(saved.root / "enc"))
    rng = np.random.default_rng(fresh_seed())
    for i in range(3):  # embedding and logits: a tuple of outputs, copied out of the graph's pool
        pixels = rng.random((2, 64, 64, 3), dtype=np.float32)
        out = model.encode(pixels)
        emb, logits = convnext_ref(saved.convnext, pixels, np.float32(model.mean), np.float32(model.std))
        errs = rel_l2(out["embedding"], emb), rel_l2(out["logits"], logits)
        print(f"convnext call {i}: rel L2 embedding {errs[0]:.2e}, logits {errs[1]:.2e}")
        assert max(errs) < TOL, f"call {i}: {errs}"
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
    stats = run.stats()
    assert stats["captures"] == 0 and len(stats["ungraphable"]) == 1, stats


def test_a_graph_holds_its_cudnn_workspace_when_a_later_conv_replaces_it(saved):
    """The backend's cuDNN workspace is the one buffer a graph writes that is not in its private
    pool. A later eager conv needing more workspace swaps in a larger buffer; the graph keeps the
    old one alive, so nothing allocated afterwards lands where the replays write their scratch."""
    import cupy as cp

    from models import load_model

    be = graphed_backend()
    model = load_model("vae", "tiny-vae", be, weights=str(saved.root / "vae"))
    rng = np.random.default_rng(fresh_seed())
    shape = (1, 4, 11, 9)
    for _ in range(2):  # eager, then capture + replay
        model.decode(rng.standard_normal(shape).astype(np.float32), tiled=False)
    (entry,) = model._decode_device.captured()
    captured_ws = be.convs.workspace
    assert any(k is captured_ws for k in entry.kept), "the graph does not hold the workspace it captured"
    del captured_ws  # only the graph may keep it alive now
    be.convs.workspace = None  # as a larger workspace would: the backend lets go of the captured one
    model.decode(rng.standard_normal((1, 4, 23, 17)).astype(np.float32), tiled=False)  # eager, new shape
    fill = [cp.full(1 << 20, 7.0, dtype=cp.float32) for _ in range(8)]  # allocations after the swap
    for i in range(2):
        lat = rng.standard_normal(shape).astype(np.float32)
        err = rel_l2(model.decode(lat, tiled=False), vae_decode_ref(saved.vae, lat))
        assert err < TOL, f"replay {i} after the workspace swap: {err:.3e}"
    assert all(float(f.min()) == 7.0 == float(f.max()) for f in fill), "a replay wrote into later allocations"


def test_tiled_decode_replays_one_graph_per_repeated_tile_shape(saved):
    """A tiled decode sends every tile through the graphed forward: tiles of one shape are
    captured once and replayed (tiled decodes through CUDA graphs). The result matches diffusers' own tiled
    decode with the same tile size and overlap."""
    import torch

    from models import load_model
    from models.autoencoder_kl import AutoencoderKLOptions

    tile = 8
    model = load_model("vae", "tiny-vae", graphed_backend(), weights=str(saved.root / "vae"),
                       options=AutoencoderKLOptions(tile_latent_size=tile))
    lat = np.random.default_rng(fresh_seed()).standard_normal((1, 4, 21, 19)).astype(np.float32)
    ours = model.decode(lat, tiled=True)
    vae = saved.vae
    vae.enable_tiling()
    saved_sizes = vae.tile_latent_min_size, vae.tile_sample_min_size
    vae.tile_latent_min_size, vae.tile_sample_min_size = tile, tile * 8
    try:
        with torch.no_grad():
            ref = vae_decode_ref(vae, lat)
    finally:
        vae.disable_tiling()
        vae.tile_latent_min_size, vae.tile_sample_min_size = saved_sizes
    err = rel_l2(ours, ref)
    stats = model._decode_device.stats()
    print(f"tiled decode: rel L2 {err:.2e}, {stats}")
    assert err < TOL, f"{err:.3e}"
    assert stats["ungraphable"] == {} and stats["captures"] >= 1 and stats["replays"] >= 2, stats


def test_a_forward_failing_on_its_input_marks_nothing():
    """A capture that fails where the eager run of the same input fails too (bad data, an
    injected fault) is the forward's error, not the capture's: the call raises, and the next
    call of the shape is captured."""
    import cupy as cp

    be = graphed_backend()
    runs = {"n": 0}

    def forward(x):
        runs["n"] += 1
        if runs["n"] in (2, 3):  # the capture attempt and its eager retry
            raise RuntimeError("injected forward failure")
        return be.mul(x, 2.0)

    run = be.graphed(forward)
    x = cp.asarray(np.random.default_rng().random((3, 5), dtype=np.float32))
    np.testing.assert_array_equal(cp.asnumpy(run(x)), 2 * cp.asnumpy(x))  # eager
    with pytest.raises(RuntimeError, match="injected"):
        run(x)
    assert run.stats()["ungraphable"] == {}
    for _ in range(2):  # captured now, then replayed
        np.testing.assert_array_equal(cp.asnumpy(run(x)), 2 * cp.asnumpy(x))
    stats = run.stats()
    assert stats["captures"] == 1 and stats["replays"] == 2 and stats["ungraphable"] == {}, stats
