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

CudaOptions.upsample_form picks one, or `auto` (the default) by the input's positions (N x H x W)
and channels (`form_for`). On an H100, in bfloat16 and float16 alike (benchmarks/gpu/upsample_forms.py,
2026-11-26 ~18:00 UTC; benchmarks/HISTORY.md), the phase form was faster at 16384 positions and
more with 256 channels or more (SD-VAE's 128x128 and 256x256 upsamplers 1.07-1.19x, Wan 2.1's and
Wan 2.2's over 4 frames 1.21-1.61x), and with 64 channels only at 262144 (TAESD's 512x512: 1.12-1.15x).
It was slower below: SD-VAE's 64x64 of 512 channels (4096 positions) 0.92-0.95x, TAESD's 128x128
and 256x256 of 64 channels 0.72-0.96x.
"""
from __future__ import annotations

from ...spec import upsample_conv_as_phases, upsample_conv_as_transpose
from ...tensor_ops import ShuffledResidual

#: `auto` takes the phase form from this many input positions (N x H x W) up, for inputs of at
#: least PHASES_MIN_CHANNELS channels; for narrower ones from PHASES_NARROW_POSITIONS up
PHASES_MIN_POSITIONS = 16384
PHASES_MIN_CHANNELS = 128
PHASES_NARROW_POSITIONS = 262144


def form_for(option: str, x_shape) -> str:
    """The form upsample_conv2d runs for an (N, H, W, C) input under CudaOptions.upsample_form."""
    if option != "auto":
        return option
    n, h, w, c = x_shape
    positions = n * h * w
    wide = c >= PHASES_MIN_CHANNELS and positions >= PHASES_MIN_POSITIONS
    return "phases" if wide or positions >= PHASES_NARROW_POSITIONS else "transposed"


def upsample_conv2d(be, x, weight, bias, residual):
    """`be`: the CudaBackend; operands checked by BackendBase.upsample_conv2d. A ShuffledResidual
    is read in place by the phase form's copy where its kernel takes it (Kernels.
    phase_interleave_shuffled: Wan 2.2's DupUp3D shortcuts), else made first."""
    dt = be.dtype_of(x)
    shuffled = isinstance(residual, ShuffledResidual)
    if form_for(be.options.upsample_form, x.shape) == "transposed":
        w4 = be.weights.get("upsample_as_transpose", weight, lambda v: be.arrays.cast(
            upsample_conv_as_transpose(be.cp, be.arrays.f32(v)), dt))
        r = be.shuffled_frames(residual) if shuffled else residual
        return be.conv_transpose2d(x, w4, bias, stride=2, padding=1, residual=r)
    wp = be.weights.get("upsample_as_phases", weight, lambda v: be.arrays.cast(
        upsample_conv_as_phases(be.cp, be.arrays.f32(v)), dt))
    # each phase's block of output channels takes the same bias
    bp = None if bias is None else be.weights.get("upsample_phase_bias", bias, lambda v: be.cp.tile(v, 4))
    y = be.arrays.contiguous(be.conv2d(x, wp, bp, padding=1))
    kern = be.arrays.kernels(dt)
    if shuffled:
        source = be.arrays.contiguous(residual.source)
        if kern.takes_shuffled(y, source, residual.factors, residual.repeats):
            return kern.phase_interleave_shuffled(y, source, residual.factors[0], residual.repeats, residual.start)
        residual = be.shuffled_frames(residual)
    r = None if residual is None else be.arrays.contiguous(residual)
    return kern.phase_interleave(y, r)
