"""The files `convserve decode` reads and writes: latents in, images, MP4s, .npy or frame folders
out, the output checked before any decoding."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .checks import fail, input_file, validated

IMAGE_SUFFIXES = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def read_tensor(path: Path, prefer: str) -> np.ndarray:
    from ..codecs import read_tensor_body
    media = {".npy": "application/x-npy", ".safetensors": "application/vnd.safetensors",
             ".json": "application/json"}.get(path.suffix.lower(), "application/octet-stream")
    arr, _ = validated(read_tensor_body, input_file(path).read_bytes(), media, prefer)
    return arr


def answer_format(output: Path) -> str:
    """What `output` makes of the pixels, named as the service's `format` names it (the answer the
    channels rule reads, service/alpha_option.py): png | jpeg | webp | npy | mp4; a folder: png frames."""
    suffix = output.suffix.lower()
    return IMAGE_SUFFIXES.get(suffix) or suffix.lstrip(".") or "png"


def write_decoded(out: np.ndarray, output: Path, video: bool, quality: int, fps: float) -> list[Path]:
    from tqdm import tqdm

    from ..codecs import image_bytes, npy_bytes, to_uint8
    from ..codecs.video import crf_for_quality, mp4_bytes

    suffix = output.suffix.lower()
    written: list[Path] = []

    def name(i: int, ext: str) -> Path:
        return output if out.shape[0] == 1 else output.with_name(f"{output.stem}_{i:03d}{ext}")

    if suffix == ".npy":
        output.write_bytes(npy_bytes(out))
        return [output]
    if suffix == ".mp4":
        if not video:
            fail("an image decoder gives images: write .png/.jpg/.webp/.npy or a folder")
        for i, v in enumerate(tqdm(out, desc="mp4", unit="video", disable=out.shape[0] < 2)):
            p = name(i, ".mp4")
            p.write_bytes(mp4_bytes(v, fps, crf_for_quality(quality)))
            written.append(p)
        return written
    if suffix in IMAGE_SUFFIXES and not video:
        for i, im in enumerate(tqdm(to_uint8(out), desc="images", unit="img", disable=out.shape[0] < 2)):
            p = name(i, suffix)
            p.write_bytes(image_bytes(im, IMAGE_SUFFIXES[suffix], quality))
            written.append(p)
        return written
    if suffix:
        fail(f"cannot write {suffix}: use .png/.jpg/.webp, .mp4, .npy or a folder")
    # a folder of PNG frames
    output.mkdir(parents=True, exist_ok=True)
    frames = out if video else out[:, None]
    total = frames.shape[0] * frames.shape[1]
    with tqdm(total=total, desc="frames", unit="frame", disable=total < 2) as bar:
        for i, clip in enumerate(to_uint8(frames)):
            for f, im in enumerate(clip):
                p = output / (f"frame_{f:04d}.png" if frames.shape[0] == 1 else f"{i:03d}_frame_{f:04d}.png")
                p.write_bytes(image_bytes(im, "png", quality))
                written.append(p)
                bar.update()
    return written


def check_output(output: Path, video: bool, local: bool) -> None:
    """What the command will write, checked before any work: a known suffix for the model kind,
    an existing folder to write into, and PyAV for a local MP4."""
    suffix = output.suffix.lower()
    if suffix and not output.parent.is_dir():  # a frames folder is made with its parents
        fail(f"{output}: the folder {output.parent} does not exist")
    if suffix == ".mp4" and not video:
        fail("an image decoder gives images: write .png/.jpg/.webp/.npy or a folder")
    if suffix in IMAGE_SUFFIXES and video:
        fail("a video decoder gives frames: write .mp4, .npy or a folder")
    if suffix and suffix not in (".npy", ".mp4", *IMAGE_SUFFIXES):
        fail(f"cannot write {suffix}: use .png/.jpg/.webp, .mp4, .npy or a folder")
    if suffix == ".mp4" and local:
        from ..codecs.video import require_av
        validated(require_av, " (or write .npy or a folder of frames)")
