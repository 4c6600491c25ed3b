"""The MLX backend (Metal on Apple silicon, MLX's CPU device elsewhere): backend.py, its conv
paths and environment (paths.py), the depthwise Metal kernel (metal.py)."""
