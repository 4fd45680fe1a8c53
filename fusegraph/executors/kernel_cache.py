"""The on-disk cache of generated NKI megakernels: one self-validating file per entry.

Why a cache: rendering a kernel and checking it against the NKI API tables costs a compile seconds, and the same
kernel comes back in every process that runs the same model. Why self-validating: a cache file lives outside
fusegraph's control -- edited, truncated, copied from another key, half-written by a crashed process, written by
another fusegraph version -- and with ``verify=False`` a wrong kernel gives silently wrong logits. So a loaded
entry is used only when it is *usable* (see :func:`read_entry` and :func:`fit_problem`); anything else is a miss:
the kernel is rebuilt, the entry rewritten, and one warning names the file and what was wrong with it.

Why authenticated: anyone who can write the cache directory could otherwise have fusegraph run their Python (an
entry's source is executed by the interpreter) or serve a kernel that is right on its verified first call and wrong
later; a checksum they can recompute proves nothing. So the directory is private (created 0700, refused with one
warning -- the cache is off for the run -- when another user owns it or others can write it), every entry starts
with an HMAC-SHA256 under a per-user key kept outside the cache (:mod:`fusegraph.securefiles`), checked before the
entry is parsed, and only regular files are opened (``O_NOFOLLOW | O_NONBLOCK``, ``fstat``; a FIFO never hangs a
compile). An entry whose MAC fails is a corrupt entry: ignored, replaced, named in one warning.

An entry is one file ``<key>.py``: a MAC comment line, a manifest comment line, then the kernel source exactly as
generated (so the file stays readable Python). The manifest holds the format, the key, the sha256 of the source, the kernel
function's name, its arguments and outputs (name, shape, dtype) and, for tools, the stats and SBUF budget. The
key is over the kernel's *content* (not its name ``fusegraph_g<graph>_r<region>``): a kernel cached for graph 1
serves graph 0 of a later process, renamed at load time. Entries are written atomically (a temp file unique per
process and thread, then ``os.replace``), so concurrent compiles never see half an entry; a cache directory that
cannot be written gives one warning and the compile goes on.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import securefiles
from ..settings import Settings
from ..warnings import warn
from ..codegen import ir
from ..codegen import registry as codegen_registry

log = logging.getLogger(__name__)

CACHE_FORMAT = 3  # part of the key: entries of older formats are never read (they have other names)
MANIFEST_PREFIX = "# fusegraph kernel cache entry: "
MAC_PREFIX = "# fusegraph kernel cache mac: "
MAC_PURPOSE = f"kernel-cache-v{CACHE_FORMAT}"
#: Settings fields that change a generated kernel besides target/weight streaming/budget/lnc: every ``attn_*``
#: switch of the attention templates (a warm cache must never serve a kernel built with other switches)
CODEGEN_PREFIXES = ("attn_",)
# CPython 3.11 builds AST objects with interpreter-global recursion bookkeeping: two threads parsing at once can
# fail with "SystemError: AST constructor recursion depth mismatch" (fixed in later releases)
_AST_LOCK = threading.Lock()


class CorruptEntry(Exception):
    """A cache entry that must not be used; the message says why (it goes into the user's warning)."""


@dataclass
class CacheEntry:
    """A validated entry: ``source`` already names the kernel function as the caller asked."""

    path: Path
    key: str
    function: str  # the name the source was generated with
    source: str
    manifest: dict[str, Any] = field(default_factory=dict)


# ---- where and under which key ---------------------------------------------------------------------------

def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fusegraph/kernels`` (or ``~/.cache/...``): the directory when ``cache_dir`` is ''."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusegraph" / "kernels"


def cache_root(settings: Settings) -> Path | None:
    """The cache directory ``settings`` asks for, or None when ``cache_dir='off'``."""
    if settings.cache_dir == "off":
        return None
    return Path(settings.cache_dir) if settings.cache_dir else default_cache_dir()


def open_cache(root: Path) -> bytes | None:
    """Make ``root`` a private cache directory and return the per-user key its entries are authenticated with;
    None (after one warning) when the cache cannot be used this run: a directory that cannot be created, one
    that is not private, or a key that cannot be trusted (:mod:`fusegraph.securefiles`)."""
    also = (root.parent,) if root == default_cache_dir() and root.parent.is_dir() else ()
    try:
        securefiles.private_dir(root, also)
        return securefiles.user_key()
    except securefiles.UnsafeCache as e:
        warn(f"kernel cache {root} refused: {e}; the kernel cache is off for this run")
    except OSError as e:
        warn(f"kernel cache directory {root} is not writable ({e.strerror or type(e).__name__}); "
             "generated kernels are not cached")
        log.debug("kernel cache directory %s cannot be created", root, exc_info=e)
    return None


def codegen_settings(settings: Settings) -> dict[str, Any]:
    """The settings fields besides the streaming/budget ones that decide a kernel's source (the key covers them)."""
    return {k: v for k, v in sorted(settings.to_dict().items()) if k.startswith(CODEGEN_PREFIXES)}


@contextlib.contextmanager
def codegen_options(settings: Settings) -> Iterator[None]:
    """Inside the ``with``, kernels are generated with every op's options from ``settings`` (attention's
    ``attn_*``: ``registry.register_codegen_options``). Why here:
    every kernel build of the executors passes through :func:`generate_cached`, which is also where those settings
    enter the key; other callers of ``codegen.megakernel.generate`` wrap it in this to honour the options."""

    with codegen_registry.codegen_options(settings):
        yield


def entry_path(root: Path, key: str) -> Path:
    return root / f"{key}.py"


def _pattern_fingerprint(region: Any) -> str:
    h = hashlib.sha256()
    for name in sorted({m.pattern.name for m in region.matches}):
        pat = next(m.pattern for m in region.matches if m.pattern.name == name)
        h.update(name.encode())
        h.update(str(getattr(pat, "fingerprint", None) or getattr(pat, "version", "")).encode())
        fn = getattr(pat, "fn", None) or getattr(pat, "function", None)
        code = getattr(fn, "__code__", None)
        if code is not None:
            h.update(code.co_code)
            h.update(repr(code.co_consts).encode())
    return h.hexdigest()[:16]


def _fingerprint(v: Any) -> str:

    if isinstance(v, ir.Value):
        return f"{v.name}:{v.kind}:{tuple(v.shape)}:{v.dtype}"
    return repr(v)


def cache_key(program_ir: Any, target: str, settings: Settings, region: Any) -> str:
    """Key over what decides the kernel's source: its instructions (shapes, dtypes, constants), the target, the
    streaming settings, the templates and codegen modules, the patterns' code, the fusegraph version and the entry
    format. Not the kernel's name: the same kernel in graph 0 or graph 1 (a recompile) is one entry."""

    h = hashlib.sha256()
    h.update(f"format={CACHE_FORMAT};fusegraph={_version()};".encode())
    for ins in program_ir.instructions:
        h.update(type(ins).__name__.encode())
        for k, v in sorted(vars(ins).items()):
            if k in ("nodes", "module"):
                continue
            h.update(f"{k}={_fingerprint(v)};".encode())
    h.update(target.encode())
    h.update(f"{settings.weight_buffers}/{settings.weight_chunk_kib}/{settings.sbuf_budget}/lnc{settings.lnc}".encode())
    h.update(json.dumps(codegen_settings(settings), sort_keys=True).encode())
    h.update(codegen_registry.templates_hash().encode())  # through the module: tests pin it
    h.update(_pattern_fingerprint(region).encode())
    return h.hexdigest()[:24]


# ---- what an entry must match ----------------------------------------------------------------------------

def signature(generated: Any) -> dict[str, list]:
    """The kernel's interface as the manifest records it: arguments and outputs with shapes and dtypes."""
    program = generated.program
    shapes = {v.name: [v.name, list(v.shape), str(v.dtype)] for v in program.inputs}
    for name, t in generated.constants.items():
        shapes[name] = [name, list(t.shape), str(t.dtype)]
    args = [shapes.get(name, [name, None, None]) for name in generated.args]
    outputs = [[v.name, list(v.shape), str(v.dtype)] for v in program.outputs]
    return {"args": args, "outputs": outputs}


def fit_problem(entry: CacheEntry, generated: Any) -> str | None:
    """Why a (sound) entry cannot serve ``generated``'s kernel, or None. The key already covers the content, so
    this only fires for an entry whose manifest was forged or written by a buggy generator -- cheap insurance
    against running a kernel on arguments it was not written for."""
    want = signature(generated)
    got = {"args": entry.manifest.get("args"), "outputs": entry.manifest.get("outputs")}
    if got == want:
        return None
    for what in ("args", "outputs"):
        a, b = got[what] or [], want[what]
        if a != b:
            diff = next((f"{x} != {y}" for x, y in zip(a, b) if x != y), f"{len(a)} != {len(b)}")
            return f"its {'arguments' if what == 'args' else 'outputs'} do not match this kernel's: {diff}"
    return "its signature does not match this kernel's"  # pragma: no cover


# ---- reading -----------------------------------------------------------------------------------------------

def _kernel_def(tree: ast.Module, function: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return node
    return None


def read_entry(path: Path, key: str, name: str, secret: bytes | None = None) -> CacheEntry | None:
    """The entry at ``path``, authenticated, checked and with its kernel function renamed to ``name``; None if
    there is none. ``secret``: the per-user key (default: :func:`fusegraph.securefiles.user_key`).

    Raises :class:`CorruptEntry` for a file that exists but must not be used: not a regular file (symlink, FIFO,
    device), too large, no MAC or a MAC that fails (tampered, copied from another key, another user's), no or
    unreadable manifest, another format or key, a source whose sha256 differs from the manifest's, a source that
    does not compile, or no ``@nki.jit`` function with the manifest's name and parameters. Nothing of the file is
    parsed before its MAC is checked."""
    try:
        data = securefiles.read_regular(path)
    except securefiles.BadEntry as e:
        raise CorruptEntry(str(e)) from None
    if data is None:
        return None
    if not data:
        raise CorruptEntry("empty file")
    secret = securefiles.user_key() if secret is None else secret
    head, _, body = data.partition(b"\n")
    if not head.startswith(MAC_PREFIX.encode()):
        raise CorruptEntry("not authenticated: no MAC line (written by another fusegraph version, or not by fusegraph)")
    if not hmac.compare_digest(head[len(MAC_PREFIX):].strip(), entry_mac(secret, key, body).encode()):
        raise CorruptEntry("authentication failed: the MAC does not match (changed, truncated, copied from another "
                           "key, or not written by this user)")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptEntry("not UTF-8 text") from None
    first, sep, source = text.partition("\n")
    if not first.startswith(MANIFEST_PREFIX):
        raise CorruptEntry("no manifest line")
    try:
        manifest = json.loads(first[len(MANIFEST_PREFIX):])
    except ValueError:
        raise CorruptEntry("unreadable manifest") from None
    if not isinstance(manifest, dict):
        raise CorruptEntry("unreadable manifest")
    if manifest.get("format") != CACHE_FORMAT:
        raise CorruptEntry(f"format {manifest.get('format')!r}, expected {CACHE_FORMAT}")
    if manifest.get("key") != key:
        raise CorruptEntry(f"it is the entry of key {str(manifest.get('key'))[:24]}, not {key}")
    if manifest.get("sha256") != hashlib.sha256(source.encode("utf-8")).hexdigest():
        raise CorruptEntry("content hash mismatch: the source was changed or truncated")
    function = manifest.get("function")
    args = manifest.get("args")
    if not isinstance(function, str) or not function.isidentifier() or not isinstance(args, list):
        raise CorruptEntry("manifest without a kernel function name and arguments")
    try:
        with _AST_LOCK:
            tree = ast.parse(source, filename=str(path))
            compile(tree, str(path), "exec")
    except (SyntaxError, ValueError) as e:
        raise CorruptEntry(f"the source does not compile: {type(e).__name__}: {e}") from None
    node = _kernel_def(tree, function)
    if node is None:
        raise CorruptEntry(f"no kernel function {function}")
    if not any(ast.unparse(d).startswith("nki.jit") for d in node.decorator_list):
        raise CorruptEntry(f"{function} is not an @nki.jit kernel")
    params = [a.arg for a in node.args.args]
    if node.args.vararg or node.args.kwarg or node.args.kwonlyargs or \
            params != [a[0] if isinstance(a, list) and a else None for a in args]:
        raise CorruptEntry(f"the parameters of {function} do not match its manifest")
    source = rename_kernel(source, node, name)
    return CacheEntry(path=path, key=key, function=function, source=source, manifest=manifest)


def rename_kernel(source: str, node: ast.FunctionDef, name: str) -> str:
    """``source`` with the kernel function ``node`` renamed to ``name`` (only its ``def`` line changes: the
    generated body never refers to the kernel's own name)."""
    if node.name == name:
        return source
    lines = source.splitlines(keepends=True)
    i = node.lineno - 1
    pattern = re.compile(rf"def\s+{re.escape(node.name)}\b")
    m = pattern.match(lines[i], node.col_offset)
    if m is None:  # pragma: no cover - ast and the text agree for any source ast parsed
        raise CorruptEntry(f"cannot find the def line of {node.name}")
    lines[i] = lines[i][:m.start()] + f"def {name}" + lines[i][m.end():]
    return "".join(lines)


# ---- writing -----------------------------------------------------------------------------------------------

def entry_mac(secret: bytes, key: str, body: bytes) -> str:
    """The MAC of an entry's body (manifest line + source) stored under ``key``."""
    return securefiles.mac(secret, MAC_PURPOSE, key, body)


def sealed_text(secret: bytes, key: str, body: str) -> str:
    """``body`` (manifest line + source) with its MAC line in front: the whole file of an entry."""
    return MAC_PREFIX + entry_mac(secret, key, body.encode("utf-8")) + "\n" + body


def entry_text(key: str, generated: Any) -> str:
    """The body of one entry: manifest line + source (:func:`sealed_text` puts the MAC in front)."""
    source = generated.source
    manifest = {"format": CACHE_FORMAT, "key": key, "sha256": hashlib.sha256(source.encode("utf-8")).hexdigest(),
                "function": generated.name, **signature(generated), "fusegraph": _version(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "stats": generated.stats,
                "budget": generated.budget.to_dict() if generated.budget is not None else None}
    return MANIFEST_PREFIX + json.dumps(manifest, default=str, sort_keys=True) + "\n" + source


def write_entry(root: Path, key: str, generated: Any, secret: bytes | None = None) -> Path | None:
    """Write one entry atomically: a temp file (0600) unique per process and thread, then ``os.replace`` (readers
    see the old entry or the new one, never half of one; of two writers of a key the last wins, both whole; a
    symlink or FIFO at the entry's name is replaced, never followed). A directory that cannot be written warns
    once; the kernel is still used. ``secret``: the per-user key (default: the user's)."""
    tmp: str | None = None
    try:
        secret = securefiles.user_key() if secret is None else secret
        text = sealed_text(secret, key, entry_text(key, generated))
        securefiles.private_dir(root)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.{os.getpid()}.{threading.get_ident()}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        path = entry_path(root, key)
        os.replace(tmp, path)
        tmp = None
        return path
    except securefiles.UnsafeCache as e:
        warn(f"kernel cache {root} refused: {e}; generated kernels are not cached")
        return None
    except OSError as e:
        warn(f"kernel cache directory {root} is not writable ({e.strerror or type(e).__name__}); "
             "generated kernels are not cached")
        log.debug("kernel cache write of %s failed", key, exc_info=e)
        return None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def discard(path: Path) -> None:
    """Remove an entry that turned out bad after loading (best effort: a later write replaces it anyway)."""
    try:
        path.unlink()
    except OSError:
        pass


# ---- the one call build_plans makes ------------------------------------------------------------------------

def generate_cached(settings: Settings, key: str, name: str,
                    generate: Callable[[str | None], Any]) -> tuple[Any, bool]:
    """``generate(cached_source)`` through the cache: returns ``(generated kernel, cache_hit)``.

    ``cache_hit`` is True only when a usable entry served the kernel. A bad entry is a miss: the kernel is built
    with ``generate(None)``, the entry rewritten, and one warning names the file and the cause. A cache directory
    or key that cannot be trusted turns the cache off (one warning). ``generate`` runs with ``settings``'
    attention switches (:func:`codegen_options`)."""
    with codegen_options(settings):
        return _generate_cached(settings, key, name, generate)


def _generate_cached(settings: Settings, key: str, name: str,
                     generate: Callable[[str | None], Any]) -> tuple[Any, bool]:
    root = cache_root(settings)
    secret = open_cache(root) if root is not None else None
    if root is None or secret is None:
        return generate(None), False
    path = entry_path(root, key)
    problem: str | None = None
    try:
        entry = read_entry(path, key, name, secret)
    except CorruptEntry as e:
        entry, problem = None, str(e)
    if entry is not None:
        generated = generate(entry.source)
        problem = fit_problem(entry, generated)
        if problem is None:
            log.debug("kernel cache hit %s for %s", path, name)
            return generated, True
    generated = generate(None)
    written = write_entry(root, key, generated, secret)
    if problem is not None:
        if written is None:
            discard(path)
        warn(f"kernel cache entry {path} is corrupt ({problem}); rebuilt it")
    return generated, False


def _version() -> str:
    try:
        from fusegraph import __version__

        return str(__version__)
    except Exception:  # pragma: no cover
        return "?"
