"""Time to first token of one 1024 x 1024 image plus 100 text tokens on Kimi-K2.5 (full-size
layers, dummy weights), and the vision encoder's share of it.

Run on the GPU machine from the repository root (.whl/gpu_vision.sh does):
  PYTHONPATH=$PWD python benchmarks/vision_ttft.py --out benchmarks/results [--commit SHA]

Method. An engine over benchmarks/configs/kimi-k2.5-nvfp4 (the published config.json,
vision_config included) with `--load-format dummy --num-layers 2`: the published MoonViT
(27 layers, width 1152, bf16) and projector in full, the text model cut to one dense and one
MoE layer; prefix caching off, so each request prefills its whole prompt. The image (random
pixels) is preprocessed as the server does (Pillow resize, normalisation, patches: 74 x 74
patches -> 1,369 tokens); the prompt is 100 text tokens with the image's placeholder run in
the middle. Timed with CUDA synchronisation, after warm-up runs:
- `encode`: the vision encoder alone on the image (`ImageEncoding.encode`);
- `ttft`: from `add_request` to the step that returns the first token, the encoder cache
  emptied before each request (the encoder runs inside the step, as for a new image);
- `ttft_cached_image`: the same with the image's embeddings cached (the text prefill alone);
- `preprocess`: the host-side preprocessing of the decoded image (Pillow + numpy).
The full model's TTFT is estimated as encode + ttft_cached_image x 61 / 2 (the step's
non-layer part is scaled too, so an upper bound), and labelled as an estimate.
`--model PATH --device cpu` runs the same method on another checkpoint (a smoke test of the
script on a tiny one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import gpu_meta

HERE = Path(__file__).resolve().parent
MODEL = HERE / "configs/kimi-k2.5-nvfp4"
IMAGE_SIDE = 1024
TEXT_TOKENS = 100
LAYERS_RUN, LAYERS_FULL = 2, 61
WARMUP, TIMED = 3, 10


def _image():
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8))


def _ms(samples: list[float]) -> dict:
    return {
        "median_ms": round(1e3 * statistics.median(samples), 3),
        "min_ms": round(1e3 * min(samples), 3),
        "n": len(samples),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    from moeserve.engine.core import build_engine
    from moeserve.multimodal.cache import EncoderCache
    from moeserve.sampling import SamplingParams

    eng = build_engine(
        args.model,
        device=args.device,
        load_format="dummy",
        num_layers=LAYERS_RUN,
        max_model_len=4096,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    runner, proc = eng.runner, eng.image_processor
    assert proc is not None, "the config's vision_config did not give the engine an encoder"
    image = _image()
    pre = []
    for _ in range(WARMUP + TIMED):
        t0 = time.perf_counter()
        item = proc.preprocess(image)
        pre.append(time.perf_counter() - t0)
    pre = pre[WARMUP:]
    vocab = eng.vocab_limit
    text = [(i * 40503 + 7) % vocab for i in range(TEXT_TOKENS)]
    half = TEXT_TOKENS // 2
    ids = proc.expand(text[:half] + [proc.pad_id] + text[half:], [item])

    def encode_once() -> float:
        sync()
        t0 = time.perf_counter()
        runner.images.encode([item])
        sync()
        return time.perf_counter() - t0

    def ttft_once(k: int, fresh_image: bool) -> float:
        if fresh_image:
            runner.images.cache = EncoderCache()
        sync()
        t0 = time.perf_counter()
        eng.add_request(f"r{k}", ids, SamplingParams(max_tokens=1, temperature=0), [item])
        first = None
        while eng.has_unfinished():
            for out in eng.step():
                if out.token_ids and first is None:
                    sync()
                    first = time.perf_counter() - t0
        assert first is not None
        return first

    enc = [encode_once() for _ in range(WARMUP + TIMED)][WARMUP:]
    ttft = [ttft_once(k, True) for k in range(WARMUP + TIMED)][WARMUP:]
    cached = [ttft_once(1000 + k, False) for k in range(WARMUP + TIMED)][WARMUP:]
    peak = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        runner.images.encode([item])
        sync()
        peak = torch.cuda.max_memory_allocated() - base
    vision = runner.model.vision
    meta = gpu_meta(args.commit) if cuda else {"gpu": "cpu", "torch": torch.__version__}
    res = {
        "meta": dict(meta, commit=meta.get("commit", "none")),
        "model": args.model,
        "layers_run": LAYERS_RUN,
        "image": {
            "size": [IMAGE_SIDE, IMAGE_SIDE],
            "grid": list(item.grid),
            "patches": int(item.pixels.shape[0]),
            "tokens": item.num_tokens,
        },
        "prompt_tokens": len(ids),
        "vision_params": vision.num_parameters(),
        "preprocess": _ms(pre),
        "encode": _ms(enc),
        "encode_peak_mib": round(peak / (1 << 20), 1),
        "ttft": _ms(ttft),
        "ttft_cached_image": _ms(cached),
    }
    e, t, c = (res[k]["median_ms"] for k in ("encode", "ttft", "ttft_cached_image"))
    res["vision_share_of_ttft"] = round(e / t, 4)
    res["estimated_full_model_ttft_ms"] = round(e + c * LAYERS_FULL / LAYERS_RUN, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_ttft.json").write_text(json.dumps(res, indent=2) + "\n")
    md = [
        "# Kimi-K2.5 image TTFT (vision encoder share)",
        "",
        f"{res['meta']['gpu']}, torch {res['meta']['torch']}, commit {res['meta']['commit']}; "
        f"{res['model']} with dummy weights, {LAYERS_RUN} text layers, the full vision encoder "
        f"({res['vision_params'] / 1e6:.0f}M parameters, bf16). Method: "
        "benchmarks/vision_ttft.py.",
        "",
        f"Image {IMAGE_SIDE} x {IMAGE_SIDE}: {res['image']['patches']:,} patches, "
        f"{item.num_tokens:,} tokens; prompt {len(ids):,} tokens ({TEXT_TOKENS} text).",
        "",
        "| measure | median ms | min ms |",
        "|---|---|---|",
    ]
    for k in ("preprocess", "encode", "ttft", "ttft_cached_image"):
        md.append(f"| {k} | {res[k]['median_ms']} | {res[k]['min_ms']} |")
    md += [
        "",
        f"Vision encoder share of TTFT ({LAYERS_RUN} layers): "
        f"{100 * res['vision_share_of_ttft']:.1f}%; encoder activation peak "
        f"{res['encode_peak_mib']} MiB.",
        f"Estimated TTFT of the full {LAYERS_FULL}-layer model (encode + cached-image TTFT x "
        f"{LAYERS_FULL}/{LAYERS_RUN}, an upper bound): {res['estimated_full_model_ttft_ms']} ms.",
        "",
    ]
    (out / "vision_ttft.md").write_text("\n".join(md))
    print("\n".join(md))
    eng.shutdown()


if __name__ == "__main__":
    main()
