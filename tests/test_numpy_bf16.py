"""The NumPy backend's opt-in bfloat16 (convkernels/_cpu/gemm_bf16.c, backends/numpy/bf16.py):
bfloat16 operands, float32 sums, the float32 tiles' epilogue.

Bounds, against torch:
- against a float64 product of the bf16-rounded operands (torch's own cast, ties to even): float32
  rounding only, the float32 tiles' 1e-5;
- against the float32 reference: rel L2 under 2^-8 (bfloat16's epsilon; rounding both operands of
  every product to 8 significant bits leaves ~2^-9 relative per product) and, for the product, under
  1.5x the error of torch.matmul on bfloat16 tensors on the CPU against the same reference;
- a whole ConvNeXt (tiny-convnext's stages at ConvNeXt-T's widths): the embedding under torch's
  bfloat16 model's error (ours rounds only the products' operands), the 14 logits under 1.5x it,
  both under 2e-2 and above 1e-4, so a silent fallback to float32 fails too.
The refusal runs on every machine: where /proc/cpuinfo lists no avx512_bf16 the backend must
refuse to start, with one line that says why."""
from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from torch_reference import F, fresh_rng, rel_l2, torch

from convkernels import _cpu, get_backend
from convkernels.backends.numpy import bf16, fused

TOL = 1e-5  # float32 rounding of the sums: the float32 tiles' bound (tests/test_cpu_gemm.py)
BF16_EPS = 2.0 ** -8
#: the whole ConvNeXt's error as a multiple of transformers' own bfloat16 model's, at most
RATIO = {"embedding": 1.0, "logits": 1.5}
ACTS = {None: lambda t: t, "gelu": F.gelu, "silu": F.silu}
CPU_SRC = Path(__file__).resolve().parents[1] / "convkernels" / "_cpu"


def cpu_has_avx512_bf16() -> bool:
    """What the CPU says, read independently of the kernels' own check"""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


needs_bf16 = pytest.mark.skipif(not bf16.available(), reason="this CPU has no AVX-512 BF16 (or no compiled kernels): "
                                "the bfloat16 tiles cannot run; test_refused_where_the_cpu_lacks_it covers it")


def to_bf16(a: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 cast, back as float64 (exact)"""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).to(torch.float64).numpy()


def truncated(a: np.ndarray) -> np.ndarray:
    """bfloat16 by dropping the low 16 bits (no rounding): the mistake the bounds must catch"""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)


def reference(x, w, bias, res, act) -> np.ndarray:
    """act(x @ w^T + bias) + res in float64 from the operands as given (float64 arrays)"""
    t = F.linear(torch.from_numpy(np.asarray(x, np.float64)), torch.from_numpy(np.asarray(w, np.float64)),
                 None if bias is None else torch.from_numpy(bias.astype(np.float64)))
    t = ACTS[act](t)
    return (t if res is None else t + torch.from_numpy(res.astype(np.float64))).numpy()


def torch_bf16(x, w, bias, res, act) -> np.ndarray:
    """torch's own bfloat16 linear on the CPU: bf16 tensors in, bf16 out"""
    b = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16)  # noqa: E731
    t = ACTS[act](F.linear(b(x), b(w), None if bias is None else b(bias)))
    return (t if res is None else t + b(res)).to(torch.float64).numpy()


def run(x, w, bias=None, res=None, act=None) -> np.ndarray:
    m, k = x.shape
    n = w.shape[0]
    out = np.full((m, n), np.nan, np.float32)
    none = np.zeros(1, np.float32)
    _cpu._kernels.gemm_bf16(x, bf16.pack_panels(w), none if bias is None else bias, none if res is None else res,
                            out, m, k, n, bias is not None, res is not None, fused.ACT_CODES[act])
    return out


def scaled_err(got, want) -> float:
    """rel L2 with a floor of unit scale (a GELU output near 0 would make a tiny absolute error large)"""
    diff = np.linalg.norm(np.asarray(got, np.float64) - want)
    return float(diff / max(np.linalg.norm(want), np.sqrt(want.size)))


def operands(m, k, n):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((m, k)) * 2).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return x, w, rng.standard_normal(n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32), seed


