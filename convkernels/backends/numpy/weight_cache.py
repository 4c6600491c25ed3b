"""Transformed weights of the NumPy backend (Winograd's, sub-pixel phases', depthwise taps, gemm.c's
packed panels), computed once per weight buffer and kept while that buffer lives.

Why: a transform costs about a third of its conv (26 ms at 512->512), a linear's packing about a
copy of the weight, and model weights never change once loaded. A view (Wan's first latent frame
uses only the last time tap, a fresh slice per call) is kept under the array owning its memory,
keyed by where the view starts and how it walks that memory; the entry goes when the owner does."""
from __future__ import annotations

import weakref
from typing import Callable

import numpy as np


class TransformedWeights:
    """`cache(w, transform)` -> transform(w as float32), computed once per (transform, weight view)."""

    def __init__(self):
        self.entries: dict = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __call__(self, w: np.ndarray, transform: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        owner = w
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        key = (transform, id(owner), w.__array_interface__["data"][0], w.shape, w.strides)
        hit = self.entries.get(key)
        if hit is not None and hit[0]() is owner:
            return hit[1]
        u = transform(np.asarray(w, np.float32))
        try:
            ref = weakref.ref(owner, lambda _r, k=key: self.entries.pop(k, None))
        except TypeError:  # not weak-referenceable: do not cache
            return u
        self.entries[key] = (ref, u)
        return u
