"""All of fusegraph's options, with their defaults, in one frozen dataclass.

Options reach fusegraph three ways, in increasing precedence:

1. the defaults below,
2. ``torch.compile(model, backend="fusegraph", options={...})``,
3. ``FUSEGRAPH_<NAME>`` environment variables (so a deployment can be switched without code changes).

Settings are flat (one environment variable per field). A group of fields sharing a prefix listed in
``NESTED_GROUPS`` may also be passed as a nested dict, ``options={"llm": {"url": u, "model": m}}`` being
``{"llm_url": u, "llm_model": m}``: that is the spelling issue #6 promises, and it flattens to the same fields.

Unknown option names are an error that lists the valid ones: a misspelt option silently ignored is the most
common complaint about compiler backends (Torch-TensorRT #688), so fusegraph refuses it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

log = logging.getLogger(__name__)

ENV_PREFIX = "FUSEGRAPH_"


class FusegraphOptionError(ValueError):
    """An option name or value fusegraph does not accept."""


TARGETS: tuple[str, ...] = ("trn2", "trn3")
DEFAULT_TARGET = "trn2"
"""fusegraph's one default target (``Settings.target``, every CLI ``--target``, ``fusegraph.api``), passed to the
interpreter explicitly on every run. Why trn2: the generation nki-library and the hand-written Qwen3 megakernel were
measured on (its README: "trn2, trn3"; GPT-OSS: trn3 only, in progress), the one every modeled table of the docs
is stated for. The interpreter's own fallback when no target is given at all stays trn3 (``nki.simulate``'s:
"otherwise defaults to trn3", nki_simulator.rst of SDK 2.29): it serves kernels run by hand, never fusegraph."""


def _opt(default: Any, doc: str, choices: tuple[Any, ...] | None = None, *, ge: float | None = None,
         gt: float | None = None, multiple_of: int | None = None) -> Any:
    """One Settings field: its default, its user documentation and what values it accepts (``choices``, a lower
    bound ``ge``/``gt``, ``multiple_of``). Why declarative: the checks, the error message naming the option and the
    documentation come from one place, so a bound that would break codegen can not be forgotten in one of them."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "multiple_of": multiple_of}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed in Settings")
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Settings:
    """Every knob of fusegraph. Field docs are the user documentation (``fusegraph options`` prints them)."""

    executor: str = _opt(
        "auto",
        "Who runs the captured step: 'eager' (ATen ops through PyTorch), 'nkisim' (generated NKI kernels in "
        "fusegraph's CPU interpreter), 'neuron' (real Trainium through torch-neuronx; needs the Neuron SDK), or "
        "'auto' (neuron when importable, else nkisim).",
        ("auto", "eager", "nkisim", "neuron"),
    )
    target: str = _opt(DEFAULT_TARGET, "Trainium generation the kernels are generated and checked for.", TARGETS)
    dryrun: bool = _opt(
        False,
        "Capture, match and form regions, then stop before codegen; the step runs eagerly and the report is "
        "still produced (like Torch-TensorRT's dryrun).",
    )
    report: str = _opt("", "Path of a JSON fused-region report written after each compile ('' = none).")
    capture_rewrites: bool = _opt(
        True,
        "Substitute known graph-break-causing module implementations (e.g. HF eager MoE expert loops) by "
        "mathematically equal traceable ones while fusegraph traces.",
    )
    reuse_layer_traces: bool = _opt(
        True,
        "With capture_rewrites: trace one HF decoder layer (static cache) and let dynamo reuse the trace for every "
        "identical layer (nested compile regions, inlined again before lowering); the program is unchanged, "
        "capture of deep models is ~2x faster.",
    )
    pass_through_build_failures: bool = _opt(
        False,
        "Raise capture/codegen errors instead of warning and falling back to the eager path (for debugging).",
    )

    # ---- LLM kernel writer (docs/llm.md); also accepted nested as options={"llm": {"url": ..., "model": ...}}
    llm_url: str = _opt(
        "",
        "OpenAI-compatible endpoint of the LLM kernel writer for regions nothing else lowers, e.g. "
        "'http://localhost:8000/v1' (vLLM, TGI, llama.cpp server). '' = the writer is off. Needs llm_model too.",
    )
    llm_model: str = _opt("", "Model name sent to the LLM endpoint (also part of the kernel cache key).")
    llm_max_rounds: int = _opt(
        2, "Repair rounds after the first answer: a rejected kernel's concrete error is sent back this many times.",
        ge=0,
    )
    llm_timeout_s: float = _opt(
        120.0, "Total deadline of one chat request to the LLM endpoint (connect, headers and body together; an "
        "endpoint that trickles its answer is cut off), in seconds.", gt=0)
    llm_max_tokens: int = _opt(4096, "Completion token limit of one chat request.", ge=1)
    llm_run_timeout_s: float = _opt(
        60.0, "Wall-clock limit of one verification run of an LLM-written kernel (separate process), in seconds.",
        gt=0,
    )
    llm_run_memory_mb: int = _opt(4096, "Address-space limit of the verification process, in MiB.", ge=1)
    llm_cache_dir: str = _opt(
        "", "Directory of accepted LLM-written kernels ('' = $XDG_CACHE_HOME/fusegraph/llm-kernels or ~/.cache/...)."
    )
    llm_experience: bool = _opt(
        True, "Keep every LLM conversation (answers, the errors sent back, the corrected kernel) under "
        "<llm_cache_dir>/experience for `fusegraph export-sft --experience` (fine-tuning / RL data).",
    )
    verify: bool = _opt(
        True,
        "On a kernel's first call, also run its region's ATen ops eagerly on the same inputs and compare; on a "
        "mismatch warn (naming the region) and run that region eagerly from then on.",
    )
    verify_tolerance: float = _opt(
        1e-4,
        "Largest accepted |kernel - eager| relative to the largest |eager| value of each output (fp32; bf16 "
        "outputs get 2e-2, the bf16 rounding step).",
        ge=0,
    )
    dump_dir: str = _opt("", "Write each generated kernel's NKI source to this directory, named by region ('' = no dump).")
    cache_dir: str = _opt(
        "",
        "On-disk cache of generated kernels, keyed by region structure, shapes, dtypes, target, the codegen "
        "options and the hashes of the patterns/templates used; a private directory (0700, refused when another "
        "user owns it or can write it), every entry authenticated on load with a per-user HMAC key kept outside "
        "it (~/.config/fusegraph/cache.key) ('' = $XDG_CACHE_HOME/fusegraph/kernels or ~/.cache/fusegraph/kernels; "
        "'off' disables it).",
    )
    weight_buffers: int = _opt(
        4, "SBUF ring buffers weight chunks stream through (DMAs are issued this many chunks minus one ahead).", ge=2)
    weight_chunk_kib: int = _opt(16, "Target size of one streamed weight chunk, in KiB per partition.", ge=1)
    sbuf_budget: int = _opt(
        0, "Usable SBUF bytes per partition (0 = the target's SBUF minus a 16 KiB reserve).", ge=0)
    generic_lowering: bool = _opt(
        True,
        "Lower ops no pattern covers (a custom activation or norm on the hidden state's own layout; any other op, "
        "any shape, on the tensor path: docs/codegen.md), and the ops of a pattern whose lowering fails, so they "
        "join the surrounding region's kernel instead of splitting it.",
    )
    lnc: int = _opt(
        1,
        "Logical NeuronCore config of the kernel launch: 2 splits projections, kv heads and MoE experts between the "
        "two physical cores of a logical core (halves exchanged with sendrecv), 1 runs on one core.",
        (1, 2),
    )
    # ---- decode attention templates (patterns/attention/lowering.py, docs/serving.md); part of the kernel cache key;
    # also accepted nested as options={"attn": {"pipeline": False, ...}}
    attn_stream_above: int = _opt(
        1024,
        "Static caches longer than this many positions use the streamed (flash-decoding) attention template; up to "
        "it the single-pass template keeps the whole score row in SBUF.",
        ge=0,
    )
    attn_block_max: int = _opt(
        8192, "Largest streamed attention block the modeled choice considers, in cache positions (one K and one V DMA "
        "per block and kv head).", ge=128, multiple_of=128,
    )
    attn_block: int = _opt(
        0, "Force the streamed attention's block to this many cache positions (the largest multiple of 128 up to it "
        "that fits); 0: the block the cost model's closed form puts fastest among those that fit SBUF and PSUM.",
        ge=0, multiple_of=128,
    )
    attn_paged_block_max: int = _opt(
        512, "Largest streamed block of paged attention, in positions (a block is read whole, so a smaller one reads "
        "fewer positions past a sequence's end).", ge=128, multiple_of=128,
    )
    attn_stream_scratch_kib: int = _opt(
        0, "Largest SBUF scratch per partition one streamed attention block may take, in KiB; 0: what the SBUF "
        "budget leaves after the weight ring and a 16 KiB reserve.", ge=0,
    )
    attn_pipeline: bool = _opt(
        True, "Software-pipeline the streamed block loop: block k's scores are computed while block k - 1's softmax "
        "and P.V run (caches a multiple of the block, not paged).",
    )
    attn_prefetch: bool = _opt(
        True, "Read sequence 0's first streamed block at the start of the layer, before its KV write (read again "
        "after it only when this step's row falls in it; position-bounded, head split, not paged).",
    )
    attn_kt_by_dma: bool = _opt(
        False, "Take K^T of a streamed block by an indirect dma_transpose instead of Tensor-engine transposes "
        "(2-byte caches, heads of at most 128, head split, not paged); off: modeled slower when DMA-bound.",
    )
    attn_row_groups: int = _opt(
        0, "Row groups sharing a streamed score tile (a core with few query rows fills more partitions, each "
        "softmax instruction runs over Lb / groups columns): 0 the cost model's choice, N at most N, 1 off.",
        (0, 1, 2, 4),
    )
    # ---- matching and regions (names as in Torch-TensorRT where one exists) ----------------------------------
    min_region_size: int = _opt(
        5,
        "Fused regions with fewer ATen ops than this are dissolved and left to the fallback path (Torch-TensorRT's "
        "min_block_size); ignored with require_full_compilation.",
        ge=0,
    )
    fallback_ops: tuple[str, ...] = _opt(
        (),
        "ATen ops forced to the fallback path, never fused (Torch-TensorRT's torch_executed_ops), e.g. "
        "'aten.topk.default' or 'aten.topk' for every overload; comma-separated in the environment.",
    )
    require_full_compilation: bool = _opt(
        False,
        "Fuse the whole step into one region or nothing: if any op stays outside, warn and run the whole step on "
        "the fallback path (Torch-TensorRT's require_full_compilation).",
    )
    disabled_patterns: tuple[str, ...] = _opt(
        (),
        "Pattern names (globs allowed, e.g. 'mypkg.*') not to match; comma-separated in the environment.",
    )
    match_debug: str = _opt(
        "",
        "A pattern name or program node id (comma-separated for several): log why that pattern did not match, or "
        "why nothing matched at that node (first failing node/edge/check).",
    )

    def __post_init__(self) -> None:
        """``Settings(weight_buffers=1)`` (no :meth:`from_options`) is held to the same declared bounds."""
        for f in dataclasses.fields(self):
            problem = _range_problem(f, getattr(self, f.name))
            if problem:
                raise FusegraphOptionError(f"fusegraph option {f.name!r} must be {problem}; got {getattr(self, f.name)!r}")

    # ---- derived helpers -------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> "Settings":
        """Build settings from ``torch.compile`` options plus ``FUSEGRAPH_*`` environment overrides."""
        env = os.environ if env is None else env
        valid = cls.field_names()
        values: dict[str, Any] = {}
        for key, value in _flatten_nested(options or {}, valid).items():
            if key not in valid:
                raise FusegraphOptionError(
                    f"unknown fusegraph option {key!r}; valid options are: {', '.join(sorted(valid))}"
                )
            values[key] = _coerce(cls, key, value)
        for key in valid:
            raw = env.get(ENV_PREFIX + key.upper())
            if raw is None:
                continue
            coerced = _coerce(cls, key, raw)
            if key in values and values[key] != coerced:
                log.info("environment %s%s=%r overrides option %s=%r", ENV_PREFIX, key.upper(), raw, key, values[key])
            values[key] = coerced
        return cls(**values)

    def replace(self, **changes: Any) -> "Settings":
        for key in changes:
            if key not in self.field_names():
                raise FusegraphOptionError(f"unknown fusegraph option {key!r}")
        return dataclasses.replace(self, **{k: _coerce(type(self), k, v) for k, v in changes.items()})

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


