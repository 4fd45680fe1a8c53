"""Virtual registers (``nisa.register_alloc`` & co).

A register holds one 32-bit integer at run time.  In data runs it is loaded from memory; in shape-only runs
a loaded value comes from the caller's ``assume`` (see :mod:`fusegraph.nkisim.assume`).

A register is a *runtime* value: the kernel's Python (NKI's meta-programming language, evaluated when the kernel is
specialised) never sees it.  So ``range(reg)``, ``int(reg)``, indexing with it, arithmetic on it and comparing it
with a number are errors (rule ``loop``) -- the interpreter knows the value, the compiler does not.  The one
documented Python use is a dynamic ``while reg:`` loop (``nki/get-started/nki-language-guide.rst``, "Dynamic
Control Flow"), a hardware loop the interpreter traces once and replays while the register is non-zero
(:func:`fusegraph.nkisim.loops.while_test`).  The induction variable of ``nl.dynamic_range`` is an
:class:`InductionRegister`: also no ``if`` on it (``nki/deep-dives/nki-dynamic-loops.rst``, "Hardware Lowering":
"You cannot use it in host-side Python expressions (e.g., ``if i == 0:``)") and it is frozen (the language guide:
"you cannot write to it with ``register_move`` or ``register_load``").
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, NoReturn

_ids = itertools.count(1)

_GUIDE = "nki/get-started/nki-language-guide.rst"
_LOOPS = "nki/deep-dives/nki-dynamic-loops.rst"


def _meta_error(reg: "VirtualRegister", what: str, hint: str) -> NoReturn:
    from .context import maybe_current
    from .errors import NkiValidationError

    ctx = maybe_current()
    raise NkiValidationError(
        f"{what} of register {reg.name}: a VirtualRegister holds a runtime value the kernel's Python cannot use; "
        f"{hint}",
        rule="loop",
        location=ctx.where() if ctx is not None else None,
    )


class VirtualRegister:
    """A virtual register on an engine sequencer (official ``nisa.VirtualRegister``)."""

    __slots__ = ("id", "value", "name", "source")
    frozen = False  # an induction register cannot be written by the kernel

    def __init__(self, value: int | None = None, name: str = ""):
        self.id = next(_ids)
        self.value = value
        self.name = name or f"reg{self.id}"
        self.source = ""  # label of the tensor it was last loaded from

    def __repr__(self) -> str:
        return f"VirtualRegister({self.name}={self.value})"

    def __int__(self) -> int:
        _meta_error(self, "int()", "pass the register itself to nl.dynamic_range or .ap(scalar_offset=...)")

    def __index__(self) -> int:
        _meta_error(self, "range() / indexing", f"use nl.dynamic_range(reg) for a loop over it ({_LOOPS}) and "
                                                 f".ap(scalar_offset=reg) for an address")

    def __bool__(self) -> bool:
        """``while reg:`` is a documented dynamic while loop: a hardware loop whose body is traced once
        (:func:`fusegraph.nkisim.loops.while_test`). Outside a running kernel: the register's value."""
        from .context import maybe_current

        ctx = maybe_current()
        if ctx is None:
            if self.value is None:
                from .errors import NkiValidationError

                raise NkiValidationError(f"register {self.name} is read before it was written", rule="register")
            return bool(self.value)
        from .loops import while_test

        return while_test(ctx, self, sys._getframe(1))

    def _compare(self, other: Any) -> Any:
        if isinstance(other, (int, float)):
            _meta_error(self, "a Python comparison", f"device-side conditions need device operations ({_LOOPS})")
        return NotImplemented

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _compare
    __hash__ = object.__hash__

    def _arith(self, *other: Any) -> NoReturn:
        _meta_error(self, "Python arithmetic", "registers have no arithmetic in NKI; address with "
                                               ".ap(pattern, offset=..., scalar_offset=reg)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __floordiv__ = __rfloordiv__ = _arith
    __mod__ = __rmod__ = __truediv__ = __rtruediv__ = __neg__ = _arith


class InductionRegister(VirtualRegister):
    """The induction variable of one ``nl.dynamic_range`` loop (bound to each iteration's value by the loop)."""

    __slots__ = ()
    frozen = True

    def __repr__(self) -> str:
        return f"InductionRegister({self.name}={self.value})"

    def __bool__(self) -> bool:
        _meta_error(self, "a Python if / bool()", f"the loop variable of nl.dynamic_range is a device register "
                                                  f"({_LOOPS}, 'Hardware Lowering'); use device-side operations")
