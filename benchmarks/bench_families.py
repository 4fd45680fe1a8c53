"""How far fusegraph gets on every causal-LM family of the installed transformers (tiny configs, random weights).

    python benchmarks/bench_families.py [--families Mistral,Phi3,...] [--steps 6] [--tied both|tied|untied]
        [--timeout 300] [--jobs 1] [--out bench-results/families.json]
    python benchmarks/bench_families.py --summarize bench-results/families.json   # table + summary of a run

The families are not a chosen list: :func:`fusegraph.models.families.discover` lists every class of
transformers' causal-LM auto mapping (deduplicated by class; ~185 in transformers 5.24), each with a ``kind``
(decoder, cross-attention decoder, encoder as decoder, multimodal) and a ``state`` (kv, hybrid, recurrent, own,
none), both derived from the class and its config (the rules are in that module's docstring). The target
population is ``target``: decoders with a KV cache (kv or hybrid). ``--families`` selects a subset (family
names, class names or model types).

Each (family, tied) runs in a fresh process (at most ``--timeout`` CPU seconds each, default 300; a
wall-clock backstop of ``--wall-factor`` times that) under
:func:`fusegraph.models.families.build_case`: the family's config class defaults shrunk to tiny sizes (hidden
256, 2 layers or the fewest holding every layer kind, 8 experts top-2, ...), random weights (seed 0), MoE
routers spread, embeddings tied or not (``tie_word_embeddings``), the prompt prefilled eagerly into a
``StaticCache`` (or the family's own cache where it takes no StaticCache: the ``cache`` column), one eager
decode step tried. Then ``--steps`` greedy steps (default 6: the first, verified against eager by fusegraph,
and 5 more) run compiled with the ``fusegraph`` backend (interpreter executor) and eagerly on a copy.

Columns: ``built`` (yes, or "cannot build tiny: <reason>": the installed transformers rejects the tiny config,
the model or its eager decode), ``tokens_equal`` (every step's greedy token equal to eager's), ``max_rel_err``
(worst logit difference over the logit scale), ``launches`` (kernel launches in the latest step), ``one_kernel``
(one launch per step, every region run by the kernel, no op of the step left to eager PyTorch and no graph
refused), ``coverage`` (the report's: of the decoder layers' ops, those that RAN in kernels; a refused graph's
ops count as uncovered), ``first_reason`` (when not one kernel with eager's tokens: the first fusegraph warning
of the run, else the first refused graph, region decision or eager op; one line), ``reason_class`` (its class,
:data:`REASON_CLASSES`), ``seconds`` (the child's build + compile + run). The summary gives the one-kernel-and-
equal-tokens counts over all families and over the target population, tied and untied, and a histogram of the
reason classes. Rows go to ``--out`` as JSON (``bench-results/families.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table, run_isolated_partial, write_json  # noqa: E402

PARTIAL_ENV = "FUSEGRAPH_BENCH_PARTIAL"

#: (class, pattern over first_reason): the first that matches names the failure class of a row (the histogram)
REASON_CLASSES: list[tuple[str, str]] = [
    ("build: transformers cannot build tiny", r"^cannot build tiny"),
    ("timeout (CPU limit)", r"^timeout"),
    ("crash (process died)", r"^crash"),
    ("tokens differ from eager", r"^tokens differ"),
    ("capture refusal", r"refus(ed|es) (the |this )?graph|graph \d+: .*running it eagerly|capture failed"),
    ("router", r"router|top-?k|topk|expert"),
    ("attention variant", r"attention|softcap|sink|alibi|sliding|window|rotary|rope|score|mask"),
    ("non-KV state (recurrent / conv / SSM)", r"recurrent|mamba|ssm|conv|linear.attention|state"),
    ("dimension / layout", r"partition|layout|dimension|shape|divisib|multiple of|PSUM|SBUF|budget|stride|head_dim"),
    ("non-per-token values", r"scalar|one-element|parameter|per-token|reduction over|cumsum|position"),
    ("complex values", r"complex"),
    ("error", r"^error"),
]


def classify_reason(reason: str | None) -> str:
    if not reason:
        return ""
    for name, pattern in REASON_CLASSES:
        if re.search(pattern, reason, re.I):
            return name
    return "other"


def _partial(row: dict) -> None:
    path = os.environ.get(PARTIAL_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(row, f)


def _one_line(text: str, n: int = 300) -> str:
    return " ".join(str(text).split())[:n]


def measure(family: str, steps: str = "6", tied: str = "0") -> dict:
    """One (family, tied) row (module docstring). Runs in a fresh process."""
    import warnings

    import torch

    from fusegraph import FusegraphWarning
    from fusegraph.capture.session import last_session
    from fusegraph.models import greedy_decode
    from fusegraph.models import families as F
    from fusegraph.report import report_for_session

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    fam = F.find(family)
    row: dict = {"family": fam.name, "class": fam.class_name, "kind": fam.kind, "kind_rule": fam.kind_rule,
                 "tied": tied == "1"}
    try:  # the state from the tiny config, else the default one: known even when the model cannot be built
        cfg = F.tiny_config(fam)
    except Exception:  # noqa: BLE001
        cfg = F._default_config(fam.model_class.config_class)
    row["state"] = F.state_of(fam.model_class, cfg) if cfg is not None else "unknown"
    row["target"] = fam.kind == "decoder" and row["state"] in ("kv", "hybrid", "unknown")
    _partial(row)
    try:
        case = F.build_case(fam, tied=tied == "1")
    except Exception as e:  # noqa: BLE001 - a family this transformers cannot build tiny is listed as such
        reason = str(e) if isinstance(e, F.TinyBuildError) else f"{type(e).__name__}: {e}"
        return {**row, "built": f"cannot build tiny: {_one_line(reason, 240)}",
                "first_reason": f"cannot build tiny: {_one_line(reason)}", "seconds": round(time.perf_counter() - t0, 1)}
    cfg_text = case.model.config.get_text_config(decoder=True)
    row.update(built="yes", state=case.state, target=fam.kind == "decoder" and case.state in ("kv", "hybrid"),
               cache=case.cache_kind, params=F.param_count(case.model), layer_kinds=sorted(set(F.layer_types(cfg_text))),
               layers=getattr(cfg_text, "num_hidden_layers", None))
    _partial(row)
    ref = case.fork()
    n = int(steps)
    step = torch.compile(case.step, backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    error = None
    toks: list = []
    logits: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            toks, logits = greedy_decode(step, case.token, case.position, n)
        except Exception as e:  # noqa: BLE001 - a compile or run error is a row, not the end of the sweep
            error = f"error: {type(e).__name__}: {_one_line(e, 240)}"
    fg_warnings = [_one_line(w.message, 400) for w in caught if issubclass(w.category, FusegraphWarning)]
    toks_e, logits_e = greedy_decode(ref.step, ref.token, ref.position, n)
    row["warnings"] = list(dict.fromkeys(fg_warnings))
    if error is not None:
        session = last_session()
        return {**row, "one_kernel": False, "tokens_equal": False, "first_reason": error,
                "first_warning": fg_warnings[0] if fg_warnings else None, "seconds": round(time.perf_counter() - t0, 1)}
    equal = [torch.equal(a, b) for a, b in zip(toks, toks_e)]
    row["tokens_equal"] = all(equal) and len(equal) == n
    row["first_diff_step"] = equal.index(False) if not all(equal) else None
    row["max_rel_err"] = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                             for a, b in zip(logits, logits_e))
    session = last_session()
    if session is None:
        return {**row, "one_kernel": False, "launches": 0, "coverage": 0.0,
                "first_reason": fg_warnings[0] if fg_warnings else "no graph of the step reached fusegraph",
                "seconds": round(time.perf_counter() - t0, 1)}
    report = report_for_session(session).data
    regions = report.get("regions", [])
    eager_regions = [r for r in regions if r.get("executed_by", "eager") == "eager"]
    row.update(
        launches=report.get("kernel_launches_per_step", 0),
        regions=len(regions), regions_eager=len(eager_regions),
        eager_segments=report.get("eager_segments"), refused_graphs=len(session.refusals),
        versions=len(session.superseded) + 1,
        coverage=round(report.get("coverage", 0.0), 4), coverage_basis=report.get("coverage_basis"),
        executed_by=",".join(sorted({r.get("executed_by", "eager") for r in regions})) or "eager",
    )
    row["one_kernel"] = (row["launches"] == 1 and not eager_regions and not session.refusals
                         and not report.get("eager_segments"))
    # the raw material of the next design step, whatever the first reason is: refused graphs, regions run
    # eagerly, the refusing region decisions (not a match that lost an overlap to a bigger one: that is how
    # every step's matches are chosen), and the ops outside every region (op, count, module, reason)
    row["refusals"] = [_one_line(r.reason) for r in session.refusals][:5]
    row["eager_regions"] = [f"region {r['id']} ({r.get('kind', '')}): {r.get('verification') or 'eager'}"
                            for r in eager_regions][:5]
    row["refusing_decisions"] = [f"{d['action']} {d['subject']}: {_one_line(d['reason'])}"
                                 for d in _refusing(report)][:5]
    row["eager_ops"] = [{"op": u["op"], "count": u["count"], "module": u.get("module"), "reason": _one_line(u["reason"])}
                        for u in _eager_ops(report)][:10]
    row["first_reason"] = (None if row["one_kernel"] and row["tokens_equal"] else _first_reason(row, fg_warnings))
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


_REFUSING = ("refuse_match", "refuse_merge", "dissolve", "fallback", "refuse_break", "require_full")
_LOST_OVERLAP = re.compile(r"^overlaps .*, which wins on ")
_BENIGN_EAGER = re.compile(r"^(no-op|constant op|folded layout op|host arithmetic on Python numbers)")


def _refusing(report: dict) -> list[dict]:
    return [d for d in report.get("decisions", [])
            if d["action"] in _REFUSING and not _LOST_OVERLAP.match(d.get("reason", ""))]


def _eager_ops(report: dict) -> list[dict]:
    """The report's ops outside every region, those with a reason first (no-ops and constants last)."""
    ops = report.get("unmatched", [])
    return [u for u in ops if not _BENIGN_EAGER.match(u["reason"])] + \
        [u for u in ops if _BENIGN_EAGER.match(u["reason"])]


