"""The sharded decode on real GPUs: each sharded family's decode split by latent rows over two GPUs, one process
each, joined by NCCL (service.worker.shard_group, convkernels.collectives.nccl), equals the unsharded decode on
one GPU; a rank that fails fails the call without hanging the others. Skipped with fewer than two
GPUs (the CPU emulation of the same code: tests/test_sharded_decode_emulated.py)."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_support import cuda_or_skip, report_parity
from torch_reference import fresh_seed, rel_l2

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def two_gpus():
    cuda_or_skip()
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs (a multi-GPU device kind)")
    from cupy.cuda import nccl  # noqa: F401  (CuPy built without NCCL: skip with the import error)


@pytest.mark.parametrize("preset,lat", [("tiny-vae", (2, 4, 13, 9)),   # uneven bands (7, 6), batch 2
                                        ("sd-vae", (1, 4, 24, 20))])   # the real SD decoder, attention
def test_two_gpu_decode_equals_one_gpu(preset, lat):
    from service.worker.shard_group import decode_on_gpus

    seed = fresh_seed()
    latents = np.random.default_rng(seed).standard_normal(lat).astype(np.float32)
    errors = {}
    whole32 = decode_on_gpus(preset, latents, ["0"], "float32", seed=seed, whole=True).images
    for dtype in ("float32", "float16"):
        sharded = decode_on_gpus(preset, latents, ["0", "1"], dtype, seed=seed).images
        assert sharded.shape == whole32.shape
        errors[dtype] = rel_l2(sharded, whole32)
        if dtype == "float16":
            whole16 = decode_on_gpus(preset, latents, ["0"], "float16", seed=seed, whole=True).images
            own = rel_l2(whole16, whole32)
            report_parity(f"sharded {preset} {lat} on 2 GPUs: float32 vs one GPU {errors['float32']:.2e}; "
                          f"float16 vs one GPU's float32 {errors['float16']:.2e} (one GPU's own float16: {own:.2e})")
            assert errors["float16"] < 1.5 * own + 1e-4, f"seed {seed}: {errors}"
    assert errors["float32"] < 1e-5, f"seed {seed}: {errors}"
    assert 0.02 < float(whole32.std()), "a flat image would prove nothing"


@pytest.mark.parametrize("plan, frames, replays", [
    ((1, True), 6, 3),  # chunks 0 | 1 | 2 | 3 | 4 | 5: the second decode captures at its third and replays on
    ((2, True), 8, 2),  # 0 | 1-2 | 3-4 | 5-6 | 7: runs of two, 3-4 and 5-6 steady, 7 shorter (eager)
])
def test_two_gpu_wan_decode_equals_one_gpu(plan, frames, replays):
    """The Wan 2.1 decoder (causal 3-D convs with row halos, per-frame attention) on two GPUs, one
    latent frame or runs of two at a time, its steady chunks (the third on) replayed from CUDA
    graphs that hold the collectives."""
    from service.worker.shard_group import decode_on_gpus

    seed = fresh_seed()
    latents = np.random.default_rng(seed).standard_normal((1, 4, frames, 9, 7)).astype(np.float32)
    whole = decode_on_gpus("tiny-wan-vae", latents, ["0"], "float32", seed=seed, whole=True).images
    result = decode_on_gpus("tiny-wan-vae", latents, ["0", "1"], "float32", seed=seed, chunk_plan=plan)
    sharded = result.images
    assert min(result.graph_replays) >= replays, f"graph replays per rank: {result.graph_replays}"
    err = rel_l2(sharded, whole)
    report_parity(f"sharded tiny-wan-vae {latents.shape} on 2 GPUs, runs of {plan[0]}: float32 vs one GPU {err:.2e}")
    assert sharded.shape == whole.shape and err < 1e-5, f"seed {seed}: {err:.3e}"


@pytest.mark.parametrize("preset,lat,plan", [
    ("tiny-flux2-vae", (2, 128, 7, 5), None),          # patched rows (4, 3), each two of the decoder's
    ("tiny-qwen-image-vae", (2, 16, 9, 7), None),       # the Wan 2.1 decoder on one frame
    ("tiny-wan2.2-vae", (1, 12, 3, 7, 5), None),        # DupUp3D shortcuts, 2x2 patches, runs by the band
    ("tiny-wan2.2-vae", (1, 12, 6, 7, 5), (1, True)),   # its steady chunks replayed from CUDA graphs
])
def test_two_gpu_decode_of_the_2026_families_equals_one_gpu(preset, lat, plan):
    """FLUX.2, Qwen-Image and Wan 2.2 (their sharded walks' parity against diffusers is
    tests/test_sharded_families_emulated.py's) on two GPUs, float32, against one GPU's decode."""
    from service.worker.shard_group import decode_on_gpus

    seed = fresh_seed()
    latents = np.random.default_rng(seed).standard_normal(lat).astype(np.float32)
    whole = decode_on_gpus(preset, latents, ["0"], "float32", seed=seed, whole=True).images
    result = decode_on_gpus(preset, latents, ["0", "1"], "float32", seed=seed, chunk_plan=plan)
    err = rel_l2(result.images, whole)
    report_parity(f"sharded {preset} {lat} on 2 GPUs{' graphed' if plan else ''}: float32 vs one GPU {err:.2e}")
    assert result.images.shape == whole.shape and err < 1e-5, f"seed {seed}: {err:.3e}"
    assert 0.02 < float(whole.std()), "a flat image would prove nothing"
    if plan:
        assert min(result.graph_replays) >= 3, f"graph replays per rank: {result.graph_replays}"


def test_a_failing_rank_fails_the_call_and_stops_the_others():
    from service.worker.shard_group import decode_on_gpus

    latents = np.zeros((1, 4, 8, 8), np.float32)
    with pytest.raises(RuntimeError, match="rank 1 .*injected failure"):
        decode_on_gpus("tiny-vae", latents, ["0", "1"], "float32", fail_rank=1, timeout_s=300)


@pytest.mark.parametrize("preset,channels,pixels", [
    ("tiny-vae", 4, 3),
    ("tiny-qwen-image2.1-vae", 8, 4),  # a decoder with alpha: RGBA by default, sharded as on one GPU
])
def test_the_cli_decodes_on_two_gpus_as_on_one(tmp_path, preset, channels, pixels):
    """`convserve decode --shards 2` writes what the one-GPU local decode writes (float32 .npy)."""
    from typer.testing import CliRunner

    from service.cli.main import app

    lat = tmp_path / "lat.npy"
    np.save(lat, np.random.default_rng(fresh_seed()).standard_normal((1, channels, 11, 9)).astype(np.float32))
    env = {"CONVSERVE_DTYPE": "float32"}
    runner = CliRunner()
    for name, extra in (("one.npy", []), ("two.npy", ["--shards", "2"])):
        res = runner.invoke(app, ["decode", str(lat), "-o", str(tmp_path / name), "--backend", "cuda",
                                  "--preset", preset, *extra], env=env)
        assert res.exit_code == 0, res.output
    one, two = np.load(tmp_path / "one.npy"), np.load(tmp_path / "two.npy")
    assert one.shape[-1] == two.shape[-1] == pixels
    assert rel_l2(two, one) < 1e-5
    assert rel_l2(two[..., -1], one[..., -1]) < 1e-5  # alpha on its own where there is one
