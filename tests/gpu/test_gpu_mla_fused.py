"""The fused attention-side kernels on a GPU: every kernel against its torch reference at
Kimi-K2.5 shapes, and the tiny Kimi NVFP4 checkpoint (published 512 + 64 MLA layout) through
the fused MLA path: the same greedy tokens as the torch path, CUDA graph = eager, a mixed
prefill + decode batch = its requests run separately, chunked prefill = one prefill.

    python3 -m pytest -q -s tests/gpu/test_gpu_mla_fused.py

Tolerances come from the measured bf16 noise floor: this random tiny model's logits are flat
and bf16 rounding alone moves its log-probs by ~0.1-0.4 against an fp32 run (the torch path
in bf16 vs the torch path in fp32). The fused path must be as close to the fp32 reference as
the bf16 torch path is (x2 + 0.02), and two bf16 runs of the same kernels within that floor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from moeserve.kernels.attention import kv_cache as kvc
from moeserve.kernels.elementwise import norm as nk
from moeserve.kernels.routing import router as rk
from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext
from moeserve.layers.attention.mla_backends import TorchMLA, TritonMLA
from moeserve.loader import load_model
from moeserve.testing.checkpoints import KERNEL_SHAPE, write_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
SHAPE = KERNEL_SHAPE  # the published 512 + 64 MLA layout: the Triton kernels apply
STEPS = 16
BF16_ULP = 2.0**-7


def _ulps_ok(got: torch.Tensor, want: torch.Tensor, ulps: int = 2, same: float = 0.9) -> None:
    g, w = got.float(), want.float()
    assert torch.all((g - w).abs() <= ulps * BF16_ULP * w.abs() + 1e-6), (g - w).abs().max()
    assert (g == w).float().mean() >= same


# ---- kernels at Kimi shapes --------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_norm_kernels(tokens):
    gen = torch.Generator(DEV).manual_seed(tokens)
    x = torch.randn(tokens, 7168, device=DEV, generator=gen).bfloat16()
    r = torch.randn(tokens, 7168, device=DEV, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(7168, device=DEV, generator=gen)).bfloat16()
    _ulps_ok(nk.rms_norm(x, w, 1e-6), nk.rms_norm_ref(x, w, 1e-6))
    y, s = nk.add_rmsnorm(x, r, w, 1e-6)
    ry, rs = nk.add_rmsnorm_ref(x, r, w, 1e-6)
    assert torch.equal(s, rs)
    _ulps_ok(y, ry)
    qkv = torch.randn(tokens, 1536 + 576, device=DEV, generator=gen).bfloat16()
    wa = (1 + 0.1 * torch.randn(1536, device=DEV, generator=gen)).bfloat16()
    wb = (1 + 0.1 * torch.randn(512, device=DEV, generator=gen)).bfloat16()
    ref = nk.rms_norm_pair_ref(qkv, wa, wb, 1e-6, 1e-6)
    _ulps_ok(nk.rms_norm_pair(qkv, wa, wb, 1e-6, 1e-6, out=qkv), ref)


@pytest.mark.parametrize(
    ("experts", "n_group", "topk_group"), [(384, 1, 1), (256, 8, 4), (48, 8, 3)]
)
@pytest.mark.parametrize("tokens", [1, 8, 64, 1000])
def test_router_kernel(tokens, experts, n_group, topk_group):
    gen = torch.Generator(DEV).manual_seed(tokens + experts)
    logits = 2 * torch.randn(tokens, experts, device=DEV, generator=gen)
    bias = 0.1 * torch.randn(experts, device=DEV, generator=gen)
    kw = dict(n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.827)
    w, ids = rk.route(logits, bias, 8 if experts > 48 else 5, **kw)
    rw, rids = rk.route_ref(logits, bias, ids.shape[1], **kw)
    # GPU exp may differ from torch's by an ulp: sets agree except at exact-near ties
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    assert same.float().mean() > 0.99
    choice = torch.sigmoid(logits) + bias
    for t in torch.nonzero(~same).flatten().tolist():
        kth = choice[t, rids[t].long()].min()
        assert (choice[t, ids[t].long()] >= kth - 1e-6).all()
    torch.testing.assert_close(w[same], rw[same], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", [64, 8])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_rope_cache_write_kernel(tokens, heads, cache_dtype):
    from moeserve.config import RopeScaling
    from moeserve.layers.rotary import RotaryEmbedding

    yarn = RopeScaling(
        type="yarn",
        factor=64.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    rot = RotaryEmbedding(64, 4096, 50000.0, yarn, interleaved=True).to(DEV)
    gen = torch.Generator(DEV).manual_seed(tokens + heads)
    qkv = torch.randn(tokens, 1536 + 576, device=DEV, generator=gen).bfloat16()
    q = torch.randn(tokens, heads, 192, device=DEV, generator=gen).bfloat16()
    pos = torch.randint(0, 200_000, (tokens,), device=DEV, generator=gen)
    slots = torch.randperm(64 * 64, device=DEV, generator=gen)[:tokens]
    slots[1::5] = -1
    scale = torch.tensor([0.05], device=DEV) if cache_dtype != torch.bfloat16 else None
    cache = torch.full((64, 64, 576), float("nan"), device=DEV).to(cache_dtype)
    ref_cache = cache.clone()
    c, k_pe = qkv[:, 1536:2048], qkv[:, 2048:]
    q_abs = torch.empty(tokens, heads, 576, device=DEV, dtype=torch.bfloat16)
    ref_q = torch.empty(tokens, heads, 64, device=DEV, dtype=torch.bfloat16)
    rope = kvc.CacheRope(pos, rot.cos, rot.sin, q[..., 128:], q_abs[..., 512:])
    kvc.write_mla_cache(c, k_pe, cache, slots, scale, rope)
    ref_rope = kvc.CacheRope(pos, rot.cos, rot.sin, q[..., 128:], ref_q)
    kvc.write_mla_cache_ref(c, k_pe, ref_cache, slots, scale, ref_rope)
    _ulps_ok(q_abs[..., 512:], ref_q, ulps=1, same=0.98)
    got, want = cache.float(), ref_cache.float()
    assert torch.equal(got.isnan(), want.isnan())
    g, w = got.nan_to_num(), want.nan_to_num()
    if cache_dtype == torch.bfloat16:
        _ulps_ok(g, w, ulps=1, same=0.98)
    else:  # one e4m3 step (relative 1/8) where the bf16 rounding of k_pe differed
        assert torch.all((g - w).abs() <= w.abs() / 8 + 1e-3) and (g == w).float().mean() > 0.98


# ---- the tiny Kimi model through the fused path ------------------------------------------------
class Driver:
    """Runs the model over a paged cache on the GPU with hand-built metadata (permuted pages)."""

    def __init__(self, lm, page_size: int = 16, num_pages: int = 64, seed: int = 0) -> None:
        self.model, self.page_size = lm.model, page_size
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(num_pages, page_size, lm.kv_cache_dtype, DEV)
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def inputs(self, chunks: dict[str, list[int]], width: int | None = None):
        ids, pos, slots, qlens = [], [], [], []
        for s, toks in chunks.items():
            table = self.tables.setdefault(s, [])
            start = self.lens.get(s, 0)
            for t in range(start, start + len(toks)):
                if t // self.page_size >= len(table):
                    table.append(self.free.pop())
                slots.append(table[t // self.page_size] * self.page_size + t % self.page_size)
            ids += toks
            pos += range(start, start + len(toks))
            qlens.append(len(toks))
            self.lens[s] = start + len(toks)
        width = width or max(len(self.tables[s]) for s in chunks)
        bt = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, s in enumerate(chunks):
            bt[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        qs = [0]
        for q in qlens:
            qs.append(qs[-1] + q)
        lens = [self.lens[s] for s in chunks]

        def d(x, dt):
            return torch.tensor(x, dtype=dt, device=DEV)

        md = AttentionMetadata(
            d(slots, torch.int64), bt.to(DEV), d(lens, torch.int32), d(qs, torch.int32),
            self.page_size, lens, qlens,
        )  # fmt: skip
        return d(ids, torch.int64), d(pos, torch.int64), md, qs

    @torch.inference_mode()
    def step(self, chunks: dict[str, list[int]], width: int | None = None) -> torch.Tensor:
        """fp32 logits of each sequence's last new token [B, V]."""
        ids, pos, md, qs = self.inputs(chunks, width)
        h = self.model(ids, pos, ForwardContext(md))
        return self.model.compute_logits(h[torch.tensor(qs[1:], device=DEV) - 1]).float()


