"""ConvNeXt encoder vs Hugging Face transformers' ConvNext (the independent reference), with
fresh random weights in every parameter, checkpoints in HF and timm naming, odd sizes."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from convkernels import get_backend  # noqa: E402
from models import ModelOptions  # noqa: E402
from models.convnext import PRESETS, build  # noqa: E402
from models.nn.weights import WeightsError  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
SMALL = {"depths": [1, 1, 2, 1], "hidden_sizes": [8, 16, 24, 40]}
TINY_DIMS = {"depths": [1, 1, 1, 1], "hidden_sizes": [96, 192, 384, 768]}
# fp32 on CPU: under 1e-5 relative L2 (we measure ~1e-6); a looser 1e-4 would miss exact-vs-tanh GELU,
# which lands near 1e-4
TOL = 1e-5


def arch(**config) -> ModelOptions:
    """Options overriding these ConvNeXt config fields."""
    return ModelOptions(config=config)


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (HF's init leaves layer scale at 1e-6, norms at 1 and biases at 0,
    which would hide bugs in the blocks, norms and biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
            elif name.endswith("layer_scale_parameter"):
                p.copy_(0.3 + 0.5 * torch.rand(p.shape, generator=g))
            elif name.endswith("weight"):  # LayerNorm scales
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_hf(tmp_path_factory, arch: dict, classifier: bool, seed: int, **extra):
    cfg = transformers.ConvNextConfig(**arch, num_labels=7 if classifier else 2, **extra)
    cls = transformers.ConvNextForImageClassification if classifier else transformers.ConvNextModel
    model = cls(cfg).eval()
    randomise_(model, seed)
    folder = tmp_path_factory.mktemp(f"hf_{'cls' if classifier else 'base'}_{seed}")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def reference(model, pixels_nhwc: np.ndarray, mean=MEAN, std=STD):
    x = torch.from_numpy(((pixels_nhwc - mean) / std).transpose(0, 3, 1, 2).copy())
    with torch.no_grad():
        if isinstance(model, transformers.ConvNextForImageClassification):
            base = model.convnext(x)
            return base.pooler_output.numpy(), model.classifier(base.pooler_output).numpy()
        return model(x).pooler_output.numpy(), None


@pytest.fixture(scope="module")
def backend():
    return get_backend("numpy")


@pytest.fixture(scope="module")
def small_cls(tmp_path_factory):
    labels = {i: f"class-{i}-{'abcdefg'[i]}" for i in range(7)}
    return make_hf(tmp_path_factory, SMALL, True, seed=1, id2label=labels,
                   label2id={v: k for k, v in labels.items()}, layer_norm_eps=1e-5)


@pytest.fixture(scope="module")
def small_base(tmp_path_factory):
    # the tanh GELU ("gelu_new") here, the exact one elsewhere
    return make_hf(tmp_path_factory, SMALL, False, seed=2, hidden_act="gelu_new")


@pytest.fixture(scope="module")
def tiny_dims_cls(tmp_path_factory):
    return make_hf(tmp_path_factory, TINY_DIMS, True, seed=3)


def check_parity(model, ref_model, size, batch=2, rng_seed=None, mean=MEAN, std=STD):
    h, w = size if isinstance(size, tuple) else (size, size)
    pixels = np.random.default_rng(rng_seed).random((batch, h, w, 3), dtype=np.float32)
    emb_ref, logits_ref = reference(ref_model, pixels, mean, std)
    out = model.encode(pixels)
    assert out["embedding"].shape == emb_ref.shape and out["embedding"].dtype == np.float32
    err = rel_l2(out["embedding"], emb_ref)
    assert err < TOL, f"embedding rel L2 {err:.2e}"
    if logits_ref is None:
        assert out["logits"] is None
    else:
        assert out["logits"].shape == logits_ref.shape
        err = rel_l2(out["logits"], logits_ref)
        assert err < TOL, f"logits rel L2 {err:.2e}"


@pytest.mark.parametrize("size", [64, 97, 224, (97, 130)])
def test_hf_classifier_parity_small(backend, small_cls, size):
    ref_model, folder = small_cls
    model = build("enc", "tiny-convnext", backend, str(folder))
    assert model.naming == "hf" and model.embed_dim == 40 and model.num_classes == 7
    check_parity(model, ref_model, size)


@pytest.mark.parametrize("size", [64, 97, 224])
def test_hf_base_model_parity_small(backend, small_base, size):
    ref_model, folder = small_base
    model = build("enc", "tiny-convnext", backend, str(folder))
    assert model.labels is None and model.num_classes == 0 and model.config.activation == "gelu_tanh"
    check_parity(model, ref_model, size)


@pytest.mark.parametrize("size", [64, 97, 224])
def test_hf_parity_convnext_tiny_dims(backend, tiny_dims_cls, size):
    ref_model, folder = tiny_dims_cls
    model = build("enc", "convnext-tiny", backend, str(folder))
    assert model.config.dims == (96, 192, 384, 768) and model.config.depths == (1, 1, 1, 1)
    check_parity(model, ref_model, size, batch=1 if size == 224 else 2)


def test_hf_parity_on_mlx_backend(small_cls):
    """Same model code on the MLX backend (Metal on a Mac, CPU elsewhere)."""
    pytest.importorskip("mlx.core")
    try:
        mlx_backend = get_backend("mlx")
    except Exception as exc:  # mlx installed but unusable here
        pytest.skip(f"mlx backend unavailable: {exc}")
    ref_model, folder = small_cls
    model = build("enc", "tiny-convnext", mlx_backend, str(folder))
    assert model.card()["backend"] == "mlx"
    check_parity(model, ref_model, (97, 66))


def test_bfloat16_normalises_on_the_host_instead_of_folding_into_the_stem(small_cls):
    """In bfloat16 the stem keeps the checkpoint's conv and the host normalises the pixels in
    float32 (benchmarks/analysis/convnext_bf16_stem_fold.py says why); the output still matches
    transformers within bf16's precision (MLX computing in bfloat16, on its CPU device here)."""
    pytest.importorskip("mlx.core")
    try:
        bf16 = get_backend("mlx", dtype="bfloat16")
    except Exception as exc:  # mlx installed but unusable here
        pytest.skip(f"mlx backend unavailable: {exc}")
    from models.convnext.model import folds_input_norm

    assert not folds_input_norm("bfloat16") and folds_input_norm("float16") and folds_input_norm("float32")
    ref_model, folder = small_cls
    model = build("enc", "tiny-convnext", bf16, str(folder))
    assert not model.tree.stem.fold_input
    pixels = np.random.default_rng().random((2, 64, 64, 3), dtype=np.float32)
    emb_ref, logits_ref = reference(ref_model, pixels, MEAN, STD)
    out = model.encode(pixels)
    for name, ours, ref in (("embedding", out["embedding"], emb_ref), ("logits", out["logits"], logits_ref)):
        err = rel_l2(ours, ref)
        assert err < 3e-2, f"{name} rel L2 {err:.2e} in bfloat16"


