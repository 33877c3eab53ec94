"""SuffixDecoding ("suffix"): draft from frequency-counted suffix trees of seen token sequences.

Two trees answer each request. Its own tree holds every substring of at most
`max_tree_depth` tokens of its prompt and output, built as tokens arrive and dropped by
`finish`. The global tree holds the outputs of the last `max_cached_requests` finished
requests; a finish adds the output and, past the bound, removes the oldest one's counts.

A node counts the occurrences of its string. To draft, the longest suffix of the sequence that
occurs in a tree with at least one token after it is matched (shortened, if need be, so that a
full draft still fits under the depth cap), and the walk goes down to the most frequent child
(ties: the continuation seen most recently) while the path probability -- the product of
child count / parent's continuation count -- stays >= `min_token_prob`. The draft is at most
`max_tokens` and `max(1, floor(max_spec_factor * matched length))` tokens. Each tree's draft
is scored by the sum of its path probabilities, the number of tokens it expects to have
accepted; the higher score wins, the request's own tree on a tie (it is the more specific
evidence).

The trees store substrings without materialising each one: an occurrence that is the only one
below a node is a leaf *reference* (a position in a stored sequence) rather than a chain of
nodes, and it is turned into a node only when a second occurrence arrives. Unrepeated text
therefore costs about one dict entry per token, and nodes exist only for repeated substrings.

Costs. `extend` of m tokens visits the nodes of the sequence's repeated suffixes, at most
`max_tree_depth` per token; `propose` reads those directly for the request's tree, matches the
global tree with O(depth * log depth) dict lookups (exponential then binary search on the match
length: a suffix that occurs has all its own suffixes occurring) and walks the draft. None of
it depends on the sequence's length. `start` and `finish` work through the prompt and the
output once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # moeserve.config imports torch; proposers stay importable without it
    from moeserve.config import SpeculativeConfig

# A leaf reference packs (sequence id, position) in one int: dict values stay small ints and a
# step along a leaf is `ref + 1`. Positions stay far below 2**40.
_SHIFT = 40
_POS = (1 << _SHIFT) - 1


class _Node:
    """A substring that occurred more than once (or did, before an eviction)."""

    __slots__ = ("count", "total", "best", "children")

    def __init__(self, count: int) -> None:
        self.count = count  # occurrences of the string
        self.total = 0  # occurrences followed by a token within the depth cap (sum of children)
        self.best = -1  # token of the most frequent child; -1: unknown, recomputed when read
        # token -> node, or an int leaf reference for a child that occurred once
        self.children: dict[int, _Node | int] = {}


class _Tree:
    """Depth-capped suffix trie with occurrence counts and single-occurrence leaf references."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0)
        self.seqs: dict[int, list[int]] = {}

    def add(self, node: _Node, tok: int, ref: int, child_depth: int) -> _Node | None:
        """Count one more occurrence of node's string followed by `tok` (which sits at `ref`).

        Returns the child when it is a node (the walk may go on), None when the occurrence now
        ends in its own leaf reference (its further tokens are implicit in the stored sequence).
        """
        children = node.children
        child = children.get(tok)
        node.total += 1
        if child is None:
            children[tok] = ref
            count = 1
            result = None
        elif isinstance(child, int):
            result = self._split(child, child_depth)
            children[tok] = result
            count = 2
        else:
            child.count += 1
            count = child.count
            result = child
        best = node.best
        if best != tok:
            if best < 0:
                if len(children) == 1:
                    node.best = tok
            else:
                other = children[best]
                # >=: a tie goes to the child just seen, so the favourite is the most recent.
                if count >= (1 if isinstance(other, int) else other.count):
                    node.best = tok
        return result

    def _split(self, ref: int, depth: int) -> _Node:
        """A node for a leaf reference's first token, which a second occurrence now shares."""
        node = _Node(2)
        seq = self.seqs[ref >> _SHIFT]
        nxt = (ref & _POS) + 1
        if depth < self.depth and nxt < len(seq):
            tok = seq[nxt]
            node.children[tok] = ref + 1
            node.total = 1
            node.best = tok
        return node

    def insert(self, seq_id: int, seq: list[int]) -> None:
        """Count every suffix of a whole sequence, each up to the depth cap."""
        self.seqs[seq_id] = seq
        base = seq_id << _SHIFT
        n, depth, root, add = len(seq), self.depth, self.root, self.add
        for s in range(n):
            node: _Node | None = root
            for i in range(s, min(n, s + depth)):
                node = add(node, seq[i], base + i, i - s + 1)
                if node is None:
                    break

    def remove(self, seq_id: int) -> None:
        """Undo `insert`: subtract each suffix's counts, deleting what only it held."""
        seq = self.seqs.pop(seq_id)
        n, depth = len(seq), self.depth
        for s in range(n):
            node = self.root
            for i in range(s, min(n, s + depth)):
                tok = seq[i]
                child = node.children[tok]
                node.total -= 1
                if node.best == tok:
                    node.best = -1  # the favourite lost a count: another may now lead
                if isinstance(child, int):
                    del node.children[tok]  # a leaf holds one occurrence: this one
                    break
                child.count -= 1
                if child.count == 0:
                    del node.children[tok]  # nothing else passed here, nor below
                    break
                node = child

    def walk(self, tokens: list[int], start: int, end: int) -> _Node | int | None:
        """The tree position of tokens[start:end] (a node or a leaf reference), or None."""
        pos: _Node | int = self.root
        for i in range(start, end):
            tok = tokens[i]
            if isinstance(pos, _Node):
                nxt = pos.children.get(tok)
                if nxt is None:
                    return None
                pos = nxt
            else:
                seq = self.seqs[pos >> _SHIFT]
                j = (pos & _POS) + 1
                if j >= len(seq) or seq[j] != tok:
                    return None
                pos += 1
        return pos

    def continues(self, pos: _Node | int) -> bool:
        """Whether a token followed the position (callers keep the depth below the cap)."""
        if isinstance(pos, _Node):
            return pos.total > 0
        return (pos & _POS) + 1 < len(self.seqs[pos >> _SHIFT])

    def draft(
        self, pos: _Node | int, depth: int, limit: int, min_prob: float
    ) -> tuple[list[int], float]:
        """Greedy walk from a position at `depth`: the tokens and the sum of path probabilities."""
        out: list[int] = []
        prob = 1.0
        score = 0.0
        cap = self.depth
        while len(out) < limit and depth < cap:
            if isinstance(pos, _Node):
                if pos.total <= 0:
                    break
                tok = pos.best
                if tok < 0:
                    tok = _recompute_best(pos)
                child = pos.children[tok]
                p = prob * (1 if isinstance(child, int) else child.count) / pos.total
                if p < min_prob:
                    break
                prob = p
                pos = child
            else:
                # Inside a leaf: one occurrence, so the next token has probability 1 given
                # the path, and the path probability carries over unchanged.
                seq = self.seqs[pos >> _SHIFT]
                j = (pos & _POS) + 1
                if j >= len(seq):
                    break
                tok = seq[j]
                pos += 1
            out.append(tok)
            score += prob
            depth += 1
        return out, score


