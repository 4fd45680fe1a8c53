"""Typed, cached access to the official NKI API tables bundled in ``fusegraph/nkiapi/data``.

The tables were generated from the official API stub files of the Neuron SDK (see the data
README in ``shared/nki``).  Everything that must agree with the official API surface (the
interpreter's signatures, the conformance checker used by codegen) reads them through this
module, so there is exactly one source of truth for names, parameter order and defaults.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Iterator

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.3.0", "0.6.0")
"""NKI versions with a bundled table: 0.3.0 (SDK 2.29, our target) and 0.6.0 (SDK 2.32)."""

MODULES: tuple[str, ...] = ("nki", "nki.language", "nki.isa", "nki.collectives")
"""Modules described by the tables."""

SDK_OF_VERSION: dict[str, str] = {"0.3.0": "2.29", "0.6.0": "2.32"}


@dataclass(frozen=True)
class Param:
    """One parameter of an official function, in declaration order."""

    name: str
    kind: str  # "positional_or_keyword", "var_keyword", "var_positional", "keyword_only"
    default: str | None = None  # the default as written in the stub (e.g. "oob_mode.error"); None = required

    @property
    def has_default(self) -> bool:
        return self.default is not None

    @property
    def is_variadic(self) -> bool:
        return self.kind in ("var_keyword", "var_positional")


@dataclass(frozen=True)
class FunctionSig:
    """Signature of one official function."""

    module: str
    name: str
    params: tuple[Param, ...]
    summary: str = ""

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def param(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if not p.is_variadic)

    @property
    def positional_params(self) -> tuple[Param, ...]:
        """Parameters that may be bound positionally, in order."""
        return tuple(p for p in self.params if p.kind == "positional_or_keyword")

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if not p.is_variadic and not p.has_default)

    @property
    def accepts_var_keyword(self) -> bool:
        return any(p.kind == "var_keyword" for p in self.params)


@dataclass(frozen=True)
class ClassInfo:
    """An official class: enums (``members``), plain classes, and instance-like namespaces."""

    module: str
    name: str
    bases: tuple[str, ...]
    members: tuple[str, ...]
    methods: tuple[str, ...]

    @property
    def is_enum(self) -> bool:
        return "Enum" in self.bases

    @property
    def attributes(self) -> frozenset[str]:
        return frozenset(self.members) | frozenset(self.methods)


@dataclass(frozen=True)
class ModuleTable:
    name: str
    functions: dict[str, FunctionSig]
    classes: dict[str, ClassInfo]
    names: frozenset[str]

    def has(self, attr: str) -> bool:
        return attr in self.functions or attr in self.classes or attr in self.names


def _instance_class_name(name: str) -> str:
    """``tile_size`` -> ``_TileSize``: how the 0.6 stubs name the class of a module-level instance."""
    return "_" + "".join(part.capitalize() for part in name.split("_") if part)


class ApiTable:
    """The official NKI API surface of one version."""

    def __init__(self, version: str, raw: dict):
        self.version = version
        self.source = raw.get("source", "")
        mods: dict[str, ModuleTable] = {}
        for mname, m in raw["modules"].items():
            funcs = {
                fname: FunctionSig(
                    module=mname,
                    name=fname,
                    params=tuple(
                        Param(p["name"], p["kind"], p.get("default")) for p in f.get("params", [])
                    ),
                    summary=f.get("summary", ""),
                )
                for fname, f in m.get("functions", {}).items()
            }
            classes = {
                cname: ClassInfo(
                    module=mname,
                    name=cname,
                    bases=tuple(c.get("bases", [])),
                    members=tuple(c.get("members", [])),
                    methods=tuple(c.get("methods", {}).keys()),
                )
                for cname, c in m.get("classes", {}).items()
            }
            mods[mname] = ModuleTable(mname, funcs, classes, frozenset(m.get("names", [])))
        self.modules = mods

    def __repr__(self) -> str:
        return f"ApiTable(version={self.version!r}, source={self.source!r})"

    @property
    def sdk(self) -> str:
        return SDK_OF_VERSION.get(self.version, "?")

    def module(self, name: str) -> ModuleTable | None:
        return self.modules.get(name)

    def has_module(self, name: str) -> bool:
        return name in self.modules

    def function(self, module: str, name: str) -> FunctionSig | None:
        m = self.modules.get(module)
        return m.functions.get(name) if m else None

    def functions(self, module: str) -> dict[str, FunctionSig]:
        m = self.modules.get(module)
        return dict(m.functions) if m else {}

    def iter_functions(self) -> Iterator[FunctionSig]:
        for m in self.modules.values():
            yield from m.functions.values()

    def cls(self, module: str, name: str) -> ClassInfo | None:
        m = self.modules.get(module)
        return m.classes.get(name) if m else None

    def enum(self, module: str, name: str) -> ClassInfo | None:
        c = self.cls(module, name)
        return c if c is not None and c.is_enum else None

    def enum_members(self, module: str, name: str) -> tuple[str, ...]:
        c = self.enum(module, name)
        return c.members if c else ()

    def names(self, module: str) -> frozenset[str]:
        m = self.modules.get(module)
        return m.names if m else frozenset()

    def has_attr(self, module: str, attr: str) -> bool:
        """True if ``module.attr`` is a function, class, module-level name or submodule."""
        m = self.modules.get(module)
        if m is None:
            return False
        return m.has(attr) or f"{module}.{attr}" in self.modules

    def attribute_namespace(self, module: str, attr: str) -> frozenset[str] | None:
        """The attributes reachable as ``module.attr.X`` (enum members, class constants, or the members of
        a module-level instance such as 0.6's ``tile_size``), or None when ``module.attr`` has no known
        attribute namespace."""
        c = self.cls(module, attr)
        if c is not None:
            return c.attributes
        if attr in self.names(module):
            inst = self.cls(module, _instance_class_name(attr))
            if inst is not None:
                return inst.attributes
        return None


def load_table(version: str = "0.3.0") -> ApiTable:
    """Load (once) the bundled API table of an NKI version (``"0.3.0"`` or ``"0.6.0"``)."""
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"unsupported NKI API version {version!r}; supported: {', '.join(SUPPORTED_VERSIONS)}")
    return _load(version)


@functools.lru_cache(maxsize=None)
def _load(version: str) -> ApiTable:
    text = resources.files("fusegraph.nkiapi").joinpath("data", f"api-nki-{version}.json").read_text("utf-8")
    return ApiTable(version, json.loads(text))
