"""The inputs of a replayed decode step, on a CPU (stand-in graphs that run the captured
forward eagerly, as a replay would on a GPU):

- a step that replays a graph is packed on the host with its padding columns and copied in
  one piece into the graphs' static buffer (its other index lists after them, the int32
  ones in int32), and its page-table entries land where they belong;
- placeholder ids (-1-j: row j's greedy token of the previous step) are resolved inside the
  captured forward from a persistent device buffer: over a run of decode steps of changing
  batch sizes and orders, with known ids mixed in, tokens left by another kind of step (the
  buffer is then refreshed before the replay) and a step too long for the static buffer,
  the logits and tokens equal the eager path's, whose ids the test resolves on the host by
  the rule itself;
- the replay's logits and greedy tokens are computed by the captured forward (its static
  logits buffer); a replayed step with logits for some rows only runs its LM head after it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from moeserve.engine.cuda_graphs import DecodeGraphs, padded_size
from moeserve.engine.offline import LLM
from moeserve.engine.runner import ModelRunner
from moeserve.engine.step import StepInput
from moeserve.testing.checkpoints import write_checkpoint

PAGE = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return write_checkpoint(
        str(tmp_path_factory.mktemp("gi") / "kimi"), "kimi-k2.5", "nvfp4-modelopt", seed=4
    ).path


def _runner(path: str) -> ModelRunner:
    llm = LLM(
        path, device="cpu", dtype="float32", max_model_len=128, page_size=PAGE,
        max_num_seqs=8, num_pages=256,
    )  # fmt: skip
    return llm.engine.runner


class _StandIn:
    """Replays by running the captured forward again on the static inputs (what a graph
    does)."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.outputs[self.size] = self.graphs._run_forward(self.size)


def _with_graphs(runner: ModelRunner, max_batch: int) -> DecodeGraphs:
    """The runner's decode graphs, replayed by stand-ins."""
    g = runner.capture.target_graphs(max_batch)
    g.allocate_inputs()
    for size in g.sizes:
        g.graphs[size] = _StandIn(g, size)  # type: ignore[assignment]
    runner.capture.graphs = g
    # the CPU attention loops over host-side lengths, which a captured graph cannot carry
    # (on a GPU the kernels read the device's): give it those of the device tensor
    decode_metadata = runner.pages.decode_metadata

    def metadata(positions, rows, seq_lens):
        md = decode_metadata(positions, rows, seq_lens)
        return replace(md, seq_lens_host=seq_lens.tolist())

    runner.pages.decode_metadata = metadata  # type: ignore[method-assign]
    return g


