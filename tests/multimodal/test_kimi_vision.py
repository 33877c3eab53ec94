"""Kimi-K2.5's vision encoder and image preprocessing against independent references:
transformers' Kimi_K25ForConditionalGeneration (fp32) on a tiny random checkpoint in the
published layout, and the published processor's preprocessing (tests/multimodal/oracle.py)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from oracle import hf_model, published_pixels, random_image, write_vision_checkpoint
from safetensors import safe_open

from moeserve.config import VisionConfig
from moeserve.loader import load_model
from moeserve.models.registry import config_from_hf
from moeserve.multimodal.kimi import KimiImageProcessor, MediaProcessorConfig, navit_resize
from moeserve.testing.checkpoints import write_checkpoint

# (frames, rows, columns): the 8 x 8 position table as it is, enlarged, shrunk, non-square
GRIDS = [(1, 6, 10), (1, 8, 8), (1, 12, 4), (1, 2, 16)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return write_vision_checkpoint(str(tmp_path_factory.mktemp("k25v") / "kimi"))


@pytest.fixture(scope="module")
def ours(folder):
    return load_model(folder, torch.float32, "cpu").model


def test_config_reads_the_published_vision_fields(folder):
    import json

    cfg = config_from_hf(json.loads((Path(folder) / "config.json").read_text()))
    v = cfg.vision
    assert isinstance(v, VisionConfig)
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads) == (32, 2, 2)
    assert (v.pos_emb_height, v.merge_kernel_size, v.text_hidden_size) == (8, (2, 2), 64)
    # the published defaults are the full model's
    assert VisionConfig.from_hf({}, 7168, None) == VisionConfig()


def test_tower_and_projector_match_transformers(folder, ours):
    hf = hf_model(folder)
    torch.manual_seed(0)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), 3, 14, 14)
    with torch.no_grad():
        got = ours.vision(pixels, GRIDS)
        want = torch.cat(hf.model.get_image_features(pixels, torch.tensor(GRIDS)).pooler_output)
    assert got.shape == want.shape == (sum(h * w // 4 for _, h, w in GRIDS), 64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # one image alone gives its rows of the batch (attention stays within each image)
    with torch.no_grad():
        alone = ours.vision(pixels[60:124], [GRIDS[1]])
    torch.testing.assert_close(alone, got[15:31], rtol=1e-5, atol=1e-5)


def test_vision_tensors_load_from_the_nvfp4_layout(tmp_path, folder):
    """NVIDIA's NVFP4 export keeps the tower and projector in BF16 under the same names."""
    path = write_checkpoint(str(tmp_path / "fp4"), "kimi-k2.5", "nvfp4-modelopt", shards=1).path
    model = load_model(path, torch.float32, "cpu").model
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        for name in ("vision_tower.encoder.blocks.1.wqkv.weight", "mm_projector.proj.2.bias"):
            want = f.get_tensor(name).float()
            got = dict(model.vision.named_parameters())[name]
            assert torch.equal(got, want)


# (width, height, in_patch_limit, patch_limit_on_one_side): no resize, padding only; a resize
# for the patch budget (wide and tall); the one-side limit; one pixel
SIZES = [(60, 40, 16384, 512), (300, 120, 64, 512), (120, 300, 64, 512), (500, 30, 16384, 8)]
SIZES += [(1, 1, 16384, 512), (97, 61, 100, 512)]


@pytest.mark.parametrize(("w", "h", "limit", "side"), SIZES)
def test_preprocessing_is_the_published_processors(w, h, limit, side):
    cfg = dict(
        in_patch_limit=limit,
        patch_size=14,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        merge_kernel_size=2,
        patch_limit_on_one_side=side,
    )
    image = random_image(w, h, seed=w * h)
    want, grid, tokens = published_pixels(image, cfg)
    proc = KimiImageProcessor(
        MediaProcessorConfig(in_patch_limit=limit, patch_limit_on_one_side=side), pad_id=7
    )
    item = proc.preprocess(image)
    assert item.grid == grid and item.num_tokens == tokens
    assert torch.equal(item.pixels, want)


def _transformers_navit_resize():
    """transformers' own `navit_resize` (image_processing_kimi_k25.py), compiled from its
    source: the module imports torchvision, which this machine lacks."""
    import transformers

    src_path = Path(transformers.__file__).parent / "models" / "kimi_k25"
    tree = ast.parse((src_path / "image_processing_kimi_k25.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    ns: dict = {"math": math}
    exec(compile(ast.Module([fn], []), "navit_resize", "exec"), ns)
    return ns["navit_resize"]


@pytest.mark.parametrize(("w", "h", "limit", "side"), SIZES)
def test_transformers_resize_plan_agrees_for_non_square_images(w, h, limit, side):
    """A width/height swap was reported in transformers' resize for non-square images;
    transformers 5.24's `navit_resize`, called as its image processor calls it (keywords
    height=, width=), gives the published sizes. Its pixels differ otherwise: it resizes with
    torchvision (absent here), the published processor with Pillow, which moeserve follows."""
    resize = _transformers_navit_resize()
    (new_h, new_w), (pad_h, pad_w) = resize(
        height=h, width=w, patch_size=14, merge_kernel_size=2, max_patches=limit,
        max_size_per_side=side,
    )  # fmt: skip
    plan = navit_resize(
        w, h, MediaProcessorConfig(in_patch_limit=limit, patch_limit_on_one_side=side)
    )
    assert (new_w, new_h) == (plan.new_width, plan.new_height)
    assert (pad_w, pad_h) == plan.size  # transformers returns the padded size itself
