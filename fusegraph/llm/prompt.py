"""The chat prompt: rules, the region as torch code with its tensor interface, the NKI facts it needs, examples.

Kept short on purpose: a model fine-tuned on ``fusegraph export-sft`` data has seen this exact layout (the SFT
user turns are :func:`task_message`), and a general model does better with the handful of API facts a region
needs than with the whole API. Facts are chosen from the reference code's vocabulary; their signatures come
from the API tables (:mod:`.facts`). Examples are few-shot chat turns from the template library.
"""
from __future__ import annotations

import hashlib
import json
from importlib import resources

import torch

from . import facts
from .examples import Example, prompt_example
from .task import KernelTask, TensorSpec

SYSTEM_TEMPLATE = """You write NKI kernels for AWS Trainium (NKI 0.3, Neuron SDK 2.29) that replace one region of a \
PyTorch model. Your kernel is parsed, checked against the official NKI API tables and a Python allow-list, run in an \
NKI simulator on random and edge-case inputs, and compared with the PyTorch reference; any difference rejects it.

{rules}
Answer with the complete kernel file in one ```python code block."""

REPAIR_TEMPLATE = """Your kernel was rejected ({stage}):
{detail}

Fix it and answer with the complete corrected kernel file in one ```python code block."""

NO_CODE_DETAIL = "the answer contains no ```python code block with an @nki.jit kernel"

BASE_FACTS = ("nki.language.ndarray", "nki.isa.dma_copy", "nki.isa.tensor_copy", "nki.isa.tensor_tensor",
              "nki.isa.tensor_scalar", "nki.isa.activation")
KEYWORD_FACTS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("matmul", "linear", "@", "bmm", "einsum", ".mm(", "addmm"), ("nki.isa.nc_matmul", "nki.isa.nc_transpose")),
    (("sum(", "mean(", "max(", "min(", "amax", "softmax", "norm", "var(", "logsumexp"), ("nki.isa.tensor_reduce",)),
    (("softmax", "/", "div", "reciprocal"), ("nki.isa.reciprocal",)),
    (("topk", "argmax", "argsort", "sort("), ("nki.isa.max8", "nki.isa.nc_find_index8")),
    (("where", "masked_fill", "tril", "triu", "arange", "causal"),
     ("nki.isa.iota", "nki.isa.affine_select", "nki.isa.tensor_copy_predicated")),
    (("zeros", "fill", "cumsum", "+="), ("nki.isa.memset",)),
    (("transpose", "permute", ".t()", ".mt"), ("nki.isa.nc_transpose", "nki.isa.dma_transpose")),
    (("[",), ("nki.language.ds",)),
)
EXAMPLE_KEYWORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("linear", ("matmul", "linear", "@", "bmm", "einsum", ".mm(", "addmm")),
    ("rmsnorm", ("rsqrt", "norm", "mean(", "var(")),
)
MAX_EXAMPLES = 2
LNC_NOTE = ("The kernel is launched as `{name}[2](...)` (LNC=2): its body runs as two programs, one per physical "
            "core, with `nl.program_id(0)` 0 and 1 (`nl.num_programs(0)` is 2). Inputs and `nl.shared_hbm` outputs "
            "are shared by both programs (each allocates the same outputs and returns them); SBUF and PSUM are "
            "private. Split the work so each program computes its own part of the outputs.")
LNC_FACTS = ("nki.language.program_id", "nki.language.num_programs")


def rules_text() -> str:
    return resources.files("fusegraph.llm").joinpath("rules.md").read_text("utf-8")


def _version() -> str:
    h = hashlib.sha256()
    for part in (rules_text(), SYSTEM_TEMPLATE, REPAIR_TEMPLATE, json.dumps(facts.NOTES, sort_keys=True),
                 json.dumps([BASE_FACTS, KEYWORD_FACTS, EXAMPLE_KEYWORDS], sort_keys=True), LNC_NOTE,
                 json.dumps(LNC_FACTS)):
        h.update(part.encode())
    return "1." + h.hexdigest()[:10]


PROMPT_VERSION = _version()
"""Changes whenever the rules, templates, facts or example choice change (part of the kernel cache key)."""


