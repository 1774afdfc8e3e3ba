"""Image decoding and preprocessing for multimodal requests (reference AA2), done on the
tokenizer side (the TokenizerManager, or the offline Engine) before a request is sent.

An image is given as a data URL (``data:image/png;base64,...``), a local file path, or plain
base64; the offline Engine also takes a `PIL.Image`. Preprocessing follows CLIP's image
processor: resize the shortest edge, center-crop, scale to [0, 1], normalize per channel.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from framework.multimodal import ImageInputs, image_hash

# CLIP's normalization, used when the model folder has no preprocessor_config.json.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """An image that cannot be read; the message says which and why."""


def open_image(data: Any, index: int = 0):
    """A PIL image (RGB) from a data URL, a file path, base64 text or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, Image.Image):
        return data.convert("RGB")
    name = f"image_data[{index}]"
    if not isinstance(data, str) or not data:
        raise ImageError(f"{name}: must be a non-empty string (data URL, file path or base64)")
    if data.startswith(("http://", "https://")):
        raise ImageError(f"{name}: image URLs are not fetched by this server; send the image as base64")
    if data.startswith("data:"):
        _, sep, payload = data.partition(",")
        if not sep or ";base64" not in data[: len(data) - len(payload)]:
            raise ImageError(f"{name}: a data URL must be base64 (data:image/...;base64,...)")
        raw = _b64decode(payload, name)
    elif len(data) < 4096 and os.path.isfile(data):
        with open(data, "rb") as f:
            raw = f.read()
    else:
        raw = _b64decode(data, name)
    try:
        image = Image.open(io.BytesIO(raw))
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ImageError(f"{name}: not a readable image ({exc})") from None
    except Exception as exc:  # corrupt data: Pillow's decoders raise ValueError, NotImplementedError,
        # its DecompressionBombError (an image of over 2 x Image.MAX_IMAGE_PIXELS pixels), ...
        raise ImageError(f"{name}: not a readable image ({type(exc).__name__}: {exc})") from None


def _b64decode(text: str, name: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{name}: neither an existing file nor valid base64") from None


@dataclass(frozen=True)
class ImageProcessor:
    """CLIP-style preprocessing to `size` x `size` pixels."""

    size: int
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_model_folder(cls, folder: str) -> "ImageProcessor | None":
        """The processor of a multimodal model folder; None for a text-only model."""
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        vision = config.get("vision_config")
        if vision is None:
            return None
        size = vision.get("image_size", 224)
        prep_path = os.path.join(folder, "preprocessor_config.json")
        if not os.path.exists(prep_path):
            return cls(size)
        with open(prep_path) as f:
            prep = json.load(f)
        return cls(size, tuple(prep.get("image_mean", CLIP_MEAN)), tuple(prep.get("image_std", CLIP_STD)))

    def pixels(self, image) -> torch.Tensor:
        """[3, size, size] float32 for one RGB PIL image."""
        from PIL import Image

        w, h = image.size
        scale = self.size / min(w, h)
        resized_w, resized_h = max(self.size, round(w * scale)), max(self.size, round(h * scale))
        left, top = (resized_w - self.size) // 2, (resized_h - self.size) // 2
        # Resize only the region of the center crop (the `box`, in source pixels): resizing the whole
        # image first would scale a 1 x 10^6 pixel image (a few bytes of PNG) to gigabytes.
        sx, sy = w / resized_w, h / resized_h
        box = (left * sx, top * sy, (left + self.size) * sx, (top + self.size) * sy)
        image = image.resize((self.size, self.size), Image.Resampling.BICUBIC, box=box)
        data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        x = data.reshape(self.size, self.size, 3).permute(2, 0, 1).to(torch.float32) / 255.0
        mean = torch.tensor(self.mean).reshape(3, 1, 1)
        std = torch.tensor(self.std).reshape(3, 1, 1)
        return (x - mean) / std

    def process(self, images: list[Any]) -> ImageInputs:
        """ImageInputs (pixels and content hashes) for one request's images."""
        pixels = [self.pixels(open_image(data, i)) for i, data in enumerate(images)]
        return ImageInputs(pixel_values=torch.stack(pixels), image_hashes=[image_hash(p) for p in pixels])


def images_per_prompt(image_data: Any, count: int, is_batch: bool) -> list[list[Any] | None]:
    """`image_data` as one list of images (or None) per prompt.

    A single prompt takes one image or a list of images; a batch takes a list with one entry
    (an image, a list of images, or null) per prompt. An empty list is no image, as null is.
    """
    if image_data is None:
        return [None] * count
    if not is_batch:
        return [_image_list(image_data)]
    if not isinstance(image_data, list) or len(image_data) != count:
        raise ImageError(f"image_data: a batch of {count} prompts needs a list with one entry per prompt")
    return [_image_list(d) for d in image_data]


def _image_list(images: Any) -> list[Any] | None:
    """One prompt's images as a list; None for none (null or an empty list)."""
    if images is None or (isinstance(images, list) and not images):
        return None
    return images if isinstance(images, list) else [images]
