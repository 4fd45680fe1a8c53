"""Virtual registers (``nisa.register_alloc`` & co).

A register holds one 32-bit integer at run time.  In data runs it is loaded from memory; in shape-only runs
a loaded value comes from the caller's ``assume`` (see :mod:`fusegraph.nkisim.assume`).
"""

from __future__ import annotations

import itertools

_ids = itertools.count(1)


class VirtualRegister:
    """A virtual register on an engine sequencer (official ``nisa.VirtualRegister``)."""

    __slots__ = ("id", "value", "name", "source")

    def __init__(self, value: int | None = None, name: str = ""):
        self.id = next(_ids)
        self.value = value
        self.name = name or f"reg{self.id}"
        self.source = ""  # label of the tensor it was last loaded from

    def __repr__(self) -> str:
        return f"VirtualRegister({self.name}={self.value})"

    def __int__(self) -> int:
        if self.value is None:
            from .errors import NkiValidationError

            raise NkiValidationError(f"register {self.name} is read before it was written", rule="register")
        return int(self.value)

    __index__ = __int__

    def __bool__(self) -> bool:
        return bool(int(self))