def test_refused_where_the_cpu_lacks_it():
    """Runs everywhere. With AVX-512 BF16 the backend is built and computes in it; without, asking
    for it ends in one line naming what is missing (not float32 instead, silently)."""
    if cpu_has_avx512_bf16() and _cpu.AVAILABLE:
        be = get_backend("numpy", dtype="bfloat16")
        assert isinstance(be, bf16.NumpyBf16Backend) and be.describe()["dtype"] == "bfloat16"
        assert bf16.available()
    else:
        assert not bf16.available()
        with pytest.raises(ValueError, match="AVX-512 BF16") as e:
            get_backend("numpy", dtype="bfloat16")
        assert "\n" not in str(e.value)
    assert type(get_backend("numpy")).__name__ == "NumpyBackend"  # float32 stays the default


def test_the_refusal_is_one_line_naming_what_is_missing(monkeypatch):
    """The refusal's own words, on every machine (the CPU check answering no, as on an AVX2 one)"""
    monkeypatch.setattr(bf16, "available", lambda: False)
    with pytest.raises(ValueError, match="dtype bfloat16 needs a CPU with AVX-512 BF16") as e:
        get_backend("numpy", dtype="bfloat16")
    assert "\n" not in str(e.value)


@needs_bf16
def test_tile_memory_counts_float32_activations():
    """The VAE tiling's memory estimate: this backend's activations are float32, 4 bytes, not 2"""
    from types import SimpleNamespace

    from models.nn import tile_memory

    assert tile_memory._itemsize(SimpleNamespace(backend=get_backend("numpy", dtype="bfloat16"))) == 4
    assert tile_memory._itemsize(SimpleNamespace(backend=SimpleNamespace(name="cuda", dtype="bfloat16"))) == 2


@needs_bf16
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (49, 97, 131), (13, 33, 40), (200, 64, 50), (25, 768, 96)])
@pytest.mark.parametrize("act", [None, "gelu", "silu"])
def test_tiles_match_torch_on_rounded_operands(m, k, n, act):
    """Odd K (the last pair half zero), a short last row block and panel, both task orders."""
    x, w, b, res, seed = operands(m, k, n)
    for bias, r in [(b, res), (None, None)]:
        got = run(x, w, bias, r, act)
        assert not np.isnan(got).any(), f"{(m, k, n)}: some output never written"
        err = scaled_err(got, reference(to_bf16(x), to_bf16(w), bias, r, act))
        assert err < TOL, f"{(m, k, n)} {act} seed {seed}: {err:.2e} against the rounded operands"
        if k > 1:  # the bound tells rounded operands from unrounded ones
            assert scaled_err(got, reference(x, w, bias, r, act)) > TOL


@needs_bf16
@pytest.mark.parametrize("m,k,n", [(49, 97, 131), (49, 768, 307), (196, 385, 96)])
def test_error_against_float32_is_bfloat16s(m, k, n):
    """Against the float32 result: the product within 1.5x torch.matmul's on bf16 tensors and under
    bf16's epsilon, with bias, GELU and residual under the epsilon too; operands truncated instead of
    rounded fail both (measured ~2.3e-3 ours, ~2.9e-3 torch's, ~6.1e-3 truncated)."""
    x, w, b, res, seed = operands(m, k, n)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    theirs = rel_l2(torch_bf16(x, w, None, None, None), exact)
    for label, got in (("ours", run(x, w)), ("truncated", truncated(x) @ truncated(w).T)):
        err = rel_l2(got, exact)
        within = err < BF16_EPS and err < 1.5 * theirs
        assert within == (label == "ours"), f"{label} {(m, k, n)} seed {seed}: {err:.2e} vs torch bf16 {theirs:.2e}"
    want = reference(x, w, b, res, "gelu")
    for label, got in (("ours", run(x, w, b, res, "gelu")),
                       ("truncated", reference(truncated(x), truncated(w), b, res, "gelu"))):
        err = rel_l2(got, want)
        assert (err < BF16_EPS) == (label == "ours"), f"{label} with epilogue {(m, k, n)} seed {seed}: {err:.2e}"


@needs_bf16
@pytest.mark.parametrize("k", [31, 64, 97])
def test_rounding_is_to_nearest_even_as_torchs_cast(k):
    """Values on and beside a tie, through both conversions: A (at run time, in vectors of 32 and a
    masked tail) against an identity weight, and the weight (packed) against an identity A; every
    product is then exact, so the outputs are the rounded values themselves, bit for bit."""
    rng, seed = fresh_rng()
    base = rng.standard_normal(k).astype(np.float32).view(np.uint32) & 0xFFFF0000
    offsets = np.array([0x8000, 0x7FFF, 0x8001, 0x18000, 0], np.uint32)
    vals = (base + offsets[np.arange(k) % 5]).view(np.float32)
    eye = np.eye(k, dtype=np.float32)
    want = to_bf16(vals)
    got_a = run(vals[None, :], eye)[0]
    got_w = run(eye, vals[None, :])[:, 0]
    np.testing.assert_array_equal(got_a, want, err_msg=f"A's rounding, seed {seed}")
    np.testing.assert_array_equal(got_w, want, err_msg=f"the weight's rounding, seed {seed}")
    assert not np.array_equal(truncated(vals), want)  # ties and near-ties do tell the roundings apart
    np.testing.assert_array_equal(bf16.bf16_round(vals), want)


