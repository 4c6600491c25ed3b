"""The NumPy backend's fused compiled kernels (convkernels/_cpu/norms.c via backends/numpy/fused.py)
against torch.nn.functional in float64, at odd channel counts (vector tails) and odd groups:
the linear epilogue (bias, activation, residual in one pass), LayerNorm, ConvNeXt's depthwise
conv + LayerNorm in one pass, GroupNorm + activation, RMS norm + bias + residual; each also
through the pure-NumPy fallback (no compiler). And the AVX2 build of the activation and norm loops is vector code: the scalar
clamp once kept GCC from vectorising them anywhere but in the AVX-512 clone."""
from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from torch_reference import F, fresh_rng, from_t, ref_conv, rel_l2, to_t, torch

from convkernels import _cpu, get_backend

TOL = 1e-5
CPU_SRC = Path(__file__).resolve().parents[1] / "convkernels" / "_cpu"


def t64(a):
    return torch.from_numpy(np.asarray(a, np.float64))


@pytest.fixture(params=[True, False], ids=["compiled", "numpy-fallback"])
def be(request, monkeypatch):
    if request.param and not _cpu.AVAILABLE:
        pytest.skip("the optional C extension was not built here (no compiler at install time)")
    monkeypatch.setattr(_cpu, "AVAILABLE", request.param)
    return get_backend("numpy")


@pytest.mark.parametrize("c_in,c_out", [(45, 13), (16, 33), (7, 200)])
@pytest.mark.parametrize("activation", [None, "gelu", "silu"])
def test_linear_epilogue_matches_torch(be, c_in, c_out, activation):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((2, 5, 7, c_in)) * 2).astype(np.float32)
    w = rng.standard_normal((c_out, c_in)).astype(np.float32) / np.sqrt(c_in)
    b = rng.standard_normal(c_out).astype(np.float32)
    res = rng.standard_normal((2, 5, 7, c_out)).astype(np.float32)
    ref = F.linear(t64(x), t64(w), t64(b))
    ref = {None: ref, "gelu": F.gelu(ref), "silu": F.silu(ref)}[activation] + t64(res)
    got = be.linear(x, w, b, residual=res, activation=activation)
    assert got.shape == ref.shape and rel_l2(got, ref.numpy()) < TOL, f"seed {seed}"
    # no bias, no residual
    ref2 = F.linear(t64(x), t64(w))
    ref2 = {None: ref2, "gelu": F.gelu(ref2), "silu": F.silu(ref2)}[activation]
    assert rel_l2(be.linear(x, w, activation=activation), ref2.numpy()) < TOL, f"seed {seed}"


def test_gelu_keeps_extremes_and_nan(be):
    """The clamp inside the rational erf: huge inputs saturate (GELU(x) = x or -0), NaN stays NaN."""
    x = np.array([-1e30, -50.0, -4.5, -0.0, 3e-39, 5.0, 1e30, np.nan, np.inf, -np.inf] * 3, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        got = be.gelu(x[None])[0]
        ref = F.gelu(t64(x)).numpy()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-6, atol=2e-7)  # the float32 erf fit near its tail
    assert np.isnan(got[np.isnan(x)]).all()


@pytest.mark.parametrize("c", [45, 96, 7])
def test_layer_norm_matches_torch_with_a_large_mean(be, c):
    rng, seed = fresh_rng()
    # a mean far above the spread: the compiled kernel's corrected two-pass variance must not
    # cancel (the NumPy fallback's plain float32 mean is good to a smaller offset only)
    offset = 300.0 if _cpu.AVAILABLE else 3.0
    x = (rng.standard_normal((3, 5, 11, c)) + offset).astype(np.float32)
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    ref = F.layer_norm(t64(x), (c,), t64(w), t64(b), eps=1e-6)
    # The float32 mean of values near `offset` is good to about an ulp of the offset, and that error
    # shifts every centred value (spread 1): a relative error near offset * eps, whatever the kernel
    # (7 channels average little of it away; seed 4181268949 gave 1.07e-5 on every build). A
    # one-pass variance that cancels would be off by about offset^2 * eps = 1e-2.
    tol = max(TOL, 2 * offset * float(np.finfo(np.float32).eps))
    assert rel_l2(be.layer_norm(x, w, b, eps=1e-6), ref.numpy()) < tol, f"seed {seed}"


