from moeserve.config import SchedulerConfig
from moeserve.engine.kv_blocks import PageAllocator
from moeserve.engine.request import Request
from moeserve.engine.scheduler import Scheduler
from moeserve.sampling import SamplingParams


def _req(rid: str, n: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)


def _run_step(s: Scheduler, token: int = 7):
    b = s.schedule()
    sampled = [r for i, r in enumerate(b.requests) if b.samples(i)]
    s.after_step(b)
    for r in sampled:
        r.output_ids.append(token)
    return b


def test_chunked_prefill_respects_token_budget():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), PageAllocator(16, 4))
    s.add(_req("a", 20))
    b = _run_step(s)
    assert b.num_tokens == [8] and not b.samples(0)
    b = _run_step(s)
    assert b.num_tokens == [8]
    b = _run_step(s)
    assert b.num_tokens == [4]  # last chunk reaches the end and samples
    b = _run_step(s)
    assert b.num_tokens == [1]  # decode


def test_decodes_go_first_and_new_prompts_fill_the_rest():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), PageAllocator(32, 4))
    s.add(_req("a", 5))
    _run_step(s)
    s.add(_req("b", 10))
    b = _run_step(s)
    assert [r.request_id for r in b.requests] == ["a", "b"]
    assert b.num_tokens == [1, 5]


def test_max_num_seqs_limits_the_batch():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), PageAllocator(32, 4))
    for i in range(3):
        s.add(_req(str(i), 3))
    b = _run_step(s)
    assert len(b.requests) == 2 and len(s.waiting) == 1


def test_preemption_by_recompute_when_pages_run_out():
    # 4 pages of 2 tokens: two requests of 3 prompt tokens fill 2 pages each while decoding
    alloc = PageAllocator(4, 2, enable_prefix_caching=False)  # recompute everything
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    a, b = _req("a", 3), _req("b", 3)
    s.add(a)
    s.add(b)
    _run_step(s)  # both prefilled (2 pages each), each sampled one token
    _run_step(s)  # 4th token of each still fits in 2 pages
    batch = _run_step(s)  # a needs a third page: b (latest) is preempted
    assert batch.preempted == [b] and b.num_computed == 0 and b.pages == []
    assert s.waiting[0] is b and b.output_ids == [7, 7]  # output kept, to be recomputed
    a.finish("stop")
    s.finish(a)
    batch = _run_step(s)
    assert batch.requests == [b] and batch.num_tokens == [5]  # prompt + its 2 output tokens


def test_long_prefill_threshold_admits_requests_behind_a_long_prompt():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, long_prefill_token_threshold=6)
    s = Scheduler(cfg, PageAllocator(64, 4))
    s.add(_req("long", 40))
    b = _run_step(s)
    assert b.num_tokens == [6]  # cut at the threshold although the budget had room
    s.add(_req("short", 3))
    b = _run_step(s)
    # the short prompt runs beside the long one's next chunk, not after all of its chunks
    assert [r.request_id for r in b.requests] == ["long", "short"] and b.num_tokens == [6, 3]
    b = _run_step(s)
    assert b.num_tokens == [6, 1]  # the short one decodes; decode steps are never cut


def test_no_threshold_lets_a_long_prompt_take_the_budget():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), PageAllocator(64, 4))
    s.add(_req("long", 40))
    _run_step(s)
    s.add(_req("short", 3))
    b = _run_step(s)
    assert [r.request_id for r in b.requests] == ["long"] and b.num_tokens == [16]
