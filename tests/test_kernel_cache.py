"""The on-disk kernel cache (fusegraph/executors/kernel_cache.py): an entry is used only when it is usable; a bad
one is rebuilt, rewritten and named in one warning; a kernel cached under another graph's name serves this graph;
concurrent compiles and unwritable directories never cost a working kernel.

The corruption tests run with ``verify=False`` on purpose: without verification nothing but the cache's own
checks stands between a bad file and wrong logits.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.executors import kernel_cache
from fusegraph.models import build_decode
from fusegraph.warnings import reset_warnings

MODEL = "qwen3-tiny"
OTHER = "llama-tiny"
TOL = 1e-4  # fp32 kernel vs eager, relative to the logit scale (as in test_megakernel_e2e)


@pytest.fixture(scope="module", autouse=True)
def _user_config(tmp_path_factory):
    """The per-user cache key of these tests lives in a private config dir (processes started here inherit it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
        yield


@pytest.fixture(autouse=True)
def _pinned_templates_hash(monkeypatch):
    """Others edit codegen while suites run; a key must not move between two compiles of one test."""
    monkeypatch.setattr("fusegraph.codegen.registry.templates_hash", lambda: "pinned-by-test_kernel_cache")


def _fresh() -> None:
    """What a new process starts from: no dynamo caches, no warnings seen yet."""
    torch._dynamo.reset()
    reset_warnings()


def _step(model, kv, tok, pos):
    """The decode step every test compiles (the kernel's argument names come from these parameter names, so one
    function throughout keeps all kernels of one model under one key)."""
    return model(input_ids=tok, cache=kv, position_ids=pos, use_cache=True).logits


def _options(cache_dir: Path, **options) -> dict:
    return {"executor": "nkisim", "cache_dir": str(cache_dir), "verify": False, **options}


def _all_stats() -> list:
    """KernelStats of every graph the last session compiled, superseded versions (recompiles) included."""
    s = last_session()
    programs = [s.program] + [v.program for v in s.superseded]
    return [st for p in programs for st in p.execution.values()]


@dataclass
class Outcome:
    rel: float
    plans: list
    executed_by: list
    warnings: list[str]


def _run(cache_dir: Path, name: str = MODEL, *, new_process: bool = True, **build) -> Outcome:
    """Compile ``name``'s decode step with the cache at ``cache_dir``, run one step, compare with eager.
    ``new_process=False``: a new compile in the same process (warnings already shown are not shown again)."""
    torch._dynamo.reset()
    if new_process:
        reset_warnings()
    case = build_decode(name, **build)
    ref = case.fork()
    step = torch.compile(_step, backend="fusegraph", dynamic=False, options=_options(cache_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = step(case.model, case.cache, case.token, case.position)
    with torch.no_grad():
        want = ref.step(ref.token, ref.position)
    stats = _all_stats()
    return Outcome(rel=((got - want).abs().max() / want.abs().max()).item(),
                   plans=[p for st in stats for p in st.run.plans],
                   executed_by=[e for st in stats for e in st.executed_by.values()],
                   warnings=[str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)])


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.py"))


def _body(path: Path) -> str:
    """An entry's manifest line and source (what follows its MAC line)."""
    return path.read_text().split("\n", 1)[1]


def _source(path: Path) -> str:
    return _body(path).split("\n", 1)[1]


def _manifest(path: Path) -> dict:
    first = _body(path).split("\n", 1)[0]
    return json.loads(first[len(kernel_cache.MANIFEST_PREFIX):])


def _forge(path: Path, source: str, **manifest) -> str:
    """The body an attacker without the key can write: ``source`` under a manifest whose hash matches it."""
    import hashlib

    m = {**_manifest(path), **manifest, "sha256": hashlib.sha256(source.encode()).hexdigest()}
    return kernel_cache.MANIFEST_PREFIX + json.dumps(m) + "\n" + source


def _resign(path: Path, source: str, **manifest) -> None:
    """Write ``source`` under ``path`` with a manifest whose hash matches it, authenticated with this user's key:
    an entry whose damage neither the MAC nor the content hash can see (a buggy writer), for the checks behind
    them."""
    from fusegraph.securefiles import user_key

    path.write_text(kernel_cache.sealed_text(user_key(), path.stem, _forge(path, source, **manifest)))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One good cache directory per module: the MODEL entry, the OTHER model's entry, the traced patterns."""
    root = tmp_path_factory.mktemp("pristine")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("fusegraph.codegen.registry.templates_hash", lambda: "pinned-by-test_kernel_cache")
        other = _run(root / "other", OTHER)
        main = _run(root / "main", MODEL)
    _fresh()
    assert main.executed_by == ["nkisim"] and main.rel <= TOL and not main.warnings
    assert other.executed_by == ["nkisim"]
    return root


@pytest.fixture
def cache(pristine, tmp_path) -> Path:
    """A private copy of the pristine MODEL cache (patterns included, so a compile takes ~1 s)."""
    d = tmp_path / "cache"
    shutil.copytree(pristine / "main", d)
    return d


def _key(cache: Path) -> str:
    (entry,) = _entries(cache)
    return entry.stem


def _change_a_constant(text: str) -> str:
    """Change one numeric literal of the kernel body -- the 1/sqrt(head_dim) attention scale -- by 1.5x."""
    import re

    head, body = text.split("@nki.jit", 1)
    m = re.search(r"scale=([0-9.]+(?:e-?\d+)?)", body)
    assert m, "no scale= constant in the kernel body"
    return head + "@nki.jit" + body[:m.start(1)] + repr(float(m.group(1)) * 1.5) + body[m.end(1):]


def _corrupt(kind: str, cache: Path, pristine: Path) -> None:
    (entry,) = _entries(cache)
    text = entry.read_text()
    if kind == "changed constant":
        entry.write_text(_change_a_constant(text))
    elif kind == "truncated":
        entry.write_text(text[: len(text) * 2 // 3])
    elif kind == "empty":
        entry.write_text("")
    elif kind == "other model's kernel":
        (other,) = _entries(pristine / "other")
        shutil.copy(other, entry)
    elif kind == "other model's kernel, key forged":  # MAC, hash and key right: only the signature check sees it
        (other,) = _entries(pristine / "other")
        shutil.copy(other, entry)
        _resign(entry, _source(other), key=entry.stem)
    elif kind == "legacy file without manifest":
        entry.write_text(_source(entry))
    elif kind == "format 2 entry (no MAC)":
        entry.write_text(_body(entry))
    else:  # pragma: no cover
        raise AssertionError(kind)


REASONS = {
    "changed constant": "authentication failed",
    "truncated": "authentication failed",
    "empty": "empty file",
    "other model's kernel": "authentication failed",  # the MAC binds an entry to its key
    "other model's kernel, key forged": "do not match this kernel's",
    "legacy file without manifest": "no MAC line",
    "format 2 entry (no MAC)": "no MAC line",
}


@pytest.mark.parametrize("kind", list(REASONS))
def test_bad_entry_is_rebuilt_rewritten_and_named(kind, cache, pristine):
    key = _key(cache)
    _corrupt(kind, cache, pristine)
    out = _run(cache)
    # the step is the kernel's, and right (verify=False: only the cache's checks could have caught it)
    assert out.executed_by == ["nkisim"] and out.rel <= TOL, (out.executed_by, out.rel, out.warnings)
    assert [p.cache_hit for p in out.plans] == [False]
    entry = cache / f"{key}.py"
    assert out.warnings == [f"fusegraph: kernel cache entry {entry} is corrupt ({_reason(out)}); rebuilt it"]
    assert REASONS[kind] in out.warnings[0]
    # healed: the entry was rewritten, and the next process uses it silently
    assert kernel_cache.read_entry(entry, key, "fusegraph_g0_r0") is not None
    again = _run(cache)
    assert [p.cache_hit for p in again.plans] == [True] and again.executed_by == ["nkisim"]
    assert again.rel <= TOL and not again.warnings


def _reason(out: Outcome) -> str:
    return out.warnings[0].split(" is corrupt (", 1)[1].rsplit("); rebuilt it", 1)[0] if out.warnings else ""


def test_good_entry_is_a_hit_and_equal_to_a_fresh_build(cache):
    key = _key(cache)
    before = (cache / f"{key}.py").read_text()
    out = _run(cache)
    assert [p.cache_hit for p in out.plans] == [True] and out.executed_by == ["nkisim"] and not out.warnings
    assert out.plans[0].generated.source == before.split("\n", 2)[2]
    assert (cache / f"{key}.py").read_text() == before  # a hit does not rewrite


# ---- the kernel's name is not part of its content ----------------------------------------------------------

def test_kernel_cached_as_g1_serves_g0_of_a_fresh_compile(tmp_path):
    """A batch-size recompile caches graph 1's kernel; a fresh process with that batch size compiles it as graph 0:
    same content, same key -- it must load under its own name (it used to be KeyError, eager for good)."""
    cache = tmp_path / "cache"
    f = torch.compile(_step, backend="fusegraph", dynamic=False, options=_options(cache))
    with torch.no_grad():
        for batch in (1, 2):
            c = build_decode(MODEL, batch=batch)
            f(c.model, c.cache, c.token, c.position)
    names = sorted(p.generated.name for p in (pl for st in _all_stats() for pl in st.run.plans))
    assert names == ["fusegraph_g0_r0", "fusegraph_g1_r0"]
    assert len(_entries(cache)) == 2
    # a fresh compile of batch 2 (graph 0), and a second model of the same shape with other weights
    for seed in (0, 1):
        out = _run(cache, batch=2, seed=seed)
        assert [p.cache_hit for p in out.plans] == [True], out.warnings
        assert [p.generated.name for p in out.plans] == ["fusegraph_g0_r0"]
        assert "def fusegraph_g0_r0(" in out.plans[0].generated.source
        assert out.executed_by == ["nkisim"] and out.rel <= TOL and not out.warnings


def test_two_threads_first_call_at_once(tmp_path):
    """Two threads call one compiled step at once: dynamo compiles the frame twice (graphs 0 and 1, one kernel
    key); both end with a working kernel and the right logits, nothing is left half-written."""
    cache = tmp_path / "cache"
    f = torch.compile(_step, backend="fusegraph", dynamic=False, options=_options(cache))
    cases = [build_decode(MODEL, seed=s) for s in (0, 1)]
    refs = [c.fork() for c in cases]
    barrier, results, errors = threading.Barrier(2), {}, []

    def call(i):
        try:
            c = cases[i]
            barrier.wait()
            with torch.no_grad():
                results[i] = f(c.model, c.cache, c.token, c.position)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    fg = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
    assert not fg, fg
    for i, ref in enumerate(refs):
        with torch.no_grad():
            want = ref.step(ref.token, ref.position)
        assert ((results[i] - want).abs().max() / want.abs().max()).item() <= TOL
    stats = _all_stats()
    assert stats and all(st.executed_by and set(st.executed_by.values()) == {"nkisim"} for st in stats)
    assert all(p.runner is not None for st in stats for p in st.run.plans)
    assert [e.name for e in tmp_path.rglob("*.tmp")] == []
    (entry,) = _entries(cache)
    assert kernel_cache.read_entry(entry, entry.stem, "x") is not None


# ---- the directory ---------------------------------------------------------------------------------------

def test_cache_dir_that_cannot_be_a_directory_warns_once(tmp_path):
    """A path under a regular file can never be created (works as root too, unlike chmod)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = blocker / "cache"
    first = _run(cache)
    second = _run(cache, new_process=False)  # same process: the warning is not repeated
    for out in (first, second):
        assert out.executed_by == ["nkisim"] and out.rel <= TOL and [p.cache_hit for p in out.plans] == [False]
    mine = [w for w in first.warnings if "kernel cache directory" in w]
    assert mine == [f"fusegraph: kernel cache directory {cache} is not writable (Not a directory); "
                    "generated kernels are not cached"], first.warnings
    assert not [w for w in second.warnings if "kernel cache directory" in w]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_cache_dir_warns_once_and_still_hits(cache):
    os.chmod(cache, 0o555)
    try:
        good = _run(cache)
        assert [p.cache_hit for p in good.plans] == [True] and not good.warnings
        _fresh()
        (entry,) = _entries(cache)
        os.chmod(cache, 0o755)
        entry.write_text("")
        os.chmod(cache, 0o555)
        bad = _run(cache)
        assert bad.executed_by == ["nkisim"] and bad.rel <= TOL
        assert any("is not writable (Permission denied)" in w for w in bad.warnings), bad.warnings
        assert any("is corrupt (empty file); rebuilt it" in w for w in bad.warnings), bad.warnings
    finally:
        os.chmod(cache, 0o755)


# ---- the entry, without compiling ------------------------------------------------------------------------

def test_entry_checks_behind_the_hash(cache):
    """What a content hash cannot catch: a manifest naming a missing function, parameters that differ, a source
    that does not compile, another format -- each a CorruptEntry with its reason; a good one is renamed."""
    (entry,) = _entries(cache)
    key, text = entry.stem, entry.read_text()
    source = _source(entry)
    good = kernel_cache.read_entry(entry, key, "fusegraph_g7_r3")
    assert "def fusegraph_g7_r3(" in good.source and "fusegraph_g0_r0" not in good.source
    assert good.function == "fusegraph_g0_r0"
    assert kernel_cache.read_entry(cache / "missing.py", "missing", "k") is None
    cases = {
        "no kernel function nope": dict(function="nope"),
        "do not match its manifest": dict(args=_manifest(entry)["args"][:-1]),
        "format 1, expected": dict(format=1),
    }
    cases = [(why, source, change) for why, change in cases.items()] + [
        ("does not compile", source.replace("):\n", ")\n", 1), {}),
        ("not an @nki.jit kernel", source.replace("@nki.jit\n", "", 1), {}),
    ]
    for why, src, change in cases:
        entry.write_text(text)
        _resign(entry, src, **change)
        with pytest.raises(kernel_cache.CorruptEntry, match=why):
            kernel_cache.read_entry(entry, key, "k")


def test_concurrent_writes_of_one_key_leave_a_whole_entry(cache):
    """Many writers of one key at once (threads of one process: the temp file must be unique per thread too):
    every read sees one writer's whole entry, and no temp file is left."""
    import dataclasses

    key = _key(cache)
    generated = _run(cache).plans[0].generated
    # per-writer sources of very different sizes, so a torn or interleaved write could not pass for a whole one
    gens = [dataclasses.replace(generated, source=generated.source + "#" * (i * 50_000) + "\n",
                                stats={**generated.stats, "writer": i}) for i in range(8)]
    barrier, seen, errors = threading.Barrier(len(gens)), [], []

    def write(g):
        try:
            barrier.wait()
            for _ in range(5):
                assert kernel_cache.write_entry(cache, key, g) is not None
                seen.append(kernel_cache.read_entry(cache / f"{key}.py", key, "fusegraph_g0_r0"))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(g,)) for g in gens]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    for e in seen:  # read_entry checked each one's hash: whole; and it is exactly its writer's source
        assert e.source == gens[e.manifest["stats"]["writer"]].source
    assert list(cache.glob("*.tmp")) == [] and list(cache.glob(".*")) == []


# ---- across processes (slow: each process imports torch and transformers) --------------------------------

_PROCESS = textwrap.dedent("""
    import sys, warnings, torch
    from fusegraph import FusegraphWarning
    from fusegraph.capture.session import last_session
    from fusegraph.models import build_decode
    import fusegraph.codegen.registry as registry
    registry.templates_hash = lambda: "pinned-by-test_kernel_cache"
    cache, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
    def step(model, kv, tok, pos):
        return model(input_ids=tok, cache=kv, position_ids=pos, use_cache=True).logits
    f = torch.compile(step, backend="fusegraph", dynamic=False,
                      options={"executor": "nkisim", "cache_dir": cache, "verify": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in batches:
            c = build_decode("qwen3-tiny", batch=b)
            ref = c.fork()
            with torch.no_grad():
                got, want = f(c.model, c.cache, c.token, c.position), ref.step(ref.token, ref.position)
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    s = last_session()
    stats = [st for p in [s.program] + [v.program for v in s.superseded] for st in p.execution.values()]
    print("EXECUTED", sorted(e for st in stats for e in st.executed_by.values()))
    print("HITS", sorted(p.cache_hit for st in stats for p in st.run.plans))
    print("WARNINGS", [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)])
""")


def _process(*args: str) -> dict[str, str]:
    r = subprocess.run([sys.executable, "-c", _PROCESS, *args], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ", 1)[0].isupper())


@pytest.mark.slow
def test_g1_kernel_then_fresh_processes(tmp_path):
    """Process 1 caches graph 1's kernel (batch 2 after batch 1); processes 2 and 3 start with batch 2."""
    cache = str(tmp_path / "cache")
    first = _process(cache, "1,2")
    assert first["EXECUTED"] == "['nkisim', 'nkisim']" and first["WARNINGS"] == "[]"
    for _ in range(2):
        later = _process(cache, "2")
        assert later == {"EXECUTED": "['nkisim']", "HITS": "[True]", "WARNINGS": "[]"}


@pytest.mark.slow
def test_two_processes_build_one_key_at_once(tmp_path):
    cache = str(tmp_path / "cache")
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, cache, "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        assert "EXECUTED ['nkisim']" in out and "WARNINGS []" in out
    assert _process(cache, "1")["HITS"] == "[True]"


def test_entry_that_passes_its_checks_but_fails_verification_is_discarded(cache):
    """The cache's checks cannot see a wrong kernel whose manifest was re-signed (a buggy writer); verification
    (on by default) does: the region runs eagerly, and the entry is deleted so the next process rebuilds it."""
    (entry,) = _entries(cache)
    _resign(entry, _change_a_constant(_source(entry)))
    _fresh()
    case = build_decode(MODEL)
    step = torch.compile(_step, backend="fusegraph", dynamic=False,
                         options={"executor": "nkisim", "cache_dir": str(cache)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            step(case.model, case.cache, case.token, case.position)
    msgs = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
    assert any("verification against eager failed" in m for m in msgs), msgs
    assert [p.cache_hit for st in _all_stats() for p in st.run.plans] == [True]
    assert not entry.exists()
