"""Kimi-K2.5's image preprocessing and prompt placeholders, as its published processor does
them (kimi_k25_vision_processing.py and media_utils.py of moonshotai/Kimi-K2.5).

Resize (`navit_resize`): scale = min(1, sqrt(in_patch_limit / (max(1, w // 14) *
max(1, h // 14))), 512 * 14 / w, 512 * 14 / h); the new size is int(side * scale), at least
1 and at most 512 * 14; Pillow's bicubic resize to it (Pillow's `resize((width, height))`);
then zeros appended right and below up to multiples of 28 (patch x merge). Pixels
(x / 255 as float32 - mean) / std with the checkpoint's mean and std (0.5 each), cut into
14 x 14 patches row by row, each patch channels-first: [patches, 3, 14, 14] with the grid
(1, rows, columns). Each image is one (rows / 2) x (columns / 2) block of placeholder tokens.

Prompt: the chat template writes
`<|media_begin|>image<|media_content|><|media_pad|><|media_end|>` (and a newline) for each
image part; the processor then repeats each `<|media_pad|>` id as many times as its image has
tokens, images in the order of the messages.

transformers' Kimi_K25ImageProcessor resizes with torchvision instead of Pillow, so its
pixels differ slightly from the published processor's; these follow the published one
(tests/multimodal show the difference).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from moeserve.config import ConfigError, VisionConfig
from moeserve.multimodal.images import ImageError
from moeserve.multimodal.inputs import ImageInput, content_digest

PREPROCESSOR_FILE = "preprocessor_config.json"
PAD_TOKEN = "<|media_pad|>"
CHANNELS = 3
MAX_PIXEL = 255.0


@dataclass(frozen=True)
class MediaProcessorConfig:
    """The published processor's `media_proc_cfg` (preprocessor_config.json), images only."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @staticmethod
    def for_model(vision: VisionConfig, folder: str | None) -> MediaProcessorConfig:
        """The checkpoint's media_proc_cfg where it ships one, else the published values;
        patch and merge sizes always agree with the vision config."""
        d: dict = {}
        path = os.path.join(folder, PREPROCESSOR_FILE) if folder else ""
        if path and os.path.isfile(path):
            with open(path) as f:
                d = json.load(f).get("media_proc_cfg") or {}
        if d.get("fixed_output_tokens") is not None:
            raise ConfigError(f"{path}: fixed_output_tokens is not supported")
        base = MediaProcessorConfig()
        kernel = vision.merge_kernel_size
        if kernel[0] != kernel[1]:
            raise ConfigError("vision_config: only square merge kernels are supported")
        return MediaProcessorConfig(
            patch_size=vision.patch_size,
            merge_kernel_size=kernel[0],
            in_patch_limit=int(d.get("in_patch_limit", base.in_patch_limit)),
            patch_limit_on_one_side=int(
                d.get("patch_limit_on_one_side", base.patch_limit_on_one_side)
            ),
            image_mean=tuple(float(x) for x in d.get("image_mean", base.image_mean)),
            image_std=tuple(float(x) for x in d.get("image_std", base.image_std)),
        )


