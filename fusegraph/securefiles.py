"""Files fusegraph reads back from its on-disk caches: private directories, a per-user HMAC key, regular files only.

Why: a cache directory is written by earlier processes and read by later ones, and what is read back is run (a
kernel's Python source, a pickle of traced patterns). Anyone who can write there could otherwise make fusegraph run
their code or serve a wrong kernel, and a recomputed checksum proves nothing. So:

* a cache directory is created 0700 and refused (:class:`UnsafeCache`) when it, or a component of it fusegraph
  created, is not a directory owned by this user or is group/world-writable;
* every entry carries an HMAC-SHA256 under a per-user key kept *outside* the caches
  (``$XDG_CONFIG_HOME/fusegraph/cache.key`` or ``~/.config/fusegraph/cache.key``: created 0600 with ``O_EXCL``,
  refused when another user owns it or others can read it), bound to the entry's purpose and name, checked before
  anything in the entry is parsed, unpickled or run;
* entries are opened with ``O_NOFOLLOW | O_NONBLOCK`` and used only when ``fstat`` says regular file and the size is
  bounded, so a symlink, FIFO or device never redirects or hangs a compile.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

KEY_BYTES = 32
MAX_ENTRY_BYTES = 256 << 20  # far above any generated kernel or pattern pickle; a bound, not a budget
SEAL_MAGIC = b"FGMAC1 "


class UnsafeCache(Exception):
    """A cache directory or key fusegraph must not trust; the message says why (it goes into the user's warning)."""


class BadEntry(Exception):
    """An entry file that must not be used (not a regular file, too large, unreadable, MAC missing or wrong)."""


def _euid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def check_private(path: Path, what: str = "directory") -> None:
    """Raise :class:`UnsafeCache` unless ``path`` is a directory owned by this user that only this user can write."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCache(f"{what} {path} is not a directory")
    me = _euid()
    if me is not None and st.st_uid != me:
        raise UnsafeCache(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {me})")
    if st.st_mode & 0o022:
        raise UnsafeCache(f"{what} {path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o}; "
                          f"chmod 700 it)")


def private_dir(path: Path, also: tuple[Path, ...] = ()) -> Path:
    """Create ``path`` (missing components 0700) and check it, every component created here and ``also``.

    Raises :class:`UnsafeCache` for a directory that is not private, ``OSError`` when it cannot be created."""
    missing: list[Path] = []
    p = Path(path)
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    for d in dict.fromkeys([*missing, Path(path), *also]):
        check_private(d)
    return Path(path)


def key_path() -> Path:
    """Where the per-user cache key lives: outside every cache directory, under the user's config directory."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "fusegraph" / "cache.key"


def user_key(path: Path | None = None) -> bytes:
    """The per-user HMAC key, created on first use. Raises :class:`UnsafeCache` when it cannot be trusted or made."""
    path = key_path() if path is None else path
    try:
        private_dir(path.parent)
    except OSError as e:
        raise UnsafeCache(f"cannot create the key directory {path.parent} ({e.strerror or type(e).__name__})") from None
    for _ in range(3):
        try:
            return _read_key(path)
        except FileNotFoundError:
            _create_key(path)
    raise UnsafeCache(f"the cache key {path} keeps disappearing")  # pragma: no cover


def _create_key(path: Path) -> None:
    """Write a fresh key to a 0600 temp file (``mkstemp``: ``O_EXCL``) and ``link`` it in place: never a partial
    key visible, and of two processes creating it at once one wins and both use its key."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cache.key.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    except OSError as e:
        raise UnsafeCache(f"cannot create the cache key {path} ({e.strerror or type(e).__name__})") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _read_key(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else (e.strerror or type(e).__name__)
        raise UnsafeCache(f"the cache key {path} cannot be used ({why})") from None
    try:
        st = os.fstat(fd)
        me = _euid()
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCache(f"the cache key {path} is not a regular file")
        if me is not None and st.st_uid != me:
            raise UnsafeCache(f"the cache key {path} is owned by uid {st.st_uid}, not by this user (uid {me})")
        if st.st_mode & 0o077:
            raise UnsafeCache(f"the cache key {path} is readable or writable by others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}; it must be 600)")
        text = os.read(fd, 4 * KEY_BYTES).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise UnsafeCache(f"the cache key {path} is not {KEY_BYTES} bytes of hex (delete it to make a new one)")
    return key


def read_regular(path: Path, limit: int | None = None) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (None if there is none). Raises :class:`BadEntry` for a
    symlink, FIFO, device or directory (never opened for blocking reads, never followed), or a file over ``limit``
    bytes (default :data:`MAX_ENTRY_BYTES`)."""
    limit = MAX_ENTRY_BYTES if limit is None else limit
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadEntry("a symbolic link, not a regular file") from None
        raise BadEntry(f"unreadable: {e.strerror or type(e).__name__}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadEntry("not a regular file (a FIFO, device or directory)")
        if st.st_size > limit:
            raise BadEntry(f"{st.st_size} bytes, more than the {limit} an entry may have")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise BadEntry(f"more than the {limit} bytes an entry may have")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise BadEntry(f"unreadable: {e.strerror or type(e).__name__}") from None
    finally:
        os.close(fd)


def mac(key: bytes, purpose: str, name: str, data: bytes) -> str:
    """HMAC-SHA256 (hex) of ``data`` bound to what it is (``purpose``) and under which name it is stored, so an
    entry copied to another name or another cache does not authenticate."""
    msg = f"fusegraph:{purpose}:{name}\n".encode() + data
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def seal(key: bytes, purpose: str, name: str, data: bytes) -> bytes:
    """``data`` with its MAC in front (binary entries such as pickles; see :func:`unseal`)."""
    return SEAL_MAGIC + mac(key, purpose, name, data).encode() + b"\n" + data


def unseal(key: bytes, purpose: str, name: str, blob: bytes) -> bytes:
    """The data of a :func:`seal`-ed blob; raises :class:`BadEntry` when the MAC is missing or wrong."""
    head, sep, data = blob.partition(b"\n")
    if not sep or not head.startswith(SEAL_MAGIC):
        raise BadEntry("no MAC: not written by this fusegraph for this user")
    if not hmac.compare_digest(head[len(SEAL_MAGIC):], mac(key, purpose, name, data).encode()):
        raise BadEntry("MAC mismatch: tampered, or written under another name or key")
    return data
