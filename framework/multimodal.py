"""Image inputs at the scheduler level (reference AA): hash-derived pad ids and image offsets.

The tokenizer side turns each image into pixels and a content hash. The scheduler replaces each
image token of the prompt by `num_image_tokens` pad ids derived from that hash, so the prefix
cache keys an image by its content: the same image shares KV, a different one does not. The model
writes the image's features over the embeddings of those positions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

IMAGE_TOO_LONG_MESSAGE = (
    "Image request length is longer than the KV cache pool size or the max context length "
    "aborting because you cannot truncate the image embeds"
)


@dataclass(frozen=True)
class ImageTokenInfo:
    """What the scheduler needs to know about a multimodal model (from its worker)."""

    image_token_id: int
    num_image_tokens: int  # feature rows per image, i.e. pad ids that replace one image token


@dataclass
class ImageInputs:
    """The images of one request: pixels, content hashes, and where they sit in the padded prompt."""

    pixel_values: torch.Tensor  # [num_images, channels, height, width] float32
    image_hashes: list[int]
    pad_values: list[int] = field(default_factory=list)
    image_offsets: list[int] = field(default_factory=list)  # first padded position of each image
    num_image_tokens: int = 0

    @property
    def num_images(self) -> int:
        return len(self.image_hashes)


def image_hash(pixel_values: torch.Tensor) -> int:
    """A 128-bit content hash of one image's pixels (stable across processes, unlike `hash`)."""
    data = pixel_values.detach().to(torch.float32).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")


def combined_hash(image_hashes: list[int]) -> int:
    """One hash of all of a request's images. The reference uses `hash(tuple(...))`, which Python
    salts per process; this one is the same in every process."""
    data = b"".join(h.to_bytes(16, "little") for h in image_hashes)
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")


def image_count_problem(input_ids: list[int], num_images: int, info: ImageTokenInfo) -> str | None:
    """Why a prompt's image tokens and its images do not pair up one to one (a prompt with image
    tokens and no images included: its image token would reach the model as text), or None."""
    found = sum(1 for t in input_ids if t == info.image_token_id)
    if found == num_images:
        return None
    return (f"image_data: the prompt has {found} image token(s) (id {info.image_token_id}) "
            f"for {num_images} image(s); put one image token where each image goes")


def expand_image_tokens(
    input_ids: list[int], images: ImageInputs, info: ImageTokenInfo, vocab_size: int
) -> list[int]:
    """Replace every image token by `info.num_image_tokens` hash-derived pad ids.

    Fills `images.pad_values`, `image_offsets` and `num_image_tokens`. Raises ValueError when the
    prompt's image tokens and the images do not pair up one to one.
    """
    problem = image_count_problem(input_ids, images.num_images, info)
    if problem is not None:
        raise ValueError(problem)
    positions = [i for i, t in enumerate(input_ids) if t == info.image_token_id]
    images.num_image_tokens = info.num_image_tokens
    h = combined_hash(images.image_hashes)
    # The reference's four slices of the hash (AA3).
    images.pad_values = [(h >> shift) % vocab_size for shift in (0, 16, 32, 64)]
    pads = (images.pad_values * (info.num_image_tokens // len(images.pad_values) + 1))[: info.num_image_tokens]
    out: list[int] = []
    images.image_offsets = []
    prev = 0
    for pos in positions:
        out.extend(input_ids[prev:pos])
        images.image_offsets.append(len(out))
        out.extend(pads)
        prev = pos + 1
    out.extend(input_ids[prev:])
    return out
