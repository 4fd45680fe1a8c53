"""On-disk cache of traced pattern graphs, so a new process does not pay seconds of aot tracing per compile.

The key covers everything a traced graph depends on: the pattern's declaration (inputs, params, slots, cases, dims,
dtypes) and the full source files of its implementations (helpers included), the tracing/canonicalization and
program-building code of fusegraph, and the torch/transformers/networkx versions. A pattern whose source cannot be
read (defined in a REPL) is simply not cached. Any problem reading the cache means "trace again". Entries are
pickles, and unpickling runs code: each is sealed with the per-user HMAC key of :mod:`fusegraph.securefiles`
(checked before ``pickle.loads``), read only when it is a regular file, in a private directory.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import os
import pickle
from pathlib import Path
from typing import Any

from .. import securefiles

log = logging.getLogger(__name__)

_FORMAT = 2  # 2: sealed with the per-user key
_CODE_FILES = ("trace.py", "canonicalize.py", "pattern.py")
_PROGRAM_FILES = ("build.py", "state.py", "ir.py", "sources.py")


def cache_root(setting: str) -> Path | None:
    """The pattern cache directory for the ``cache_dir`` option ('' = default location, 'off' = no cache)."""
    if setting == "off":
        return None
    if setting:
        return Path(setting) / "patterns"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusegraph" / "patterns"


def _file_digest(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _environment_digest() -> str:
    import networkx
    import torch

    h = hashlib.sha256(f"{_FORMAT}|torch {torch.__version__}|networkx {networkx.__version__}".encode())
    try:
        import transformers

        h.update(f"|transformers {transformers.__version__}".encode())
    except Exception:  # noqa: BLE001 - transformers is optional for plugins
        pass
    here = Path(__file__).parent
    for name in _CODE_FILES:
        h.update(_file_digest(here / name).encode())
    for name in _PROGRAM_FILES:
        h.update(_file_digest(here.parent / "program" / name).encode())
    return h.hexdigest()


def pattern_key(pattern: Any) -> str | None:
    """Content key of a pattern's traced variants, or None if its source cannot be read."""
    h = hashlib.sha256(_environment_digest().encode())
    h.update(repr((pattern.name, pattern.inputs, pattern.outputs, sorted(pattern.params.items()),
                   [dict(c) for c in pattern.cases], sorted(pattern.dims.items()), pattern.dtypes)).encode())
    files: set[str] = set()
    try:
        for s, slot in sorted(pattern.slots.items()):
            h.update(f"slot {s}: {list(slot.options)}".encode())
            for fn in slot.options.values():
                h.update(_callable_source(fn).encode())
        for impl in pattern.implementations:
            h.update(repr((impl.name, impl.cases and [dict(c) for c in impl.cases], impl.dtypes, impl.inputs)).encode())
            h.update(inspect.getsource(impl.fn).encode())
            src = inspect.getsourcefile(impl.fn)
            if src:
                files.add(src)
    except (OSError, TypeError):
        return None
    for f in sorted(files):
        try:
            h.update(_file_digest(f).encode())
        except OSError:
            return None
    return h.hexdigest()


def _callable_source(fn: Any) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


def load(root: Path, key: str, pattern: Any) -> list | None:
    path = root / f"{key}.pkl"
    if not path.exists():
        return None
    try:
        securefiles.check_private(root)
        blob = securefiles.read_regular(path)
        if blob is None:
            return None
        variants = pickle.loads(securefiles.unseal(securefiles.user_key(), "pattern-cache", key, blob))
        for v in variants:
            v.pattern = pattern
        log.debug("pattern %s: %d traced variants loaded from %s", pattern.name, len(variants), path)
        return variants
    except Exception as e:  # noqa: BLE001 - a stale or corrupt entry is just a miss
        log.debug("pattern cache entry %s unusable (%s); tracing again", path, e)
        return None


def store(root: Path, key: str, variants: list) -> None:
    try:
        securefiles.private_dir(root)
        detached = []
        for v in variants:
            c = _shallow_copy(v)
            c.pattern = None
            detached.append(c)
        tmp = root / f".{key}.{os.getpid()}.tmp"
        blob = securefiles.seal(securefiles.user_key(), "pattern-cache", key,
                                pickle.dumps(detached, protocol=pickle.HIGHEST_PROTOCOL))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, root / f"{key}.pkl")
    except Exception as e:  # noqa: BLE001 - caching is an optimization only
        log.debug("could not store traced pattern variants in %s: %s", root, e)


def _shallow_copy(v: Any) -> Any:
    import copy

    return copy.copy(v)
