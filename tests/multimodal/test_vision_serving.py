"""Images over the OpenAI chat API on a tiny random Kimi-K2.5 (CPU, fp32): greedy tokens equal
transformers' `generate` (Kimi_K25ForConditionalGeneration) on the published processor's
inputs (tests/multimodal/oracle.py), across images of several sizes, several images in one
request, an image in a later turn, an image cut by chunked prefill, and the prefix cache;
every unusable image is a 400 naming its field, and the next request is served."""

from __future__ import annotations

import base64
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from oracle import (
    data_url,
    expand,
    hf_model,
    published_pixels,
    random_image,
    write_vision_checkpoint,
)
from PIL import Image

from moeserve.config import ServerConfig
from moeserve.engine.async_engine import build_async_engine
from moeserve.engine.core import build_engine
from moeserve.sampling import SamplingParams
from moeserve.server.api import create_app
from moeserve.testing.checkpoints import write_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from kimi_k25_oracle import oracle as render_template  # noqa: E402
from server_thread import ServerThread  # noqa: E402

MODEL = "tiny-vl"
NEW_TOKENS = 10
LOGPROB_TOL = 2e-4
# a smaller patch budget than the published 16,384, so that larger test images are resized
MEDIA_CFG = {
    "in_patch_limit": 96,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "patch_limit_on_one_side": 512,
}
LIMITS = dict(max_image_bytes=100_000, max_image_pixels=300_000, max_images_per_request=4)
# padded only; non-square; resized for the patch budget (and non-square)
IMAGES = [random_image(60, 40, 1), random_image(33, 90, 2), random_image(230, 100, 3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return write_vision_checkpoint(str(tmp_path_factory.mktemp("serve") / "kimi"), 3, MEDIA_CFG)


@pytest.fixture(scope="module")
def hf(folder):
    return hf_model(folder)


@pytest.fixture(scope="module")
def server(folder):
    engine = build_async_engine(
        folder, device="cpu", dtype="float32", max_model_len=1024, threads=1
    )
    app = create_app(engine, ServerConfig(served_model_name=MODEL, **LIMITS))
    try:
        with ServerThread(app, startup_timeout=60) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.shutdown()


def image_part(image: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def chat(server, messages: list[dict], **kw) -> httpx.Response:
    body = dict(model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    body.update(skip_special_tokens=False, logprobs=True)
    return httpx.post(server.base_url + "/v1/chat/completions", json=dict(body, **kw), timeout=120)


def oracle_answer(hf, tokenizer, folder: str, messages: list[dict]) -> Answer:
    """transformers' greedy continuation (text, prompt length, each token's logprob) of the
    published template's rendering of `messages`, its images preprocessed and expanded as
    the published processor does."""
    images, plain = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            for p in content:
                if p["type"] == "image_url":
                    raw = base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
                    images.append(Image.open(io.BytesIO(raw)).convert("RGB"))
            content = [{"type": p["type"], "text": p.get("text")} for p in content]
        plain.append(dict(m, content=content))
    ids = tokenizer.encode(render_template(plain))
    pad = json.loads((Path(folder) / "config.json").read_text())["media_placeholder_token_id"]
    inputs = [published_pixels(im, MEDIA_CFG) for im in images]
    ids = expand(ids, pad, [n for _, _, n in inputs])
    kw = {}
    if inputs:
        kw = dict(
            pixel_values=torch.cat([p for p, _, _ in inputs]),
            image_grid_thw=torch.tensor([g for _, g, _ in inputs]),
        )
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
            output_scores=True, return_dict_in_generate=True, **kw,
        )  # fmt: skip
    new = out.sequences[0, len(ids) :].tolist()
    lps = [s[0].log_softmax(-1)[t].item() for s, t in zip(out.scores, new, strict=True)]
    return Answer(tokenizer.decode(new, skip_special_tokens=False), len(ids), lps)


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    logprobs: list[float]

    def matches(self, other: Answer) -> bool:
        """Same tokens, and each token's logprob within fp32 tolerance: far finer than what
        a different image changes (test_the_answers_depend_on_the_images)."""
        return (self.text, self.prompt_tokens) == (other.text, other.prompt_tokens) and all(
            abs(a - b) < LOGPROB_TOL for a, b in zip(self.logprobs, other.logprobs, strict=True)
        )


def answer(resp: httpx.Response) -> Answer:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    return Answer(choice["message"]["content"], body["usage"]["prompt_tokens"], lps)


def test_three_images_of_different_sizes_equal_transformers(server, hf, folder):
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Compare these: "}]
            + [image_part(im) for im in IMAGES]
            + [{"type": "text", "text": "Which is widest?"}],
        }
    ]
    got = answer(chat(server, messages))
    want = oracle_answer(hf, server.engine.tokenizer, folder, messages)
    assert got.matches(want), (got, want)


def test_two_images_then_an_image_in_a_later_turn(server, hf, folder):
    messages = [
        {"role": "user", "content": [image_part(IMAGES[0]), image_part(IMAGES[2])]},
        {"role": "assistant", "content": "Two pictures."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And this? "}, image_part(IMAGES[1])],
        },
    ]
    got = answer(chat(server, messages))
    want = oracle_answer(hf, server.engine.tokenizer, folder, messages)
    assert got.matches(want), (got, want)


def test_prefix_cache_keys_image_pages_on_their_content(server, hf, folder):
    """Two different images behind the same text share only the pages before them; the same
    image again is served from the cache, with the same answer."""
    lead = "Describe the picture below in a few words, please, with care. " * 2
    page = server.engine.engine.config.cache.page_size

    def ask(image):
        messages = [
            {"role": "user", "content": [{"type": "text", "text": lead}, image_part(image)]}
        ]
        resp = chat(server, messages)
        return (
            answer(resp),
            resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
            messages,
        )

    a = random_image(112, 112, 10)  # 16 image tokens each
    b = random_image(112, 112, 11)
    got_a, _, _ = ask(a)
    got_b, cached_b, messages_b = ask(b)
    head = "<|im_user|>user<|im_middle|>" + lead + "<|media_begin|>image<|media_content|>"
    offset = len(server.engine.tokenizer.encode(head))  # the image's first token
    assert cached_b <= (offset // page) * page  # nothing from the image on
    assert got_b.matches(oracle_answer(hf, server.engine.tokenizer, folder, messages_b))
    assert not got_b.matches(got_a)  # the images do change the answer
    got_a2, cached_a2, _ = ask(a)
    assert got_a2.matches(got_a) and cached_a2 >= ((offset + 16) // page) * page > offset


def test_chunked_prefill_cuts_an_image_and_encodes_it_once(folder, hf):
    """A step budget smaller than an image's tokens: its embeddings go in over several steps,
    from one run of the encoder."""
    engine = build_engine(
        folder, device="cpu", dtype="float32", max_model_len=1024, max_num_batched_tokens=8,
        long_prefill_token_threshold=0, threads=1,
    )  # fmt: skip
    messages = [
        {"role": "user", "content": [image_part(IMAGES[2]), {"type": "text", "text": "Hi"}]}
    ]
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "Hi"}]}]
    )
    image = engine.image_processor.preprocess(IMAGES[2])
    assert image.num_tokens > 8
    ids = engine.image_processor.expand(engine.tokenizer.encode(text), [image])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0)
    engine.add_request("r", ids, params, [image])
    tokens: list[int] = []
    lps: list[float] = []
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
            lps += [e.logprob for e in out.logprobs or []]
        steps += 1
    engine.shutdown()
    assert steps > NEW_TOKENS + image.num_tokens // 8
    assert engine.runner.images.cache.misses == 1
    got = Answer(engine.tokenizer.decode(tokens, skip_special_tokens=False), len(ids), lps)
    assert got.matches(oracle_answer(hf, engine.tokenizer, folder, messages))


