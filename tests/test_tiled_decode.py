"""Tiled decode vs diffusers' own tiled decode (enable_tiling, same tile size and overlap), the
auto-tiling decision, and peak memory under a budget."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from convkernels import get_backend
from models import load_model
from models.nn import tiling
from models.autoencoder_kl import AutoencoderKLOptions

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from reference_checks import assert_informative  # noqa: E402
from test_models_vae import SD_LIKE, diffusers_decode, diffusers_encode, fresh_seed, make_vae, rel_l2  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def backend():
    return get_backend("numpy")


@pytest.fixture(scope="module")
def vae_and_model(tmp_path_factory, backend):
    seed = fresh_seed()
    vae = make_vae(SD_LIKE, seed)  # sample_size 64 -> diffusers tiles of 8 latents / 64 pixels
    path = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(path)
    return vae, str(path), seed


@pytest.mark.parametrize("tile_latent,size", [(None, (1, 19, 27)), (12, (2, 29, 17)), (16, (1, 10, 37))])
def test_tiled_matches_diffusers_tiled(vae_and_model, backend, tile_latent, size):
    vae, path, seed = vae_and_model
    model = load_model("vae", "sd-vae", backend, weights=path, options=AutoencoderKLOptions(tile_latent_size=tile_latent))
    vae.enable_tiling()
    if tile_latent is not None:
        vae.tile_latent_min_size, vae.tile_sample_min_size = tile_latent, tile_latent * 8
    try:
        lat = np.random.default_rng(seed).standard_normal((size[0], 4, size[1], size[2])).astype(np.float32)
        ref = diffusers_decode(vae, lat)
    finally:
        vae.disable_tiling()
        vae.tile_latent_min_size, vae.tile_sample_min_size = 8, 64
    ours = model.decode(lat, tiled=True)
    assert_informative(ref, f"tile {tile_latent} size {size} seed {seed}")
    err = rel_l2(ours, ref)
    assert err < TOL, f"tile {tile_latent} size {size} seed {seed}: rel L2 {err:.2e}"
    # tiled is not untiled: GroupNorm statistics are per tile, in diffusers as here
    untiled = model.decode(lat, tiled=False)
    diff = rel_l2(ours, untiled)
    print(f"tiled vs untiled, tile {tile_latent or 8} latents, {size}: rel L2 {diff:.3e}, "
          f"max abs {np.abs(ours - untiled).max():.3e}")
    assert np.isfinite(diff) and 0 < diff < 0.5


@pytest.mark.parametrize("tile_latent,size", [(None, (1, 130, 90)), (12, (2, 101, 203))])
def test_tiled_encode_matches_diffusers_tiled(vae_and_model, backend, tile_latent, size):
    vae, path, seed = vae_and_model
    model = load_model("vae", "sd-vae", backend, weights=path, options=AutoencoderKLOptions(tile_latent_size=tile_latent))
    img = np.random.default_rng(seed + 2).uniform(0, 1, (*size, 3)).astype(np.float32)
    vae.enable_tiling()
    if tile_latent is not None:
        vae.tile_latent_min_size, vae.tile_sample_min_size = tile_latent, tile_latent * 8
    try:
        ref = diffusers_encode(vae, img)
    finally:
        vae.disable_tiling()
        vae.tile_latent_min_size, vae.tile_sample_min_size = 8, 64
    ours = model.encode(img, tiled=True)
    err = rel_l2(ours, ref)
    assert err < TOL, f"tiled encode, tile {tile_latent} size {size} seed {seed}: rel L2 {err:.2e}"
    untiled = model.encode(img, tiled=False)
    diff = rel_l2(ours, untiled)
    print(f"tiled vs untiled encode, tile {tile_latent or 8} latents, {size}: rel L2 {diff:.3e}")
    assert np.isfinite(diff) and 0 < diff < 1.0


def test_inconsistent_tile_size_is_refused(vae_and_model, backend):
    # diffusers would decode 10x23 latents to 84x196 with 10-latent tiles: we refuse the setting
    with pytest.raises(ValueError, match="inconsistently"):
        load_model("vae", "sd-vae", backend, weights=vae_and_model[1], options=AutoencoderKLOptions(tile_latent_size=10))


def test_auto_tiling_follows_the_budget(vae_and_model, backend):
    vae, path, seed = vae_and_model
    lat = np.random.default_rng(seed + 1).standard_normal((1, 4, 20, 14)).astype(np.float32)
    roomy = load_model("vae", "sd-vae", backend, weights=path, options=AutoencoderKLOptions(memory_budget_bytes=1 << 34))
    assert tiling.plan_decode(roomy, (1, 20, 14, 4), None) is None
    np.testing.assert_array_equal(roomy.decode(lat), roomy.decode(lat, tiled=False))
    # a budget between one tile's working set and the whole decode's: tiles of the set size
    tight_budget = tiling.estimate_tiled_peak_bytes(roomy, 1, 20, 14, 8) + 1
    assert tight_budget < tiling.estimate_decode_peak_bytes(roomy, 1, 20, 14)
    tight = load_model("vae", "sd-vae", backend, weights=path,
                       options=AutoencoderKLOptions(memory_budget_bytes=tight_budget))
    plan = tiling.plan_decode(tight, (1, 20, 14, 4), None)
    assert plan is not None and plan.tile_latent == 8
    np.testing.assert_array_equal(tight.decode(lat), tight.decode(lat, tiled=True))
    # latents that fit in one tile are never tiled (diffusers' rule), whatever the budget
    assert tiling.plan_decode(tight, (1, 8, 8, 4), True) is None


def test_the_default_budget_is_the_backends_work_memory(vae_and_model):
    """Without memory_budget_bytes a model takes its backend's work_memory_budget (the cuda
    backend sizes it from the card), so one decode tiles on a small budget and not on a large."""
    path = vae_and_model[1]
    shape = (1, 20, 14, 4)
    small, large = get_backend("numpy"), get_backend("numpy")
    small.work_memory_budget = tiling.estimate_tiled_peak_bytes(
        load_model("probe", "sd-vae", large, weights=path), 1, 20, 14, 8) + 1
    large.work_memory_budget = 1 << 34
    tiles = load_model("vae", "sd-vae", small, weights=path)
    whole = load_model("vae", "sd-vae", large, weights=path)
    assert tiles.tiling.memory_budget_bytes == small.work_memory_budget
    assert tiling.plan_decode(tiles, shape, None) is not None
    assert tiling.plan_decode(whole, shape, None) is None


def test_attention_bounded_by_bytes_does_not_tile_a_decode_that_fits(vae_and_model):
    """A backend that bounds its attention score blocks by size (cuda: attention_score_bytes)
    holds scores of that size whatever the token count: counting the whole token x token matrix
    instead (48 GiB at 2048x2048) tiled decodes that fit, and tiling changes the output."""
    path = vae_and_model[1]
    rows, by_bytes = get_backend("numpy"), get_backend("numpy")
    rows.attention_chunk = by_bytes.attention_chunk = None  # unbounded by rows
    by_bytes.attention_score_bytes = 256 << 20
    unbounded = tiling.estimate_decode_peak_bytes(load_model("a", "sd-vae", rows, weights=path), 1, 256, 256)
    budget = tiling.estimate_decode_peak_bytes(load_model("b", "sd-vae", by_bytes, weights=path), 1, 256, 256) + 1
    assert budget < unbounded / 4
    rows.work_memory_budget = by_bytes.work_memory_budget = budget
    assert tiling.plan_decode(load_model("c", "sd-vae", by_bytes, weights=path), (1, 256, 256, 4), None) is None
    assert tiling.plan_decode(load_model("d", "sd-vae", rows, weights=path), (1, 256, 256, 4), None) is not None


def test_estimate_covers_measured_peak(backend):
    """The untiled estimate that drives auto tiling must not undershoot numpy's real peak."""
    import tracemalloc
    model = load_model("demo", "tiny-vae", backend)
    lat = np.random.default_rng().standard_normal((1, 4, 24, 20)).astype(np.float32)
    model.decode(lat, tiled=False)  # first sight of a shape autotunes its convs: not steady state
    tracemalloc.start()
    try:
        model.decode(lat, tiled=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    est = tiling.estimate_decode_peak_bytes(model, 1, 24, 20)
    print(f"untiled 24x20 tiny-vae: traced peak {peak / 2**20:.1f} MiB, estimate {est / 2**20:.1f} MiB")
    assert peak <= est


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_large_decode_stays_within_budget():
    """512x512 output from tiny-vae under a 64 MiB budget (auto tiling picks 16-latent tiles), peak RSS measured in a fresh process."""
    budget = 64 << 20
    code = textwrap.dedent(f"""
        import numpy as np
        from convkernels import get_backend
        from models import load_model
        from models.autoencoder_kl import AutoencoderKLOptions

        def status(field):  # kB figures of /proc/self/status
            for line in open("/proc/self/status"):
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

        m = load_model("t", "tiny-vae", get_backend("numpy"), options=AutoencoderKLOptions(memory_budget_bytes={budget}))
        lat = np.random.default_rng(0).standard_normal((1, 4, 64, 64)).astype(np.float32)
        m.decode(lat[:, :, :8, :8])
        # ru_maxrss survives exec (it would report pytest's peak): reset the per-process
        # high-water mark instead and read it back
        open("/proc/self/clear_refs", "w").write("5")
        base = status("VmRSS")
        img = m.decode(lat)
        peak = status("VmHWM")
        assert img.shape == (1, 512, 512, 3) and np.isfinite(img).all()
        print(peak - base)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    delta = int(res.stdout.strip().splitlines()[-1])
    print(f"512x512 tiny-vae decode: peak RSS growth {delta / 2**20:.1f} MiB, budget {budget / 2**20:.0f} MiB")
    assert delta <= budget