class _Seqs:
    """Sequences in page-table rows of their own, on pages of their own; steps over them
    built as the engine does."""

    def __init__(self, rows: list[int], first_page: int) -> None:
        self.rows = rows
        self.pages: dict[int, list[int]] = {r: [] for r in rows}
        self.lens = dict.fromkeys(rows, 0)
        self.next_page = first_page

    def _grow(self, row: int, pages: int, updates: list[int]) -> None:
        new = list(range(self.next_page, self.next_page + pages))
        self.next_page += pages
        updates += [row, len(self.pages[row]), pages, *new]
        self.pages[row] += new

    def prefill(self, prompts: list[list[int]]) -> StepInput:
        step = StepInput([], [], [], [], [])
        for row, p in zip(self.rows, prompts, strict=True):
            start = self.lens[row] = self.lens[row] + len(p)
            step.ids.extend(p)
            step.positions.extend(range(start - len(p), start))
            step.rows.append(row)
            step.seq_lens.append(start)
            step.query_lens.append(len(p))
            self._grow(row, -(-start // PAGE) - len(self.pages[row]), step.page_updates)
            step.logit_rows.append(len(step.ids) - 1)
        return step

    def decode(self, seqs: list[int], ids: list[int], reserve: int = 0) -> StepInput:
        """One token for each of sequences `seqs` (in that order); `reserve`: pages more
        for each (as the scheduler reserves them for drafts)."""
        step = StepInput([], [], [], [], [])
        for s, token in zip(seqs, ids, strict=True):
            row = self.rows[s]
            self.lens[row] += 1
            step.ids.append(token)
            step.positions.append(self.lens[row] - 1)
            step.rows.append(row)
            step.seq_lens.append(self.lens[row])
            step.query_lens.append(1)
            more = -(-self.lens[row] // PAGE) - len(self.pages[row]) + reserve
            if more > 0:
                self._grow(row, more, step.page_updates)
        step.logit_rows = list(range(len(seqs)))
        return step


def _old_rule(ids: list[int], src: list[int]) -> list[int]:
    """Placeholder -1-j is row j's token of the previous greedy step."""
    return [src[-1 - i] if i < 0 else i for i in ids]


def test_replayed_decode_with_placeholders_equals_the_eager_path(kimi):
    runner = _runner(kimi)
    g = _with_graphs(runner, 4)
    limit = runner.vocab_limit
    staged: list[bool] = []
    tensors = runner.tensors

    def spy(step: StepInput, graph_size: int | None = None):
        st = tensors(step, graph_size)
        if graph_size is not None:
            staged.append(st.staged)
        return st

    runner.tensors = spy  # type: ignore[method-assign]
    # the same three sequences twice: replayed (greedy, placeholder ids) and eager (the ids
    # resolved by the test), each in rows and pages of its own
    replayed, eager = _Seqs([0, 1, 2], 0), _Seqs([3, 4, 5], 128)
    la = runner.execute_model(replace(replayed.prefill(PROMPTS), greedy=True))
    lb = runner.execute_model(eager.prefill(PROMPTS))
    torch.testing.assert_close(la, lb)
    known = lb[:, :limit].argmax(-1).tolist()  # each sequence's next token
    slot = {s: s for s in range(3)}  # sequence -> its row in the latest greedy step
    # batches of 3, 3, 2, 3, 1, 3 sequences (padded to 4, 4, 2, 4, 1, 4), in changing orders
    plan = [[0, 1, 2], [2, 0, 1], [1, 2], [2, 1, 0], [0], [1, 0, 2]]
    for k, seqs in enumerate(plan):
        if k == 3:  # another step's greedy tokens (a draft's): reversed rows, not held yet
            src = runner.tokens.latest
            flipped = torch.full((len(src), runner.vocab_size), -1.0)
            flipped[torch.arange(len(src)), src.flip(0)] = 1.0
            runner.sampler.greedy_on_device(flipped)
            slot = {s: len(src) - 1 - j for s, j in slot.items()}
        ids = [-1 - slot[s] if s in slot else known[s] for s in seqs]
        assert any(i < 0 for i in ids)
        src = runner.tokens.latest.tolist()
        want_ids = _old_rule(ids, src)
        assert want_ids == [known[s] for s in seqs]
        # k == 4: a whole table row appended, too long for the room after the static inputs
        reserve = runner.max_pages_per_seq - len(replayed.pages[seqs[0]]) if k == 4 else 0
        la = runner.execute_model(replace(replayed.decode(seqs, ids, reserve), greedy=True))
        lb = runner.execute_model(replace(eager.decode(seqs, want_ids, reserve), eager=True))
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
        # the graph read the placeholders themselves: resolved inside the captured forward
        assert g.inputs_of(padded_size(len(seqs), g.sizes))[0, : len(seqs)].tolist() == ids
        # the logits and greedy tokens came from the captured forward too
        assert la.data_ptr() == runner.capture.logits.data_ptr()
        tokens = la[:, :limit].argmax(-1).tolist()
        assert tokens == lb[:, :limit].argmax(-1).tolist()
        assert runner.tokens.latest.tolist() == tokens
        assert runner.tokens.graph[: len(tokens)].tolist() == tokens  # for the next replay
        for j, s in enumerate(seqs):
            known[s] = tokens[j]
        slot = {s: j for j, s in enumerate(seqs)}
    assert g.replays == Counter({4: 4, 2: 1, 1: 1})  # every decode step of `replayed`
    assert staged == [True, True, True, True, False, True]
    # the eager rerun of the latest step (profiling) takes the tokens that step was given
    rerun = replace(replayed.decode([1, 0, 2], [-1 - slot[s] for s in (1, 0, 2)]), greedy=True)
    first = runner.execute_model(rerun).clone()
    again = runner.execute_model(replace(rerun, eager=True, greedy=False))
    torch.testing.assert_close(again, first, rtol=1e-4, atol=1e-4)
    # a replayed step with logits for some rows only: its LM head runs on those rows
    tokens = first[:, :limit].argmax(-1).tolist()
    some = replace(replayed.decode([1, 0, 2], tokens), logit_rows=[0, 2])
    la = runner.execute_model(some)
    assert la.shape == (2, runner.vocab_size) and la.data_ptr() != runner.capture.logits.data_ptr()
    lb = runner.execute_model(replace(some, eager=True))  # the same step again, eagerly
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)


def test_a_replayed_step_is_packed_with_its_padding_columns(kimi):
    runner = _runner(kimi)
    assert runner.graphs is None and runner.tokens.graph_holds is None  # CPU: no graphs
    g = _with_graphs(runner, 8)
    pad = runner.max_rows
    four = StepInput(
        ids=[3, 4, 5, 6], positions=[1, 2, 3, 4], rows=[0, 1, 2, 3], seq_lens=[2, 3, 4, 5],
        query_lens=[1] * 4, logit_rows=[0, 1, 2, 3],
    )  # fmt: skip
    st = runner.tensors(four, 4)
    assert st.staged and st.packed.data_ptr() == g.staged.data_ptr()
    three = StepInput(
        ids=[-1, 7, -3], positions=[4, 9, 2], rows=[5, 1, 6], seq_lens=[5, 10, 3],
        query_lens=[1] * 3, page_updates=[1, 2, 1, 17, 6, 0, 2, 30, 31], logit_rows=[2, 0],
    )  # fmt: skip
    st = runner.tensors(three, 4)
    assert st.staged and st.packed.data_ptr() == g.staged.data_ptr()
    # what the graph of 4 reads: the step, then a padding column (the 4-step's is gone)
    assert g.inputs_of(4).tolist() == [
        [-1, 7, -3, 0],
        [4, 9, 2, 0],
        [5, 1, 6, pad],
        [5, 10, 3, 0],
    ]
    assert st.ids.tolist() == [-1, 7, -3] and st.seq_lens.tolist() == [5, 10, 3]
    assert st.logit_rows.tolist() == [2, 0] and st.query_lens.tolist() == [1, 1, 1]
    assert st.query_start.dtype == torch.int32 and st.query_start.tolist() == [0, 1, 2, 3]
    assert st.hidden_rows.numel() == 0 and st.embed_rows.numel() == 0
    assert runner.pages.table[1, 2] == 17 and runner.pages.table[6, :2].tolist() == [30, 31]
    assert runner.pages.table.dtype == torch.int32
    assert int(runner.pages.table.count_nonzero()) == 3  # nothing else written
    # an eager step keeps its lists unpadded, the first four one [4, B] block (what the
    # draft model's graphs copy in), in a buffer of its own
    st = runner.tensors(replace(three, page_updates=[]))
    assert not st.staged
    assert st.packed[:12].view(4, 3).tolist() == [
        [-1, 7, -3],
        [4, 9, 2],
        [5, 1, 6],
        [5, 10, 3],
    ]
    assert st.query_start.tolist() == [0, 1, 2, 3] and st.logit_rows.tolist() == [2, 0]
