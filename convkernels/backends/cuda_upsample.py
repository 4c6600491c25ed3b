"""upsample_conv2d on CUDA: nearest 2x of (N, H, W, C), then a 3x3 conv with padding 1 (diffusers'
Upsample2D, Wan's Resample), in one of two equivalent forms. Each does 4 instead of the literal
form's 9 multiply-adds per output and input channel, and neither builds the 4x-size upsampled
input:

- transposed: one cuDNN dgrad, stride 2, with the (O, 4, 4, I) weight of
  spec.upsample_conv_as_transpose, writes the four output phases interleaved; bias and residual
  join in its epilogue. Measured 2.3-3.6x faster than nearest + 3x3 on the H100 (2026-11-24).
- phases: one cuDNN forward conv, 2x2 with padding 1, with the (4 O, 2, 2, I) weight of
  spec.upsample_conv_as_phases, writes the phases as channel blocks of an (N, H+1, W+1, 4 O)
  tensor; one copy kernel (shuffle.cu's phase_interleave) puts them in place and adds the
  residual. Why it exists: in an H100 profile of Wan 2.2 720p (2026-11-26), the upsamplers' dgrad
  kernel (an sm80 one) ran at about a third of the dense bf16 peak, where the model's forward convs
  ran at about three quarters; the copy costs one pass over the output.

CudaOptions.upsample_form picks one, or `auto` (the default) picks by the input's positions
(N x H x W, `form_for`). On an H100 in bfloat16 (benchmarks/upsample_forms.py, 2026-11-26 17:50 UTC)
the phase form was slower at 4096 positions (SD-VAE 512's 64x64 of 512 channels: 0.218 against
0.198 ms) and faster from 56320 up (Wan 2.2 720p's 4 frames of 88x160, 1024 channels, 1.60x;
SD-VAE's 256x256 of 256 channels 1.05x; TAESD's 512x512 of 64 channels 1.14x).
"""
from __future__ import annotations

from ..spec import upsample_conv_as_phases, upsample_conv_as_transpose

#: `auto` takes the phase form from this many input positions (N x H x W) up
PHASES_MIN_POSITIONS = 16384


def form_for(option: str, x_shape) -> str:
    """The form upsample_conv2d runs for an (N, H, W, C) input under CudaOptions.upsample_form."""
    if option != "auto":
        return option
    n, h, w, _ = x_shape
    return "phases" if n * h * w >= PHASES_MIN_POSITIONS else "transposed"


def upsample_conv2d(be, x, weight, bias, residual):
    """`be`: the CudaBackend; operands checked by BackendBase.upsample_conv2d."""
    dt = be.dtype_of(x)
    if form_for(be.options.upsample_form, x.shape) == "transposed":
        w4 = be.weights.get("upsample_as_transpose", weight, lambda v: be.arrays.cast(
            upsample_conv_as_transpose(be.cp, be.arrays.f32(v)), dt))
        return be.conv_transpose2d(x, w4, bias, stride=2, padding=1, residual=residual)
    wp = be.weights.get("upsample_as_phases", weight, lambda v: be.arrays.cast(
        upsample_conv_as_phases(be.cp, be.arrays.f32(v)), dt))
    # each phase's block of output channels takes the same bias
    bp = None if bias is None else be.weights.get("upsample_phase_bias", bias, lambda v: be.cp.tile(v, 4))
    y = be.arrays.contiguous(be.conv2d(x, wp, bp, padding=1))
    r = None if residual is None else be.arrays.contiguous(residual)
    return be.arrays.kernels(dt).phase_interleave(y, r)