@dataclass
class Kimi:
    lm: object  # bf16, the GPU path
    lm32: object  # fp32, the torch path: the reference
    floor: float  # max |log-prob| difference of the bf16 torch path against the reference
    tokens: list[list[int]]  # the reference's greedy tokens


def _use_kernels(lm, on: bool) -> None:
    """The Triton MLA kernels on or off (True: the kernel plan's backend on this GPU, else
    the torch one)."""
    for layer in lm.model.attention_layers():
        layer.use_backend(lm.kernel_plan.mla if on else TorchMLA)


def _prompts() -> list[list[int]]:
    return [[10 + (37 * i + 11 * j) % 240 for j in range(n)] for i, n in enumerate((5, 33, 17))]


def _greedy(lm, steps: int) -> list[list[int]]:
    drv, names = Driver(lm, seed=3), ["s0", "s1", "s2"]
    logits = drv.step(dict(zip(names, _prompts(), strict=True)))
    tokens: list[list[int]] = [[], [], []]
    for _ in range(steps):
        for t, n in zip(tokens, logits.argmax(-1).tolist(), strict=True):
            t.append(n)
        logits = drv.step({n: [t[-1]] for n, t in zip(names, tokens, strict=True)})
    return tokens


def _teacher_forced(lm, tokens: list[list[int]]) -> torch.Tensor:
    """Log-probs [steps + 1, 3, V]: the prompts in one batch, then batched decodes of `tokens`."""
    drv, names = Driver(lm, seed=3), ["s0", "s1", "s2"]
    out = [drv.step(dict(zip(names, _prompts(), strict=True)))]
    for k in range(len(tokens[0])):
        out.append(drv.step({n: [t[k]] for n, t in zip(names, tokens, strict=True)}))
    return torch.stack(out).log_softmax(-1)


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def kimi(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kimi") / "ckpt")
    write_checkpoint(path, "kimi-k2.5", "nvfp4-modelopt", shape=SHAPE, seed=1)
    lm = load_model(path, torch.bfloat16, DEV, kv_cache_dtype=request.param)
    attn = lm.model.attention_layers()
    assert all(a.fused_qkv_a_proj is not None and isinstance(a.backend, TritonMLA) for a in attn)
    lm32 = load_model(path, torch.float32, DEV, kv_cache_dtype=request.param)
    _use_kernels(lm32, False)
    tokens = _greedy(lm32, STEPS)
    ref = _teacher_forced(lm32, tokens)
    _use_kernels(lm, False)
    floor = float((_teacher_forced(lm, tokens) - ref).abs().max())
    _use_kernels(lm, True)
    print(f"\nkv={request.param}: bf16 torch path vs fp32 reference: {floor:.4f}")
    return Kimi(lm, lm32, floor, tokens)


def _check_close(ref: torch.Tensor, got: torch.Tensor, what: str, tol: float) -> None:
    """Log-probs of two bf16 runs: within `tol`, the same argmax unless the reference's top
    two are closer than 2 * tol."""
    ref, got = ref.log_softmax(-1), got.log_softmax(-1)
    diff = float((ref - got).abs().max())
    top2 = ref.topk(2, dim=-1).values
    agree = (ref.argmax(-1) == got.argmax(-1)) | ((top2[..., 0] - top2[..., 1]) < 2 * tol)
    print(f"  {what}: max |log-prob diff| {diff:.4f} (tolerance {tol:.4f})")
    assert diff <= tol and bool(agree.all()), (what, diff, tol)


def test_fused_path_matches_torch_path(kimi):
    """The kernel path as close to the fp32 reference as the bf16 torch path, and its free
    greedy run agrees with the reference's tokens as long as the bf16 torch run does."""
    ref = _teacher_forced(kimi.lm32, kimi.tokens)
    got = float((_teacher_forced(kimi.lm, kimi.tokens) - ref).abs().max())
    tol = 2 * kimi.floor + 0.02
    print(f"  fused bf16 vs fp32 reference: {got:.4f} (tolerance {tol:.4f})")
    assert got <= tol

    def agree(tokens: list[list[int]]) -> int:
        n = 0
        while n < STEPS and all(t[n] == r[n] for t, r in zip(tokens, kimi.tokens, strict=True)):
            n += 1
        return n

    fused = agree(_greedy(kimi.lm, STEPS))
    _use_kernels(kimi.lm, False)
    try:
        torch_bf16 = agree(_greedy(kimi.lm, STEPS))
    finally:
        _use_kernels(kimi.lm, True)
    print(f"  greedy steps equal to the reference: fused {fused}, torch bf16 {torch_bf16}")
    assert fused >= min(torch_bf16, STEPS // 2)


def test_graph_replay_matches_eager(kimi):
    """A CUDA graph of the decode forward (3 sequences), replayed with new inputs, against the
    eager forward with the same block-table width (so the same split count). Both drivers
    bind the same layer caches with the same page tables: each step writes the same rows."""
    lm, width = kimi.lm, 8  # static block-table width (128 tokens)
    drv_e, drv_g = Driver(lm, seed=5), Driver(lm, seed=5)
    names = ["a", "b", "c"]
    prompts = dict(zip(names, _prompts(), strict=True))
    first = drv_e.step(prompts)
    drv_g.step(prompts)
    shared: dict = {}
    for m in lm.model.modules():
        hook = getattr(m, "prepare_cuda_graph", None)
        if hook is not None and m is not lm.model:
            hook(len(names), width * drv_g.page_size, shared)
    ids, pos, md, _ = drv_g.inputs({n: [0] for n in names}, width)
    drv_g.lens = {n: v - 1 for n, v in drv_g.lens.items()}  # that was the capture's dry input
    model = lm.model
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(ids, pos, ForwardContext(md))  # warm-up (compilation, lazy state)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            hidden = model(ids, pos, ForwardContext(md))
    tokens = first.argmax(-1).tolist()
    for _ in range(12):
        chunk = {n: [t] for n, t in zip(names, tokens, strict=True)}
        want = drv_e.step(chunk, width)
        ids2, pos2, md2, _ = drv_g.inputs(chunk, width)
        for dst, src in (
            (ids, ids2), (pos, pos2), (md.slot_mapping, md2.slot_mapping),
            (md.block_tables, md2.block_tables), (md.seq_lens, md2.seq_lens),
        ):  # fmt: skip
            dst.copy_(src)
        graph.replay()
        with torch.inference_mode():
            got = model.compute_logits(hidden).float()
        _check_close(want, got, "graph vs eager", kimi.floor + 0.02)
        tokens = want.argmax(-1).tolist()


def test_mixed_batch_equals_separate_runs(kimi):
    """Decode of `a` next to the prefill of `b` in one step (decodes first, the runner's order,
    and the other order) against each request on its own; chunked prefill against one."""
    lm, width, tol = kimi.lm, 8, kimi.floor + 0.02
    pa, pb = _prompts()[1], _prompts()[2] * 3  # b: 51 tokens, several pages
    alone_a = Driver(lm, seed=7)
    la = alone_a.step({"a": pa}, width)
    tok = int(la.argmax())
    la2 = alone_a.step({"a": [tok]}, width)
    lb = Driver(lm, seed=8).step({"b": pb}, width)
    for order in (("a", "b"), ("b", "a")):
        mixed = Driver(lm, seed=9)
        mixed.step({"a": pa}, width)
        chunks = {"a": [tok], "b": pb}
        out = mixed.step({k: chunks[k] for k in order}, width)
        got = dict(zip(order, out, strict=True))
        _check_close(la2[0], got["a"], f"mixed {order}: decode row", tol)
        _check_close(lb[0], got["b"], f"mixed {order}: prefill row", tol)
    chunked = Driver(lm, seed=10)
    for lo in range(0, len(pb), 20):  # 20 + 20 + 11 over the cached context
        last = chunked.step({"b": pb[lo : lo + 20]}, width)
    _check_close(lb[0], last[0], "chunked prefill", tol)
