"""The `channels` option of a decode: `rgba` or `rgb` (None: the model's own), decided in one place
for every way a decode is asked for: the front end's routes (service/frontend/decode_request.py
builds each request with it) and the local `convserve decode` (service/cli/main.py, which runs the
model in-process), so the two answer the same pixels and refuse the same asks in the same words.

A decoder that decodes alpha (models/contract.py AlphaDecoder: the Qwen-Image 2.1 VAE, whose
pipeline's PIL output is RGBA) answers RGBA by default where the answer can hold alpha: every
format but JPEG (and MP4, a video decoder's). `rgba` asked of JPEG, or of a model without alpha, is
a 422 naming why; the CLI prints the same detail as its one-line error.

Shared by the processes (it imports only service.problems): a front end decides with a model's
view, the CLI with the model it loaded; both pass the two facts the rule reads.
"""
from __future__ import annotations

from .problems import Problem

#: the option's values, the default of a decoder with alpha first
CHANNELS = ("rgba", "rgb")
#: answers that cannot hold an alpha channel (remote_decode names JPEG "jpg")
NO_ALPHA_FORMATS = {"jpeg": "JPEG", "jpg": "JPEG", "mp4": "MP4"}


def parse_channels(value) -> str | None:
    """The option as a client sent it (a JSON value, query or command-line text): rgba | rgb | None."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in CHANNELS:
        return value.lower()
    raise Problem(422, "bad-channels", f"channels must be 'rgba' or 'rgb', not {value!r}")


def decide_alpha(model_name: str, decodes_alpha: bool, channels: str | None, answer: str) -> bool:
    """Whether the decode answers RGBA: `channels` (rgba | rgb | None: the model's own) asked of the
    model `model_name` (`decodes_alpha`: an AlphaDecoder) for an answer of `answer` (png, jpeg, jpg,
    webp, npy, mp4, tensor). A 422 for rgba of a model that decodes no alpha, or of an answer that
    cannot hold it."""
    if channels == "rgb":
        return False
    if channels is None:
        return decodes_alpha and answer not in NO_ALPHA_FORMATS
    if not decodes_alpha:
        raise Problem(422, "no-alpha", f"{model_name} decodes RGB only: channels=rgba is for a decoder with an "
                      "alpha channel (card pixel_channels, e.g. the Qwen-Image 2.1 VAE)")
    if answer in NO_ALPHA_FORMATS:
        raise Problem(422, "format-without-alpha", f"{NO_ALPHA_FORMATS[answer]} holds no alpha: ask channels=rgba "
                      "with PNG, WebP, .npy or a tensor, or channels=rgb")
    return True
