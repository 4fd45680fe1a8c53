"""The cache of accepted LLM-written kernels (fusegraph/llm/cache.py) against someone who can write its directory:
an entry is used only when it is a regular file in a private directory and its MAC (per-user key, outside the
cache) is right; a recomputed sha256 is not enough. Each of these was accepted by the format-1 cache."""
from __future__ import annotations

import hashlib
import json
import os
import threading

import pytest

from fusegraph.llm.cache import KernelCache

SRC = "def kernel(x):\n    return x\n"


@pytest.fixture(autouse=True)
def _user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    c = KernelCache(tmp_path / "llm-cache")
    assert c.store("k1", SRC, {"task": "t"}) is not None
    return c


def test_a_stored_entry_loads(cache):
    e = cache.load("k1")
    assert e is not None and e.source == SRC and e.meta == {"task": "t"}
    assert oct(os.stat(cache.root).st_mode & 0o777) == "0o700"


def test_recomputed_checksum_is_refused_and_the_entry_deleted(cache):
    p = cache.path("k1")
    data = json.loads(p.read_text())
    data["source"] = "import os\nos.system('true')\n"
    data["sha256"] = hashlib.sha256(data["source"].encode()).hexdigest()
    p.write_text(json.dumps(data))
    assert cache.load("k1") is None and not p.exists()


def test_entry_copied_to_another_key_is_refused(cache):
    cache.path("k2").write_bytes(cache.path("k1").read_bytes())
    assert cache.load("k2") is None and cache.load("k1") is not None


def test_fifo_and_symlink_entries_are_refused_without_hanging(cache, tmp_path):
    p = cache.path("k1")
    good = tmp_path / "outside.json"
    good.write_bytes(p.read_bytes())
    p.unlink()
    p.symlink_to(good)
    assert cache.load("k1") is None and good.exists()
    os.mkfifo(cache.path("k3"))
    got: list = []
    t = threading.Thread(target=lambda: got.append(cache.load("k3")), daemon=True)
    t.start()
    t.join(timeout=20)
    if t.is_alive():
        os.close(os.open(cache.path("k3"), os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("loading a FIFO entry blocked")
    assert got == [None]


def test_directory_others_can_write_turns_the_cache_off(cache):
    os.chmod(cache.root, 0o777)
    assert cache.load("k1") is None
    assert cache.store("k4", SRC, {}) is None and not cache.path("k4").exists()
