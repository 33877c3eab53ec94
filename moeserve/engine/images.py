"""Images in a runner's steps: the vision encoder run once per image (its output kept in an
encoder cache by content for the image's later chunks and later requests), the embeddings
that replace a step's image-placeholder rows, and the activation peak the encoder adds."""

from __future__ import annotations

import logging

import torch

from moeserve.engine.step import StepInput
from moeserve.engine.step_tensors import StepTensors
from moeserve.multimodal.cache import EncoderCache
from moeserve.multimodal.inputs import ImageInput
from moeserve.multimodal.kimi import MediaProcessorConfig, largest_image_grid
from moeserve.parallel.groups import TPGroup

log = logging.getLogger(__name__)


class ImageEncoding:
    """One rank's image inputs. Rank 0 holds the vision encoder (`vision`; None on the other
    ranks and for models without one) and encodes; the other ranks receive the values by an
    all-reduce to which they add zeros."""

    def __init__(
        self,
        model: torch.nn.Module,
        hidden_size: int,
        model_path: str | None,
        tp: TPGroup,
        device: torch.device,
    ) -> None:
        self.vision = getattr(model, "vision", None)
        self.model = model
        self.hidden_size = hidden_size
        self.model_path = model_path
        self.tp = tp
        self.device = device
        self.cache = EncoderCache()

    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The vision encoder on images in one batch: one tensor each."""
        pixels = torch.cat([im.pixels for im in images]).to(self.device, self.vision.dtype)
        out = self.vision(pixels, [im.grid for im in images])
        return list(out.split([im.num_tokens for im in images]))

    def embeds(self, step: StepInput, st: StepTensors) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, values) of the step's image tokens, or None where it has none."""
        if not step.embed_rows:
            return None
        dtype = self.model.model.embed_tokens.weight.dtype
        if step.images:
            encoded = self._encoded([im for im, _, _ in step.images])
            values = torch.cat(
                [encoded[im.digest][first : first + n] for im, first, n in step.images]
            ).to(dtype)
        else:
            values = torch.zeros(
                len(step.embed_rows), self.hidden_size, dtype=dtype, device=self.device
            )
        if self.tp.size > 1:
            values = self.tp.all_reduce(values.contiguous())
        return st.embed_rows, values

    def profile(self, base: int, prefill_peak: int) -> int:
        """The activation peak with images (GPU): the larger of the encoder on the largest
        image the processor makes and a prefill step, either beside a full encoder cache."""
        if self.vision is None:
            return prefill_peak
        cfg = self.vision.config
        grid = largest_image_grid(MediaProcessorConfig.for_model(cfg, self.model_path))
        patches = grid[1] * grid[2]
        pixels = torch.zeros(patches, 3, cfg.patch_size, cfg.patch_size)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.encode([ImageInput(pixels, grid, patches // cfg.merge_size, b"")])
        torch.cuda.synchronize(self.device)
        encode_peak = torch.cuda.max_memory_allocated(self.device) - base
        log.info(
            "vision encoder: %.2f GiB peak on a %dx%d-patch image",
            encode_peak / (1 << 30),
            grid[1],
            grid[2],
        )
        return max(prefill_peak, encode_peak) + self.cache.max_bytes

    def _encoded(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings by its digest: from the cache, else encoded now."""
        found: dict[bytes, torch.Tensor] = {}
        todo: list[ImageInput] = []
        for im in images:
            if im.digest in found:
                continue
            hit = self.cache.get(im.digest)
            if hit is not None:
                found[im.digest] = hit
            elif all(im.digest != t.digest for t in todo):
                todo.append(im)
        if todo:
            for im, out in zip(todo, self.encode(todo), strict=True):
                self.cache.put(im.digest, out)
                found[im.digest] = out
        return found
