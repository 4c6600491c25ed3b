"""Backends: numpy (CPU default), mlx (Metal; MLX's CPU device elsewhere), cuda (CuPy + cuDNN)."""
