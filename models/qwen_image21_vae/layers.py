"""What the Qwen-Image 2.1 VAE changes in the Wan layers it is built from: its causal convs are 2-D.

diffusers' `QwenImage21CausalConv3d` is an `nn.Conv2d` (weights O, I, kH, kW) that squeezes the one
frame out, pads space symmetrically and refuses a feature cache: the image specialisation of Wan's
causal conv. On a lone frame a Wan causal conv sees only zero frames before it, so it is exactly its
last time tap; a `FrameConv` is that conv with a time kernel of 1, loading the 2-D weight as it is
(no zero taps stored) and caching nothing (there is no second frame to cache for). Everything else
is Wan 2.2's (models/wan22_vae: residual up and down blocks with DupUp3D / AvgDown3D shortcuts) and
Wan 2.1's (models/wan_vae: RMS norms, resnets, the mid-block attention, the resamplers), row-shard
aware as they are: a FrameConv keeps CausalConv3d's halo rows and edge padding.

`frame_convs(tree)` swaps every CausalConv3d of a built Wan tree for a FrameConv of the same widths,
spatial kernel and padding, before the tree loads, so its expected state dict is diffusers'.
"""
from __future__ import annotations

import numpy as np

from ..nn.module import Module
from ..nn.weights import conv_weight_to_channels_last
from ..wan_vae.layers import CausalConv3d, FeatureCache


class FrameConv(CausalConv3d):
    """QwenImage21CausalConv3d: a 2-D conv on each (the one) frame, its weight O, I, kH, kW as the
    checkpoint has it (stored O, 1, kH, kW, I for the backend's conv3d)."""

    @classmethod
    def of(cls, conv: CausalConv3d) -> "FrameConv":
        _, kh, kw = conv.kernel
        return cls(conv.cin, conv.cout, (1, kh, kw), padding=(0, conv.space_pad[0][0], conv.space_pad[1][0]))

    def param_shapes(self):
        return {"weight": (self.cout, self.cin, *self.kernel[1:]), "bias": (self.cout,)}

    def convert(self, name, host):
        if name != "weight":
            return host
        return np.ascontiguousarray(conv_weight_to_channels_last(host)[:, None])

    def with_cache(self, x, state: FeatureCache, norm=None):
        """CausalConv3d.with_cache without a cache: (x normed and haloed, 0 frames to pad). The
        slot is kept (empty) so the decode's slot order is Wan's."""
        rows = self._halo(x)
        if norm is not None:
            x = norm(x, "silu", rows=rows)
        elif rows is not None:
            x = self.backend.concat([r for r in (rows[0], x, rows[1]) if r is not None], axis=2)
        state.peek()
        state.put(None)
        return x, 0


def frame_convs(tree: Module) -> Module:
    """`tree` with each CausalConv3d child replaced by FrameConv.of it, in `children` and in the
    attribute its parent calls it by (every Wan block holds its convs as attributes)."""
    for _, parent in list(tree.walk()):
        for name, child in list(parent.children.items()):
            if type(child) is not CausalConv3d:
                continue
            frame = parent.children[name] = FrameConv.of(child)
            held = [attr for attr, value in vars(parent).items() if value is child]
            if not held:
                raise TypeError(f"{type(parent).__name__}.{name}: a conv its block does not hold by attribute")
            for attr in held:
                setattr(parent, attr, frame)
    return tree