def _first_reason(row: dict, fg_warnings: list[str]) -> str:
    """Why this step is not one kernel with eager's tokens, in one line: with one kernel, the tokens; else the
    first applicable of a fusegraph warning, a refused graph, a region run eagerly, an op outside every region
    (with the matcher's reason: the closest pattern, or the refused match and why), a refusing region decision,
    the tokens, the launch count."""
    if row.get("one_kernel") and not row.get("tokens_equal"):
        return f"tokens differ from eager at step {row.get('first_diff_step')} (max rel err {row.get('max_rel_err'):.3g})"
    if fg_warnings:
        return fg_warnings[0]
    if row.get("refusals"):
        return f"graph refused: {row['refusals'][0]}"
    if row.get("eager_regions"):
        return f"{row['eager_regions'][0]} ran eagerly"
    if row.get("eager_ops"):
        u = row["eager_ops"][0]
        return f"eager {u['op']} x{u['count']} ({u.get('module') or '-'}): {u['reason']}"
    if row.get("refusing_decisions"):
        return row["refusing_decisions"][0]
    if not row.get("tokens_equal", True):
        return f"tokens differ from eager at step {row.get('first_diff_step')} (max rel err {row.get('max_rel_err'):.3g})"
    if row.get("launches", 0) != 1:
        return f"{row.get('launches')} kernel launches per step (no warning, refusal or eager op names why)"
    return "not one kernel (no warning, refusal or eager op names why)"


