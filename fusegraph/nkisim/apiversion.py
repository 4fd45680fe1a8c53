"""Which NKI version's semantics the interpreter applies where the versions differ (``FUSEGRAPH_NKISIM_API``).

The interpreter implements NKI 0.3 (SDK 2.29, the project's target; the NKI 0.5+ tensor methods raise). A few
documented behaviours changed between 0.3 and 0.6 (SDK 2.32) without a change of signature, so the source alone
does not say which applies; this switch does. Today it selects one behaviour:

* ``.ap()`` called on a view (a slice, an ``.ap()`` result): a compile error in 0.3 ("Restriction on Nested
  Indexing", nki/deep-dives/nki-aps.rst of SDK 2.29); legal in 0.6 but storage-relative (section "Composition and
  ``.ap`` on a view": the pattern and offset address the tensor's storage, ignoring the view's shape, strides and
  offset; ``offset=None`` inherits the view's offset).

A third value, ``sdk-2.27``, is no table version: it is the behaviour the hand-written Qwen3 megakernel (its README:
"Tested with AWS Neuron SDK v2.27") relies on, ``qnw_f32_all[0:PMAX, l:l + 1].ap([[1, PMAX], [0, GQA]], offset=0)``
read relative to the view (layer ``l``'s column). Its anchor test runs under it so that the kernel stays runnable
unmodified; nothing else should.

Why a process-wide switch rather than a kernel argument: the same generated source must be checkable under both
versions without editing it, and tests pin one with :func:`use_api_version`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from ..nkiapi.tables import SUPPORTED_VERSIONS

API_ENV = "FUSEGRAPH_NKISIM_API"
"""Environment variable selecting the NKI version (``0.3.0`` or ``0.6.0``; default ``0.3.0``)."""

DEFAULT_API_VERSION = "0.3.0"
SDK_2_27 = "sdk-2.27"
VERSIONS: tuple[str, ...] = SUPPORTED_VERSIONS + (SDK_2_27,)

#: what ``.ap()`` on a view does per version: ``error`` (rule ``nested-ap``), ``storage`` (the pattern and offset
#: address the view's storage), ``view`` (relative to the view's first element)
AP_ON_VIEW: dict[str, str] = {"0.3.0": "error", "0.6.0": "storage", SDK_2_27: "view"}

_lock = threading.Lock()
_override: list[str] = []


def _check(version: str) -> str:
    if version not in VERSIONS:
        raise ValueError(f"NKI API version {version!r} is not one of {', '.join(VERSIONS)}")
    return version


def api_version() -> str:
    """The NKI version whose semantics apply now: the innermost :func:`use_api_version`, else
    ``FUSEGRAPH_NKISIM_API``, else 0.3.0. A bad environment value raises (a silent fallback would check kernels
    against the wrong rules)."""
    with _lock:
        if _override:
            return _override[-1]
    env = os.environ.get(API_ENV, "").strip()
    if not env:
        return DEFAULT_API_VERSION
    try:
        return _check(env)
    except ValueError as e:
        raise ValueError(f"{API_ENV}={env!r}: {e}") from None


def ap_on_view() -> str:
    """What ``.ap()`` called on a view does under the current version (see :data:`AP_ON_VIEW`)."""
    return AP_ON_VIEW[api_version()]


@contextlib.contextmanager
def use_api_version(version: str) -> Iterator[str]:
    """Apply ``version``'s semantics inside the block (all threads: LNC=2 programs and in-process ranks run on
    threads of their own)."""
    _check(version)
    with _lock:
        _override.append(version)
    try:
        yield version
    finally:
        with _lock:
            _override.pop()