def needed_facts(reference_source: str) -> list[str]:
    """API functions the region probably needs, from the vocabulary of its torch reference."""
    text = reference_source.lower()
    out = list(BASE_FACTS)
    for words, names in KEYWORD_FACTS:
        if any(w in text for w in words):
            out += [n for n in names if n not in out]
    return out


def pick_examples(task: KernelTask, limit: int = MAX_EXAMPLES) -> list[Example]:
    """One or two template-library examples close to the region (the gated activation when nothing matches)."""
    text = task.reference_source.lower()
    kinds = [kind for kind, words in EXAMPLE_KEYWORDS if any(w in text for w in words)] or ["gated_act"]
    return [prompt_example(k) for k in kinds[:limit]]


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _dt(spec: TensorSpec) -> str:
    return str(spec.kernel_dtype).replace("torch.", "")


def _input_line(s: TensorSpec) -> str:
    line = f"- `{s.name}`: {_dt(s)} {_shape(s.shape)}"
    if s.dtype == torch.int64:
        line += " (int64 in the reference)"
    if s.fixed is not None:
        line += ", a constant"
    elif s.index and s.value_range:
        line += f", indices in [{int(s.value_range[0])}, {int(s.value_range[1])})"
    elif s.value_range:
        line += f", values in [{s.value_range[0]:g}, {s.value_range[1]:g}]"
    if s.description:
        line += f" — {s.description}"
    return line


def _output_line(s: TensorSpec) -> str:
    if s.alias_of:
        return f"- `{s.name}`: the input `{s.alias_of}`, written in place and returned"
    line = f"- `{s.name}`: {_dt(s)} {_shape(s.shape)}, a new nl.shared_hbm tensor"
    return line + (f" — {s.description}" if s.description else "")


def task_message(task: KernelTask) -> str:
    """The user turn describing one region (identical in the writer's prompt and in the SFT data)."""
    head = f"Region `{task.name}`" + (f" of {task.model}" if task.model else "")
    if task.context:
        head += f": {task.context}"
    params = ", ".join(s.name for s in task.inputs)
    lines = [head + ".", "", "PyTorch reference:", "```python", task.reference_source.rstrip(), "```", "",
             "Kernel interface (every input is an HBM tensor).", "Inputs, in parameter order:"]
    lines += [_input_line(s) for s in task.inputs]
    lines += ["Outputs, returned in this order:"]
    lines += [_output_line(s) for s in task.outputs]
    lines += ["", "NKI API you will probably need (valid in NKI 0.3.0 and 0.6.0; pass arguments by keyword):"]
    lnc = getattr(task, "lnc", 1)
    for q in needed_facts(task.reference_source) + (list(LNC_FACTS) if lnc == 2 else []):
        f = facts.fact(q)
        lines.append(f"- `{f.signature}`: {f.short}")
    lines += ["", f"Write `@nki.jit def {task.kernel_name}({params})`."]
    if lnc == 2:
        lines += [LNC_NOTE.format(name=task.kernel_name)]
    return "\n".join(lines)


def system_message() -> str:
    return SYSTEM_TEMPLATE.format(rules=rules_text())


def answer_message(source: str) -> str:
    """How a kernel is written as an assistant turn (few-shot examples and SFT targets)."""
    return f"```python\n{source.rstrip()}\n```"


def build_messages(task: KernelTask, examples: list[Example] | None = None) -> list[dict[str, str]]:
    """System, few-shot example turns, then the task."""
    msgs = [{"role": "system", "content": system_message()}]
    for ex in pick_examples(task) if examples is None else examples:
        msgs.append({"role": "user", "content": task_message(ex.task)})
        msgs.append({"role": "assistant", "content": answer_message(ex.source)})
    msgs.append({"role": "user", "content": task_message(task)})
    return msgs


def repair_message(stage: str, detail: str, limit: int = 4000) -> str:
    """The user turn that sends a rejection back: the stage and the concrete error text."""
    if len(detail) > limit:
        detail = detail[:limit] + "\n[... truncated]"
    return REPAIR_TEMPLATE.format(stage=stage, detail=detail)
