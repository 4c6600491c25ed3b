"""Ranked labels out: an image encoder's logits -> the `top_k` classes of each row."""
from __future__ import annotations

import numpy as np


def top_k(logits: np.ndarray, k: int, labels: list[str] | None) -> list[list[dict]]:
    """Per row, the k largest softmax probabilities with their class index and label."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    k = min(k, p.shape[1])
    out = []
    for row in p:
        idx = np.argsort(-row, kind="stable")[:k]
        out.append([{"index": int(i), "label": labels[i] if labels and i < len(labels) else None,
                     "score": float(row[i])} for i in idx])
    return out
