"""The CUDA backend (CuPy + cuDNN frontend, cuBLAS and cuBLASLt through ctypes): backend.py names
what each module here does; the kernels' CUDA C is in src/*.cu (package data). Importing this
package imports nothing: CuPy loads only with the modules that need it."""
