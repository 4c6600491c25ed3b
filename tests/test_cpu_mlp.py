"""The NumPy backend's `mlp` (convkernels/backends/numpy/fused.py): an MLP's two products run over
blocks of rows whose hidden activations stay in cache, where they would not. Each row's sums run
in the order of the two whole products, so the result must equal theirs to the bit, whatever the
blocks; and both must match torch's linear, GELU, linear and residual in float32's error."""
from __future__ import annotations

import numpy as np
import pytest

from torch_reference import F, fresh_rng, rel_l2, torch

from convkernels import get_backend
from convkernels.backends.numpy import fused

needs_tiles = pytest.mark.skipif(not fused.panel_width(), reason="no compiled gemm tiles here (no compiler, "
                                                                    "or not x86-64 v3/v4)")


@pytest.fixture
def blocks(monkeypatch):
    """mlp taken for any size, in blocks of 5 rows of 52 hidden floats (the last one short)."""
    monkeypatch.setattr(fused, "MLP_BLOCKS_MIN_BYTES", 0)
    monkeypatch.setattr(fused, "MLP_BLOCK_BYTES", 5 * 52 * 4)


def _case(rng, lead=(2, 7, 9), c=20, hidden=52):
    x = rng.standard_normal((*lead, c)).astype(np.float32)
    w1 = (rng.standard_normal((hidden, c)) / np.sqrt(c)).astype(np.float32)
    w2 = (rng.standard_normal((c, hidden)) / np.sqrt(hidden)).astype(np.float32)
    b1, b2 = (rng.standard_normal(n).astype(np.float32) for n in (hidden, c))
    return x, w1, b1, w2, b2


@needs_tiles
@pytest.mark.parametrize("activation", ["gelu", None])
@pytest.mark.parametrize("with_b2", [True, False])
def test_mlp_in_blocks_equals_the_two_linears_bit_for_bit_and_torch(blocks, activation, with_b2):
    rng, seed = fresh_rng()
    be = get_backend("numpy")
    x, w1, b1, w2, b2 = _case(rng)
    b2 = b2 if with_b2 else None
    got = be.mlp(x, w1, b1, w2, b2, activation, x)
    assert got is not None and got.shape == x.shape
    two = be.linear(be.linear(x, w1, b1, activation=activation), w2, b2, residual=x)
    assert np.array_equal(got, two)
    t = torch.from_numpy
    h = F.linear(t(x).double(), t(w1).double(), t(b1).double())
    h = F.gelu(h) if activation == "gelu" else h
    ref = F.linear(h, t(w2).double(), None if b2 is None else t(b2).double()) + t(x).double()
    assert rel_l2(got, ref.numpy()) < 1e-6, f"seed {seed}"


@needs_tiles
def test_a_block_left_out_or_misplaced_fails(blocks, monkeypatch):
    """The equality above can fail: blocks whose rows land one block late differ from the two linears."""
    rng, seed = fresh_rng()
    be = get_backend("numpy")
    x, w1, b1, w2, b2 = _case(rng)
    real = fused.linear
    calls = []

    def shifted(x2, weight, bias, residual, activation, packed=None, out=None):
        calls.append(x2.shape[0])
        if out is not None and len(calls) == 4:  # the second block's second product: written nowhere
            return real(x2, weight, bias, residual, activation, packed)
        return real(x2, weight, bias, residual, activation, packed, out=out)

    monkeypatch.setattr(fused, "linear", shifted)
    got = be.mlp(x, w1, b1, w2, b2, "gelu", x)
    monkeypatch.setattr(fused, "linear", real)
    assert len(calls) > 4 and calls[-1] < calls[0]  # several blocks, the last one short
    assert not np.array_equal(got, be.linear(be.linear(x, w1, b1, activation="gelu"), w2, b2, residual=x))


@needs_tiles
def test_small_mlps_are_left_to_the_two_linears():
    """Below the size where the hidden activations leave the cache, the blocks' extra calls lose."""
    rng, seed = fresh_rng()
    x, w1, b1, w2, b2 = _case(rng)
    assert get_backend("numpy").mlp(x, w1, b1, w2, b2, "gelu", x) is None
    assert fused.mlp_applies(25088, 384) and not fused.mlp_applies(3136, 384)  # ConvNeXt-T stage 1: b8, b1


@needs_tiles
def test_convnext_encodes_the_same_with_the_blocks(monkeypatch):
    from models import load_model

    pixels = fresh_rng()[0].random((2, 37, 41, 3)).astype(np.float32)
    monkeypatch.setattr(fused, "MLP_BLOCKS_MIN_BYTES", 1 << 60)
    whole = load_model("m", "tiny-convnext", get_backend("numpy")).encode(pixels)
    monkeypatch.setattr(fused, "MLP_BLOCKS_MIN_BYTES", 0)
    monkeypatch.setattr(fused, "MLP_BLOCK_BYTES", 4096)
    calls = []
    real = fused.mlp
    monkeypatch.setattr(fused, "mlp", lambda *a: calls.append(1) or real(*a))
    blocked = load_model("m", "tiny-convnext", get_backend("numpy")).encode(pixels)
    outputs = whole.keys() if isinstance(whole, dict) else range(len(whole))
    assert calls and all(np.array_equal(blocked[k], whole[k]) for k in outputs)


def test_the_default_backend_offers_no_mlp():
    from convkernels.backend import BackendBase

    assert BackendBase.mlp(None, None, None, None, None, None, None, None) is None
