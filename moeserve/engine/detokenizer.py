"""Incremental detokenizing with stop strings.

Text is produced by decoding a short window of ids and diffing against the same window one
token shorter, so tokenizers that merge or strip across token borders (byte-level BPE,
SentencePiece) give exactly the text a full decode would. A delta never ends inside a UTF-8
character (decoding shows U+FFFD until its last byte arrives: we wait) and never ends with a
piece that could be the start of a stop string (held back until it is ruled in or out).
"""

from __future__ import annotations

from moeserve.sampling import SamplingParams
from moeserve.tokenizer.base import Tokenizer

_CONTEXT = 5  # prompt tokens decoded with the first output token, for its leading space


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tok = tokenizer
        # ids beyond the tokenizer (a padded LM head's rows) have no text: never decoded
        self.vocab = getattr(tokenizer, "vocab_size", None)
        self.skip_special = params.skip_special_tokens
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text so far (emitted or held back)
        self.emitted = 0  # characters of self.text already returned

    def _decode_new(self) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing complete yet
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def add(self, token: int, final: bool = False) -> tuple[str, str | None]:
        """Feed one output token. Returns (text to emit now, matched stop string or None).
        `final`: the token ends the request (EOS / stop id): its own text is not shown."""
        if final:
            return self.flush(), None
        if self.vocab is not None and not 0 <= token < self.vocab:
            return "", None
        self.ids.append(token)
        new = self._decode_new()
        if not new:
            return "", None
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += new
        if self.stops:
            hit = self._find_stop(start)
            if hit is not None:
                idx, stop = hit
                end = idx + len(stop) if self.include_stop else idx
                self.text = self.text[:end]
                out = self.text[self.emitted :]
                self.emitted = len(self.text)
                return out, stop
        safe = len(self.text) - self._held_back()
        out = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return out, None

    def flush(self) -> str:
        """Everything held back (the request is ending for another reason)."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out

    @property
    def _max_stop(self) -> int:
        return max((len(s) for s in self.stops), default=0)

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), tail, -1):
                if self.text.endswith(s[:k]):
                    tail = k
                    break
        return tail
