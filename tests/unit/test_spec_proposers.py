"""Host-side draft proposers: prompt lookup (ngram) and SuffixDecoding (suffix).

Drafts are checked on sequences built so that the right draft is known, and against brute-force
references that rescan the whole sequence at every step (the proposers keep incremental
indexes; the references share none of their code). No torch: the proposers do not need it.
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from moeserve.spec.ngram import NgramProposer
from moeserve.spec.suffix import _POS, _SHIFT, SuffixProposer, _Node, _Tree

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- references


def ngram_reference(seq: list[int], lo: int, hi: int, limit: int) -> list[int]:
    """Longest n first; for it, the latest earlier occurrence; what followed, up to the end."""
    end = len(seq)
    for n in range(hi, lo - 1, -1):
        if end <= n:
            continue
        tail = seq[end - n :]
        for i in range(end - n - 1, -1, -1):
            if seq[i : i + n] == tail:
                return seq[i + n : min(i + n + limit, end)]
    return []


def suffix_reference(
    seq: list[int], depth: int, limit: int, factor: float, min_prob: float
) -> list[int]:
    """The per-request-tree draft, from substring counts recomputed from scratch."""
    n = len(seq)

    def continuations(w: list[int]) -> dict[int, tuple[int, int]]:
        # token -> (occurrences of w + token, position of its latest one)
        out: dict[int, tuple[int, int]] = {}
        if len(w) >= depth:
            return out
        for s in range(n - len(w)):
            if seq[s : s + len(w)] == w:
                j = s + len(w)
                out[seq[j]] = (out.get(seq[j], (0, -1))[0] + 1, j)
        return out

    cap = min(depth - 1, max(1, depth - limit), n)
    k = next((k for k in range(cap, 0, -1) if continuations(seq[n - k :])), 0)
    if limit <= 0 or k == 0:
        return []
    length = min(limit, max(1, int(factor * k + 1e-9)))
    w, prob, out = seq[n - k :], 1.0, []
    while len(out) < length:
        cont = continuations(w)
        if not cont:
            break
        tok = max(cont, key=lambda t: cont[t])  # most frequent, then most recent
        p = prob * cont[tok][0] / sum(c for c, _ in cont.values())
        if p < min_prob:
            break
        prob = p
        out.append(tok)
        w = w + [tok]
    return out


def substring_counts(seqs: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in seqs:
        for s in range(len(seq)):
            for m in range(1, min(depth, len(seq) - s) + 1):
                counts[tuple(seq[s : s + m])] += 1
    return counts


def tree_counts(tree: _Tree) -> Counter:
    """Every string a tree holds with its count, leaf references expanded; checks the
    per-node bookkeeping (continuation totals, favourite child) on the way."""
    out: Counter = Counter()

    def visit(node: _Node, prefix: tuple[int, ...]) -> None:
        total = 0
        for tok, child in node.children.items():
            s = prefix + (tok,)
            if isinstance(child, _Node):
                assert child.count > 0
                out[s] = child.count
                total += child.count
                visit(child, s)
            else:
                total += 1
                seq, j = tree.seqs[child >> _SHIFT], child & _POS
                assert seq[j] == tok
                out[s] = 1
                while len(s) < tree.depth and j + 1 < len(seq):
                    j += 1
                    s = s + (seq[j],)
                    out[s] = 1
        assert node.total == total
        if node.best >= 0:
            best = node.children[node.best]
            counts = [1 if isinstance(c, int) else c.count for c in node.children.values()]
            assert (1 if isinstance(best, int) else best.count) == max(counts)

    visit(tree.root, ())
    return out


# ---------------------------------------------------------------------------- ngram


def ngram(lo: int = 2, hi: int = 5, k: int = 8) -> NgramProposer:
    return NgramProposer(prompt_lookup_min=lo, prompt_lookup_max=hi, num_speculative_tokens=k)


def test_ngram_phrase_seen_before_continues():
    p = ngram(2, 3)
    p.start("r", [1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert p.propose("r", 3) == [4, 5, 9]


def test_ngram_prefers_longest_n_then_most_recent_occurrence():
    p = ngram(1, 3)
    # "7 8 9" occurred at 0 (then 1); "8 9" occurred later, at 5 (then 2): the longer wins.
    p.start("r", [7, 8, 9, 1, 5, 8, 9, 2, 7, 8, 9])
    assert p.propose("r", 1) == [1]
    # Among occurrences of the same n-gram, the latest one is used.
    p.start("s", [1, 2, 5, 1, 2, 6, 1, 2])
    assert p.propose("s", 1) == [6]
    p.extend("s", [7, 3, 1, 2])
    assert p.propose("s", 1) == [7]


def test_ngram_no_match_and_limits():
    p = ngram(2, 4, k=3)
    p.start("r", [1, 2, 3, 4, 5])
    assert p.propose("r", 3) == []  # nothing recurs
    p.start("short", [1])
    assert p.propose("short", 3) == []
    p.start("empty", [])
    assert p.propose("empty", 3) == []
    # Below the minimum n a single repeated token is no match.
    p.start("one", [5, 1, 5])
    assert p.propose("one", 3) == []

    p.start("rep", [1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert p.propose("rep", 2) == [3, 4]  # max_tokens
    assert p.propose("rep", 10) == [3, 4, 5]  # num_speculative_tokens
    assert p.propose("rep", 0) == []


def test_ngram_draft_stops_at_the_sequence_end():
    p = ngram(2, 2, k=10)
    p.start("r", [1, 2, 3, 1, 2])
    # The occurrence at 0 is followed by 3 1 2 and then the known sequence ends.
    assert p.propose("r", 10) == [3, 1, 2]
    p.start("a", [4, 4, 4])
    assert p.propose("a", 10) == [4]


def test_ngram_matches_brute_force_on_every_prefix():
    rng = random.Random(1234)
    for trial in range(60):
        lo = rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        alphabet = rng.randint(2, 5)
        seq = [rng.randrange(alphabet) for _ in range(rng.randint(1, 120))]
        cut = rng.randint(0, len(seq))
        p = ngram(lo, hi, k=16)
        p.start("r", seq[:cut])
        for i in range(cut, len(seq) + 1):
            limit = rng.randint(1, 16)
            assert p.propose("r", limit) == ngram_reference(seq[:i], lo, hi, limit), (trial, i)
            if i < len(seq):
                p.extend("r", [seq[i]])


def test_ngram_extend_in_chunks_equals_one_by_one():
    rng = random.Random(7)
    seq = [rng.randrange(4) for _ in range(400)]
    a, b = ngram(1, 4), ngram(1, 4)
    a.start("r", seq[:10])
    b.start("r", seq[:10])
    for t in seq[10:]:
        a.extend("r", [t])
    i = 10
    while i < len(seq):
        step = rng.randint(1, 9)
        b.extend("r", seq[i : i + step])
        i += step
    assert a._requests["r"].index == b._requests["r"].index
    assert a.propose("r", 8) == b.propose("r", 8) == ngram_reference(seq, 1, 4, 8)


def test_ngram_finish_frees_the_request():
    p = ngram()
    p.start("r", [1, 2, 1, 2])
    assert "r" in p
    p.finish("r")
    assert "r" not in p and not p._requests
    p.finish("r")  # twice: harmless
    with pytest.raises(KeyError):
        p.propose("r", 3)
    with pytest.raises(KeyError):
        p.extend("r", [1])


# ---------------------------------------------------------------------------- suffix


def suffix(depth: int = 64, cached: int = 8, factor: float = 1.0, prob: float = 0.1, k: int = 8):
    return SuffixProposer(
        max_tree_depth=depth,
        max_cached_requests=cached,
        max_spec_factor=factor,
        min_token_prob=prob,
        num_speculative_tokens=k,
    )


def test_suffix_phrase_seen_before_continues():
    p = suffix()
    phrase = [11, 12, 13, 14, 15, 16, 17]
    p.start("r", [1, 2] + phrase + [3, 4] + phrase[:4])
    assert p.propose("r", 3) == [15, 16, 17]
    p.extend("r", [15])
    assert p.propose("r", 8) == [16, 17, 3, 4, 11]  # capped by the matched length (5)


# After "8 0 1 2" always 3; after "8 0 1 2 3", 4 twice and 5 once.
BRANCHY = [8, 0, 1, 2, 3, 4, 8, 0, 1, 2, 3, 4, 8, 0, 1, 2, 3, 5, 8, 0, 1, 2]


def test_suffix_probability_threshold_cuts_the_draft():
    # Path probabilities: 3 -> 1, then 4 -> 2/3, then 8 -> 2/3, 0 -> 2/3.
    for min_prob, want in [(1.0, [3]), (0.7, [3]), (0.6, [3, 4, 8, 0]), (0.0, [3, 4, 8, 0])]:
        p = suffix(prob=min_prob)
        p.start("r", BRANCHY)
        assert p.propose("r", 8) == want, min_prob
    # An even split (1/2 each) under a threshold above it gives no draft at all.
    p = suffix(prob=0.6)
    p.start("r", [9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2])
    assert p.propose("r", 8) == []
    p = suffix(prob=0.5)
    p.start("r", [9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2])
    assert p.propose("r", 8) == [4, 9, 1]  # tie: the most recent continuation


def test_suffix_spec_factor_and_max_tokens_cap_the_draft():
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6]
    p = suffix(factor=1.0)
    p.start("r", seq)
    assert p.propose("r", 8) == [7, 8]  # matched "5 6": factor 1 allows 2
    p = suffix(factor=2.5)
    p.start("r", seq)
    assert p.propose("r", 8) == [7, 8, 9, 10, 11]
    assert p.propose("r", 3) == [7, 8, 9]
    p = suffix(factor=0.1)
    p.start("r", seq)
    assert p.propose("r", 8) == [7]  # at least one token once anything matched


def test_suffix_draft_stays_within_the_depth_cap():
    # Depth 4 and 2 draft tokens: match at most 2 tokens so that 2 more fit in the tree.
    p = suffix(depth=4, factor=4.0, k=2)
    p.start("r", [1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert p.propose("r", 2) == [4, 5]
    p = suffix(depth=1)
    p.start("r", [1, 1, 1])
    assert p.propose("r", 2) == []  # single tokens only: nothing to continue


def test_suffix_global_tree_helps_a_request_that_says_a_finished_output_again():
    rng = random.Random(3)
    output = [rng.randrange(1000, 2000) for _ in range(30)]
    p = suffix()
    p.start("a", [1, 2, 3])
    p.extend("a", output[:10])
    p.extend("a", output[10:])
    p.finish("a")
    assert p.num_cached_requests == 1
    p.start("b", [7, 8, 9] + output[:6])  # the prompt alone has nothing to repeat
    assert p.propose("b", 4) == output[6:10]
    p.extend("b", output[6:8])
    assert p.propose("b", 4) == output[8:12]
    # The prompt is not cached: only outputs are.
    p.start("c", [1, 2])
    assert p.propose("c", 4) == []


def test_suffix_request_tree_wins_when_it_scores_higher():
    p = suffix()
    p.start("a", [50])
    p.extend("a", [1, 2, 3, 1, 2, 4])  # after "1 2": 3 or 4, half each
    p.finish("a")
    p.start("b", [1, 2, 9, 1, 2, 9, 1, 2])  # its own history: always 9
    assert p.propose("b", 1) == [9]
    p.start("c", [60, 1, 2])  # no own history: the global tree's (most recent) 4
    assert p.propose("c", 1) == [4]


def test_suffix_eviction_keeps_only_the_newest_outputs():
    rng = random.Random(11)
    p = suffix(depth=6, cached=2)
    outputs = []
    for i in range(6):
        out = [rng.randrange(4) for _ in range(rng.randint(1, 25))]
        outputs.append(out)
        p.start(f"r{i}", [9, 9])
        p.extend(f"r{i}", out)
        p.finish(f"r{i}")
        kept = outputs[-2:]
        assert p.num_cached_requests == len(kept)
        assert tree_counts(p._global) == substring_counts(kept, 6)
        assert set(p._global.seqs) == set(p._cached)
    # An evicted output no longer drafts.
    p = suffix(cached=1)
    for rid, out in [("x", [100, 101, 102, 103]), ("y", [200, 201, 202, 203])]:
        p.start(rid, [0])
        p.extend(rid, out)
        p.finish(rid)
    p.start("q", [100, 101])
    assert p.propose("q", 2) == []
    p.start("z", [200, 201])
    assert p.propose("z", 2) == [202, 203]
    # No cache at all: finished outputs are dropped.
    p = suffix(cached=0)
    p.start("x", [0])
    p.extend("x", [1, 2, 3])
    p.finish("x")
    assert p.num_cached_requests == 0 and not p._global.root.children


def test_suffix_finish_frees_the_request():
    p = suffix()
    p.start("r", [1, 2, 1, 2])
    assert "r" in p
    p.finish("r")
    assert "r" not in p and not p._requests
    p.finish("r")
    with pytest.raises(KeyError):
        p.propose("r", 3)
    with pytest.raises(KeyError):
        p.extend("r", [1])


def test_suffix_request_tree_holds_every_substring_count():
    rng = random.Random(5)
    for depth in (1, 2, 3, 7):
        seq = [rng.randrange(3) for _ in range(90)]
        p = suffix(depth=depth)
        p.start("r", seq[:5])
        i = 5
        while i < len(seq):
            step = rng.randint(1, 6)
            p.extend("r", seq[i : i + step])
            i += step
            req = p._requests["r"]
            assert tree_counts(req.tree) == substring_counts([seq[:i]], depth)


def test_suffix_matches_brute_force_on_every_prefix():
    rng = random.Random(99)
    for trial in range(40):
        depth = rng.randint(2, 9)
        factor = rng.choice([0.5, 1.0, 2.0])
        min_prob = rng.choice([0.0, 0.1, 0.3, 0.5, 0.7])
        alphabet = rng.randint(2, 4)
        seq = [rng.randrange(alphabet) for _ in range(rng.randint(1, 70))]
        p = suffix(depth=depth, factor=factor, prob=min_prob, cached=0, k=6)
        cut = rng.randint(0, len(seq))
        p.start("r", seq[:cut])
        for i in range(cut, len(seq) + 1):
            limit = rng.randint(1, 6)
            want = suffix_reference(seq[:i], depth, limit, factor, min_prob)
            assert p.propose("r", limit) == want, (trial, i)
            if i < len(seq):
                p.extend("r", [seq[i]])


def test_suffix_global_tree_counts_survive_random_traffic():
    rng = random.Random(21)
    p = suffix(depth=5, cached=3)
    live: dict[str, list[int]] = {}
    finished: list[list[int]] = []
    for step in range(300):
        action = rng.random()
        if action < 0.2 or not live:
            rid = f"r{step}"
            live[rid] = []
            p.start(rid, [rng.randrange(3) for _ in range(rng.randint(0, 5))])
        elif action < 0.8:
            rid = rng.choice(sorted(live))
            new = [rng.randrange(3) for _ in range(rng.randint(1, 4))]
            live[rid] += new
            p.extend(rid, new)
            p.propose(rid, rng.randint(1, 8))  # exercises favourites recomputed after evictions
        else:
            rid = rng.choice(sorted(live))
            p.finish(rid)
            if live[rid]:
                finished.append(live[rid])
            del live[rid]
            assert tree_counts(p._global) == substring_counts(finished[-3:], 5)


def test_suffix_extend_in_chunks_equals_one_by_one():
    rng = random.Random(8)
    seq = [rng.randrange(3) for _ in range(300)]
    a, b = suffix(depth=8), suffix(depth=8)
    a.start("r", seq[:7])
    b.start("r", seq[:7])
    for t in seq[7:]:
        a.extend("r", [t])
    i = 7
    while i < len(seq):
        step = rng.randint(1, 9)
        b.extend("r", seq[i : i + step])
        i += step
    assert tree_counts(a._requests["r"].tree) == tree_counts(b._requests["r"].tree)
    assert [n.count for n in a._requests["r"].active] == [n.count for n in b._requests["r"].active]
    for limit in range(1, 9):
        assert a.propose("r", limit) == b.propose("r", limit)


# ---------------------------------------------------------------------------- both


def _config_defaults(method: str) -> SimpleNamespace:
    """SpeculativeConfig's fields and defaults, read from its source (importing moeserve.config
    would import torch, which these proposers must not need)."""
    tree = ast.parse((ROOT / "moeserve" / "config.py").read_text())
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig"
    )
    fields = {
        st.target.id: ast.literal_eval(st.value)
        for st in cls.body
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value
    }
    return SimpleNamespace(**{**fields, "method": method})


def test_from_config_reads_the_speculative_settings():
    cfg = _config_defaults("ngram")
    n = NgramProposer.from_config(cfg)  # type: ignore[arg-type]
    assert (n.prompt_lookup_min, n.prompt_lookup_max, n.num_speculative_tokens) == (
        cfg.prompt_lookup_min,
        cfg.prompt_lookup_max,
        cfg.num_speculative_tokens,
    )
    cfg = _config_defaults("suffix")
    s = SuffixProposer.from_config(cfg)  # type: ignore[arg-type]
    assert (
        s.max_tree_depth,
        s.max_cached_requests,
        s.max_spec_factor,
        s.min_token_prob,
        s.num_speculative_tokens,
    ) == (
        cfg.suffix_decoding_max_tree_depth,
        cfg.suffix_decoding_max_cached_requests,
        cfg.suffix_decoding_max_spec_factor,
        cfg.suffix_decoding_min_token_prob,
        cfg.num_speculative_tokens,
    )


def test_proposers_import_without_torch():
    code = "import sys, moeserve.spec.ngram, moeserve.spec.suffix; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_step_cost_does_not_grow_with_the_sequence(kind: str):
    """1000 decode steps on a 200k-token request cost what they cost on a short one: the work
    per step is bounded by the draft and the index depth, so this takes milliseconds."""
    rng = random.Random(17)
    phrase = [rng.randrange(50_000, 60_000) for _ in range(40)]
    prompt = [rng.randrange(50_000) for _ in range(200_000)] + phrase
    p = ngram() if kind == "ngram" else suffix(depth=24)
    p.start("long", prompt)
    # The output repeats the phrase over and over: every step finds a long match.
    output = (phrase * 30)[:1000]
    t0 = time.perf_counter()
    drafted = 0
    for tok in output:
        p.extend("long", [tok])
        drafted += len(p.propose("long", 5))
    elapsed = time.perf_counter() - t0
    assert drafted >= 4 * 1000
    assert elapsed < 2.0, f"{elapsed:.2f}s for 1000 steps"