@pytest.mark.parametrize("c,kernel", [(45, (7, 7)), (32, (5, 5)), (17, (3, 7)), (96, (7, 3))])
def test_depthwise_conv_layer_norm_matches_torch(be, c, kernel):
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 13, 9, c)).astype(np.float32)
    w = rng.standard_normal((c, *kernel, 1)).astype(np.float32) / 7
    dwb, nw, nb = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    pad = ((kernel[0] // 2,) * 2, (kernel[1] // 2,) * 2)
    conv = ref_conv(x, w, dwb, (1, 1), pad, (1, 1), c)
    ref = F.layer_norm(t64(conv), (c,), t64(nw), t64(nb), eps=1e-6).numpy()
    got = be.depthwise_conv_layer_norm(x, w, dwb, nw, nb, 1e-6)
    if not _cpu.AVAILABLE:
        assert got is None  # the caller then runs conv2d and layer_norm
        got = be.layer_norm(be.conv2d(x, w, dwb, padding=(kernel[0] // 2, kernel[1] // 2), groups=c), nw, nb,
                            eps=1e-6)
    assert rel_l2(got, ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("shape,kernel", [((1, 17, 11, 131), (7, 7)), ((3, 9, 7, 67), (7, 7)), ((1, 7, 7, 768), (7, 7)),
                                          ((2, 23, 5, 40), (5, 3))])
def test_depthwise_conv_layer_norm_split_over_threads(be, shape, kernel):
    """Above a million multiply-adds the fused kernel splits each image into blocks of rows (one
    row where an image has few), handed out to the threads: every row, odd sizes, several images"""
    if not _cpu.AVAILABLE:
        pytest.skip("the split over threads is the compiled kernel's")
    rng, seed = fresh_rng()
    c = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((c, *kernel, 1)).astype(np.float32) / 7
    dwb, nw, nb = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    pad = ((kernel[0] // 2,) * 2, (kernel[1] // 2,) * 2)
    ref = F.layer_norm(t64(ref_conv(x, w, dwb, (1, 1), pad, (1, 1), c)), (c,), t64(nw), t64(nb), eps=1e-6).numpy()
    got = be.depthwise_conv_layer_norm(x, w, dwb, nw, nb, 1e-6)
    assert rel_l2(got, ref) < TOL, f"{shape} seed {seed}"


def test_fused_depthwise_layer_norm_calls_the_conv_hook(be):
    if not _cpu.AVAILABLE:
        pytest.skip("fused only where compiled")
    seen = []
    be.before_conv = lambda x, w, spec: seen.append((tuple(w.shape), spec.padding, spec.groups))
    x = np.zeros((1, 8, 8, 16), np.float32)
    assert be.depthwise_conv_layer_norm(x, np.zeros((16, 7, 7, 1), np.float32), None, None, None, 1e-6) is not None
    assert seen == [((16, 7, 7, 1), ((3, 3), (3, 3)), 16)]


def block_params(rng, c, kernel, present=(True, True, True)):
    """one ConvNeXt block's (w, dw bias, norm w, norm b, w1, b1, w2, b2), fresh random weights"""
    hidden = 4 * c
    w = rng.standard_normal((c, *kernel, 1)).astype(np.float32) / 7
    dwb, nw, nb = (rng.standard_normal(c).astype(np.float32) if p else None for p in present)
    w1 = (rng.standard_normal((hidden, c)) / np.sqrt(c)).astype(np.float32)
    w2 = (rng.standard_normal((c, hidden)) / np.sqrt(hidden)).astype(np.float32)
    b1, b2 = rng.standard_normal(hidden).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    return w, dwb, nw, nb, w1, b1, w2, b2


@pytest.mark.parametrize("shape,kernel,activation,blocks", [((1, 9, 11, 45), (7, 7), "gelu", 1),
                                                            ((2, 5, 7, 13), (5, 3), None, 2),
                                                            ((1, 14, 14, 96), (7, 7), "silu", 3)])
def test_depthwise_ln_mlp_is_the_three_ops_to_the_bit_and_matches_torch(be, shape, kernel, activation, blocks):
    """ConvNeXt's block bodies in one compiled call, each x = x + fc2(act(fc1(LayerNorm(dw conv(x))))):
    odd channel counts (vector tails), a non-square kernel, several images, one to three blocks
    (their outputs alternate between two buffers); the same bits as depthwise_conv_layer_norm and two
    linears a block, and torch's float64 within fp32 rounding. Without the compiled tiles it is None
    (the caller runs the ops)."""
    rng, seed = fresh_rng()
    c = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32)
    params = [block_params(rng, c, kernel) for _ in range(blocks)]
    got = be.depthwise_ln_mlp(x, params, 1e-6, activation)
    if not _cpu.AVAILABLE:
        assert got is None
        return
    want, ref = x, t64(x)
    pad = ((kernel[0] // 2,) * 2, (kernel[1] // 2,) * 2)
    for w, dwb, nw, nb, w1, b1, w2, b2 in params:
        h = be.linear(be.depthwise_conv_layer_norm(want, w, dwb, nw, nb, 1e-6), w1, b1, activation=activation)
        want = be.linear(h, w2, b2, residual=want)
        t = F.layer_norm(t64(ref_conv(ref.numpy(), w, dwb, (1, 1), pad, (1, 1), c)), (c,), t64(nw), t64(nb), eps=1e-6)
        hid = F.linear(t, t64(w1), t64(b1))
        hid = {None: hid, "gelu": F.gelu(hid), "silu": F.silu(hid)}[activation]
        ref = F.linear(hid, t64(w2), t64(b2)) + ref
    assert np.array_equal(got, want), f"seed {seed}"
    assert got.shape == shape and rel_l2(got, ref.numpy()) < TOL, f"seed {seed}"


def conv_count(be, path):
    from convkernels.metrics import REGISTRY
    return REGISTRY.get_sample_value("convkernels_conv_total", {"backend": be.name, "op": "conv2d", "path": path}) or 0


def test_depthwise_ln_mlp_counts_each_block_and_leaves_the_rest_to_the_ops(be):
    """Each block counts as one conv on its path. None while before_conv watches each conv (fault
    injection inspects them one by one), where the hidden activations would outgrow the cache
    (mlp's blocks of rows take those), and where the blocks differ in which parameters they have
    (one call takes one set)."""
    rng, c = fresh_rng()[0], 16
    blocks = [block_params(rng, c, (7, 7), (False, True, True)) for _ in range(3)]
    small, large = np.zeros((1, 8, 8, c), np.float32), np.zeros((1, 400, 300, c), np.float32)
    before = conv_count(be, "depthwise_ln_mlp")
    assert (be.depthwise_ln_mlp(small, blocks, 1e-6, "gelu") is not None) == _cpu.AVAILABLE
    assert conv_count(be, "depthwise_ln_mlp") - before == (3 if _cpu.AVAILABLE else 0)
    assert be.depthwise_ln_mlp(large, blocks, 1e-6, "gelu") is None
    mixed = blocks[:2] + [block_params(rng, c, (7, 7))]
    assert be.depthwise_ln_mlp(small, mixed, 1e-6, "gelu") is None
    be.before_conv = lambda *a: None
    assert be.depthwise_ln_mlp(small, blocks, 1e-6, "gelu") is None


@pytest.mark.parametrize("c,groups", [(45, 5), (45, 9), (64, 32), (12, 3)])
@pytest.mark.parametrize("activation", [None, "silu", "gelu"])
def test_group_norm_activation_matches_torch(be, c, groups, activation):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((2, 19, 7, c)) * 2 + 5).astype(np.float32)
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    ref = F.group_norm(to_t(x), groups, t64(w), t64(b), eps=1e-6)
    ref = {None: ref, "silu": F.silu(ref), "gelu": F.gelu(ref)}[activation]
    got = be.group_norm(x, groups, w, b, eps=1e-6, activation=activation)
    assert rel_l2(got, from_t(ref)) < TOL, f"seed {seed}"


@pytest.mark.parametrize("shape,groups", [((2, 97, 61, 66), 11), ((1, 200, 131, 48), 16), ((3, 67, 5, 1201), 1)])
def test_group_norm_split_over_threads(be, shape, groups):
    """Above PARALLEL_MIN_WORK the sums run as tasks over runs of positions, each with its own
    partial sums (up to 64 tasks, the last one shorter), and the apply pass likewise"""
    rng, seed = fresh_rng()
    c = shape[-1]
    x = (rng.standard_normal(shape) * 2 + 5).astype(np.float32)
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    ref = F.silu(F.group_norm(to_t(x), groups, t64(w), t64(b), eps=1e-6))
    got = be.group_norm(x, groups, w, b, eps=1e-6, activation="silu")
    assert rel_l2(got, from_t(ref)) < TOL, f"{shape} seed {seed}"


@pytest.mark.parametrize("c", [45, 64, 7])
@pytest.mark.parametrize("parts", ["bias_residual", "bias", "residual", "neither"])
def test_rms_norm_affine_matches_torch(be, c, parts):
    """rms_norm_affine (DC-AE's norm before its block's shortcut): norm * weight + bias + residual
    in the compiled pass (vector tails at odd channel counts, rows split over threads), against
    torch in float64; without the compiled kernels it is None and the caller adds."""
    rng, seed = fresh_rng()
    x, res = ((rng.standard_normal((3, 67, 41, c)) * 2 + 1).astype(np.float32) for _ in range(2))
    w, b = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    bias, residual = (b if "bias" in parts else None), (res if "residual" in parts else None)
    got = be.rms_norm_affine(x, w, bias, residual, 1e-5)
    if not _cpu.AVAILABLE:
        assert got is None
        return
    ref = F.rms_norm(t64(x), (c,), t64(w), 1e-5) + (t64(b) if bias is not None else 0)
    ref = ref.numpy() + (res if residual is not None else 0)
    assert got.dtype == np.float32 and rel_l2(got, ref) < TOL, f"seed {seed}"
    assert be.rms_norm_affine(x, w, b, res[:, :, :1], 1e-5) is None  # a broadcast residual: the caller adds


#: functions whose loops must be vector code in an AVX2 build (the Zen 2/3 and older Xeon path)
VECTOR_FUNCTIONS = ("epilogue_task", "gn_apply_task")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to build the AVX2 variant with")
def test_activation_and_norm_loops_are_vector_code_in_an_avx2_build(tmp_path):
    """Built for x86-64-v3 alone (what the AVX2 clone runs), each function divides (the rational
    erf and tanh) or adds with 8-float ymm instructions, never with the scalar ones. The
    scalar-clamp form compiled to vdivss here and made GELU 57 ms of a 174 ms ConvNeXt-T call."""
    asm = tmp_path / "norms.s"
    run = subprocess.run(["gcc", "-O3", "-fopenmp", "-march=x86-64-v3", "-DCONVKERNELS_NO_CLONES", "-Wno-psabi",
                          "-I", sysconfig.get_paths()["include"], "-S", str(CPU_SRC / "norms.c"), "-o", str(asm)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    bodies: dict[str, list[str]] = {}
    current = None
    for line in asm.read_text().splitlines():
        if line and not line[0].isspace() and line.endswith(":") and not line.startswith("."):
            current = line[:-1].split(".")[0]
            bodies.setdefault(current, [])
        elif current:
            bodies[current].append(line.strip())
    for name in VECTOR_FUNCTIONS:
        body = [ln for fn, lines in bodies.items() if fn == name for ln in lines]
        assert body, f"{name} not found in the AVX2 build"
        ops = [ln.split()[0] for ln in body if ln and not ln.startswith(".")]
        scalar = [op for op in ops if op in ("vdivss", "divss", "vcomiss", "comiss", "ucomiss", "vucomiss")]
        vector = [ln for ln in body if ("vdivps" in ln or "vaddps" in ln or "vfmadd" in ln) and "%ymm" in ln]
        assert vector and not scalar, f"{name}: {len(vector)} ymm ops, scalar {sorted(set(scalar))}"
