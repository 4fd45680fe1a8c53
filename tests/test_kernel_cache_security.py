"""The kernel cache against someone who can write its directory (fusegraph/securefiles.py, kernel_cache.py): a
recomputed checksum, a poisoned entry, an entry whose Python writes a marker file, a FIFO, a symlink, a directory
others can write, a key others can read, a pickle that runs code -- each refused (one warning naming the cause, the
kernel rebuilt or the cache off, the logits right); a normal entry is still a hit.

Every attack here succeeded against the format-2 cache (sha256 in the manifest, no MAC, ``read_text`` on the
entry, ``pickle.load`` of the pattern cache). ``verify=False`` where it matters: then nothing but the cache's own
checks stands between the file and the logits.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import stat
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.executors import kernel_cache
from fusegraph.matching import pattern_cache
from fusegraph.models import build_decode
from fusegraph.securefiles import key_path, user_key
from fusegraph.warnings import reset_warnings

MODEL = "qwen3-tiny"
TOL = 1e-4
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture(scope="module", autouse=True)
def _user_config(tmp_path_factory):
    """This module's user: its key under a private config dir (the real ~/.config is never touched)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
        yield


@pytest.fixture(autouse=True)
def _pinned_templates_hash(monkeypatch):
    monkeypatch.setattr("fusegraph.codegen.registry.templates_hash", lambda: "pinned-by-test_kernel_cache_security")


def _step(model, kv, tok, pos):
    return model(input_ids=tok, cache=kv, position_ids=pos, use_cache=True).logits