def _b64(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


_PNG = base64.b64decode(data_url(random_image(64, 64, 6)).split(",", 1)[1])
BAD = {
    "corrupt": _b64("image/png", b"\x89PNG\r\n\x1a\n" + b"\0" * 40),
    "truncated": _b64("image/png", _PNG[: len(_PNG) // 2]),
    "not_an_image": _b64("image/png", b"GIF89a" + b"\0" * 40),
    "unsupported_type": "data:image/gif;base64,R0lGODlhAQABAAAAACw=",
    "bad_base64": "data:image/png;base64,@@@",
    "too_many_bytes": data_url(random_image(300, 300, 5)),
    "too_many_pixels": data_url(Image.new("RGB", (700, 500))),
    "url_not_allowed": "https://example.com/cat.png",  # refused before any fetch
    "file_url": "file:///etc/passwd",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_image_is_a_400_naming_its_field(server, case):
    part = {"type": "image_url", "image_url": {"url": BAD[case]}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "See"}, part]}]
    resp = chat(server, messages)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages.0.content.1.image_url"
    ok = chat(server, [{"role": "user", "content": [image_part(IMAGES[0])]}], max_tokens=2)
    assert ok.status_code == 200


def test_too_many_images_and_a_forged_placeholder_are_400s(server):
    many = [{"role": "user", "content": [image_part(IMAGES[0])] * 5}]
    resp = chat(server, many)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert "at most 4" in resp.json()["error"]["message"]
    forged = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "<|media_pad|>"}, image_part(IMAGES[0])],
        }
    ]
    resp = chat(server, forged)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert chat(server, [{"role": "user", "content": "Hello"}], max_tokens=2).status_code == 200