def test_hf_single_file_without_config(backend, small_cls):
    """A bare model.safetensors: architecture from preset + overrides, head from the tensors;
    the reference's head eps (1e-5) has to come in as an override without config.json."""
    ref_model, folder = small_cls
    model = build("enc", "tiny-convnext", backend, str(folder / "model.safetensors"),
                  arch(depths=(1, 1, 2, 1), dims=(8, 16, 24, 40), head_norm_eps=1e-5))
    assert model.labels is None and model.num_classes == 7
    check_parity(model, ref_model, 97)


# timm's ConvNeXt module layout (timm/models/convnext/model.py): stem = Sequential(Conv2d, LayerNorm2d),
# stages[i] = ConvNeXtStage(downsample=Sequential(LayerNorm2d, Conv2d) | Identity, blocks=Sequential
# of ConvNeXtBlock(conv_dw, norm, mlp=Mlp(fc1, act, fc2), gamma)), head = NormMlpClassifierHead(norm, fc).
def hf_to_timm_name(name: str) -> str:
    name = name.removeprefix("convnext.")
    table = [("embeddings.patch_embeddings.", "stem.0."), ("embeddings.layernorm.", "stem.1."),
             ("encoder.stages.", "stages."), (".downsampling_layer.", ".downsample."), (".layers.", ".blocks."),
             (".dwconv.", ".conv_dw."), (".layernorm.", ".norm."), (".pwconv1.", ".mlp.fc1."),
             (".pwconv2.", ".mlp.fc2."), (".layer_scale_parameter", ".gamma"), ("classifier.", "head.fc.")]
    if name.startswith("layernorm."):
        return "head.norm." + name.removeprefix("layernorm.")
    for old, new in table:
        name = name.replace(old, new)
    return name


