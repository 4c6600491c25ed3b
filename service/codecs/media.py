"""Which reader a request body goes to: its Content-Type, or (where that says nothing) its magic
bytes; a body whose bytes contradict its Content-Type is named in a 415 instead of failing in the
wrong parser. The readers are npy_parse.py's and tensors.py's; images are images.py's."""
from __future__ import annotations

import numpy as np

from ..problems import Problem
from .npy_parse import parse_npy
from .tensors import read_json_tensor, read_safetensors

NPY_MEDIA = "application/x-npy"
SAFETENSORS_MEDIA = "application/vnd.safetensors"


def read_npy(body: bytes, what: str = "body", takes_images: bool = False) -> np.ndarray:
    """A .npy body (npy_parse.parse_npy: sizes checked before anything is made, no pickles); an
    image sent as one is named in a 415 saying which Content-Type to use instead."""
    refuse_misnamed(body, NPY_MEDIA, takes_images)
    return parse_npy(body, what)


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


#: Content-Types that say nothing about the body: none, octet-stream, and curl's default for
#: `--data-binary` (form-urlencoded). Bodies sent with them are recognised by their first bytes.
GENERIC_MEDIA = ("", "application/octet-stream", "application/x-www-form-urlencoded")
TENSOR_MEDIA_TEXT = f"{NPY_MEDIA}, {SAFETENSORS_MEDIA} or application/json"
IMAGE_MEDIA_TEXT = "image/jpeg, image/png, image/webp"


def sniff(body: bytes) -> str | None:
    """The media type a body's magic bytes show: image/png, image/jpeg, image/webp, .npy, or
    safetensors (an 8-byte little-endian header length that fits the body, then a JSON object);
    None when none fits."""
    head = bytes(body[:16])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"\x93NUMPY"):
        return NPY_MEDIA
    if len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= len(body) - 8:
        return SAFETENSORS_MEDIA
    return None


def refuse_misnamed(body: bytes, mt: str, takes_images: bool = False) -> None:
    """A 415 for a body whose magic bytes (`sniff`) contradict how it would be read as `mt`: an
    image sent to a tensor reader, named, with the Content-Type that takes it (takes_images) or the
    tensor types this route takes; a .npy file sent as JSON or safetensors (which would otherwise
    fail as undecodable UTF-8 or a header length past the body, with no hint of the cause)."""
    sniffed = sniff(body)
    if sniffed is None:
        return
    said = "" if mt in GENERIC_MEDIA else f", not the {mt} its Content-Type says"
    if sniffed.startswith("image/"):
        fix = (f"send it with Content-Type: {sniffed}" if takes_images
               else f"this route takes tensors, not images: send {TENSOR_MEDIA_TEXT}")
        raise Problem(415, "unsupported-media-type", f"the body is a {sniffed.split('/')[1].upper()} image{said}; {fix}")
    if sniffed == NPY_MEDIA and mt not in (NPY_MEDIA, "application/npy", *GENERIC_MEDIA):
        raise Problem(415, "unsupported-media-type",
                      f"the body looks like a .npy file{said}; send it with Content-Type: {NPY_MEDIA}")


def read_tensor_body(body: bytes, content_type: str | None, prefer: str,
                     takes_images: bool = False) -> tuple[np.ndarray, dict]:
    """Latents (or pixels) from a request body by its Content-Type; a body whose Content-Type
    says nothing (GENERIC_MEDIA) is recognised by its magic bytes (.npy, else safetensors). A body
    whose magic bytes contradict its Content-Type (an image, a .npy sent as JSON) is named in a 415
    (refuse_misnamed) instead of failing in the wrong parser; takes_images: the route also takes
    image files (the 415 then names the image's own Content-Type)."""
    mt = media_type(content_type)
    refuse_misnamed(body, mt, takes_images)
    if mt in GENERIC_MEDIA:
        sniffed = sniff(body)
        if sniffed is not None or mt != "application/x-www-form-urlencoded":
            mt = sniffed or SAFETENSORS_MEDIA  # unrecognised bytes: safetensors' parser names what is wrong
    if mt == "application/json":
        return read_json_tensor(body)
    if mt in (NPY_MEDIA, "application/npy"):
        return parse_npy(body), {}
    if mt == SAFETENSORS_MEDIA:
        return read_safetensors(body, prefer), {}
    raise Problem(415, "unsupported-media-type", f"Content-Type {mt!r} not accepted; send {TENSOR_MEDIA_TEXT}")
