from moeserve.engine.kv_blocks import PageAllocator, page_hash


def _slicer(tokens):
    return lambda a, b: tokens[a:b]


def test_allocate_release_and_exhaustion():
    a = PageAllocator(num_pages=4, page_size=2)
    p = a.allocate(3)
    assert sorted(p) == [0, 1, 2] and a.num_free == 1
    assert a.allocate(2) is None and a.num_free == 1  # nothing taken on failure
    a.release(p)
    assert a.num_free == 4


def test_prefix_hits_only_full_pages_and_leave_last_token():
    a = PageAllocator(num_pages=8, page_size=4)
    toks = list(range(10))  # 2 full pages + 2 tokens
    pages = a.allocate(3)
    a.register_full_pages(pages, _slicer(toks), num_known=10)
    a.release(pages)
    # same prompt: both full pages hit (8 tokens), the 2 tail tokens are recomputed
    hit = a.match_prefix(toks)
    assert hit == pages[:2]
    a.release(hit)
    # a prompt of exactly 8 tokens may reuse only the first page: its last token must be computed
    assert a.match_prefix(toks[:8]) == pages[:1]
    assert a.stats.hits == 8 + 4


def test_hash_is_chained_over_the_whole_prefix():
    a = PageAllocator(num_pages=8, page_size=2)
    pages = a.allocate(2)
    a.register_full_pages(pages, _slicer([1, 2, 3, 4]), num_known=4)
    a.release(pages)
    # second page's tokens equal, first differs: no hit at all
    assert a.match_prefix([9, 9, 3, 4, 5]) == []


def test_cached_free_pages_are_evicted_lru_and_lose_their_hash():
    a = PageAllocator(num_pages=2, page_size=2)
    pages = a.allocate(2)
    a.register_full_pages(pages, _slicer([1, 2, 3, 4]), num_known=4)
    a.release(pages)
    fresh = a.allocate(2)  # reuses both cached pages
    assert sorted(fresh) == sorted(pages)
    a.release(fresh)
    assert a.match_prefix([1, 2, 3, 4, 5]) == []


def test_shared_pages_are_reference_counted():
    a = PageAllocator(num_pages=4, page_size=2)
    pages = a.allocate(2)
    a.register_full_pages(pages, _slicer([1, 2, 3, 4]), 4)
    hit = a.match_prefix([1, 2, 3, 4, 5])
    assert hit == pages and a.ref[pages[0]] == 2
    a.release(pages)
    assert a.num_free == 2  # still held by the second user
    a.release(hit)
    assert a.num_free == 4


def test_incremental_hashing_equals_hashing_all_pages_at_once():
    """Hashing page by page as tokens arrive (each page once) gives the hashes of one pass."""
    toks = list(range(100, 123))
    whole = PageAllocator(num_pages=8, page_size=4)
    pw = whole.allocate(6)
    assert whole.register_full_pages(pw, _slicer(toks), len(toks)) == (5, whole.hash_of[pw[4]])
    step = PageAllocator(num_pages=8, page_size=4)
    ps = step.allocate(6)
    done, parent = 0, None
    calls = []
    for known in (3, 4, 9, 9, 17, 23):
        done, parent = step.register_full_pages(
            ps, lambda a, b: calls.append(a) or toks[a:b], known, done, parent
        )
    assert calls == [0, 4, 8, 12, 16]  # every full page hashed exactly once
    assert [step.hash_of[p] for p in ps[:5]] == [whole.hash_of[p] for p in pw[:5]]
    # and equal to the chain computed from scratch
    h = None
    for i in range(5):
        h = page_hash(h, toks[4 * i : 4 * i + 4])
    assert parent == h
