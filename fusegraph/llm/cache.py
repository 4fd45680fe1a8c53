"""On-disk cache of accepted LLM-written kernels, so a region costs one request per model, not one per compile.

The key covers everything that decides whether a kernel is right and how it was obtained: the region's
structure (``KernelTask.structure``, else the AST of the reference source, so comments and formatting do not
matter), every input/output spec (shapes, dtypes, ranges, constants, in-place outputs), the verification cases,
the LLM model name, the prompt version and the target. One JSON file per key; writes are atomic (temp file +
rename), so concurrent compiles never read half an entry. A loaded entry is not trusted blindly: it must be a
regular file in a private directory and carry an HMAC-SHA256 under the per-user key of :mod:`fusegraph.securefiles`
(kept outside the cache; a recomputed checksum is not enough: whoever can write the directory can recompute it),
and the writer re-runs the static checks (allow-list, conformance, contract) on it. An entry that fails is deleted.
"""
from __future__ import annotations

import ast
import hashlib
import hmac
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import securefiles
from .task import KernelTask

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: entries carry a MAC
MAC_PURPOSE = "llm-kernel-cache"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusegraph" / "llm-kernels"


def region_structure(task: KernelTask) -> str:
    if task.structure:
        return task.structure
    try:
        return ast.dump(ast.parse(task.reference_source))
    except (SyntaxError, ValueError):
        return task.reference_source


def cache_key(task: KernelTask, llm_model: str, prompt_version: str, target: str) -> str:
    payload = {
        "format": CACHE_FORMAT,
        "structure": region_structure(task),
        "inputs": [s.key() for s in task.inputs],
        "outputs": [s.key() for s in task.outputs],
        "cases": list(task.cases),
        "data_movement_only": task.data_movement_only,
        "llm_model": llm_model,
        "prompt_version": prompt_version,
        "target": target,
    }
    if getattr(task, "lnc", 1) != 1:
        payload["lnc"] = task.lnc  # only when set, so LNC=1 keys stay what they were
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class CacheEntry:
    key: str
    source: str
    meta: dict[str, Any] = field(default_factory=dict)


def entry_mac(secret: bytes, key: str, data: dict[str, Any]) -> str:
    """The MAC of an entry (every field but ``mac``, canonical JSON) stored under ``key``."""
    body = json.dumps({k: v for k, v in data.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return securefiles.mac(secret, MAC_PURPOSE, key, body.encode("utf-8"))


class KernelCache:
    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root else default_dir()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def _secret(self) -> bytes | None:
        """The per-user key, after making the directory private; None (logged) when the cache cannot be trusted."""
        try:
            securefiles.private_dir(self.root)
            return securefiles.user_key()
        except (securefiles.UnsafeCache, OSError) as e:
            log.warning("LLM kernel cache %s is off: %s", self.root, e)
            return None

    def load(self, key: str) -> CacheEntry | None:
        p = self.path(key)
        if not os.path.lexists(p):
            return None
        secret = self._secret()
        if secret is None:
            return None
        try:
            raw = securefiles.read_regular(p)
            if raw is None:
                return None
            data = json.loads(raw.decode("utf-8"))
        except (securefiles.BadEntry, ValueError) as e:
            log.warning("ignoring and deleting unreadable LLM kernel cache entry %s: %s", p, e)
            self.discard(key)
            return None
        src = data.get("source") if isinstance(data, dict) else None
        mac = data.get("mac") if isinstance(data, dict) else None
        if not isinstance(mac, str) or not hmac.compare_digest(mac, entry_mac(secret, key, data)):
            log.warning("ignoring and deleting LLM kernel cache entry %s: not authenticated (MAC missing or wrong: "
                        "tampered, copied, or not written by this user)", p)
            self.discard(key)
            return None
        if not isinstance(src, str) or data.get("key") != key or data.get("format") != CACHE_FORMAT \
                or data.get("sha256") != hashlib.sha256(src.encode()).hexdigest():
            log.warning("ignoring inconsistent LLM kernel cache entry %s", p)
            return None
        return CacheEntry(key, src, data.get("meta") or {})

    def store(self, key: str, source: str, meta: dict[str, Any]) -> Path | None:
        """Write an entry atomically (0600 temp file, then rename), with its MAC; a failure is logged, not raised
        (the kernel is still usable)."""
        secret = self._secret()
        if secret is None:
            return None
        entry = {"format": CACHE_FORMAT, "key": key, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "sha256": hashlib.sha256(source.encode()).hexdigest(), "source": source, "meta": meta}
        try:
            entry["mac"] = entry_mac(secret, key, json.loads(json.dumps(entry)))  # the MAC of what load will parse
        except (TypeError, ValueError) as e:
            log.warning("could not write the LLM kernel cache entry for %s: %s", key[:12], e)
            return None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, indent=1)
            os.replace(tmp, self.path(key))
            return self.path(key)
        except OSError as e:
            log.warning("could not write the LLM kernel cache entry for %s: %s", key[:12], e)
            return None

    def discard(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except OSError:
            pass
