"""Page allocator for the paged KV cache, with prefix caching (no torch).

Contract:
- A page holds `page_size` consecutive tokens of one sequence. A request owns the list of
  pages covering its computed tokens; a page may be shared by several requests (prefix hits),
  counted in `ref`.
- A FULL page is identified by a hash chained over all tokens up to its end (the parent
  page's hash + this page's tokens), so equal hashes mean equal whole prefixes.
- Pages with ref 0 stay in the free queue with their contents and hash (least recently freed
  first out): they can still be hit until the allocator hands them out again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


def page_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_pages
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self.free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Cached pages covering the longest cached prefix of `tokens`, leaving at least the
        last token to compute (the model must produce logits for it). Takes a reference."""
        if not self.enable_prefix_caching:
            return []
        self.stats.queries += len(tokens)
        pages: list[int] = []
        parent: bytes | None = None
        for start in range(0, len(tokens) - 1 - self.page_size + 1, self.page_size):
            parent = page_hash(parent, tokens[start : start + self.page_size])
            page = self.page_of.get(parent)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._take(page)
        self.stats.hits += len(pages) * self.page_size
        return pages

    def register_full_pages(
        self,
        pages: list[int],
        tokens: Callable[[int, int], list[int]],
        num_known: int,
        done: int = 0,
        parent: bytes | None = None,
    ) -> tuple[int, bytes | None]:
        """Record hashes for the full pages among the first `num_known` tokens, from page
        `done` on (`parent`: the hash of page done-1), so each page is hashed once over a
        request's life. `tokens(a, b)` gives tokens [a, b). Returns (pages done, last hash)
        for the next call."""
        full = num_known // self.page_size
        if not self.enable_prefix_caching or full <= done:
            return done, parent
        ps = self.page_size
        for i in range(done, full):
            page = pages[i]
            known = self.hash_of.get(page)
            if known is not None:
                parent = known
                continue
            parent = page_hash(parent, tokens(i * ps, (i + 1) * ps))
            if parent not in self.page_of:  # another copy already serves this prefix
                self.page_of[parent] = page
                self.hash_of[page] = parent
        return full, parent

    # ---- allocation ------------------------------------------------------------------------
    def _take(self, page: int) -> None:
        if self.ref[page] == 0:
            del self.free[page]
        self.ref[page] += 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh pages, or None (nothing taken) if fewer are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            page, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(page, None)
            if h is not None:
                del self.page_of[h]
            self.ref[page] = 1
            out.append(page)
        return out

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; tail pages are freed first so that the head of
        a prefix (the most shareable part) stays cached longest."""
        for page in reversed(pages):
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self.free[page] = None
