"""The Gluon MLA decode kernel (kernels/attention/mla_decode_gluon.py) on a Hopper GPU against the
fp32 torch reference ``mla_decode_ref``.

Oracle independence: the reference gathers the rows with torch indexing and runs a plain
fp32 softmax; the kernel streams TMA tiles through the block table with an online softmax
and a split-KV merge. Every unused cache row is NaN (tests/kernels/mla_cases.py), pages are
permuted and block-table entries past each sequence hold out-of-range ids, so any stray
read poisons the output.

The last test needs no GPU: it compiles both kernels for sm_90a on the host (Gluon kernels
cannot run under the interpreter) and checks shared memory, spills and the TMA/wgmma code.

    python3 -m pytest -q tests/gpu/test_gpu_mla_gluon.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moeserve.kernels.attention import mla_decode as md
from tests.kernels.mla_cases import check_split_slots, make_case, poison_workspace

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not _HOPPER, reason="needs an sm_90 (Hopper) GPU")

if _HOPPER:
    from moeserve.kernels.attention import mla_decode_gluon as mg

DEV = "cuda"
SM_SCALE = 0.1352
# bf16 output vs the fp32 reference: a few bf16 ulps of O(1) values, as the Triton tests.
ATOL = RTOL = 2e-2


def _case(seq_lens: list[int], heads: int, page_size: int = 64, seed: int = 0):
    q, cache, bt, seq, _ = make_case(seq_lens, heads, page_size, torch.bfloat16, seed)
    return q.to(DEV), cache.to(DEV), bt.to(DEV), seq.to(DEV)


def _reference(q, cache, bt, seq) -> torch.Tensor:
    ref = torch.empty(q.shape[0], q.shape[1], md.KV_LORA_RANK, device=DEV)
    return md.mla_decode_ref(q, cache, bt, seq, SM_SCALE, ref)


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, atol=ATOL, rtol=RTOL)


@needs_hopper
@pytest.mark.parametrize("heads", [8, 16, 64, 128])
@pytest.mark.parametrize("seq_lens", [[5000, 1000, 33, 0], [1]], ids=["mixed", "one"])
@pytest.mark.parametrize("num_splits", [None, 1, 7, 300])
def test_matches_reference(heads, seq_lens, num_splits):
    q, cache, bt, seq = _case(seq_lens, heads, seed=heads + len(seq_lens))
    assert mg.gluon_mla_supported(q, cache)
    out = torch.full((q.shape[0], heads, md.KV_LORA_RANK), float("nan"), device=DEV)
    out = out.bfloat16()
    mg.mla_decode_gluon(q, cache, bt, seq, SM_SCALE, out, num_splits=num_splits)
    ref = _reference(q, cache, bt, seq)
    _check(out, ref)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@needs_hopper
@pytest.mark.parametrize(
    "config",
    [mg.GluonMLAConfig(32, 4), mg.GluonMLAConfig(32, 3)] if _HOPPER else [],
    ids=lambda c: f"n{c.block_n}s{c.num_stages}",
)
def test_other_ring_geometries(config):
    q, cache, bt, seq = _case([5000, 1000, 33, 0], 64, seed=11)
    out = torch.empty(q.shape[0], 64, md.KV_LORA_RANK, device=DEV, dtype=torch.bfloat16)
    mg.mla_decode_gluon(q, cache, bt, seq, SM_SCALE, out, num_splits=5, config=config)
    _check(out, _reference(q, cache, bt, seq))


@needs_hopper
@pytest.mark.parametrize("heads", [8, 16])
def test_padded_kernel_for_few_heads(heads):
    # Few heads normally take the tokens-on-M kernel; the 64-row kernel must serve them too.
    q, cache, bt, seq = _case([5000, 1000, 33, 0], heads, seed=31)
    out = torch.empty(q.shape[0], heads, md.KV_LORA_RANK, device=DEV, dtype=torch.bfloat16)
    config = mg.GluonMLAConfig(small_heads_max=0, small_max_tiles=0)
    mg.mla_decode_gluon(q, cache, bt, seq, SM_SCALE, out, num_splits=7, config=config)
    _check(out, _reference(q, cache, bt, seq))


@needs_hopper
@pytest.mark.parametrize("heads", [20, 64])
def test_few_head_kernel_on_several_head_blocks(heads):
    # 16-head blocks, the last one partly masked (20 heads).
    q, cache, bt, seq = _case([5000, 1000, 33, 0], heads, seed=41)
    out = torch.empty(q.shape[0], heads, md.KV_LORA_RANK, device=DEV, dtype=torch.bfloat16)
    config = mg.GluonMLAConfig(small_heads_max=heads)
    mg.mla_decode_gluon(q, cache, bt, seq, SM_SCALE, out, config=config)
    _check(out, _reference(q, cache, bt, seq))


@needs_hopper
def test_page_256_fp32_query_and_fp32_out():
    # Four tiles per page; a non-bf16 q is converted in the kernel, fp32 partials.
    q, cache, bt, seq = _case([700, 257, 64], 16, page_size=256, seed=3)
    q = q.float()
    out = torch.empty(q.shape[0], 16, md.KV_LORA_RANK, device=DEV)
    mg.mla_decode_gluon(q, cache, bt, seq, SM_SCALE, out, num_splits=3)
    _check(out, _reference(q, cache, bt, seq))


@needs_hopper
def test_graph_replay_reads_new_seq_lens_and_block_tables():
    heads, cap_pages = 64, 80
    q, cache, bt, seq = _case([5000, 1000, 33, 0], heads, seed=21)
    bt_static = torch.zeros(4, cap_pages, dtype=torch.int32, device=DEV)
    bt_static[:, : bt.shape[1]] = bt
    seq_static = seq.clone()
    ws = md.MLADecodeWorkspace.allocate(4, heads, 64, DEV)
    out = torch.empty(4, heads, md.KV_LORA_RANK, device=DEV, dtype=torch.bfloat16)

    def call():
        mg.mla_decode_gluon(q, cache, bt_static, seq_static, SM_SCALE, out, workspace=ws)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    # A second set of sequences on the same cache: other lengths, other (permuted) pages.
    _, cache2, bt2, seq2 = _case([33, 4500, 0, 1200], heads, seed=22)
    assert cache2.shape[0] <= cache.shape[0] and bt2.shape[1] <= cap_pages
    cache[: cache2.shape[0]].copy_(cache2)
    bt_static.zero_()
    bt_static[:, : bt2.shape[1]] = bt2
    seq_static.copy_(seq2)
    g.replay()
    torch.cuda.synchronize()
    _check(out, _reference(q, cache, bt_static, seq_static))


@needs_hopper
@pytest.mark.parametrize("few_heads", [True, False], ids=["few-head", "64-row"])
@pytest.mark.parametrize(
    ("min_split_tokens", "seq_lens", "active"),
    [
        # one 64-token tile per split (the default): empty, one full tile, one token, one
        # token past a tile, 10 tiles over 5 splits, 79 tiles over all 8
        (None, [0, 64, 1, 65, 640, 5000], [0, 1, 1, 2, 5, 8]),
        # four tiles: 256 tokens still one split, 257 two
        (256, [0, 256, 257, 64, 640, 5000], [0, 1, 2, 1, 3, 8]),
    ],
)
@pytest.mark.parametrize(
    ("out_dtype", "ws_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
     (torch.bfloat16, torch.float32)],
    ids=["bf16", "fp32-out", "fp32-partials"],
)  # fmt: skip
def test_one_split_sequences_write_out_and_skip_the_merge(
    few_heads, min_split_tokens, seq_lens, active, out_dtype, ws_dtype
):
    # NaN in out (every element must be written) and in the caller's workspace (a slot the
    # merge reads but no split wrote poisons the output; a slot written that should not be
    # stays visible). Mixed out / partial dtypes take the kernels' two-store epilogue.
    heads, splits = (16, 8) if few_heads else (64, 8)
    config = mg.GluonMLAConfig(min_split_tokens=min_split_tokens)
    if not few_heads:
        config = mg.GluonMLAConfig(
            small_heads_max=0, small_max_tiles=0, min_split_tokens=min_split_tokens
        )
    tiles = config.min_tiles()
    assert [md.active_splits(n, splits, config.block_n, tiles) for n in seq_lens] == active
    q, cache, bt, seq = _case(seq_lens, heads, seed=51)
    ws = md.MLADecodeWorkspace.allocate(len(seq_lens), heads, splits, DEV, ws_dtype)
    poison_workspace(ws)
    out = torch.full((len(seq_lens), heads, md.KV_LORA_RANK), float("nan"), device=DEV)
    out = out.to(out_dtype)
    mg.mla_decode_gluon(
        q, cache, bt, seq, SM_SCALE, out, num_splits=splits, workspace=ws, config=config
    )
    _check(out, _reference(q, cache, bt, seq))
    for b, (n, a) in enumerate(zip(seq_lens, active, strict=True)):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
        check_split_slots(ws, b, heads, a)


@needs_hopper
def test_unsupported_inputs_keep_triton():
    q, cache, _, _ = _case([100], 16, page_size=16)
    assert not mg.gluon_mla_supported(q, cache)  # page 16 < the 64-token tile
    q, cache, _, _ = _case([100], 16)
    assert not mg.gluon_mla_supported(q, cache.to(torch.float8_e4m3fn))
    assert not mg.gluon_mla_supported(q.cpu(), cache.cpu())


_OFFLINE_COMPILE = r"""
import json, re, subprocess, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from moeserve.kernels.attention import mla_decode_gluon as mg