def test_timm_naming_parity(backend, tmp_path_factory):
    """timm's head norm eps is 1e-6, so the HF reference is built with that eps."""
    ref_model, folder = make_hf(tmp_path_factory, SMALL, True, seed=4, layer_norm_eps=1e-6)
    hf = safetensors_numpy.load_file(str(folder / "model.safetensors"))
    timm_sd = {hf_to_timm_name(k): v for k, v in hf.items()}
    assert "stages.2.blocks.1.mlp.fc2.weight" in timm_sd and "head.norm.weight" in timm_sd
    path = tmp_path_factory.mktemp("timm") / "convnext_small_random.safetensors"
    safetensors_numpy.save_file(timm_sd, str(path))
    model = build("enc", "tiny-convnext", backend, str(path), arch(depths=(1, 1, 2, 1), dims=(8, 16, 24, 40)))
    assert model.naming == "timm" and model.num_classes == 7
    for size in (64, 97):
        check_parity(model, ref_model, size)


def test_timm_hub_folder_config(backend, tmp_path_factory):
    """A timm hub folder: timm tensor names + timm's config.json (preprocessing in pretrained_cfg,
    class names in label_names); the architecture stays the preset's."""
    ref_model, folder = make_hf(tmp_path_factory, SMALL, True, seed=5, layer_norm_eps=1e-6)
    hf = safetensors_numpy.load_file(str(folder / "model.safetensors"))
    out = tmp_path_factory.mktemp("timm_hub")
    safetensors_numpy.save_file({hf_to_timm_name(k): v for k, v in hf.items()}, str(out / "model.safetensors"))
    mean, std = np.array([0.5, 0.4, 0.3], np.float32), np.array([0.2, 0.3, 0.25], np.float32)
    names = [f"n{i:02d}" for i in range(7)]
    (out / "config.json").write_text(json.dumps({
        "architecture": "convnext_small_random", "num_classes": 7, "num_features": 40, "label_names": names,
        "pretrained_cfg": {"input_size": [3, 160, 160], "mean": mean.tolist(), "std": std.tolist(),
                           "first_conv": "stem.0", "classifier": "head.fc"}}))
    model = build("enc", "tiny-convnext", backend, str(out), arch(depths=(1, 1, 2, 1), dims=(8, 16, 24, 40)))
    assert model.naming == "timm" and model.labels == names and model.input_size == 160
    check_parity(model, ref_model, 97, mean=mean, std=std)


def test_registry_loads_convnext_presets(backend):
    models = pytest.importorskip("models")
    for preset in ("convnext-tiny", "convnext-base", "tiny-convnext"):
        assert models.PRESETS[preset].kind == "image-encoder"
    model = models.load_model("enc", "tiny-convnext", backend)
    assert model.kind == "image-encoder" and model.embed_dim == PRESETS["tiny-convnext"]["dims"][-1]


def test_two_digit_block_indices(backend, tmp_path_factory):
    """convnext-base has 27 blocks in stage 3: block 10+ must map (HF and timm) and run in order."""
    ref_model, folder = make_hf(tmp_path_factory, {"depths": [1, 1, 11, 1], "hidden_sizes": [8, 16, 24, 40]},
                                True, seed=6, layer_norm_eps=1e-6)
    check_parity(build("enc", "tiny-convnext", backend, str(folder)), ref_model, 64)
    hf = safetensors_numpy.load_file(str(folder / "model.safetensors"))
    path = tmp_path_factory.mktemp("timm11") / "m.safetensors"
    safetensors_numpy.save_file({hf_to_timm_name(k): v for k, v in hf.items()}, str(path))
    model = build("enc", "tiny-convnext", backend, str(path), arch(depths=(1, 1, 11, 1), dims=(8, 16, 24, 40)))
    check_parity(model, ref_model, 64)


