"""``fusegraph export-sft``: chat-format training data for an NKI kernel-writing model.

Two kinds of records, one JSON object per line (``{"messages": [...]}``, the format OpenAI-compatible
fine-tuning stacks take):

* **kernel examples** — system: the writer's system prompt; user: the region's torch reference with its tensor
  interface and API facts, exactly as :func:`fusegraph.llm.prompt.task_message` writes it at inference time;
  assistant: the template library's kernel in a fenced block. Every example is verified by the same harness
  that judges model output (separate process, all input cases, reference comparison) before it is written;
  one that fails is skipped and reported, never written.
* **API fact cards** — one per commonly used ``nki.isa``/``nki.language`` function: its signature generated from
  the API tables (parameters valid in 0.3.0 *and* 0.6.0) and a one-paragraph semantics note, plus one card on
  the 0.3 tensor views.

A side file ``OUT.meta.jsonl`` (same line order) holds what re-verification needs and training does not: the
kind, the input/output specs (constants by recipe) and the verification cases. :func:`reverify` reruns the
harness on the file's own text: the reference code from the user turn, the kernel from the assistant turn.

With ``experience`` (a directory of the writer's experience records, :mod:`.experience`) the export also writes
repair trajectories and per-answer reward records next to ``OUT.jsonl`` (:mod:`.trajectories`).
"""
from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import facts
from .examples import Example, load_reference, spec_from_json, sweep
from .extract import extract_code
from .harness import Limits, Verdict, verify
from .prompt import answer_message, system_message, task_message
from .task import KernelTask

log = logging.getLogger(__name__)

CARD_QUESTION = "What does `{name}` do in NKI 0.3 (Neuron SDK 2.29), and how is it called?"
CARD_FOOTER = "Pass every argument by keyword; the call is valid in NKI 0.3.0 and 0.6.0."
VIEWS_QUESTION = "Which tensor views and attributes can an NKI 0.3 kernel use?"


@dataclass
class ExportStats:
    path: str
    examples: int = 0
    cards: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    experience: Any = None  # trajectories.ExperienceStats when experience records were exported

    def summary(self) -> str:
        text = (f"wrote {self.examples} verified kernel example(s) and {self.cards} API fact card(s) to {self.path} "
                f"in {self.seconds:.1f} s")
        if self.skipped:
            text += f"; skipped {len(self.skipped)} that failed verification: " + "; ".join(
                f"{n} ({r})" for n, r in self.skipped)
        if self.experience is not None:
            text += "; " + self.experience.summary()
        return text


def kernel_record(ex: Example) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system_message()},
                         {"role": "user", "content": task_message(ex.task)},
                         {"role": "assistant", "content": answer_message(ex.source)}]}


def card_records() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(record, side-file line) for every fact card."""
    out = []
    system = system_message()
    for q in facts.card_functions():
        f = facts.fact(q)
        answer = f"```python\n{f.signature}\n```\n{f.note}\n{CARD_FOOTER}"
        rec = {"messages": [{"role": "system", "content": system},
                            {"role": "user", "content": CARD_QUESTION.format(name=facts.short_name(q))},
                            {"role": "assistant", "content": answer}]}
        out.append((rec, {"kind": "card", "function": q}))
    views = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": VIEWS_QUESTION},
                          {"role": "assistant", "content": facts.TENSOR_METHODS_NOTE}]}
    out.append((views, {"kind": "card", "function": None}))
    return out


def meta_path(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".meta.jsonl") if p.suffix != ".jsonl" else p.with_suffix(".meta.jsonl")


def export(path: str | Path, *, max_examples: int | None = None, seed: int = 0, sweep_name: str = "small",
           cards: bool = True, target: str = "trn2", limits: Limits = Limits(),
           experience: str | Path | None = None, include_benchmark: bool = False) -> ExportStats:
    """Verify and write the examples of a sweep (optionally shuffled by ``seed`` and capped) plus the fact cards;
    with ``experience``, also the repair trajectories and reward records of that directory's records
    (``llm-eval`` records only with ``include_benchmark``: they are the benchmark's test set)."""
    t0 = time.perf_counter()
    stats = ExportStats(str(path))
    examples = sweep(sweep_name)
    if seed:
        random.Random(seed).shuffle(examples)
    if max_examples is not None:
        examples = examples[: max(0, max_examples)]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out, open(meta_path(path), "w", encoding="utf-8") as side:
        for ex in examples:
            v = verify(ex.source, ex.task, target=target, limits=limits, seed=seed)
            if not v.ok:
                log.warning("export-sft: %s fails verification, skipped: %s", ex.task.name, v.reason)
                stats.skipped.append((ex.task.name, v.reason))
                continue
            out.write(json.dumps(kernel_record(ex), ensure_ascii=False) + "\n")
            side.write(json.dumps(dict(ex.meta, kind="kernel", example=ex.kind, target=target)) + "\n")
            stats.examples += 1
        if cards:
            for rec, meta in card_records():
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                side.write(json.dumps(meta) + "\n")
                stats.cards += 1
    if experience is not None:
        from .trajectories import export_experience

        stats.experience = export_experience(experience, path, limits=limits, seed=seed,
                                             include_benchmark=include_benchmark)
    stats.seconds = time.perf_counter() - t0
    return stats


_CODE = re.compile(r"```python\n(.*?)```", re.S)


def task_from_record(record: dict[str, Any], meta: dict[str, Any]) -> KernelTask:
    """Rebuild the task of an exported kernel example from the file's own text plus its side-file line."""
    user = next(m["content"] for m in record["messages"] if m["role"] == "user")
    ref_src = _CODE.search(user).group(1)
    return KernelTask(name=meta["name"], reference_source=ref_src, reference=load_reference(ref_src),
                      inputs=[spec_from_json(d) for d in meta["inputs"]],
                      outputs=[spec_from_json(d) for d in meta["outputs"]], context=meta.get("context", ""),
                      cases=tuple(meta.get("cases", ())))


def reverify(path: str | Path, *, seed: int = 0, limits: Limits = Limits()) -> list[tuple[int, str, Verdict]]:
    """Re-check every record of an exported file: ``[(line, kind, verdict)]``; kernels run in the harness again."""
    results = []
    with open(path, encoding="utf-8") as f, open(meta_path(path), encoding="utf-8") as side:
        for i, (line, mline) in enumerate(zip(f, side), start=1):
            record, meta = json.loads(line), json.loads(mline)
            roles = [m["role"] for m in record["messages"]]
            if roles != ["system", "user", "assistant"]:
                results.append((i, meta.get("kind", "?"), Verdict.fail("format", f"roles {roles}")))
                continue
            answer = record["messages"][2]["content"]
            if meta["kind"] == "card":
                results.append((i, "card", _check_card(meta.get("function"), answer)))
                continue
            code = extract_code(answer)
            if code is None:
                results.append((i, "kernel", Verdict.fail("extract", "no code block in the assistant turn")))
                continue
            task = task_from_record(record, meta)
            results.append((i, "kernel", verify(code, task, target=meta.get("target", "trn2"), limits=limits,
                                                 seed=seed)))
    return results


def _check_card(function: str | None, answer: str) -> Verdict:
    if function is None:
        return Verdict(True, "accepted", "tensor views card")
    try:
        sig = facts.signature(function)
    except KeyError as e:
        return Verdict.fail("card", str(e))
    if f"```python\n{sig}\n```" not in answer:
        return Verdict.fail("card", f"the card of {function} does not carry the table signature {sig}")
    return Verdict(True, "accepted", f"signature of {function} matches the API tables")
