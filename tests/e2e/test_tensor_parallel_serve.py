"""`moeserve serve -tp 2` (gloo worker processes on the CPU) through the real CLI and HTTP API
gives the greedy tokens of one process, for tensor and expert parallelism, on a tiny Kimi-K2.5
NVFP4, a DeepSeek block-FP8 and a llama.cpp-converted deepseek2 GGUF checkpoint; a dying rank
takes the server down with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import TinyShape, write_checkpoint, write_eagle3_checkpoint
from tests.e2e.conftest import greedy_choice

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
MAX_TOKENS = 10
# block-FP8 splits must keep 128-wide blocks whole: every split dim is a multiple of 256
FP8_SHAPE = TinyShape(
    hidden=128,
    heads=4,
    q_lora=64,
    kv_lora=64,
    nope=64,
    rope=64,
    v_dim=64,
    intermediate=256,
    moe_intermediate=256,
)
CASES = {
    "kimi-nvfp4": ("kimi-k2.5", "nvfp4-modelopt", TinyShape()),
    "deepseek-fp8": ("deepseek-v3", "fp8-block", FP8_SHAPE),
}


def _deepseek2_gguf(root) -> str:
    """A Q8_0 deepseek2 GGUF written by llama.cpp's own converter from a tiny HF model."""
    from tests.loader.gguf_fixtures import Job, convert
    from tests.loader.gguf_fixtures import write_checkpoint as write_hf
    from tests.loader.test_gguf_deepseek import CFG_V3, VOCAB
    from tests.models.helpers import build_hf_model

    folder, out = str(root / "hf-v3"), str(root / "v3-q8_0.gguf")
    write_hf(folder, build_hf_model(CFG_V3, seed=5), VOCAB)
    convert([Job(folder, "q8_0", out)], str(root))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    paths = {
        key: write_checkpoint(str(root / key), like, fmt, shape=shape, seed=11).path
        for key, (like, fmt, shape) in CASES.items()
    }
    paths["deepseek2-gguf"] = _deepseek2_gguf(root)
    out = {}
    for key, path in paths.items():
        ref = LLM(path, device="cpu", dtype="float32", max_model_len=256)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        outs = ref.generate(PROMPTS, params)
        texts = [_text(ref.tokenizer.decode(c.token_ids, skip_special_tokens=False)) for c in outs]
        out[key] = (path, texts)
    return out


def _text(s: str) -> str:
    # a stream cut by max_tokens may end inside a UTF-8 sequence: the server holds those
    # bytes back, a one-shot decode shows U+FFFD; the tokens before them are what is compared
    return s.rstrip("\ufffd")


def _completions(base_url: str) -> list[str]:
    return [_text(greedy_choice(base_url, p, MAX_TOKENS)["text"]) for p in PROMPTS]


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
@pytest.mark.parametrize("case", ["kimi-nvfp4", "deepseek-fp8", "deepseek2-gguf"])
def test_tp2_serve_matches_single_process(cli_server, checkpoints, case, ep):
    path, want = checkpoints[case]
    extra = ["--enable-expert-parallel"] if ep else []
    server = cli_server(
        path, "-tp", "2", *extra, "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--threads", "1",
    )  # fmt: skip
    assert _completions(server.base_url) == want
    out = server.close()
    assert "2 ranks" in out and ("expert parallel" in out) == bool(extra), out[-2000:]