@pytest.mark.skipif(shutil.which("gcc") is None or platform.machine() != "x86_64", reason="needs gcc on x86-64")
def test_the_full_tile_keeps_its_accumulators_in_registers(tmp_path):
    """Built on any x86-64 (the instruction set is the tile's own attribute, not the build's): the 12 x
    32 tile's step over K is 24 vdpbf16ps on zmm registers, no vector moving to or from the stack"""
    asm = tmp_path / "gemm_bf16.s"
    run = subprocess.run(["gcc", "-O3", "-fopenmp", "-Wno-psabi", "-I", sysconfig.get_paths()["include"], "-S",
                          str(CPU_SRC / "gemm_bf16.c"), "-o", str(asm)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    body, inside = [], False
    for line in asm.read_text().splitlines():
        if line and not line[0].isspace() and line.endswith(":") and not line.startswith("."):
            inside = line[:-1] == "tile_bf16_12"
        elif inside:
            body.append(line.strip())
    dots = [i for i, ln in enumerate(body) if ln.startswith("vdpbf16ps")]
    assert len(dots) == 24 and all("%zmm" in body[i] for i in dots), [body[i] for i in dots]
    start = max(i for i in range(dots[0]) if body[i].startswith(".L") and body[i].endswith(":"))
    end = next(i for i in range(dots[-1], len(body)) if body[i].startswith("j"))
    loop = body[start:end + 1]  # the step over K: loads of A and the panel, the 24 products, the branch
    spills = [ln for ln in loop if "%zmm" in ln and ("(%rsp)" in ln or "(%rbp)" in ln)]
    assert not spills, spills


@needs_bf16
def test_mismatched_buffers_are_refused():
    k = _cpu._kernels
    x, w = np.ones((4, 7), np.float32), np.ones((5, 7), np.float32)
    out, none, p = np.empty((4, 5), np.float32), np.zeros(1, np.float32), bf16.pack_panels(w)
    with pytest.raises(ValueError, match="gemm_bf16"):
        k.gemm_bf16(x, p[:-1], none, none, out, 4, 7, 5, False, False, 0)  # panels too short
    with pytest.raises(ValueError, match="gemm_bf16"):
        k.gemm_bf16(x, p, none, none, out, 4, 7, 5, True, False, 0)  # a bias of one float for 5 columns
    with pytest.raises(ValueError, match="pack_weight_bf16"):
        k.pack_weight_bf16(w, np.empty(3, np.uint16), 5, 7)


@needs_bf16
def test_backend_linears_and_gemm_convs_take_bfloat16_and_float32_is_unchanged():
    """The backend's linear, pointwise conv and unfolded conv (ConvNeXt's stem: 4x4 stride 4) run
    the bfloat16 tiles; the float32 backend's results are those of the float32 tiles, bit for bit."""
    be, f32 = get_backend("numpy", dtype="bfloat16"), get_backend("numpy")
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 7, 7, 97)).astype(np.float32)
    w = (rng.standard_normal((131, 97)) / 10).astype(np.float32)
    b = rng.standard_normal(131).astype(np.float32)
    res = rng.standard_normal((2, 7, 7, 131)).astype(np.float32)
    got = be.linear(x, w, b, residual=res, activation="gelu")
    x2 = x.reshape(-1, 97)
    want = reference(to_bf16(x2), to_bf16(w), b, res.reshape(-1, 131), "gelu")
    assert scaled_err(got.reshape(-1, 131), want) < TOL, f"linear, seed {seed}"
    f32_out = f32.linear(x, w, b, residual=res, activation="gelu")
    np.testing.assert_array_equal(f32_out.reshape(-1, 131), fused.linear(x2, w, b, res, "gelu", fused.pack_panels))
    assert scaled_err(f32_out.reshape(-1, 131), want) > TOL  # the two dtypes do differ

    for kernel, stride, cin, cout in [(1, 1, 97, 131), (4, 4, 3, 96)]:
        xi = rng.random((2, 16, 16, cin), dtype=np.float32)
        wc = (rng.standard_normal((cout, kernel, kernel, cin)) / np.sqrt(cin * kernel * kernel)).astype(np.float32)
        bc = rng.standard_normal(cout).astype(np.float32)
        got = be.conv2d(xi, wc, bc, stride=stride)
        t = F.conv2d(torch.from_numpy(to_bf16(xi)).permute(0, 3, 1, 2), torch.from_numpy(to_bf16(wc)).permute(0, 3, 1, 2),
                     torch.from_numpy(bc.astype(np.float64)), stride=stride).permute(0, 2, 3, 1).numpy()
        assert scaled_err(got, t) < TOL, f"conv {kernel}x{kernel}, seed {seed}"
        assert scaled_err(f32.conv2d(xi, wc, bc, stride=stride), t) > TOL