@dataclass(frozen=True)
class ResizePlan:
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) after padding."""
        return self.new_width + self.pad_width, self.new_height + self.pad_height


def navit_resize(width: int, height: int, cfg: MediaProcessorConfig) -> ResizePlan:
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    s1 = math.sqrt(cfg.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, s1, side * p / width, side * p / height)
    new_w, new_h = max(1, int(width * scale)), max(1, int(height * scale))
    new_w, new_h = min(new_w, side * p), min(new_h, side * p)
    factor = cfg.merge_kernel_size * p
    return ResizePlan(
        new_w, new_h, (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
    )


# image aspect ratios (width / height) tried for the largest image the processor can make
_ASPECTS = (1.0, 0.5, 2.0, 0.25, 4.0, 1 / 16, 16.0)
_LARGE_SIDE = 1 << 15  # pixels: any image this large is scaled down to the patch budget


def largest_image_grid(cfg: MediaProcessorConfig) -> tuple[int, int, int]:
    """The patch grid (1, rows, columns) of the largest image the processor makes (its
    patch budget, padded), over a range of aspect ratios: what memory is planned for."""
    best = (1, 0, 0)
    for a in _ASPECTS:
        w, h = (
            (_LARGE_SIDE, int(_LARGE_SIDE / a)) if a <= 1 else (int(_LARGE_SIDE * a), _LARGE_SIDE)
        )
        pw, ph = navit_resize(w, h, cfg).size
        grid = (1, ph // cfg.patch_size, pw // cfg.patch_size)
        if grid[1] * grid[2] > best[1] * best[2]:
            best = grid
    return best


class KimiImageProcessor:
    """Images -> `ImageInput`s, and the prompt's placeholders expanded for them."""

    def __init__(self, cfg: MediaProcessorConfig, pad_id: int) -> None:
        self.cfg = cfg
        self.pad_id = pad_id
        # every (value, channel) normalised once, with the processor's own arithmetic: x / 255
        # rounded to float32, minus the mean, times 1 / std (numpy in float64, stored float32)
        lut = (np.arange(256)[:, None].repeat(CHANNELS, 1) / MAX_PIXEL).astype(np.float32)
        lut -= np.array(cfg.image_mean)
        lut *= 1.0 / np.array(cfg.image_std)
        self.lut = lut

    def plan(self, image: Image.Image) -> ResizePlan:
        return navit_resize(image.width, image.height, self.cfg)

    def resized(self, image: Image.Image) -> np.ndarray:
        """The image resized and zero-padded as the processor does: uint8 [H, W, 3]."""
        plan = self.plan(image)
        arr = np.asarray(
            image.convert("RGB").resize(
                (plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC
            )
        )
        return np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))

    def patches(self, arr: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Normalised patches [patches, 3, p, p] (float32) of a resized image, and the grid
        (1, rows, cols)."""
        p = self.cfg.patch_size
        rows, cols = arr.shape[0] // p, arr.shape[1] // p
        # gathered straight into patch order: [rows, cols, 3, p, p]
        src = arr.reshape(rows, p, cols, p, CHANNELS).transpose(0, 2, 4, 1, 3)
        chan = np.arange(CHANNELS).reshape(1, 1, CHANNELS, 1, 1)
        return self.lut[src, chan].reshape(-1, CHANNELS, p, p), (1, rows, cols)

    def pixels(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Normalised patches [patches, 3, p, p] (float32) and the grid (1, rows, cols)."""
        return self.patches(self.resized(image))

    def preprocess(self, image: Image.Image) -> ImageInput:
        arr = self.resized(image)
        patches, grid = self.patches(arr)
        m = self.cfg.merge_kernel_size
        tokens = (grid[1] // m) * (grid[2] // m)
        # the patches are a function of the resized bytes: hashing those (a quarter the size)
        # names the same content
        return ImageInput(torch.from_numpy(patches), grid, tokens, content_digest(arr, grid))

    def expand(self, ids: list[int], images: list[ImageInput]) -> list[int]:
        """`ids` with each placeholder repeated for its image (in order); sets the images'
        offsets. The prompt must hold exactly one placeholder per image."""
        found = sum(1 for t in ids if t == self.pad_id)
        if found != len(images):
            raise ImageError(
                f"the prompt holds {found} image placeholder(s) ({PAD_TOKEN}) for "
                f"{len(images)} image(s); text may not contain {PAD_TOKEN}"
            )
        out: list[int] = []
        k = 0
        for t in ids:
            if t != self.pad_id:
                out.append(t)
                continue
            images[k].offset = len(out)
            out.extend([t] * images[k].num_tokens)
            k += 1
        return out