def test_bad_checkpoint_lists_every_problem(backend, small_cls, tmp_path):
    _, folder = small_cls
    sd = safetensors_numpy.load_file(str(folder / "model.safetensors"))
    del sd["convnext.encoder.stages.2.layers.1.pwconv1.bias"]
    sd["convnext.encoder.stages.9.layers.0.dwconv.weight"] = np.zeros((3,), np.float32)
    sd["classifier.bias"] = np.zeros((8,), np.float32)  # classifier.weight says 7 classes
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    safetensors_numpy.save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError) as info:
        build("enc", "tiny-convnext", backend, str(tmp_path))
    msg = str(info.value)
    assert "missing (1): convnext.encoder.stages.2.layers.1.pwconv1.bias" in msg
    assert "unexpected (1): convnext.encoder.stages.9.layers.0.dwconv.weight" in msg
    assert "classifier.bias: checkpoint (8,) vs model (7,)" in msg


def test_wrong_architecture_and_unknown_format_are_clear(backend, small_base, tmp_path):
    _, folder = small_base
    with pytest.raises(WeightsError, match="mis-shaped"):  # preset dims, checkpoint's are smaller
        build("enc", "tiny-convnext", backend, str(folder / "model.safetensors"))
    safetensors_numpy.save_file({"encoder.conv_in.weight": np.zeros((4, 3, 3, 3), np.float32)},
                                str(tmp_path / "vae.safetensors"))
    with pytest.raises(WeightsError, match="cannot tell the checkpoint format"):
        build("enc", "tiny-convnext", backend, str(tmp_path / "vae.safetensors"))
    other = tmp_path / "v2"
    other.mkdir()
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (other / "config.json").write_text(json.dumps({"model_type": "convnextv2", "depths": [1, 1, 2, 1]}))
    with pytest.raises(WeightsError, match="'convnextv2' model"):
        build("enc", "tiny-convnext", backend, str(other))


def test_overrides_beat_checkpoint_config(backend, small_cls):
    _, folder = small_cls
    model = build("enc", "tiny-convnext", backend, str(folder), arch(head_norm_eps=1e-3, input_size=96))
    assert model.config.head_norm_eps == 1e-3 and model.input_size == 96
    with pytest.raises(ValueError, match="unknown overrides"):
        build("enc", "tiny-convnext", backend, str(folder), arch(width=3))


def test_labels_and_card_from_config(backend, small_cls):
    _, folder = small_cls
    model = build("enc", "tiny-convnext", backend, str(folder))
    assert model.labels == [f"class-{i}-{'abcdefg'[i]}" for i in range(7)]
    card = model.card()
    cfg = json.loads((folder / "config.json").read_text())
    assert card["kind"] == "image-encoder" and card["backend"] == "numpy" and card["dtype"] == "float32"
    assert card["weights"] == str(folder) and card["config"]["dims"] == cfg["hidden_sizes"]
    assert card["config"]["head_norm_eps"] == cfg["layer_norm_eps"]
    assert tuple(model.mean) == pytest.approx(tuple(MEAN)) and tuple(model.std) == pytest.approx(tuple(STD))


def test_random_init_is_seeded_and_says_so(backend):
    pixels = np.random.default_rng().random((2, 70, 45, 3), dtype=np.float32)
    a = build("a", "tiny-convnext", backend).encode(pixels)
    b = build("b", "tiny-convnext", backend).encode(pixels)
    np.testing.assert_array_equal(a["embedding"], b["embedding"])
    model = build("a", "tiny-convnext", backend)
    assert model.card()["weights"] == "random init" and model.input_size == PRESETS["tiny-convnext"]["input_size"]
    assert a["logits"].shape == (2, PRESETS["tiny-convnext"]["num_classes"])
    assert np.isfinite(a["embedding"]).all() and a["embedding"].std() > 0.1