def _run(cache: Path, steps: int = 1, **options):
    """Compile with the cache at ``cache`` (verify off unless given), run ``steps`` decode steps; (max relative
    error over the steps, plans, executors, fusegraph warnings)."""
    torch._dynamo.reset()
    reset_warnings()
    case = build_decode(MODEL)
    ref = case.fork()
    opts = {"executor": "nkisim", "cache_dir": str(cache), "verify": False, **options}
    step = torch.compile(_step, backend="fusegraph", dynamic=False, options=opts)
    rel = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            tok, pos = case.token, case.position
            rtok, rpos = ref.token, ref.position
            for _ in range(steps):
                got = step(case.model, case.cache, tok, pos)
                want = ref.step(rtok, rpos)
                rel = max(rel, ((got - want).abs().max() / want.abs().max()).item())
                tok = rtok = want[:, -1:].argmax(-1)
                pos, rpos = pos + 1, rpos + 1
    s = last_session()
    stats = [st for p in [s.program] + [v.program for v in s.superseded] for st in p.execution.values()]
    return (rel, [p for st in stats for p in st.run.plans], [e for st in stats for e in st.executed_by.values()],
            [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, _user_config):
    root = tmp_path_factory.mktemp("pristine") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("fusegraph.codegen.registry.templates_hash", lambda: "pinned-by-test_kernel_cache_security")
        rel, plans, by, warned = _run(root)
    assert by == ["nkisim"] and rel <= TOL and not warned, (by, rel, warned)
    return root


@pytest.fixture
def cache(pristine, tmp_path) -> Path:
    d = tmp_path / "cache"
    shutil.copytree(pristine, d)
    os.chmod(d, 0o700)
    return d


def _entry(cache: Path) -> Path:
    (entry,) = sorted(cache.glob("*.py"))
    return entry


def _forge(entry: Path, source: str) -> None:
    """What an attacker without the key writes: ``source`` under the entry's manifest with its sha256 recomputed
    (and the old MAC line kept: it cannot be recomputed)."""
    mac, body = entry.read_text().split("\n", 1)
    manifest_line = body.split("\n", 1)[0]
    m = json.loads(manifest_line[len(kernel_cache.MANIFEST_PREFIX):])
    m["sha256"] = hashlib.sha256(source.encode()).hexdigest()
    entry.write_text(mac + "\n" + kernel_cache.MANIFEST_PREFIX + json.dumps(m) + "\n" + source)


def _source(entry: Path) -> str:
    return entry.read_text().split("\n", 2)[2]


def _scaled(source: str) -> str:
    """The kernel with its attention scale 1.5x: compiles, passes every structural check, wrong logits."""
    import re

    head, body = source.split("@nki.jit", 1)
    m = re.search(r"scale=([0-9.]+(?:e-?\d+)?)", body)
    assert m
    return head + "@nki.jit" + body[:m.start(1)] + repr(float(m.group(1)) * 1.5) + body[m.end(1):]


def _assert_rebuilt(cache: Path, out, reason: str) -> None:
    rel, plans, by, warned = out
    entry = _entry(cache)
    assert by == ["nkisim"] and rel <= TOL, (by, rel, warned)
    assert [p.cache_hit for p in plans] == [False]
    assert warned == [f"fusegraph: kernel cache entry {entry} is corrupt ({reason_of(warned)}); rebuilt it"], warned
    assert reason in warned[0], warned
    assert stat.S_ISREG(os.lstat(entry).st_mode)  # replaced by a whole, authenticated entry
    assert kernel_cache.read_entry(entry, entry.stem, "k") is not None


def reason_of(warned: list[str]) -> str:
    return warned[0].split(" is corrupt (", 1)[1].rsplit("); rebuilt it", 1)[0] if warned else ""


# ---- entries ---------------------------------------------------------------------------------------------

def test_normal_entry_is_a_hit(cache):
    before = _entry(cache).read_text()
    rel, plans, by, warned = _run(cache)
    assert [p.cache_hit for p in plans] == [True] and by == ["nkisim"] and rel <= TOL and not warned
    assert _entry(cache).read_text() == before


def test_recomputed_checksum_is_refused_with_verify_off(cache):
    """A changed kernel with the manifest's sha256 recomputed was trusted (verify off: wrong logits)."""
    entry = _entry(cache)
    _forge(entry, _scaled(_source(entry)))
    _assert_rebuilt(cache, _run(cache), "authentication failed")


def test_poisoned_entry_never_reaches_first_call_verification(cache):
    """With verify on, a poisoned entry that is right on the verified first call would be trusted for every later
    call; refused before it is used, the kernel is rebuilt, and every step is right (no verification failure: the
    poisoned kernel never ran)."""
    entry = _entry(cache)
    _forge(entry, _scaled(_source(entry)))
    rel, plans, by, warned = _run(cache, steps=3, verify=True)
    assert by == ["nkisim"] and rel <= TOL and [p.cache_hit for p in plans] == [False]
    assert len(warned) == 1 and "authentication failed" in warned[0], warned
    assert not any("verification" in w for w in warned)


def test_entry_whose_python_writes_a_marker_is_never_run(cache, tmp_path):
    marker = tmp_path / "marker"
    entry = _entry(cache)
    src = _source(entry)
    evil = src.replace("@nki.jit", f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n\n@nki.jit", 1)
    _forge(entry, evil)
    _assert_rebuilt(cache, _run(cache), "authentication failed")
    assert not marker.exists()


def test_entry_signed_with_another_users_key_is_refused(cache):
    entry = _entry(cache)
    body = entry.read_text().split("\n", 1)[1]
    entry.write_text(kernel_cache.sealed_text(b"\x01" * 32, entry.stem, body))
    _assert_rebuilt(cache, _run(cache), "authentication failed")


def test_fifo_entry_does_not_hang(cache):
    """A FIFO at the entry's name: reading it blocked forever (no writer). Checked in a thread with a timeout so a
    regression fails instead of hanging the suite; the thread is released by opening the FIFO's write end."""
    entry = _entry(cache)
    key = entry.stem
    entry.unlink()
    os.mkfifo(entry)
    result: list = []

    def read():
        try:
            result.append(kernel_cache.read_entry(entry, key, "k"))
        except kernel_cache.CorruptEntry as e:
            result.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=20)
    if t.is_alive():
        os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
        t.join(timeout=20)
        pytest.fail("read_entry blocked on a FIFO")
    assert isinstance(result[0], kernel_cache.CorruptEntry) and "not a regular file" in str(result[0])
    _assert_rebuilt(cache, _run(cache), "not a regular file")


def test_symlink_entry_is_refused_and_its_target_untouched(cache, tmp_path):
    """A symlink (here to a copy of the valid entry elsewhere) is never followed: refused, replaced by a regular
    file, and what it pointed to is not written through it."""
    entry = _entry(cache)
    outside = tmp_path / "elsewhere.py"
    shutil.copy(entry, outside)
    before = outside.read_bytes()
    entry.unlink()
    entry.symlink_to(outside)
    _assert_rebuilt(cache, _run(cache), "symbolic link")
    assert outside.read_bytes() == before and not entry.is_symlink()


def test_oversized_entry_is_refused(cache, monkeypatch):
    """Entries are read with a size bound (a huge or endless file never exhausts memory)."""
    entry = _entry(cache)
    limit = 2 * entry.stat().st_size
    monkeypatch.setattr("fusegraph.securefiles.MAX_ENTRY_BYTES", limit)
    with entry.open("a") as f:
        f.write("#" * limit)
    _assert_rebuilt(cache, _run(cache), f"more than the {limit}")


# ---- the directory and the key ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o777, 0o770, 0o703])
def test_directory_others_can_write_is_refused(cache, mode):
    entry = _entry(cache)
    _forge(entry, _scaled(_source(entry)))  # what the other writer left: must not even be read
    before = entry.read_text()
    os.chmod(cache, mode)
    try:
        rel, plans, by, warned = _run(cache)
    finally:
        os.chmod(cache, 0o700)
    assert by == ["nkisim"] and rel <= TOL and [p.cache_hit for p in plans] == [False]
    assert warned == [f"fusegraph: kernel cache {cache} refused: directory {cache} is group- or world-writable "
                      f"(mode {mode:o}; chmod 700 it); the kernel cache is off for this run"], warned
    assert entry.read_text() == before  # the cache is off: nothing read, nothing written


@pytest.mark.skipif(not IS_ROOT, reason="only root can give a directory to another user")
def test_directory_owned_by_another_user_is_refused(cache):
    os.chown(cache, 4242, -1)
    try:
        rel, plans, by, warned = _run(cache)
    finally:
        os.chown(cache, os.geteuid(), -1)
    assert by == ["nkisim"] and rel <= TOL and [p.cache_hit for p in plans] == [False]
    assert len(warned) == 1 and "is owned by uid 4242" in warned[0] and "off for this run" in warned[0], warned


def test_created_directories_are_private(tmp_path):
    cache = tmp_path / "a" / "b" / "cache"
    rel, plans, by, warned = _run(cache)
    assert by == ["nkisim"] and not warned
    for d in (tmp_path / "a", tmp_path / "a" / "b", cache):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert all(stat.S_IMODE(os.stat(e).st_mode) == 0o600 for e in cache.glob("*.py"))
    k = key_path()
    assert not str(k).startswith(str(cache)) and stat.S_IMODE(os.stat(k).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(k.parent).st_mode) == 0o700


def _with_key(change, cache: Path):
    k = key_path()
    user_key()  # exists
    saved = k.read_bytes()
    try:
        change(k)
        return _run(cache)
    finally:
        if k.is_symlink() or k.exists():
            k.unlink()
        k.write_bytes(saved)
        os.chmod(k, 0o600)


@pytest.mark.parametrize("kind", ["group/world readable", "symlink", "not hex", "other owner"])
def test_key_that_cannot_be_trusted_turns_the_cache_off(cache, tmp_path, kind):
    if kind == "other owner" and not IS_ROOT:
        pytest.skip("only root can give a file to another user")

    def change(k: Path) -> None:
        if kind == "group/world readable":
            os.chmod(k, 0o644)
        elif kind == "symlink":
            other = tmp_path / "planted.key"
            other.write_text("00" * 32)
            os.chmod(other, 0o600)
            k.unlink()
            k.symlink_to(other)
        elif kind == "not hex":
            k.write_text("not a key")
        else:
            os.chown(k, 4242, -1)

    why = {"group/world readable": "readable or writable by others", "symlink": "a symbolic link",
           "not hex": "is not 32 bytes of hex", "other owner": "is owned by uid 4242"}[kind]
    rel, plans, by, warned = _with_key(change, cache)
    assert by == ["nkisim"] and rel <= TOL and [p.cache_hit for p in plans] == [False]
    assert len(warned) == 1 and why in warned[0] and str(key_path()) in warned[0], warned
    assert "the kernel cache is off for this run" in warned[0]


# ---- the pattern cache's pickles --------------------------------------------------------------------------

class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "ran"))


def test_pattern_pickle_is_authenticated_before_it_is_unpickled(cache, tmp_path):
    """The traced-pattern cache (``<cache_dir>/patterns``) holds pickles, and unpickling runs code: a planted
    pickle -- bare or sealed under another key -- is a miss and never runs; a genuine one still loads."""
    from fusegraph import securefiles

    root = cache / "patterns"
    entries = sorted(root.glob("*.pkl"))
    if not entries:  # the patterns were traced by an earlier test of this process (in memory): store one entry
        pattern_cache.store(root, "genuine-entry", [SimpleNamespace(pattern=None, graph="traced")])
        entries = sorted(root.glob("*.pkl"))
    assert entries
    good = entries[0]
    pattern = SimpleNamespace(name="test-pattern")
    assert pattern_cache.load(root, good.stem, pattern) is not None
    marker = tmp_path / "marker"
    evil = pickle.dumps(_Marker(str(marker)))
    for blob in (evil, securefiles.seal(b"\x02" * 32, "pattern-cache", good.stem, evil)):
        good.write_bytes(blob)
        assert pattern_cache.load(root, good.stem, pattern) is None
        assert not marker.exists()
