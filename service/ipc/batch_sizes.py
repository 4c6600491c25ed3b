"""The batch sizes a model worker's batcher runs (service/worker/batcher.py's Batcher._bucket):
the worker warms each up, and a front end reports them to Triton clients (the model config's
preferred_batch_size), so both sides compute them here from the shared max_batch setting."""
from __future__ import annotations


def batch_sizes(max_batch: int) -> list[int]:
    """Every batch size Batcher._bucket runs: the powers of two below max_batch, and max_batch."""
    return [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch] + [max_batch]