def test_bad_pixels_are_refused(backend):
    model = build("t", "tiny-convnext", backend)
    with pytest.raises(ValueError, match="N,H,W,3"):
        model.encode(np.zeros((64, 64, 3), np.float32))
    with pytest.raises(ValueError, match="floating point in \\[0, 1\\] or uint8 0..255"):
        model.encode(np.zeros((1, 64, 64, 3), np.int16))
    with pytest.raises(ValueError, match="smaller than the 32x32 minimum"):
        model.encode(np.zeros((1, 31, 64, 3), np.float32))


def check_uint8_against_float(model, size, batch=3, tol=1e-5):
    """uint8 pixels vs the same pixels / 255 in float32: embedding and logits within `tol`
    (relative L2), the same top-5 classes per image; returns the uint8 result."""
    h, w = size
    u8 = np.random.default_rng().integers(0, 256, (batch, h, w, 3), dtype=np.uint8)
    ours = model.encode(u8)
    ref = model.encode(u8.astype(np.float32) / np.float32(255.0))
    for name in ("embedding", "logits"):
        assert ours[name].dtype == np.float32 and ours[name].shape == ref[name].shape
        err = rel_l2(ours[name], ref[name])
        assert err < tol, f"{name}: rel L2 {err:.2e}"
    top = lambda logits: np.argsort(-logits, axis=1)[:, :5]  # noqa: E731
    np.testing.assert_array_equal(top(ours["logits"]), top(ref["logits"]))
    return u8, ours


def test_uint8_pixels_are_scaled_on_the_device(backend, small_cls):
    """uint8 pixels cross to the backend as uint8 (the 1/255 is folded into the stem conv with
    mean/std) and encode like pixels / 255, which match transformers; the float path is the one
    it was (encode of float pixels does not touch the uint8 stem)."""
    ref_model, folder = small_cls
    model = build("enc", "tiny-convnext", backend, str(folder))
    seen = []
    inner = backend.asarray
    backend.asarray = lambda host, dtype=None: seen.append(np.asarray(host).dtype) or inner(host, dtype)
    try:
        u8, ours = check_uint8_against_float(model, (97, 66))
    finally:
        del backend.asarray
    assert seen == [np.uint8, np.float32]
    emb_ref, logits_ref = reference(ref_model, u8.astype(np.float32) / np.float32(255.0))
    assert rel_l2(ours["embedding"], emb_ref) < TOL and rel_l2(ours["logits"], logits_ref) < TOL
    # the uint8 stem is the float stem / 255
    stem = model.tree.stem
    np.testing.assert_allclose(backend.to_host(stem.weight_uint8) * 255, backend.to_host(stem.conv.weight), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_uint8_pixels_on_mlx(small_cls, dtype):
    """The same on MLX (CPU device here): float32 and float16 fold the 1/255 into the stem;
    bfloat16, which folds nothing into its stem, normalises uint8 on the host as it does floats
    (so there the two routes agree exactly). In half precision the uint8 route must be as close
    to transformers (float32) as the float route is."""
    pytest.importorskip("mlx.core")
    try:
        be = get_backend("mlx", dtype=dtype)
    except Exception as exc:  # mlx installed but unusable here
        pytest.skip(f"mlx backend unavailable: {exc}")
    ref_model, folder = small_cls
    model = build("enc", "tiny-convnext", be, str(folder))
    assert model.tree.stem.fold_input == (dtype != "bfloat16")
    if dtype == "float32":
        check_uint8_against_float(model, (64, 71))
        return
    u8 = np.random.default_rng().integers(0, 256, (3, 64, 71, 3), dtype=np.uint8)
    f = u8.astype(np.float32) / np.float32(255.0)
    ours, floats = model.encode(u8), model.encode(f)
    if dtype == "bfloat16":
        for name in ("embedding", "logits"):
            np.testing.assert_array_equal(ours[name], floats[name])
    for name, ref in zip(("embedding", "logits"), reference(ref_model, f)):
        err, err_float = rel_l2(ours[name], ref), rel_l2(floats[name], ref)
        assert err < 2 * err_float + 1e-4, f"{name}: uint8 rel L2 {err:.2e}, float {err_float:.2e} in {dtype}"