def _recompute_best(node: _Node) -> int:
    """After an eviction: the most frequent child (ties go to the earliest inserted)."""
    best_tok, best_count = -1, 0
    for tok, child in node.children.items():
        count = 1 if isinstance(child, int) else child.count
        if count > best_count:
            best_tok, best_count = tok, count
    node.best = best_tok
    return best_tok


class _Request:
    __slots__ = ("tokens", "prompt_len", "tree", "active")

    def __init__(self, depth: int) -> None:
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.tree = _Tree(depth)
        self.tree.seqs[0] = self.tokens  # the request's leaf references are plain positions
        # active[k - 1]: the node of the sequence's suffix of length k, for k = 1..K, where K
        # is the longest suffix that occurred before (and is below the depth cap). Longer
        # suffixes occurred only here and live in their own leaf reference, which grows with
        # the sequence for free; so appending a token touches these K nodes and the root.
        self.active: list[_Node] = []


class SuffixProposer:
    """SuffixDecoding drafts for running requests (see the module docstring for the rules)."""

    def __init__(
        self,
        max_tree_depth: int = 64,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        num_speculative_tokens: int = 3,
    ) -> None:
        if max_tree_depth < 1 or max_cached_requests < 0:
            raise ValueError(
                "max_tree_depth must be >= 1 and max_cached_requests >= 0, "
                f"got {max_tree_depth} and {max_cached_requests}"
            )
        if max_spec_factor <= 0 or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(
                "max_spec_factor must be > 0 and min_token_prob in [0, 1], "
                f"got {max_spec_factor} and {min_token_prob}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.num_speculative_tokens = num_speculative_tokens
        self._requests: dict[str, _Request] = {}
        self._global = _Tree(max_tree_depth)
        self._cached: deque[int] = deque()  # global sequence ids, oldest first
        self._next_seq_id = 0

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig) -> SuffixProposer:
        return cls(
            max_tree_depth=cfg.suffix_decoding_max_tree_depth,
            max_cached_requests=cfg.suffix_decoding_max_cached_requests,
            max_spec_factor=cfg.suffix_decoding_max_spec_factor,
            min_token_prob=cfg.suffix_decoding_min_token_prob,
            num_speculative_tokens=cfg.num_speculative_tokens,
        )

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def num_cached_requests(self) -> int:
        """Finished outputs the global tree holds now."""
        return len(self._cached)

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        req = _Request(self.max_tree_depth)
        self._requests[request_id] = req
        self._append(req, prompt_ids)
        req.prompt_len = len(req.tokens)

    def extend(self, request_id: str, new_ids: Sequence[int]) -> None:
        self._append(self._requests[request_id], new_ids)

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        """Up to min(`max_tokens`, num_speculative_tokens) tokens; [] when nothing matches."""
        req = self._requests[request_id]
        limit = min(max_tokens, self.num_speculative_tokens)
        depth = self.max_tree_depth
        # Match at most so deep that a full draft still fits under the depth cap: a longer
        # match is barely more specific but would leave no room to draft from.
        match_cap = min(depth - 1, max(1, depth - limit), len(req.tokens))
        if limit <= 0 or match_cap < 1:
            return []

        best: list[int] = []
        best_score = 0.0
        k = min(len(req.active), match_cap)
        if k:
            best, best_score = req.tree.draft(
                req.active[k - 1], k, self._draft_len(k, limit), self.min_token_prob
            )
        if self._cached:
            k, pos = self._match_global(req.tokens, match_cap)
            if pos is not None:
                draft, score = self._global.draft(
                    pos, k, self._draft_len(k, limit), self.min_token_prob
                )
                if score > best_score:
                    best = draft
        return best

    def finish(self, request_id: str) -> None:
        """Drop the request's tree; keep its output for later requests (evicting the oldest)."""
        req = self._requests.pop(request_id, None)
        if req is None or self.max_cached_requests == 0:
            return
        output = req.tokens[req.prompt_len :]
        if output:
            seq_id = self._next_seq_id
            self._next_seq_id += 1
            self._global.insert(seq_id, output)
            self._cached.append(seq_id)
        while len(self._cached) > self.max_cached_requests:
            self._global.remove(self._cached.popleft())

    def _draft_len(self, matched: int, limit: int) -> int:
        return min(limit, max(1, int(self.max_spec_factor * matched + 1e-9)))

    def _match_global(self, tokens: list[int], cap: int) -> tuple[int, _Node | int | None]:
        """Longest suffix of `tokens` (at most `cap`) that occurs in the global tree with a
        continuation. Having a continuation is inherited by every shorter suffix, so the
        length is found by doubling, then bisecting, each probe a walk from the root."""
        tree = self._global
        n = len(tokens)
        good_k, good_pos = 0, None
        bad_k = cap + 1
        k = 1
        while k <= cap:
            pos = tree.walk(tokens, n - k, n)
            if pos is None or not tree.continues(pos):
                bad_k = k
                break
            good_k, good_pos = k, pos
            k *= 2
        while bad_k - good_k > 1:
            mid = (good_k + bad_k) // 2
            pos = tree.walk(tokens, n - mid, n)
            if pos is None or not tree.continues(pos):
                bad_k = mid
            else:
                good_k, good_pos = mid, pos
        return good_k, good_pos

    def _append(self, req: _Request, new_ids: Sequence[int]) -> None:
        tokens = req.tokens
        tree = req.tree
        add = tree.add
        depth = tree.depth
        root = tree.root
        for t in new_ids:
            tok = int(t)
            p = len(tokens)
            tokens.append(tok)  # first: splitting a leaf may read the token just appended
            # Each suffix that occurred before (and the empty one, at the root) gains the
            # continuation `tok`; the new suffixes that occurred before are the results that
            # came back as nodes, shortest first and without gaps (a suffix of a repeated
            # string is repeated too).
            active: list[_Node] = []
            grow = True
            child = add(root, tok, p, 1)
            if child is not None and depth > 1:
                active.append(child)
            else:
                grow = False
            for k, node in enumerate(req.active, 1):
                child = add(node, tok, p, k + 1)
                if grow and child is not None and k + 1 < depth:
                    active.append(child)
                else:
                    grow = False
            req.active = active