def build(small, direct):
    fn = mg._mla_decode_gluon_small_kernel if small else mg._mla_decode_gluon_kernel
    lat, pe = mg._descriptors(torch.empty(4, 64, 576, dtype=torch.bfloat16), 64)
    const = dict(BLOCK_H=16 if small else 64, BLOCK_N=64, D_LAT=512, D_ROPE=64, NUM_STAGES=2,
                 DIRECT_OUT=direct, MIN_SPLIT_TILES=1,
                 num_warps=mg.SMALL_NUM_WARPS if small else mg.NUM_WARPS)
    if not small:
        const["BF16_OUT"] = True
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in const: sig[n] = "constexpr"
        elif n == "lat_desc": sig[n] = mangle_type(lat)
        elif n == "pe_desc": sig[n] = mangle_type(pe)
        elif n in ("bt_ptr", "seq_lens_ptr"): sig[n] = "*i32"
        elif n == "pl_ptr": sig[n] = "*fp32"
        elif n.endswith("_ptr"): sig[n] = "*bf16"
        elif n == "qk_scale": sig[n] = "fp32"
        else: sig[n] = "i32"
    aligned = [n for n in names if sig[n].startswith("*") or n.startswith("stride")]
    src = GluonASTSource(fn=fn, signature=sig,
                         constexprs={(names.index(k),): v for k, v in const.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": const["num_warps"]})
    ptx = k.asm["ptx"]
    with open("k.ptx", "w") as f:
        f.write(ptx)
    log = subprocess.run([get_ptxas(90).path, "--gpu-name=sm_90a", "-v", "k.ptx", "-o", "k.cubin"],
                         capture_output=True, text=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", log)
    return dict(shared=k.metadata.shared, spill_bytes=int(spill.group(1)) if spill else -1,
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                v4_stores=len(re.findall(r"st\.global\.v4", ptx)))

print(json.dumps({f"{s}-{d}": build(s, d) for s in (False, True) for d in (False, True)}))
"""


# ptxas spills one register (4 bytes) of the 64-row kernel when it writes `out` directly
# (one split); more than a few would mean the 128-register accumulator no longer fits.
MAX_SPILL_BYTES = 8


def test_kernels_compile_for_sm90_offline(tmp_path):
    """No GPU needed. Both kernels fit the 227 KB of shared memory an sm_90 block may use,
    ptxas spills at most MAX_SPILL_BYTES, the KV tiles arrive by TMA and both products are
    wgmma (the 64-row kernel: 36 k-steps of q @ k^T + 4 of p @ v; the few-head one: 36 +
    32), and the outputs leave as 16-byte stores."""
    pytest.importorskip("triton.experimental.gluon")
    from moeserve.kernels.attention import mla_decode_gluon as mg_host

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _OFFLINE_COMPILE], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    expected_wgmma = {False: 36 + 4, True: 36 + 32}
    for key, r in res.items():
        small = key.startswith("True")
        assert r["shared"] <= mg_host.SMEM_LIMIT_BYTES, (key, r)
        assert 0 <= r["spill_bytes"] <= MAX_SPILL_BYTES, (key, r)
        assert r["wgmma"] == expected_wgmma[small], (key, r)
        assert r["tma"] >= 2, (key, r)
        assert r["v4_stores"] > 0, (key, r)
