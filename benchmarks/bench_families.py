"""How far fusegraph gets on HF decoder families beyond the bundled ones (tiny configs, random weights).

    python benchmarks/bench_families.py [--families Mistral,Phi3,...] [--steps 5] [--tied both|tied|untied]
        [--out bench-results/families.json]

Per family: greedy tokens equal to eager, worst logit error relative to the logit scale, kernel launches in the
latest step, the report's coverage (of what ran in kernels; a refused graph's ops count as uncovered), the
number of refused graphs, which executors ran its regions, how many versions of the step dynamo compiled, and the fusegraph
warnings (each names why a region stayed on the eager path). Each family runs in a fresh process, with untied
and with tied embeddings (``tie_word_embeddings``: the default of many small real models) unless ``--tied`` says.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, run_isolated, write_json  # noqa: E402

FAMILIES = ["Llama", "Qwen2", "Qwen3", "Qwen3Moe", "Mistral", "Mixtral", "Phi3", "Phi", "Gemma", "Gemma2", "Gemma3", "Olmo",
            "Olmo2", "Olmo3", "Granite", "SmolLM3", "Ministral", "Exaone4", "Qwen2Moe", "StableLm", "Starcoder2",
            "Apertus", "Arcee", "HunYuanDenseV1", "SeedOss", "Glm", "Cohere", "GptOss", "GPTNeoX", "Ernie4_5"]


def measure(family: str, steps: str = "5", tied: str = "0") -> dict:
    import time
    import warnings

    import torch

    from fusegraph import FusegraphWarning
    from fusegraph.capture.session import last_session
    from fusegraph.models import build_family_decode, greedy_decode
    from fusegraph.report import report_for_session

    torch.set_num_threads(2)
    row: dict = {"family": family, "tied": tied == "1"}
    try:
        case = build_family_decode(family, tie_word_embeddings=tied == "1")
    except Exception as e:  # noqa: BLE001 - a family this transformers cannot build tiny is reported, not fatal
        return {**row, "error": f"build: {type(e).__name__}: {str(e)[:160]}"}
    ref = case.fork()
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        toks, logits = greedy_decode(step, case.token, case.position, int(steps))
    seconds = time.perf_counter() - t0
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, int(steps))
    session = last_session()
    runs = list(session.program.execution.values()) if session else []
    return {
        **row,
        "tokens_equal": all(torch.equal(a, b) for a, b in zip(toks, toks_e)),
        "max_rel_err": max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(logits, logits_e)),
        "launches": sum(r.launches_per_call for r in runs),
        "executed_by": ",".join(sorted({e for r in runs for e in r.executed_by.values()})) or "eager",
        # of what ran in kernels; the ops of a graph fusegraph refused count as uncovered (docs/report.md)
        "coverage": round(report_for_session(session).coverage, 4) if session else 0.0,
        "refused_graphs": len(session.refusals) if session else 0,
        "versions": len(session.superseded) + 1 if session else 0,
        "seconds": round(seconds, 2),
        "warnings": sorted({str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--steps", default="5")
    ap.add_argument("--tied", choices=("both", "tied", "untied"), default="both",
                    help="embeddings tied to the lm head, untied, or each family both ways (default)")
    ap.add_argument("--out", default="bench-results/families.json")
    args = ap.parse_args()
    rows = []
    ties = {"both": ("0", "1"), "tied": ("1",), "untied": ("0",)}[args.tied]
    for fam, tied in [(f, t) for f in args.families.split(",") for t in ties]:
        try:
            r = run_isolated("bench_families", "measure", fam, args.steps, tied, timeout=600)
        except Exception as e:  # noqa: BLE001
            r = {"family": fam, "tied": tied == "1", "error": str(e).splitlines()[0][:160]}
        r["warnings_n"] = len(r.get("warnings", []))
        rows.append(r)
        print(f"{fam}{' (tied)' if tied == '1' else ''}: done", file=sys.stderr)
    print_table(rows, [("family", "family"), ("tied", "tied"), ("tokens_equal", "tokens = eager"), ("max_rel_err", "max rel err"),
                       ("launches", "launches/step"), ("coverage", "coverage"), ("refused_graphs", "refused"),
                       ("executed_by", "regions run by"), ("versions", "versions"),
                       ("warnings_n", "warnings"), ("seconds", "compile+run s"), ("error", "error")])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