@needs_bf16
def test_weights_are_packed_once_at_load_as_bfloat16(monkeypatch):
    """prepare_linear and a gemm conv's prepare pack the bfloat16 panels the calls then use: the
    calls pack nothing more, and no float32 panels are made"""
    be = get_backend("numpy", dtype="bfloat16")
    calls = []
    for module, name in ((bf16, "pack_panels"), (fused, "pack_panels")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda w, real=real, tag=module.__name__: calls.append(tag) or real(w))
    rng, seed = fresh_rng()
    w = (rng.standard_normal((40, 24)) / 5).astype(np.float32)
    wc = (rng.standard_normal((32, 2, 2, 24)) / 10).astype(np.float32)
    be.prepare_linear(w)
    be.prepare_conv(wc, stride=2)
    assert calls == [bf16.__name__, bf16.__name__], calls
    be.linear(rng.standard_normal((5, 24)).astype(np.float32), w)
    be.conv2d(rng.random((1, 8, 8, 24), dtype=np.float32), wc, stride=2)
    assert calls == [bf16.__name__, bf16.__name__], calls


@needs_bf16
def test_measured_choices_are_stored_apart_from_float32s(tmp_path):
    """The same plan_cache_dir: bfloat16's stored path choices in a file of their own (its convs
    are timed on other products), float32's file as before"""
    f32 = get_backend("numpy", numpy_options={"plan_cache_dir": str(tmp_path)})
    be = get_backend("numpy", dtype="bfloat16", numpy_options={"plan_cache_dir": str(tmp_path)})
    assert be.path_store.path.parent == f32.path_store.path.parent == tmp_path
    assert be.path_store.path != f32.path_store.path
    assert be.choice.store is be.path_store


@needs_bf16
def test_whole_convnext_within_torchs_bfloat16_error(tmp_path_factory):
    """tiny-convnext's stages at ConvNeXt-T's widths (96-768), fresh random weights: our bfloat16
    embedding and logits against transformers in float32, beside transformers' own bfloat16 model."""
    import test_models_convnext as cnx
    from models.convnext import build

    seed = int(np.random.default_rng().integers(1 << 30))
    ref_model, folder = cnx.make_hf(tmp_path_factory, cnx.TINY_DIMS, True, seed=seed)
    pixels = np.random.default_rng(seed).random((2, 64, 64, 3), dtype=np.float32)
    emb_ref, logits_ref = cnx.reference(ref_model, pixels)
    x = torch.from_numpy(((pixels - cnx.MEAN) / cnx.STD).transpose(0, 3, 1, 2).copy()).to(torch.bfloat16)
    ref_bf16 = ref_model.to(torch.bfloat16)
    with torch.no_grad():
        base = ref_bf16.convnext(x)
        emb_t, logits_t = base.pooler_output.float().numpy(), ref_bf16.classifier(base.pooler_output).float().numpy()
    ours = build("enc", "tiny-convnext", get_backend("numpy", dtype="bfloat16"), str(folder)).encode(pixels)
    f32 = build("enc", "tiny-convnext", get_backend("numpy"), str(folder)).encode(pixels)
    for name, got, want, theirs, exact in (("embedding", ours["embedding"], emb_ref, emb_t, f32["embedding"]),
                                           ("logits", ours["logits"], logits_ref, logits_t, f32["logits"])):
        err, err_t = rel_l2(got, want), rel_l2(theirs, want)
        assert rel_l2(exact, want) < cnx.TOL, f"{name}: float32 itself, seed {seed}"
        # measured over 10 seeds (2026-11-29): embedding (1536 values) 0.53-0.59x torch's error, logits
        # (14 values, so noisier) 0.55-0.99x; ours 1.9e-3-7.7e-3, torch's 3.4e-3-1.1e-2
        assert 1e-4 < err < min(RATIO[name] * err_t, 2e-2), f"{name} seed {seed}: rel L2 {err:.2e}, torch bf16 {err_t:.2e}"