COLUMNS = [("family", "family"), ("kind", "kind"), ("state", "state"), ("tied", "tied"), ("built", "built"),
           ("cache", "cache"), ("tokens_equal", "tokens = eager"), ("max_rel_err", "max rel err"),
           ("launches", "launches/step"), ("one_kernel", "one kernel"), ("coverage", "coverage"),
           ("reason_class", "class"), ("first_reason", "first reason"), ("seconds", "s")]


def _fmt_row(r: dict) -> dict:
    out = dict(r)
    out["built"] = "yes" if r.get("built") == "yes" else "no" if r.get("built") else ""
    out["cache"] = (r.get("cache") or "")[:24]
    out["first_reason"] = _one_line(r.get("first_reason") or "", 110)
    out["reason_class"] = classify_reason(r.get("first_reason"))
    return out


def summary(rows: list[dict]) -> list[str]:
    """The summary lines: one kernel with eager's tokens over all families and the target population (tied and
    untied), what could not be built, and the histogram of reason classes."""
    def good(r: dict) -> bool:
        return bool(r.get("one_kernel")) and bool(r.get("tokens_equal"))

    lines = []
    for label, pick in (("all families", lambda r: True), ("decoder-only with a KV cache", lambda r: r.get("target"))):
        parts = []
        for tied in (True, False):
            sel = [r for r in rows if r.get("tied") == tied and pick(r)]
            if sel:
                parts.append(f"{sum(map(good, sel))}/{len(sel)} ({'tied' if tied else 'untied'})")
        lines.append(f"one kernel per step and eager's tokens, {label}: " + ", ".join(parts))
    for tied in (True, False):
        sel = [r for r in rows if r.get("tied") == tied]
        if sel:
            built = sum(1 for r in sel if r.get("built") == "yes")
            lines.append(f"built tiny ({'tied' if tied else 'untied'}): {built}/{len(sel)}; "
                         f"tokens equal eager: {sum(1 for r in sel if r.get('tokens_equal'))}/{built}")
    hist = Counter(classify_reason(r.get("first_reason")) for r in rows if r.get("first_reason"))
    target = Counter(classify_reason(r.get("first_reason")) for r in rows if r.get("first_reason") and r.get("target"))
    lines.append("first reason by class (rows; rows of the target population):")
    for name, count in hist.most_common():
        lines.append(f"  {count:4d}  {target.get(name, 0):4d}  {name}")
    return lines


