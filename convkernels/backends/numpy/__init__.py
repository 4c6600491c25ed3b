"""The NumPy backend (the readable reference and CPU default): backend.py, its conv paths (conv.py),
activations, path timing (autotune.py) and their store on disk (path_store.py), BLAS threads."""