@pytest.mark.parametrize("ep", [True], ids=["tp2-ep"])  # tp2 alone: the MTP test below
def test_tp2_speculative_decoding_matches_single_process(cli_server, checkpoints, ep):
    """Rank 0 verifies the drafts; the other ranks compute the draft rows the step carries
    and roll back nothing themselves (rejected positions are overwritten later). Each prompt
    is sent twice: the second time the suffix cache drafts from the first answer."""
    path, want = checkpoints["kimi-nvfp4"]
    prompts = PROMPTS + PROMPTS
    ref = LLM(path, device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [
        _text(ref.tokenizer.decode(c.token_ids, skip_special_tokens=False))
        for c in ref.generate(prompts, params)
    ]
    spec = '{"method": "suffix", "num_speculative_tokens": 3, "adaptive": false}'
    extra = ["--enable-expert-parallel"] if ep else []
    server = cli_server(
        path, "-tp", "2", *extra, "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--threads", "1", "--speculative-config", spec,
    )  # fmt: skip
    got = [_text(greedy_choice(server.base_url, p, MAX_TOKENS)["text"]) for p in prompts]
    assert got == want
    metrics = httpx.get(server.base_url + "/metrics").text
    drafted = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_drafts")]
    assert drafted and int(drafted[0].split()[-1]) > 0, metrics[-1500:]
    server.close()


@pytest.mark.parametrize("ep", [False], ids=["tp2"])  # tp2-ep: the suffix test above
def test_tp2_mtp_drafts_match_single_process(cli_server, checkpoints, ep):
    """DeepSeek's MTP layer as the draft model under tensor parallelism: its catch-up and
    chained draft steps go to every rank like target steps."""
    path, want = checkpoints["deepseek-fp8"]
    spec = '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": false}'
    extra = ["--enable-expert-parallel"] if ep else []
    server = cli_server(
        path, "-tp", "2", *extra, "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--threads", "1", "--speculative-config", spec,
    )  # fmt: skip
    assert _completions(server.base_url) == want
    metrics = httpx.get(server.base_url + "/metrics").text
    drafted = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_drafts")]
    assert drafted and int(drafted[0].split()[-1]) > 0, metrics[-1500:]
    server.close()


def test_tp2_eagle3_drafts_match_single_process(cli_server, tmp_path):
    """An EAGLE-3 MLA draft head (its own folder) under tensor parallelism: every rank loads
    its slice, captures the target's aux hidden states and runs the head's catch-up and
    chained draft steps; the answers are one process's plain ones."""
    path = write_checkpoint(
        str(tmp_path / "kimi"), "kimi-k2.5", "nvfp4-modelopt", TinyShape(layers=3), seed=11
    ).path
    head = write_eagle3_checkpoint(str(tmp_path / "head"), "kimi-k2.5-eagle3-mla", path).path
    ref = LLM(path, device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [
        _text(ref.tokenizer.decode(c.token_ids, skip_special_tokens=False))
        for c in ref.generate(PROMPTS, params)
    ]
    spec = json.dumps(
        {"method": "eagle3", "model": head, "num_speculative_tokens": 2, "adaptive": False}
    )
    server = cli_server(
        path, "-tp", "2", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--threads", "1", "--speculative-config", spec,
    )  # fmt: skip
    assert _completions(server.base_url) == want
    metrics = httpx.get(server.base_url + "/metrics").text
    drafted = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_drafts")]
    assert drafted and int(drafted[0].split()[-1]) > 0, metrics[-1500:]
    server.close()


def test_a_dying_rank_stops_the_server_with_one_line(cli_server, checkpoints):
    path, _ = checkpoints["kimi-nvfp4"]
    server = cli_server(path, "-tp", "2", "--device", "cpu", "--dtype", "float32",
                        "--max-model-len", "256", "--threads", "1")  # fmt: skip
    children = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert children, "the spawned rank is a child of the server"
    for pid in children:  # the rank (and spawn's resource tracker, which does not matter)
        os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.proc.poll() not in (None, 0)
    out = server.close()
    lines = [ln for ln in out.splitlines() if "moeserve: error:" in ln]
    assert len(lines) == 1 and "rank" in lines[0] and "exited" in lines[0], out[-2000:]


# Requests that must not disturb the ranks: each is refused with a 4xx before it reaches them
# (a request that failed inside one rank's forward would take every rank down), or served.
ODD_REQUESTS = [
    ({"prompt": list(range(5, 400)), "max_tokens": 2}, 400),  # longer than --max-model-len
    ({"prompt": [5, 6], "max_tokens": 2, "logit_bias": {"999999": 5}}, 400),  # beyond vocab
    ({"prompt": [5, 6], "max_tokens": 2, "stop_token_ids": [10**9]}, 400),
    ({"prompt": [], "max_tokens": 2}, 400),
    ({"prompt": [5, 6], "max_tokens": 10**9}, 400),
    ({"prompt": [5, 6], "max_tokens": 3, "n": 3, "temperature": 1.0, "seed": 3}, 200),
    ({"prompt": [5, 6], "max_tokens": 3, "repetition_penalty": 1e-38, "temperature": 1}, 200),
    ({"prompt": [5, 6], "max_tokens": 3, "logit_bias": {"7": -100, "8": 100}}, 200),
]


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_odd_requests_leave_the_ranks_serving(cli_server, checkpoints, ep):
    path, want = checkpoints["kimi-nvfp4"]
    extra = ["--enable-expert-parallel"] if ep else []
    server = cli_server(
        path, "-tp", "2", *extra, "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--threads", "1",
    )  # fmt: skip
    url = f"{server.base_url}/v1/completions"
    for body, status in ODD_REQUESTS:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        if status >= 400:
            assert r.json()["error"]["message"], r.text
    with httpx.stream("POST", url, json={"prompt": [5, 6], "max_tokens": 50, "stream": True},
                      timeout=60) as r:  # fmt: skip
        next(r.iter_lines())  # the client goes away mid-stream
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert _completions(server.base_url) == want  # and the same tokens as one process