def _classes(rows: list[dict]) -> None:
    for r in rows:
        r["reason_class"] = classify_reason(r.get("first_reason"))


def report(rows: list[dict]) -> None:
    _classes(rows)
    print_table([_fmt_row(r) for r in rows], COLUMNS)
    print()
    for line in summary(rows):
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help="comma-separated family / class names or model types "
                                                    "(default: every discovered family)")
    ap.add_argument("--steps", default="6", help="greedy steps (>= 6: the verified first one and 5 more)")
    ap.add_argument("--tied", choices=("both", "tied", "untied"), default="both",
                    help="embeddings tied to the lm head, untied, or each family both ways (default)")
    ap.add_argument("--timeout", type=int, default=300,
                    help="CPU seconds per (family, tied) process (RLIMIT_CPU: the same on a loaded machine)")
    ap.add_argument("--wall-factor", type=int, default=6,
                    help="wall-clock backstop per process: this many times --timeout (default 6)")
    ap.add_argument("--jobs", type=int, default=1, help="processes at a time (default 1)")
    ap.add_argument("--out", default="bench-results/families.json")
    ap.add_argument("--summarize", metavar="JSON", help="print the table and summary of an earlier run and exit")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            report(json.load(f))
        return
    from fusegraph.models.families import discover, find

    fams = discover()
    names = [find(n.strip(), fams).name for n in args.families.split(",") if n.strip()] or [f.name for f in fams]
    by_name = {f.name: f for f in fams}
    ties = {"both": ("1", "0"), "tied": ("1",), "untied": ("0",)}[args.tied]
    todo = [(fam, tied) for fam in names for tied in ties]
    rows: list[dict] = []
    t_all = time.perf_counter()

    def run_one(fam: str, tied: str) -> dict:
        t = time.perf_counter()
        base = {"family": fam, "class": by_name[fam].class_name, "kind": by_name[fam].kind, "tied": tied == "1"}
        r = run_isolated_partial("bench_families", "measure", fam, args.steps, tied, cpu_limit=args.timeout,
                                 timeout=args.timeout * args.wall_factor, partial_env=PARTIAL_ENV)
        r = {**base, **r}
        if r.get("failure"):  # timeout or a dead process: what the child had recorded, and why it stopped
            r["first_reason"] = r["failure"]
            r.setdefault("one_kernel", False)
        r["wall_seconds"] = round(time.perf_counter() - t, 1)
        return r

    if args.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [(fam, tied, pool.submit(run_one, fam, tied)) for fam, tied in todo]
            for i, (fam, tied, fut) in enumerate(futures):
                rows.append(fut.result())
                print(f"[{i + 1}/{len(todo)}] {fam}{' (tied)' if tied == '1' else ''}: done", file=sys.stderr)
                write_json(args.out, rows, quiet=True)
    else:
        for i, (fam, tied) in enumerate(todo):
            rows.append(run_one(fam, tied))
            r = rows[-1]
            print(f"[{i + 1}/{len(todo)}] {fam}{' (tied)' if tied == '1' else ''}: "
                  f"{'one kernel' if r.get('one_kernel') else _one_line(r.get('first_reason') or '', 120)} "
                  f"({r['wall_seconds']} s)", file=sys.stderr, flush=True)
            write_json(args.out, rows, quiet=True)  # a partial sweep is readable while it runs
    report(rows)
    print(f"sweep wall time: {time.perf_counter() - t_all:.0f} s for {len(todo)} processes")
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