@needs_bf16
@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("hidden", [84, 13])
def test_a_stage_call_in_bfloat16_is_depthwise_layer_norm_and_two_bfloat16_products_a_block(blocks, hidden):
    """gemm.c's depthwise_ln_mlp with bf16 set, one or three blocks in one call, odd channels (an odd
    K: the last pair's second half zero): the bits of the compiled depthwise conv + LayerNorm and two
    gemm_bf16 calls a block on the same bfloat16 panels, although the call hands the hidden rows from one
    product to the next in bfloat16. hidden 84: the layer norm's pairs fit in the hidden scratch's upper
    part; 13: they do not (a scratch of their own), and the hidden rows' odd end is a pad that must be
    zero (the scratch starts as NaN, which a pad left unwritten would carry into the result). A bfloat16
    panel one pair short is an error, not a read past it."""
    from test_cpu_gemm import STAGE, stage_case

    def gemm(a, p, bias, res, out, m, k, n, has_res, act):
        _cpu._kernels.gemm_bf16(a, p, bias, res, out, m, k, n, True, has_res, act)
    shape = STAGE[:4] + (hidden,)
    x, params, want, seed = stage_case(blocks, bf16.pack_panels, gemm, shape)
    n, h, w, c, _ = shape
    rows = n * h * w

    def call(out, given):
        _cpu._kernels.depthwise_ln_mlp(x, out, np.empty_like(x), np.empty((rows, c), np.float32),
                                       np.full((rows, hidden), np.nan, np.float32), given, True, True, True, n, h,
                                       w, c, 7, 7, hidden, 1e-6, fused.ACT_CODES["gelu"], 0, True)
    got = np.full((n, h, w, c), np.nan, np.float32)
    call(got, params)
    assert np.array_equal(got, want), f"seed {seed}"
    short = params[-1][:6] + (params[-1][6][:-2],) + params[-1][7:]
    with pytest.raises(ValueError, match="depthwise_ln_mlp"):
        call(got, params[:-1] + [short])


@needs_bf16
def test_convnext_blocks_take_bfloat16_products_in_one_call_or_as_ops():
    """The bfloat16 backend's stage call is its float32 ops' twin with bfloat16 products: the bits of
    depthwise_conv_layer_norm and its own two (bfloat16) linears a block, not the float32 backend's
    result. Where the hidden activations outgrow the cache, its MLP in blocks of rows gives the bits
    of its two whole bfloat16 linears (rows odd, the last block short). Both fail if a float32
    product slips in."""
    import test_cpu_fused_kernels as fk

    rng, seed = fresh_rng()
    c = 45
    be, f32 = get_backend("numpy", dtype="bfloat16"), get_backend("numpy")
    x = rng.standard_normal((2, 9, 11, c)).astype(np.float32)
    params = [fk.block_params(rng, c, (7, 7)) for _ in range(2)]
    got = be.depthwise_ln_mlp(x, params, 1e-6, "gelu")
    want = x
    for w, dwb, nw, nb, w1, b1, w2, b2 in params:
        h = be.linear(be.depthwise_conv_layer_norm(want, w, dwb, nw, nb, 1e-6), w1, b1, activation="gelu")
        want = be.linear(h, w2, b2, residual=want)
    assert np.array_equal(got, want), f"seed {seed}"
    theirs = f32.depthwise_ln_mlp(x, params, 1e-6, "gelu")
    assert 1e-4 < rel_l2(got, theirs) < BF16_EPS, f"seed {seed}"
    large = rng.standard_normal((1, 401, 299, 16)).astype(np.float32)
    w, dwb, nw, nb, w1, b1, w2, b2 = fk.block_params(rng, 16, (7, 7))
    blocked = be.mlp(large, w1, b1, w2, b2, "gelu", large)
    whole = be.linear(be.linear(large, w1, b1, activation="gelu"), w2, b2, residual=large)
    assert blocked is not None and np.array_equal(blocked, whole), f"seed {seed}"
    assert 1e-4 < rel_l2(blocked, f32.mlp(large, w1, b1, w2, b2, "gelu", large)) < BF16_EPS, f"seed {seed}"