def test_an_image_for_a_text_only_model_is_a_400(tmp_path):
    path = write_checkpoint(str(tmp_path / "text"), "moonlight", "bf16", shards=1).path
    engine = build_async_engine(path, device="cpu", dtype="float32", max_model_len=256, threads=1)
    app = create_app(engine, ServerConfig(served_model_name=MODEL))
    try:
        with ServerThread(app, startup_timeout=60) as srv:
            messages = [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part(IMAGES[0])]}
            ]
            resp = chat(srv, messages)
            assert resp.status_code == 400
            assert resp.json()["error"]["param"] == "messages.0.content.1.image_url"
            assert "no images" in resp.json()["error"]["message"]
            assert chat(srv, [{"role": "user", "content": "Hi"}], max_tokens=2).status_code == 200
    finally:
        engine.shutdown()


def test_tensor_parallel_rank0_encodes_for_every_rank(folder, hf):
    """-tp 2 (gloo ranks on the CPU): rank 0 holds the encoder, the other rank receives the
    image embeddings of each step; the answer is transformers'."""
    engine = build_engine(
        folder, device="cpu", dtype="float32", max_model_len=512, tensor_parallel_size=2,
        threads=1,
    )  # fmt: skip
    try:
        parts = [image_part(IMAGES[1]), {"type": "text", "text": "and"}, image_part(IMAGES[0])]
        messages = [{"role": "user", "content": parts}]
        plain = [{"type": p["type"], "text": p.get("text")} for p in parts]
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": plain}])
        images = [engine.image_processor.preprocess(im) for im in (IMAGES[1], IMAGES[0])]
        ids = engine.image_processor.expand(engine.tokenizer.encode(text), images)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0)
        engine.add_request("tp", ids, params, images)
        tokens: list[int] = []
        lps: list[float] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.token_ids
                lps += [e.logprob for e in out.logprobs or []]
        assert engine.runner.tp.size == 2 and engine.runner.model.vision is not None
    finally:
        engine.shutdown()
    got = Answer(engine.tokenizer.decode(tokens, skip_special_tokens=False), len(ids), lps)
    assert got.matches(oracle_answer(hf, engine.tokenizer, folder, messages))


def test_an_image_url_on_an_allowed_host_is_fetched(server, tmp_path):
    """--allowed-media-domains 127.0.0.1: an http URL there is fetched (a file server on the
    loopback), and answers as the same image sent inline; other hosts stay refused."""
    import functools
    import http.server
    import threading

    (tmp_path / "a.png").write_bytes(base64.b64decode(data_url(IMAGES[0]).split(",", 1)[1]))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    app = create_app(
        server.engine, ServerConfig(served_model_name=MODEL, allowed_media_domains="127.0.0.1")
    )
    url = f"http://127.0.0.1:{files.server_address[1]}/a.png"
    try:
        with ServerThread(app, startup_timeout=60) as srv:
            part = {"type": "image_url", "image_url": {"url": url}}
            got = answer(chat(srv, [{"role": "user", "content": [part]}]))
            missing = {"type": "image_url", "image_url": {"url": url.replace("a.png", "b.png")}}
            resp = chat(srv, [{"role": "user", "content": [missing]}])
            assert resp.status_code == 400 and "could not be fetched" in resp.text
            other = {"type": "image_url", "image_url": {"url": "http://localhost/a.png"}}
            assert chat(srv, [{"role": "user", "content": [other]}]).status_code == 400
    finally:
        files.shutdown()
    assert got.matches(answer(chat(server, [{"role": "user", "content": [image_part(IMAGES[0])]}])))


def test_offline_chat_takes_images(folder, hf):
    """`LLM.chat` with an image_url part and a PIL image part: transformers' answer."""
    from moeserve.engine.offline import LLM

    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=1024, threads=1)
    text = {"type": "text", "text": "Compare: "}
    pil = {"type": "image", "image": IMAGES[1]}
    got = llm.chat(
        [{"role": "user", "content": [text, image_part(IMAGES[0]), pil]}],
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0),
    )
    want = oracle_answer(
        hf,
        llm.tokenizer,
        folder,
        [{"role": "user", "content": [text, image_part(IMAGES[0]), image_part(IMAGES[1])]}],
    )
    assert llm.tokenizer.decode(got.token_ids, skip_special_tokens=False) == want.text
    lps = [e.logprob for e in got.logprobs]
    assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(lps, want.logprobs, strict=True))
    llm.engine.shutdown()


def test_tokenize_counts_an_images_tokens(server):
    """/tokenize on a chat with an image counts what the chat request's prompt holds."""
    messages = [
        {"role": "user", "content": [image_part(IMAGES[2]), {"type": "text", "text": "Hi"}]}
    ]
    used = answer(chat(server, messages)).prompt_tokens
    resp = httpx.post(
        server.base_url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["count"] == used
