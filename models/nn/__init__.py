"""What several model families share: the Module base (module.py), shared layers (layers.py),
checkpoint reading, renaming and config loading (weights.py), tiling and its memory estimate (tiling.py,
tile_memory.py) and the interrupt check (interrupt.py). It imports no family."""
