"""The vocab-parallel embedding inside the TP megakernel (``patterns/vocab_parallel_embedding.py``,
``patterns/embedding/lowering.py: VocabParallelEmbed``, ``embed_vocab_parallel.j2``).

The lowering alone, in generated (conformance-checked) kernels run by the interpreter: each rank's lookup equals
DTensor's semantics (its own rows at ``id - start``, zero rows for every other id, whatever the id: another rank's,
negative, past the vocabulary), the interpreter's bounds check never fires (the row index is clamped), and the
ranks' rows summed (what the in-kernel all-reduce does) are the unsharded lookup. The pattern against the step
DTensor really captures (one rank on torch's fake process group, as ``tests/perf/test_tp_bench.py``). The 2-rank
decode step with it inside the kernel is ``test_tp_decode.py::test_two_ranks_hf_llama_and_parallelize_module``.
"""
from __future__ import annotations

import pytest
import torch

from fusegraph.patterns.embedding.lowering import VocabParallelEmbed, vocab_parallel_lookup
from fusegraph.codegen.testing import Builder

VOCAB, H, W = 1000, 256, 2
ROWS = VOCAB // W


def _dtensor_rows(full: torch.Tensor, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """What DTensor's ``_MaskPartial`` gives one rank, written from its definition on the *global* table."""
    out = torch.zeros(len(ids), full.shape[1], dtype=full.dtype)
    for t, i in enumerate(ids.tolist()):
        if start <= i < end:
            out[t] = full[i]
    return out


def _kernel(table: torch.Tensor, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    b = Builder(tokens=len(ids))
    b.tensors["ids"] = ids.to(torch.int32)
    t = b.hbm("table", table)
    y = b.new("y", table.shape[1], table.dtype)
    b.ins.append(VocabParallelEmbed(ids=b.ids, table=t, out=y, start=start, layer=None))
    b.store(y)
    gen, results, ref_env, _ = b.run()
    return results["out_y"], ref_env["y"], gen.source


# ids of this rank, of the other rank, at both edges of each range, negative and past the vocabulary
IDS = [[3, 700, 499], [500, 999, 0], [-1, 1000, 1 << 30], [7]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ids", IDS, ids=lambda i: "-".join(map(str, i)))
def test_each_rank_gets_its_rows_and_zeros_elsewhere(ids: list[int], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    full = torch.randn(VOCAB, H).to(dtype) + 3  # no zero entries: a row that should be zero cannot be by chance
    idt = torch.tensor(ids)
    summed = torch.zeros(len(ids), H, dtype=torch.float32)
    for rank in range(W):
        start, end = rank * ROWS, (rank + 1) * ROWS
        got, ref, src = _kernel(full[start:end].clone(), idt, start)
        want = _dtensor_rows(full, idt, start, end)
        assert torch.equal(got, want), (rank, ids)
        assert torch.equal(ref, want), (rank, ids)  # the reference VM (bisection) says the same
        summed += got.float()
        assert "tensor_copy_predicated" in src and "scalar_offset" in src
    inside = [(0 <= i < VOCAB) for i in ids]
    want_sum = torch.stack([full[i].float() if ok else torch.zeros(H) for i, ok in zip(ids, inside)])
    assert torch.equal(summed, want_sum)  # the all-reduce of the ranks' rows: the unsharded lookup, zero outside


def test_reference_lookup_is_dtensors_masked_lookup() -> None:
    """``vocab_parallel_lookup`` (the reference VM's) against DTensor's own steps on a local shard."""
    torch.manual_seed(1)
    table = torch.randn(ROWS, 8)
    ids = torch.tensor([0, 499, 500, 999, -3, 2000])
    for start in (0, ROWS):
        mask = (ids < start) | (ids >= start + ROWS)  # DTensor's _MaskPartial._mask_tensor, then apply_mask
        local = ids.clone() - start
        local[mask] = 0
        want = torch.nn.functional.embedding(local, table)
        want[mask, :] = 0.0
        assert torch.equal(vocab_parallel_lookup(table, ids, start), want)


class _MaskedLookup(torch.nn.Module):
    """Rank ``start // rows``'s half of a vocab-parallel embedding written as DTensor's ``_MaskPartial`` computes it
    (``masked[mask] = 0``, ``out[mask, :] = fill``), then a projection: one process, no collective."""

    def __init__(self, start: int = ROWS, fill: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(ROWS, H) + 3)
        self.proj = torch.nn.Linear(H, H, bias=False)
        self.start, self.end, self.fill = start, start + ROWS, fill

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids < self.start) | (ids >= self.end)
        local = ids.clone() - self.start
        local[mask] = 0
        out = torch.nn.functional.embedding(local, self.weight)
        out[mask, :] = self.fill
        return self.proj(out)


def _compiled(module: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object, list[str]]:
    import warnings

    import fusegraph

    step = torch.compile(module, backend="fusegraph", dynamic=False,
                         options={"cache_dir": "off", "executor": "nkisim"})
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = step(ids), module(ids)
    cap = fusegraph.last_capture()
    return got, want, cap, [str(w.message) for w in caught if issubclass(w.category, fusegraph.FusegraphWarning)]


def test_batch_of_three_runs_in_one_kernel_equal_to_eager() -> None:
    """Three tokens (one of this rank, two of the other, one at its range's last id): the masked lookup and the
    projection are one kernel launch, verified, bit-equal to eager; every op of the lookup is inside the kernel
    (DTensor's clone of the ids included)."""
    module = _MaskedLookup().eval()
    got, want, cap, warned = _compiled(module, torch.tensor([[3], [700], [999]]))
    assert warned == [] and torch.equal(got, want)
    record = cap.program.execution[0]
    (run,) = record.regions
    assert record.launches_per_call == 1 and run.runs_kernel and run.verification == "passed"
    G = cap.program.graph
    ops = {n for n, d in G.nodes(data=True) if d.get("kind") == "op"}
    outside = sorted(G.nodes[n]["op"] for n in ops - set(run.kernel_nodes))
    assert outside == [], outside


def test_an_id_past_int32_stays_out_of_range() -> None:
    """int64 ids reach the kernel as int32: 2^32 + 700 must not wrap to 700 (this rank's row 200) but saturate, out of
    every rank's range, so the kernel zeroes it as DTensor's masking does (else verification fails: eager path)."""
    module = _MaskedLookup().eval()
    got, want, cap, warned = _compiled(module, torch.tensor([[3], [2 ** 32 + 700], [999]]))
    assert warned == [] and torch.equal(got, want)
    assert cap.program.execution[0].regions[0].verification == "passed"


def test_a_masked_row_filled_with_anything_but_zero_is_refused() -> None:
    """The matcher does not compare lifted constants' values: the lowering's check does. A lookup that fills the
    masked rows with 1.0 is not DTensor's: the pattern is refused when regions form (the report says why, with
    generic lowering off), and its ops run in the kernel through generic lowering instead, equal to eager."""
    import fusegraph

    module = _MaskedLookup(fill=1.0).eval()
    ids = torch.tensor([[3], [700]])
    got, want, cap, warned = _compiled(module, ids)
    assert torch.equal(got, want) and warned == []
    record = cap.program.execution[0]
    assert record.launches_per_call == 1 and record.regions[0].verification == "passed"
    assert "fusegraph.vocab_parallel_embedding" not in fusegraph.explain(module, ids).to_dict()["pattern_counts"]
    report = fusegraph.explain(module, ids, options={"generic_lowering": False})
    reasons = {u["reason"] for u in report.to_dict()["unmatched"] if u["op"] == "aten.index_put.default"}
    assert any("writes 1.0 where DTensor writes 0" in r for r in reasons), reasons


def test_pattern_matches_the_step_dtensor_captures_on_a_rank() -> None:
    """Rank 1 of the tiny Llama at TP=2 (HF's tp_plan, torch's fake process group, meta device: the benchmark's
    capture, where the zeros are ``scalar_tensor`` ops): the match holds the whole masked lookup with the rank's
    vocabulary range, is lowerable, and nothing of the embedding is left unmatched."""
    from fusegraph.codegen import registry
    from fusegraph.matching import analyze
    from fusegraph.modelperf import tp

    cfg = tp.TPConfig("llama-tiny", "trn3", 2, 1, layers=1, cache_len=64)
    with tp.fake_rank(cfg.tp, rank=1):
        step, _ = tp.capture_rank(cfg)
        a = analyze(step.program, lowerable=registry.check)
    (m,) = [m for m in a.matches if m.pattern.name == "fusegraph.vocab_parallel_embedding"]
    assert (m.params["start"], m.params["end"]) == (ROWS, VOCAB)
    G = step.program.graph
    assert sorted(G.nodes[n]["op"].split(".")[1] for n in m.nodes) == [
        "bitwise_or", "embedding", "ge", "index_put", "index_put", "lt", "scalar_tensor", "scalar_tensor", "sub"]
    embed_unmatched = [u.op for u in a.unmatched if (u.to_dict().get("module") or "") == "model.embed_tokens"
                       and u.op not in ("aten.clone.default", "aten.view.default")]
    assert embed_unmatched == [], embed_unmatched
