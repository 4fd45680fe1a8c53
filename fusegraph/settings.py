"""All of fusegraph's options, with their defaults, in one frozen dataclass.

Options reach fusegraph three ways, in increasing precedence:

1. the defaults below,
2. ``torch.compile(model, backend="fusegraph", options={...})``,
3. ``FUSEGRAPH_<NAME>`` environment variables (so a deployment can be switched without code changes).

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
    pass_through_build_failures: bool = _opt(
        False,
        "Raise capture/codegen errors instead of warning and falling back to the eager path (for debugging).",
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
        for key, value in dict(options or {}).items():
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
