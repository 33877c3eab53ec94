"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's extras), with the same
chat rendering and tokenizing as generation uses."""

from __future__ import annotations

from typing import Any

from moeserve.server.errors import ApiError
from moeserve.server.protocol import DetokenizeRequest, TokenizeRequest
from moeserve.server.state import ServerState


def tokenize(st: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    st.check_model(req.model)
    if req.messages is not None:
        if not req.messages:
            raise ApiError("messages must contain at least one message.", param="messages")
        text = st.prompts.render_chat(
            req.messages,
            req.tools,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        add_special = bool(req.add_special_tokens)  # the template already has them
    else:
        text = req.prompt or ""
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
    ids = st.prompts.encode(text, add_special_tokens=add_special)
    if req.messages is not None and any(m.image_parts() for m in req.messages):
        ids = st.prompts.expand_images(ids, st.prompts.images(req.messages))
    res: dict[str, Any] = {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": st.engine.max_model_len,
    }
    if req.return_token_strs:
        res["token_strs"] = [st.tokenizer.id_to_token(t) for t in ids]
    return res


def detokenize(st: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    st.check_model(req.model)
    st.prompts.check_token_ids(req.tokens, "tokens")
    return {"prompt": st.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(st: ServerState) -> dict[str, Any]:
    tok = st.tokenizer
    return {
        "tokenizer_class": type(tok).__name__,
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token,
        "pad_token": tok.pad_token,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "chat_template": tok.chat_template,
        "model_max_length": st.engine.max_model_len,
        "vocab_size": tok.vocab_size,
    }
