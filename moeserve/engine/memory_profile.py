"""How many KV-cache pages a runner gets: on a GPU from a profiling run (the weights as loaded,
the activation peaks of the largest eager prefill and of the largest decode batch, images'),
on a CPU from the RAM available; the smallest over the tensor-parallel group. The arithmetic
is engine/memory.py's."""

from __future__ import annotations

import torch

from moeserve.engine.memory import MemoryPlan, plan_kv_pages
from moeserve.engine.runner_view import RunnerView
from moeserve.engine.step import StepInput

RAM_UNKNOWN_BYTES = 4 << 30  # what a CPU without /proc/meminfo is assumed to have free


def size_kv_cache(runner: RunnerView, model_len: int) -> MemoryPlan:
    """Pages of the KV cache on this rank, the smallest over the group."""
    cfg = runner.config
    per_token = runner.kv_bytes_per_token()
    want_tokens = cfg.scheduler.max_num_seqs * model_len
    if runner.device.type == "cuda":
        plan = _profile_gpu(runner, per_token, want_tokens)
    else:
        budget = min(
            available_ram() * cfg.cache.cpu_memory_fraction,
            cfg.cache.cpu_max_kv_gib * (1 << 30),
        )
        plan = plan_kv_pages(
            budget_bytes=int(budget),
            kv_bytes_per_token=per_token,
            page_size=runner.page_size,
            want_tokens=want_tokens,
            num_pages=cfg.cache.num_pages,
        )
    pages = runner.tp.min_int(plan.kv_pages)
    return plan if pages == plan.kv_pages else plan.with_pages(pages)


@torch.inference_mode()
def _profile_gpu(runner: RunnerView, per_token: int, want_tokens: int) -> MemoryPlan:
    """Weights as loaded, the activation peak of the largest eager prefill step and of the
    largest decode batch (what a captured graph's pool holds), then the rest of the memory
    budget to the KV cache."""
    cfg, dev, ps = runner.config, runner.device, runner.page_size
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(dev)
    tokens = cfg.scheduler.max_num_batched_tokens
    decode_batch = max(1, cfg.graph_max_batch(str(dev)))
    n_pages = -(-tokens // ps)
    runner.bind_cache(n_pages + decode_batch + 1)
    runner.pages.allocate(decode_batch + 1, n_pages)
    table = runner.pages.table
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    # one prefill of `tokens` tokens, then `decode_batch` one-token sequences
    table[0, :n_pages] = torch.arange(n_pages, dtype=torch.int32, device=dev)
    logit_rows = min(tokens, cfg.scheduler.max_num_seqs)
    runner.execute_model(
        StepInput(
            ids=[0] * tokens,
            positions=list(range(tokens)),
            rows=[0],
            seq_lens=[tokens],
            query_lens=[tokens],
            logit_rows=list(range(tokens - logit_rows, tokens)),
        )
    )
    torch.cuda.synchronize(dev)
    prefill_peak = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.reset_peak_memory_stats(dev)
    table[1:, 0] = torch.arange(n_pages, n_pages + decode_batch, dtype=torch.int32, device=dev)
    runner.execute_model(
        StepInput(
            ids=[0] * decode_batch,
            positions=[0] * decode_batch,
            rows=list(range(1, decode_batch + 1)),
            seq_lens=[1] * decode_batch,
            query_lens=[1] * decode_batch,
            logit_rows=list(range(decode_batch)),
        )
    )
    torch.cuda.synchronize(dev)
    decode_peak = torch.cuda.max_memory_allocated(dev) - base
    prefill_peak = runner.images.profile(base, prefill_peak)
    runner.bind_cache(0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    # memory held outside this process's torch allocator (CUDA context, NCCL, other
    # processes on the GPU): counted against the budget as it is now
    outside = total - free - torch.cuda.memory_reserved(dev)
    graph_reserve = decode_peak if cfg.graph_max_batch(str(dev)) else 0
    budget = int(total * cfg.cache.gpu_memory_utilization)
    return plan_kv_pages(
        budget_bytes=budget - outside - weights - prefill_peak - graph_reserve,
        kv_bytes_per_token=per_token,
        page_size=ps,
        want_tokens=want_tokens,
        num_pages=cfg.cache.num_pages,
        total_bytes=total,
        utilization=cfg.cache.gpu_memory_utilization,
        weights_bytes=weights,
        activation_bytes=prefill_peak,
        graph_bytes=graph_reserve,
        other_bytes=outside,
    )


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return RAM_UNKNOWN_BYTES
