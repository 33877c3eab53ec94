"""The CLI as users run it: one-line errors with exit code 2, and `serve` end to end."""

import subprocess
import sys

import openai


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moeserve.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_bad_arguments_give_one_line_and_exit_2():
    for args in (["serve", "--max-num-seqs", "-3"], ["serve", "--dtype", "int3"], ["frobnicate"]):
        r = _run(*args)
        assert r.returncode == 2, args
        assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr, r.stderr


def test_missing_model_path_is_one_line(tmp_path):
    r = _run("serve", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2
    assert (
        r.stderr.strip().splitlines()[-1]
        == f"moeserve: error: model path {tmp_path / 'nope.gguf'} does not exist"
    )


def test_serve_default_answers_paris(cli_server):
    srv = cli_server()  # the README's command: the embedded SmolLM2 default
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert "Paris" in r.choices[0].message.content


def test_serve_tiny_kimi_nvfp4_checkpoint(cli_server, tmp_path):
    out = tmp_path / "kimi"
    r = _run("make-checkpoint", "--like", "kimi-k2.5", "--format", "nvfp4-modelopt", str(out))
    assert r.returncode == 0, r.stderr
    srv = cli_server(
        str(out),
        "--reasoning-parser",
        "kimi_k2",
        "--tool-call-parser",
        "kimi_k2",
        "--max-model-len",
        "512",
    )
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_streams_an_answer():
    r = subprocess.run(
        [sys.executable, "-m", "moeserve.cli", "chat", "--temperature", "0", "--max-tokens", "24"],
        input="What is the capital of France?\n\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_max_model_len_beyond_the_model_is_one_line(tmp_path):
    import json

    out = tmp_path / "kimi"
    r = _run("make-checkpoint", "--like", "kimi-k2.5", "--format", "nvfp4-modelopt", str(out))
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    limit = cfg.get("text_config", cfg)["max_position_embeddings"]  # the oracle: the file
    for tp in ([], ["-tp", "2"]):
        r = _run("serve", str(out), "--max-model-len", str(limit + 1), *tp, "--threads", "1")
        assert r.returncode == 2, r.stderr[-2000:]
        lines = [ln for ln in r.stderr.strip().splitlines() if "moeserve: error" in ln]
        assert len(lines) == 1 and f"exceeds the model's context of {limit}" in lines[0], r.stderr
