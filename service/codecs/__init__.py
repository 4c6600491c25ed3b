"""Payload codecs, one module per format, used by the HTTP front ends and the CLI: which reader a
body goes to (media.py), tensors in (.npy: npy_parse.py; safetensors and JSON+base64:
tensors.py), .npy out (npy_write.py), images in and out (images.py), ranked labels out
(labels.py), MP4 (video.py) and fragmented MP4 for streams (fmp4.py). Everything raises Problem
with a 4xx on bad input. The names below are the tensor and image codecs' (`codecs.X`); video and
fmp4 are imported by name where they are used (PyAV loads only there)."""
from .images import (IMAGE_FORMATS, WEBP_METHOD, ZIP_MEDIA, check_source_image, encode_images, image_bytes,
                     model_pixels, open_image, png_bytes, preprocess, to_uint8, zip_bytes)
from .labels import top_k
from .media import (GENERIC_MEDIA, IMAGE_MEDIA_TEXT, NPY_MEDIA, SAFETENSORS_MEDIA, TENSOR_MEDIA_TEXT, media_type,
                    read_npy, read_tensor_body, refuse_misnamed, sniff)
from .npy_write import npy_bytes, npy_header, npy_parts
from .tensors import bf16_to_f32, load_json, read_json_tensor, read_safetensors, reshape, shape_text

__all__ = ["GENERIC_MEDIA", "IMAGE_FORMATS", "IMAGE_MEDIA_TEXT", "NPY_MEDIA", "SAFETENSORS_MEDIA", "TENSOR_MEDIA_TEXT",
           "WEBP_METHOD", "ZIP_MEDIA", "bf16_to_f32", "check_source_image", "encode_images", "image_bytes",
           "load_json", "media_type", "model_pixels", "npy_bytes", "npy_header", "npy_parts", "open_image",
           "png_bytes", "preprocess", "read_json_tensor", "read_npy", "read_safetensors", "read_tensor_body",
           "refuse_misnamed", "reshape", "shape_text", "sniff", "to_uint8", "top_k", "zip_bytes"]
