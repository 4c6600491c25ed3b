"""File codecs on the GPU's own engines (jpeg.py: baseline JPEG decode through nvImageCodec), which
the CUDA backend offers through its contract (`CudaBackend.jpeg_decoder`)."""
