"""Weights by Hugging Face Hub reference (models/hub.py), with no network: a Hub cache directory in
huggingface_hub's real on-disk layout (`models--org--name/blobs`, `snapshots/<commit>/...` links
into the blobs, `refs/<branch or tag>`), filled from small random checkpoints that diffusers and
transformers save, read with HF_HUB_OFFLINE=1 and HF_HUB_CACHE through the public API, the CLI and
a live server. References: the same checkpoint loaded from its folder, and diffusers/transformers."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from live_server import REPO, from_npy, npy, start_server
from reference_checks import cross_process_atol
from service_parity import (IMAGENET_MEAN, IMAGENET_STD, convnext_ref, fresh_seed, make_convnext, make_vae,
                            rel_l2, vae_decode_ref)

pytest.importorskip("huggingface_hub")

PIPE = "testorg/tiny-pipe"       # a diffusers pipeline-style repository: the VAE under vae/
ENC = "testorg/tiny-convnext"    # a transformers model repository: files at the root
PICKLE_ONLY = "testorg/pickle-only"


def _commit(seed: int) -> str:
    return hashlib.sha1(f"commit {seed} {os.urandom(8).hex()}".encode()).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, Path], refs: tuple[str, ...] = ()) -> Path:
    """Lay `files` (path in the repository -> a file on disk) out as huggingface_hub stores a
    download: content-addressed blobs (sha256 for LFS files, the git blob sha1 otherwise),
    relative links to them under snapshots/<commit>/, and refs/<name> holding the commit."""
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo_dir / "snapshots" / commit
    for rel, src in files.items():
        data = src.read_bytes()
        lfs = not rel.endswith(".json")
        etag = hashlib.sha256(data).hexdigest() if lfs else \
            hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = repo_dir / "blobs" / etag
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo_dir / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snap


def folder_files(folder: Path, prefix: str = "") -> dict[str, Path]:
    return {prefix + p.name: p for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Two commits of PIPE (main = the newer; tag v1 = the older), one of ENC, one pickle-only repo."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    seed = fresh_seed()
    print(f"hub test seed {seed}")
    vaes, commits = {}, {}
    for tag, s in (("old", seed), ("new", seed + 1)):
        vae = make_vae(s)
        vae.save_pretrained(root / tag / "vae")
        (root / tag / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
        commits[tag] = _commit(s)
        vaes[tag] = vae
    add_snapshot(cache, PIPE, commits["old"], {"model_index.json": root / "old" / "model_index.json",
                                               **folder_files(root / "old" / "vae", "vae/")}, refs=("v1",))
    add_snapshot(cache, PIPE, commits["new"], {"model_index.json": root / "new" / "model_index.json",
                                               **folder_files(root / "new" / "vae", "vae/")}, refs=("main",))
    enc = make_convnext(seed + 2)
    enc.save_pretrained(root / "enc", safe_serialization=True)
    commits["enc"] = _commit(seed + 2)
    add_snapshot(cache, ENC, commits["enc"], folder_files(root / "enc"), refs=("main",))
    # transformers 5 saves only safetensors: the pickle file is torch.save's, as older releases wrote it
    import torch
    (root / "pickle").mkdir()
    torch.save(enc.state_dict(), root / "pickle" / "pytorch_model.bin")
    (root / "pickle" / "config.json").write_bytes((root / "enc" / "config.json").read_bytes())
    add_snapshot(cache, PICKLE_ONLY, _commit(seed + 3), folder_files(root / "pickle"), refs=("main",))
    return {"cache": cache, "root": root, "vaes": vaes, "enc": enc, "commits": commits}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.delenv("HF_HOME", raising=False)
    return hub


@pytest.fixture(scope="module")
def backend():
    from convkernels import get_backend
    return get_backend("numpy")


# ---- the reference grammar --------------------------------------------------------------------------
@pytest.mark.parametrize("text,repo,sub,rev", [
    ("stabilityai/sd-vae-ft-mse", "stabilityai/sd-vae-ft-mse", None, None),
    ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers/vae@0123abc", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "vae", "0123abc"),
    ("facebook/convnext-tiny-224@v1.0", "facebook/convnext-tiny-224", None, "v1.0"),
    ("hf://org/name/a/b@refs/pr/3", "org/name", "a/b", "refs/pr/3"),
])
def test_hub_references_parse(text, repo, sub, rev, tmp_path, monkeypatch):
    from models.hub import HubRef, parse_weights
    monkeypatch.chdir(tmp_path)
    assert parse_weights(text) == HubRef(repo, sub, rev)


@pytest.mark.parametrize("text", ["tinyvae", "org//name", "org/name@", "/org/name", "org/na me", "org/-name",
                                  "org/name@a..b", "org--x/name", "hf://justone"])
def test_malformed_references_list_the_accepted_forms(text, tmp_path, monkeypatch):
    from models.hub import HubError, parse_hub_ref, parse_weights
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubError, match="accepted weights forms") as err:
        parse_weights(text) if not text.startswith("/") else parse_hub_ref(text)
    assert repr(text) in str(err.value)


def test_local_paths_win_and_ambiguous_names_are_refused(tmp_path, monkeypatch):
    from models.hub import HubError, HubRef, parse_weights
    from service.settings import parse_models
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_weights("org/name") == "org/name"              # exists: the local folder
    assert parse_weights("./missing/dir") == "./missing/dir"    # path-like: stays a path
    assert parse_weights("org2/x.safetensors") == "org2/x.safetensors"
    assert parse_weights("hf://org/name") == HubRef("org/name")  # the scheme forces the Hub
    with pytest.raises(HubError, match="ambiguous.*hf://org/other"):
        parse_weights("org/other")                                # org/ is here, org/other is not
    with pytest.raises(ValueError, match="accepted weights forms"):
        parse_models("sd=sd-vae:not-a-reference")
    assert parse_models("wan=wan2.1-vae:Wan-AI/W/vae@abc")[0].weights == "Wan-AI/W/vae@abc"


# ---- loading through the public API -----------------------------------------------------------------
def _decode(model, lat):
    return model.decode(lat, tiled=False)


def test_vae_from_hub_matches_the_folder_and_diffusers(offline, backend):
    from models import load_model
    hub, rng = offline, np.random.default_rng(fresh_seed())
    lat = rng.standard_normal((2, 4, 7, 11)).astype(np.float32)
    ours = load_model("sd", "tiny-vae", backend, weights=f"{PIPE}/vae")
    folder = load_model("sd", "tiny-vae", backend, weights=str(hub["root"] / "new" / "vae"))
    np.testing.assert_array_equal(_decode(ours, lat), _decode(folder, lat))
    assert rel_l2(_decode(ours, lat), vae_decode_ref(hub["vaes"]["new"], lat)) < 1e-5
    prov = ours.weights_provenance
    assert prov["repo"] == PIPE and prov["subfolder"] == "vae" and prov["revision"] == "main"
    assert prov["commit"] == hub["commits"]["new"]
    assert ours.card()["weights"] == f"hf://{PIPE}/vae@{hub['commits']['new']}"
    saved = hub["root"] / "new" / "vae"
    assert prov["files"] == {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                             for p in saved.iterdir()}


@pytest.mark.parametrize("pin", ["v1", "commit"])
def test_revision_pinning_picks_that_snapshot(offline, backend, pin):
    from models import load_model
    hub, rng = offline, np.random.default_rng(fresh_seed())
    old = hub["commits"]["old"]
    rev = old if pin == "commit" else pin
    lat = rng.standard_normal((1, 4, 9, 5)).astype(np.float32)
    pinned = load_model("sd", "tiny-vae", backend, weights=f"{PIPE}/vae@{rev}")
    latest = load_model("sd", "tiny-vae", backend, weights=f"{PIPE}/vae")
    assert pinned.weights_provenance["commit"] == old and pinned.weights_provenance["revision"] == rev
    assert rel_l2(_decode(pinned, lat), vae_decode_ref(hub["vaes"]["old"], lat)) < 1e-5
    assert rel_l2(_decode(pinned, lat), _decode(latest, lat)) > 1e-3, "both revisions decode alike"


def test_convnext_from_hub_matches_transformers(offline, backend):
    from models import load_model
    hub, rng = offline, np.random.default_rng(fresh_seed())
    model = load_model("enc", "tiny-convnext", backend, weights=ENC)
    px = rng.random((2, model.input_size, model.input_size, 3), dtype=np.float32)
    out = model.encode(px)
    emb, logits = convnext_ref(hub["enc"], px, IMAGENET_MEAN, IMAGENET_STD)
    assert rel_l2(out["embedding"], emb) < 1e-5 and rel_l2(out["logits"], logits) < 1e-5
    assert model.weights_provenance["commit"] == hub["commits"]["enc"]


def test_wan_vae_from_a_pipeline_subfolder_pinned_by_commit(offline, backend, tmp_path, request):
    """`wan=wan2.1-vae:Wan-AI/Wan2.1-T2V-1.3B-Diffusers/vae@<commit>` at test size."""
    from models import load_model
    from test_models_wan import WAN_SMALL, make_reference, reference_decode
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # diffusers' many small ops crawl with an oversubscribed pool on 2 shared cores
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    seed, cache = fresh_seed(), offline["cache"]
    vae, folder, config = make_reference(tmp_path, WAN_SMALL, seed)
    commit = _commit(seed)
    add_snapshot(cache, "testorg/tiny-wan-pipe", commit, folder_files(folder, "vae/"), refs=("main",))
    model = load_model("wan", "tiny-wan-vae", backend, weights=f"testorg/tiny-wan-pipe/vae@{commit}")
    lat = np.random.default_rng(seed).standard_normal((1, config["z_dim"], 2, 5, 7)).astype(np.float32)
    ours = model.decode(lat)
    np.testing.assert_array_equal(ours, load_model("wan", "tiny-wan-vae", backend, weights=str(folder)).decode(lat))
    assert rel_l2(ours, reference_decode(vae, config, lat)) < 1e-4
    assert model.card()["weights"] == f"hf://testorg/tiny-wan-pipe/vae@{commit}"


def test_pickle_only_repository_is_refused(offline, backend):
    from models import WeightsError, load_model
    with pytest.raises(WeightsError, match=r"pickle-only: no \.safetensors.*pytorch_model\.bin.*refused"):
        load_model("enc", "tiny-convnext", backend, weights=PICKLE_ONLY)


@pytest.mark.parametrize("weights,why", [("testorg/missing", "HF_HUB_OFFLINE is set"),
                                         (f"{PIPE}/vae@v9", "HF_HUB_OFFLINE is set"),
                                         (f"{PIPE}/unet", "no folder 'unet'")])
def test_missing_offline_names_the_reference(offline, backend, weights, why):
    from models import WeightsError, load_model
    with pytest.raises(WeightsError, match=why) as err:
        load_model("x", "tiny-vae", backend, weights=weights)
    assert str(err.value).startswith(f"weights {weights}:")


# ---- the CLI and a live server ----------------------------------------------------------------------
def _cli(*args, env_extra: dict, cwd=REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVSERVE_", "HF_"))}
    env.update({"PYTHONPATH": str(REPO), "CONVSERVE_BACKEND": "numpy", **env_extra})
    return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_serve_with_a_missing_repository_exits_with_one_line(hub):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub["cache"])}
    r = _cli("serve", "--port", "1", "--models", "sd=tiny-vae:testorg/missing@v2", env_extra=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "testorg/missing@v2" in r.stderr and "convserve pull" in r.stderr
    bad = _cli("serve", "--port", "1", "--models", "sd=tiny-vae:nope", env_extra=env)
    assert bad.returncode == 2 and "accepted weights forms" in bad.stderr and "Traceback" not in bad.stderr


def test_pull_reports_the_resolved_commit(hub):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub["cache"])}
    r = _cli("pull", f"sd=tiny-vae:{PIPE}/vae@v1,tiny-convnext", f"hf://{ENC}", env_extra=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2, r.stdout
    assert f"hf://{PIPE}/vae@{hub['commits']['old']}" in lines[0] and "revision v1" in lines[0]
    assert f"hf://{ENC}@{hub['commits']['enc']}" in lines[1]
    for bad in ("testorg/missing", "testorg/bad name", "x=tiny-vae:nope"):
        r = _cli("pull", bad, env_extra=env)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and bad.rpartition(":")[2] in r.stderr, r.stderr


def test_live_server_serves_hub_weights_with_provenance(offline, backend, tmp_path, monkeypatch):
    import httpx

    from models import load_model
    hub, rng = offline, np.random.default_rng(fresh_seed())
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    server = start_server(tmp_path, models=f"sd=tiny-vae:{PIPE}/vae@v1,enc=tiny-convnext:hf://{ENC}")
    try:
        card = httpx.get(f"{server.url}/v1/models/sd", timeout=10).json()
        assert card["hub"]["repo"] == PIPE and card["hub"]["commit"] == hub["commits"]["old"]
        assert card["hub"]["revision"] == "v1" and card["weights"] == f"hf://{PIPE}/vae@{hub['commits']['old']}"
        st = hub["root"] / "old" / "vae" / "diffusion_pytorch_model.safetensors"
        assert card["hub"]["files"][st.name]["sha256"] == hashlib.sha256(st.read_bytes()).hexdigest()
        lat = rng.standard_normal((1, 4, 6, 10)).astype(np.float32)
        r = httpx.post(f"{server.url}/v1/models/sd/decode", content=npy(lat), params={"format": "npy"},
                       headers={"content-type": "application/x-npy"}, timeout=60)
        assert r.status_code == 200, r.text
        folder = load_model("sd", "tiny-vae", backend, weights=str(hub["root"] / "old" / "vae"))
        want = folder.decode(lat)  # this process's decode: the server's worker may take other conv paths
        np.testing.assert_allclose(from_npy(r.content), want, rtol=0, atol=cross_process_atol(want))
        enc = httpx.get(f"{server.url}/v1/models/enc", timeout=10).json()
        assert enc["hub"]["commit"] == hub["commits"]["enc"] and enc["hub"]["subfolder"] is None
    finally:
        server.stop()


# ---- online, against a local stand-in for the Hub's HTTP API ----------------------------------------
@pytest.fixture
def hub_server(hub):
    from hub_server import HubServer, Repo
    vae_dir = hub["root"] / "new" / "vae"
    pipe = {f"vae/{p.name}": p.read_bytes() for p in vae_dir.iterdir()}
    pipe["vae/diffusion_pytorch_model.bin"] = b"a pickle that must never be fetched"
    pipe["unet/diffusion_pytorch_model.safetensors"] = b"another model's weights"
    pipe["model_index.json"] = b'{"_class_name": "StableDiffusionPipeline"}'
    server = HubServer({
        "onlineorg/pipe": Repo(_commit(1), pipe, revisions=("main", "v2")),
        "onlineorg/pickles": Repo(_commit(2), {"config.json": b"{}", "pytorch_model.bin": b"pickle"}),
    })
    yield server
    server.stop()


def test_pull_over_http_fetches_only_configs_and_safetensors_then_serves_offline(hub_server, hub, backend,
                                                                                  tmp_path, monkeypatch):
    from models import load_model
    cache = tmp_path / "cache"
    online = {"HF_ENDPOINT": hub_server.url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1"}
    r = _cli("pull", "sd=tiny-vae:onlineorg/pipe/vae@v2", env_extra=online)
    assert r.returncode == 0, r.stderr
    commit = hub_server.repos["onlineorg/pipe"].commit
    assert f"hf://onlineorg/pipe/vae@{commit} (revision v2)" in r.stdout
    assert hub_server.fetched() == {"onlineorg/pipe/vae/config.json",
                                    "onlineorg/pipe/vae/diffusion_pytorch_model.safetensors"}

    # the cache it left is what an offline server loads
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model = load_model("sd", "tiny-vae", backend, weights="onlineorg/pipe/vae@v2")
    assert model.weights_provenance["commit"] == commit
    lat = np.random.default_rng(fresh_seed()).standard_normal((1, 4, 5, 6)).astype(np.float32)
    folder = load_model("sd", "tiny-vae", backend, weights=str(hub["root"] / "new" / "vae"))
    np.testing.assert_array_equal(_decode(model, lat), _decode(folder, lat))


@pytest.mark.parametrize("ref,expect", [
    ("onlineorg/pickles", r"no \.safetensors weights .*\['pytorch_model\.bin'\].*refused"),
    ("onlineorg/absent", "no such repository 'onlineorg/absent'"),
    ("onlineorg/pipe/vae@v3", "has no revision 'v3'"),
])
def test_pull_over_http_refuses_clearly(hub_server, tmp_path, ref, expect):
    import re
    online = {"HF_ENDPOINT": hub_server.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_DISABLE_XET": "1"}
    r = _cli("pull", ref, env_extra=online)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("convserve: error:")]
    assert line.startswith(f"convserve: error: weights {ref}:") and re.search(expect, line), line
    assert not any(p.endswith(".bin") for p in hub_server.fetched())


def test_serve_downloads_once_then_loads_from_the_cache(hub_server, hub, backend, tmp_path, monkeypatch):
    """The README's first run: `convserve serve --models sd=...:org/name/vae` with an empty cache
    fetches the weights before the server starts; the loader then reads the cache (one revision
    look-up in all, so a branch moving meanwhile cannot split what is served)."""
    import httpx

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = start_server(tmp_path, models="sd=tiny-vae:onlineorg/pipe/vae")
    try:
        card = httpx.get(f"{server.url}/v1/models/sd", timeout=10).json()
        assert card["hub"]["commit"] == hub_server.repos["onlineorg/pipe"].commit
        lookups = [p for m, p in hub_server.requests if "/revision/" in p]
        assert lookups == ["/api/models/onlineorg/pipe/revision/main"], hub_server.requests
        lat = np.random.default_rng(fresh_seed()).standard_normal((1, 4, 7, 3)).astype(np.float32)
        r = httpx.post(f"{server.url}/v1/models/sd/decode", content=npy(lat), params={"format": "npy"},
                       headers={"content-type": "application/x-npy"}, timeout=60)
        assert r.status_code == 200, r.text
        ref = vae_decode_ref(hub["vaes"]["new"], lat)
        assert rel_l2(from_npy(r.content), ref) < 1e-5
    finally:
        server.stop()
