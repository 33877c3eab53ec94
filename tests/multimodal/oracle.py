"""Independent references for Kimi-K2.5 image input: the published processor's preprocessing
(media_utils.py / kimi_k25_vision_processing.py of moonshotai/Kimi-K2.5, restated here),
its placeholder expansion (the processor repeats each <|media_pad|> id once per image token),
and transformers' Kimi_K25ForConditionalGeneration loaded from a checkpoint folder in the
published layout through transformers' own key mapping."""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from moeserve.testing.checkpoints import TinyShape, TinyVision, write_checkpoint

TEMPLATE = Path(__file__).parents[1] / "tokenizer" / "fixtures" / "kimi_k25_chat_template.jinja"
PUBLISHED_MEDIA_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "patch_limit_on_one_side": 512,
}


def published_pixels(image: Image.Image, cfg: dict = PUBLISHED_MEDIA_CFG):
    """pixel_values [P, 3, 14, 14] (float32), grid_thw (1, h, w), num_tokens: the published
    processor's `preprocess` of one image."""
    w, h = image.size
    ps, m = cfg["patch_size"], cfg["merge_kernel_size"]
    side, limit = cfg["patch_limit_on_one_side"], cfg["in_patch_limit"]
    s1 = math.sqrt(limit / (max(1.0, w // ps) * max(1.0, h // ps)))
    scale = min(1.0, s1, side * ps / w, side * ps / h)
    new_w, new_h = max(1, int(w * scale)), max(1, int(h * scale))
    new_w, new_h = min(new_w, side * ps), min(new_h, side * ps)
    factor = m * ps
    pad_h, pad_w = (factor - new_h % factor) % factor, (factor - new_w % factor) % factor
    img = np.asarray(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
    img = np.pad(img, ((0, pad_h), (0, pad_w), (0, 0)), mode="constant", constant_values=0)
    x = (img[None] / 255.0).astype(np.float32)
    x -= np.array(cfg["image_mean"])
    x *= 1.0 / np.array(cfg["image_std"])
    t, hh, ww, c = x.shape
    patches = x.reshape(t, hh // ps, ps, ww // ps, ps, c).transpose(0, 1, 3, 5, 2, 4)
    tokens = ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
    return torch.from_numpy(patches.reshape(-1, c, ps, ps).copy()), (t, hh // ps, ww // ps), tokens


def expand(ids: list[int], pad_id: int, tokens: list[int]) -> list[int]:
    """The published processor's expansion: each pad id repeated for its image."""
    tokens = list(tokens)
    out: list[int] = []
    for t in ids:
        out.extend([t] * tokens.pop(0) if t == pad_id else [t])
    assert not tokens
    return out


def random_image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    # smooth content (a gradient plus noise), as photos are: resampling then matters
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(1, w - 1)), (yy * 255 // max(1, h - 1)), (xx + yy) % 256], -1)
    noise = rng.integers(-40, 40, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}[fmt]
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def write_vision_checkpoint(out: str, seed: int = 0, media_cfg: dict | None = None) -> str:
    """A tiny Kimi-K2.5 in the published BF16 layout whose tokenizer renders the published
    chat template (so moeserve writes Kimi-K2.5's own prompt format); `media_cfg`: a
    preprocessor_config.json `media_proc_cfg` to ship."""
    wc = write_checkpoint(
        out, "kimi-k2.5", "bf16", TinyShape(), seed=seed, shards=1, vision=TinyVision()
    )
    folder = Path(wc.path)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template")  # the checkpoint's template is its chat_template.jinja
    cfg_path.write_text(json.dumps(cfg))
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    if media_cfg is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media_cfg}))
    return wc.path


def hf_model(path: str):
    """transformers' Kimi_K25ForConditionalGeneration (fp32, eager attention) from the folder:
    its config built from the published fields, its weights through transformers' key
    mapping of the published names."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    cfg = json.loads((Path(path) / "config.json").read_text())
    v = cfg["vision_config"]
    text = {k: x for k, x in cfg["text_config"].items() if k != "architectures"}
    hf_cfg = Kimi_K25Config(
        text_config=text,
        vision_config=dict(
            hidden_size=v["vt_hidden_size"],
            num_hidden_layers=v["vt_num_hidden_layers"],
            num_attention_heads=v["vt_num_attention_heads"],
            intermediate_size=v["vt_intermediate_size"],
            pos_emb_height=v["init_pos_emb_height"],
            pos_emb_width=v["init_pos_emb_width"],
            pos_emb_time=v["init_pos_emb_time"],
            patch_size=v["patch_size"],
            merge_kernel_size=v["merge_kernel_size"],
            rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
        ),
        projection_hidden_size=v["mm_hidden_size"],
        projection_layer_norm_eps=v["projector_ln_eps"],
        image_token_id=cfg["media_placeholder_token_id"],
        tie_word_embeddings=False,
    )
    model = Kimi_K25ForConditionalGeneration.from_pretrained(
        path, config=hf_cfg, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