NESTED_GROUPS: tuple[str, ...] = ("llm", "attn")
"""Option groups that may also be given as a nested dict: ``{"llm": {"url": u}}`` is ``{"llm_url": u}``."""


def _flatten_nested(options: Mapping[str, Any], valid: list[str]) -> dict[str, Any]:
    """Turn ``{"llm": {"url": ...}}`` into ``{"llm_url": ...}`` (the flat names are the env-overridable ones)."""
    out: dict[str, Any] = {}
    for key, value in dict(options).items():
        if key not in NESTED_GROUPS:
            out[key] = value
            continue
        if not isinstance(value, Mapping):
            raise FusegraphOptionError(f"fusegraph option {key!r} expects a dict such as {{'url': ..., 'model': ...}}")
        group = [name[len(key) + 1:] for name in valid if name.startswith(key + "_")]
        for sub, subvalue in value.items():
            flat = f"{key}_{sub}"
            if sub not in group:
                raise FusegraphOptionError(
                    f"unknown fusegraph option {key}.{sub}; valid {key} options are: {', '.join(sorted(group))}"
                )
            if flat in options:
                raise FusegraphOptionError(f"fusegraph option {flat!r} is given twice (as {flat} and {key}.{sub})")
            out[flat] = subvalue
    return out


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _coerce(cls: type, name: str, value: Any) -> Any:
    """Convert an option value (possibly an environment string) to the field's type and check choices."""
    f = _field(cls, name)
    hints = typing.get_type_hints(cls)
    kind = hints[name]
    try:
        if kind is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    value = True
                elif low in ("0", "false", "no", "off", ""):
                    value = False
                else:
                    raise ValueError(value)
            elif not isinstance(value, bool):
                raise ValueError(value)
        elif kind is int:
            value = _as_int(value)
        elif kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            value = float(value)
        elif kind is str:
            if value is None:
                value = ""
            if not isinstance(value, (str, os.PathLike)):
                raise ValueError(value)
            value = os.fspath(value)
        elif typing.get_origin(kind) is tuple:
            if isinstance(value, str):
                value = tuple(v.strip() for v in value.split(",") if v.strip())
            else:
                value = tuple(value)
    except (TypeError, ValueError):
        raise FusegraphOptionError(f"fusegraph option {name!r} expects {getattr(kind, '__name__', kind)}, got {value!r}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise FusegraphOptionError(f"fusegraph option {name!r} must be one of {', '.join(map(str, choices))}; got {value!r}")
    problem = _range_problem(f, value)
    if problem:
        raise FusegraphOptionError(f"fusegraph option {name!r} must be {problem}; got {value!r}")
    return value


def _as_int(value: Any) -> int:
    """An int option's value: an int, an integral float (``2.0``) or a decimal string. Why strict: ``int(2.9)``
    silently truncates, and an option the user did not get is worse than an error naming it."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(value)
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    raise ValueError(value)


def _range_problem(f: dataclasses.Field, value: Any) -> str:
    """What the field's declared bounds require that ``value`` lacks ('' when it is in range; NaN never is)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    ge, gt, mult = f.metadata.get("ge"), f.metadata.get("gt"), f.metadata.get("multiple_of")
    if ge is not None and not value >= ge:
        return f">= {ge}"
    if gt is not None and not value > gt:
        return f"> {gt}"
    if mult and value % mult:
        return f"a multiple of {mult}"
    return ""


def _bounds_doc(f: dataclasses.Field) -> str:
    """The accepted range as a sentence for the documentation ('' when unbounded)."""
    ge, gt, mult = f.metadata.get("ge"), f.metadata.get("gt"), f.metadata.get("multiple_of")
    parts = ([f">= {ge}"] if ge is not None else []) + ([f"> {gt}"] if gt is not None else []) + \
        ([f"a multiple of {mult}"] if mult else [])
    return f" Must be {', '.join(parts)}." if parts else ""


def describe_options(markdown: bool = False) -> str:
    """Every option, its default, its environment variable and what it does (text, or a markdown table)."""
    fields = dataclasses.fields(Settings)
    if markdown:
        rows = ["| option | default | environment | what it does |", "|---|---|---|---|"]
        for f in fields:
            choices = f.metadata.get("choices")
            doc = f.metadata["doc"] + (f" One of: {', '.join(f'`{c}`' for c in choices)}." if choices else "") + \
                _bounds_doc(f)
            rows.append(f"| `{f.name}` | `{f.default!r}` | `{ENV_PREFIX}{f.name.upper()}` | {doc} |")
        return "\n".join(rows)
    lines = []
    for f in fields:
        choices = f.metadata.get("choices")
        extra = f" (one of: {', '.join(map(str, choices))})" if choices else ""
        bounds = _bounds_doc(f)
        extra += f" ({bounds.strip().rstrip('.').lower()})" if bounds else ""
        lines.append(f"{f.name} = {f.default!r}{extra}\n    env {ENV_PREFIX}{f.name.upper()}\n    {f.metadata['doc']}")
    return "\n".join(lines)
