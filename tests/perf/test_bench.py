"""The benchmark's tables for rows and like-for-like shards the pipeline refuses (no kernel, so no figures)."""
from fusegraph.modelperf.analysis import NotRun
from fusegraph.modelperf.bench import format_tables, not_run_row


def test_not_run_rows_and_shard_in_the_tables():
    nr = NotRun("qwen3-30b-a3b", "trn3", "codegen", "BudgetError: the kernel needs 275.4 KiB of SBUF", {
        "num_hidden_layers": 1})
    row = not_run_row(nr)
    assert row == {"model": "qwen3-30b-a3b", "target": "trn3", "status": "not run", "stage": "codegen",
                   "reason": nr.reason, "layers": 1}
    shard = {"model": "qwen3-30b-a3b", "target": "trn3", "cores": 8, "tp": 4, "lnc": 2, "status": "not run",
             "stage": "capture", "reason": "CodegenError: no fusible region was found"}
    text = format_tables({"rows": [row], "like_for_like": [shard]})
    lines = text.splitlines()
    assert sum(ln.startswith("qwen3-30b-a3b  trn3    not run: BudgetError: the kernel needs 275.4 KiB") for ln in lines) == 2
    at = next(i for i, ln in enumerate(lines) if ln.startswith("Like for like: qwen3-30b-a3b on trn3"))
    assert lines[at + 1] == "not run: CodegenError: no fusible region was found"
    # the reason spans the figure columns; it does not widen them
    assert lines[1].startswith("model          target  capture s  match s  codegen s  ")


def test_generic_pieces_are_ranked_by_the_modeled_time_they_expose():
    """ModelPerf.generic_by_cost: tensor-path ops (named by the kernel's own comments) summed over their kernel lines'
    exposed time, largest first, other lines (a pattern's attention) left out; the bench table prints them."""
    from types import SimpleNamespace

    from fusegraph.modelperf.analysis import ModelPerf

    src = ("    # aten.sort.default (t_sort) on the tensor path: ...\n"
           "    # aten.histc.default (t_hist) on the tensor path: ...\n")
    lines = [{"region": "t_sort", "exposed_s": 2e-6}, {"region": "t_hist", "exposed_s": 5e-6},
             {"region": "t_hist", "exposed_s": 1e-6}, {"region": "l0_attn", "exposed_s": 9e-6}]
    mk = SimpleNamespace(seconds=1e-4, to_dict=lambda lines=0: {"top_lines": list(lines_)})
    lines_ = lines
    perf = SimpleNamespace(build=SimpleNamespace(generated=SimpleNamespace(source=src)),
                           strategies=SimpleNamespace(megakernel=mk))
    got = ModelPerf.generic_by_cost(perf)
    assert [(g["region"], g["op"]) for g in got] == [("t_hist", "aten.histc.default"), ("t_sort", "aten.sort.default")]
    assert abs(got[0]["ms"] - 0.006) < 1e-12 and abs(got[0]["share"] - 0.06) < 1e-12
    row = {**not_run_row(NotRun("m", "trn3", "codegen", "x", {})), "generic_by_cost": got}
    text = format_tables({"rows": [row], "like_for_like": []})
    assert "m trn3: t_hist (aten.histc.default) 0.006 ms (6.0%); t_sort (aten.sort.default) 0.002 ms (2.0%)" in text
