from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.sampling import SamplingParams


class ByteTok:
    """Each id is one byte; decode shows U+FFFD for an incomplete UTF-8 tail (like real ones)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _run(text: str, **kw):
    d = IncrementalDetokenizer(ByteTok(), [], SamplingParams(**kw))
    pieces, stop = [], None
    for b in text.encode():
        piece, stop = d.add(b)
        pieces.append(piece)
        if stop is not None:
            break
    if stop is None:
        pieces.append(d.flush())
    return pieces, stop


def test_never_emits_half_a_character():
    pieces, _ = _run("aé€😀b")
    assert "".join(pieces) == "aé€😀b"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_split_across_tokens_is_not_emitted():
    pieces, stop = _run("hello STOP world", stop=("STOP",))
    assert stop == "STOP" and "".join(pieces) == "hello "
    # the partial "ST", "STO" were held back, never emitted
    assert not any("S" in p for p in pieces)


def test_include_stop_and_false_alarm():
    pieces, stop = _run("a STAR b STOP", stop=("STOP",), include_stop_str_in_output=True)
    assert "".join(pieces) == "a STAR b STOP" and stop == "STOP"


def test_ids_beyond_the_tokenizer_give_no_text():
    """A padded LM head's rows have no token: never decoded (the tokenizer would raise)."""

    class Strict:
        vocab_size = 3

        def decode(self, ids, skip_special_tokens=True):
            return "".join("abc"[i] for i in ids)  # IndexError beyond the vocabulary

    d = IncrementalDetokenizer(Strict(), [0], SamplingParams())
    assert d.add(1) == ("b", None)
    assert d.add(7) == ("", None)
    assert d.add(2) == ("c", None)
