"""Checkpoint mismatch errors: a summary under ~1 KB (counts, the first few names of each kind of
problem, what the checkpoint looks like, the likely fix) instead of a 9-16 KB list of every name."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from convkernels import get_backend
from models import WeightsError, load_model
from models.nn.weights import check_state_dict, checkpoint_family


@pytest.fixture(scope="module")
def backend():
    return get_backend("numpy")


def zeros_like(shapes) -> dict:
    return {k: np.zeros(v, np.float32) for k, v in shapes.items()}


def error_of(preset, path, backend) -> str:
    with pytest.raises(WeightsError) as info:
        load_model("x", preset, backend, weights=str(path))
    return str(info.value)


def test_a_vae_of_another_size_as_a_bare_file(tmp_path, backend):
    """The SD VAE's tensors (every name there, other widths) as a bare .safetensors for tiny-vae."""
    save_file(zeros_like(load_model("sd", "sd-vae", backend).tree.expected_shapes()), str(tmp_path / "sd.safetensors"))
    msg = error_of("tiny-vae", tmp_path / "sd.safetensors", backend)
    assert len(msg) < 1200, len(msg)
    assert "mis-shaped (" in msg and "... and " in msg and "more" in msg
    assert "decoder.conv_in.weight: checkpoint (512, 4, 3, 3) vs model (64, 4, 3, 3)" in msg
    assert "config.json" in msg and "another size" in msg


def test_a_convnext_checkpoint_for_a_vae(tmp_path, backend):
    save_file(zeros_like(load_model("c", "tiny-convnext", backend).tree.expected_shapes()), str(tmp_path / "c.safetensors"))
    for preset in ("tiny-vae", "tiny-wan-vae"):
        msg = error_of(preset, tmp_path / "c.safetensors", backend)
        assert len(msg) < 1200, len(msg)
        assert "looks like a ConvNeXt checkpoint" in msg and "ConvNeXt preset" in msg, msg
        assert "missing (" in msg and "unexpected (" in msg


def test_counts_are_complete_and_names_are_few():
    expected = {f"decoder.block.{i}.weight": (4, 4) for i in range(200)}
    given = {f"decoder.block.{i}.weight": np.zeros((4, 4), np.float32) for i in range(100)}
    given.update({f"decoder.extra.{i}.weight": np.zeros(3, np.float32) for i in range(50)})
    given["decoder.block.0.weight"] = np.zeros((4, 5), np.float32)
    with pytest.raises(WeightsError) as info:
        check_state_dict(expected, given, "demo")
    msg = str(info.value)
    assert "missing (100)" in msg and "unexpected (50)" in msg and "mis-shaped (1)" in msg
    assert "... and 96 more" in msg and "... and 46 more" in msg
    assert "decoder.block.0.weight: checkpoint (4, 5) vs model (4, 4)" in msg
    assert len(msg) < 1000 and "Hint:" in msg


def test_non_finite_values_are_named():
    with pytest.raises(WeightsError, match=r"non-finite values \(1\) in: a.*NaN or Inf"):
        check_state_dict({"a": (2,)}, {"a": np.array([0.0, np.nan], np.float32)}, "demo")


@pytest.mark.parametrize("keys,family", [
    (["decoder.up_blocks.0.resnets.0.conv1.weight", "encoder.conv_in.weight"], "vae"),
    (["decoder.up.0.block.0.conv1.weight", "decoder.mid.block_1.conv1.weight"], "ldm-vae"),
    (["first_stage_model.decoder.conv_in.weight", "model.diffusion_model.input_blocks.0.0.weight"], "sd-pipeline"),
    (["convnext.embeddings.patch_embeddings.weight"], "convnext"),
    (["stem.0.weight", "stages.0.blocks.0.conv_dw.weight"], "convnext"),
    (["decoder.layers.0.weight", "encoder.layers.1.conv.0.weight"], "taesd"),
    (["decoder.up_blocks.0.upsampler.resample.1.weight", "decoder.up_blocks.0.resnets.0.conv1.weight"], "wan22-vae"),
    (["text_model.embeddings.token_embedding.weight"], None),
])
def test_checkpoint_family(keys, family):
    assert checkpoint_family(keys) == family


def test_an_ldm_vae_is_told_to_use_the_diffusers_format():
    expected = {"decoder.conv_in.weight": (4, 4), "decoder.up_blocks.0.resnets.0.conv1.weight": (4, 4)}
    given = {"decoder.conv_in.weight": np.zeros((4, 4), np.float32),
             "decoder.up.0.block.0.conv1.weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(WeightsError, match="original Stable Diffusion .ldm. naming.*diffusers-format VAE"):
        check_state_dict(expected, given, "demo")


def test_a_taesd_checkpoint_under_a_vae_preset_is_told_its_presets():
    expected = {"decoder.conv_in.weight": (4, 4), "decoder.up_blocks.0.resnets.0.conv1.weight": (4, 4)}
    given = {"decoder.layers.0.weight": np.zeros((64, 4, 3, 3), np.float32)}
    with pytest.raises(WeightsError, match=r"TAESD tiny VAE checkpoint.*taesd, taesdxl, taef1"):
        check_state_dict(expected, given, "tiny-vae")
