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
