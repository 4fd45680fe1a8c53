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


def _opt(default: Any, doc: str, choices: tuple[Any, ...] | None = None) -> Any:
    meta = {"doc": doc, "choices": choices}
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
    target: str = _opt("trn2", "Trainium generation the kernels are generated and checked for.", ("trn2", "trn3"))
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
        2, "Repair rounds after the first answer: a rejected kernel's concrete error is sent back this many times."
    )
    llm_timeout_s: float = _opt(120.0, "Timeout of one chat request to the LLM endpoint, in seconds.")
    llm_max_tokens: int = _opt(4096, "Completion token limit of one chat request.")
    llm_run_timeout_s: float = _opt(
        60.0, "Wall-clock limit of one verification run of an LLM-written kernel (separate process), in seconds."
    )
    llm_run_memory_mb: int = _opt(4096, "Address-space limit of the verification process, in MiB.")
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
    )
    dump_dir: str = _opt("", "Write each generated kernel's NKI source to this directory, named by region ('' = no dump).")
    cache_dir: str = _opt(
        "",
        "On-disk cache of generated kernels, keyed by region structure, shapes, dtypes, target and the hashes of "
        "the patterns/templates used; every entry carries a content hash checked on load ('' = "
        "$XDG_CACHE_HOME/fusegraph/kernels or ~/.cache/fusegraph/kernels; 'off' disables it).",
    )
    weight_buffers: int = _opt(4, "SBUF ring buffers weight chunks stream through (DMAs are issued this many chunks minus one ahead).")
    weight_chunk_kib: int = _opt(16, "Target size of one streamed weight chunk, in KiB per partition.")
    sbuf_budget: int = _opt(0, "Usable SBUF bytes per partition (0 = the target's SBUF minus a 16 KiB reserve).")
    generic_lowering: bool = _opt(
        True,
        "Lower unmatched elementwise chains and feature-axis reductions (a custom activation or norm) without a "
        "pattern, so they join the surrounding region instead of splitting it.",
    )
    lnc: int = _opt(
        1,
        "Logical NeuronCore config of the kernel launch: 2 splits projections, kv heads and MoE experts between the "
        "two physical cores of a logical core (halves exchanged with sendrecv), 1 runs on one core.",
        (1, 2),
    )
    # ---- matching and regions (names as in Torch-TensorRT where one exists) ----------------------------------
    min_region_size: int = _opt(
        5,
        "Fused regions with fewer ATen ops than this are dissolved and left to the fallback path (Torch-TensorRT's "
        "min_block_size); ignored with require_full_compilation.",
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


NESTED_GROUPS: tuple[str, ...] = ("llm",)
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
            if isinstance(value, bool):
                raise ValueError(value)
            value = int(value)
        elif kind is float:
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
    return value


def describe_options(markdown: bool = False) -> str:
    """Every option, its default, its environment variable and what it does (text, or a markdown table)."""
    fields = dataclasses.fields(Settings)
    if markdown:
        rows = ["| option | default | environment | what it does |", "|---|---|---|---|"]
        for f in fields:
            choices = f.metadata.get("choices")
            doc = f.metadata["doc"] + (f" One of: {', '.join(f'`{c}`' for c in choices)}." if choices else "")
            rows.append(f"| `{f.name}` | `{f.default!r}` | `{ENV_PREFIX}{f.name.upper()}` | {doc} |")
        return "\n".join(rows)
    lines = []
    for f in fields:
        choices = f.metadata.get("choices")
        extra = f" (one of: {', '.join(map(str, choices))})" if choices else ""
        lines.append(f"{f.name} = {f.default!r}{extra}\n    env {ENV_PREFIX}{f.name.upper()}\n    {f.metadata['doc']}")
    return "\n".join(lines)
