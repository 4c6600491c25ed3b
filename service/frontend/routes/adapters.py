"""What every protocol adapter (routes_v1, streaming, kserve, remote_vae, triton_extensions) shares,
so that no adapter imports another: the Service of the request and the OpenAPI pieces."""
from __future__ import annotations

from fastapi import Request

from ... import codecs
from ...problems import PROBLEM_SCHEMA
from ..pipeline import Service


def service(request: Request) -> Service:
    return request.app.state.service


ERRORS = {code: PROBLEM_SCHEMA for code in (400, 401, 404, 409, 413, 415, 422, 429, 501, 503, 504)}

TENSOR_BODY = {"requestBody": {"required": True, "content": {
    codecs.NPY_MEDIA: {"schema": {"type": "string", "format": "binary"},
                       "description": "a .npy array (np.save), no pickles"},
    codecs.SAFETENSORS_MEDIA: {"schema": {"type": "string", "format": "binary"},
                               "description": "safetensors bytes: the tensor named 'latents' or the only one"},
    "application/json": {"schema": {"type": "object", "required": ["data", "shape"], "properties": {
        "data": {"type": "string", "format": "byte", "description": "base64 of the little-endian raw bytes"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "dtype": {"type": "string", "enum": ["float32", "float16", "bfloat16", "float64"], "default": "float32"}}}},
}}}
