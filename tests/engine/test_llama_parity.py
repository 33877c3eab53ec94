"""Greedy parity with HF transformers' LlamaForCausalLM on the same GGUF (fp32)."""

import torch

from moeserve.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):\n    # complete this Python function",
    "Give me a recipe for pancakes.",
    "Who wrote 'Pride and Prejudice', and when was it published?",
]
N = 48


def _chat_ids(tok, text):
    prompt = tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(prompt, add_special_tokens=False)


def test_greedy_48_tokens_match_hf(llm, hf_llama):
    tok = llm.tokenizer
    ids = [_chat_ids(tok, p) for p in PROMPTS]
    ours = llm.generate(ids, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    for prompt_ids, got in zip(ids, ours, strict=True):
        with torch.no_grad():
            ref = hf_llama.generate(torch.tensor([prompt_ids]), max_new_tokens=N, do_sample=False)
        assert got.token_ids == ref[0, len(prompt_ids) :].tolist(), tok.decode(prompt_ids)


def test_prompt_logprobs_match_hf_logits(llm, hf_llama):
    ids = _chat_ids(llm.tokenizer, PROMPTS[1])
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_llama(torch.tensor([ids])).logits[0].float(), -1)
    expect = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    assert out.prompt_logprobs[0] is None and out.token_ids == []
    assert torch.allclose(got, expect, atol=2e-3)
