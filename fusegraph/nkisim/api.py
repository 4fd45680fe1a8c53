"""The namespaces of the interpreter's ``nki``, ``nki.language``, ``nki.isa``, ``nki.collectives``,
``nki.typing`` and ``nki.isa.constants`` modules.

Every official name of the 0.3.0 table is present: implemented functions come from the ISA/language modules,
the rest are signature-exact stubs raising NotImplementedError (see :mod:`.stubs`).
"""

from __future__ import annotations

import functools
from typing import Any

from . import collectives as _cc
from . import dtypes as _dt
from . import enums as _en
from . import isa_act, isa_dma, isa_elementwise, isa_misc, isa_pe, isa_select, isa_sync
from . import jit as _jit
from . import language as _lang
from . import language_ops as _ops
from .errors import NkiValidationError
from .loops import NOT_INSTRUCTIONS, traced
from .registers import VirtualRegister
from .stubs import fill_missing
from .tensor import NkiTensor

ISA_IMPLEMENTED = (
    "activation", "activation_reduce", "affine_select", "bn_aggr", "bn_stats", "core_barrier", "dma_compute",
    "dma_copy", "dma_transpose", "exponential", "get_nc_version", "iota", "local_gather", "max8", "memset",
    "nc_find_index8", "nc_match_replace8", "nc_matmul", "nc_n_gather", "nc_stream_shuffle", "nc_transpose",
    "range_select", "reciprocal", "register_alloc", "register_load", "register_move", "register_store",
    "scalar_tensor_tensor", "select_reduce", "sendrecv", "tensor_copy", "tensor_copy_predicated",
    "tensor_partition_reduce", "tensor_reduce", "tensor_scalar", "tensor_scalar_reduce", "tensor_tensor",
    "tensor_tensor_scan",
)

LANGUAGE_IMPLEMENTED = (
    "ndarray", "zeros", "ones", "full", "zeros_like", "empty_like", "ds", "affine_range", "sequential_range",
    "static_range", "dynamic_range", "program_id", "num_programs", "program_ndim", "no_reorder", "device_print",
    "is_hbm", "is_on_chip", "is_psum", "is_sbuf", "load", "store", "load_transpose2d", "transpose", "matmul",
    "shared_identity_matrix", "softmax", "broadcast_to", "expand_dims", "where",
)

COLLECTIVES_IMPLEMENTED = ("all_gather", "all_reduce", "all_to_all", "rank_id", "reduce_scatter")


class _TensorAnnotation:
    """``nki.typing.tensor[128, 512]``: a shape annotation (not enforced by the interpreter)."""

    def __class_getitem__(cls, shape: Any) -> Any:
        return ("tensor", shape if isinstance(shape, tuple) else (shape,))


def _recorded(name: str, fn: Any) -> Any:
    """Instructions are recorded when a ``nl.dynamic_range`` body is traced, to be replayed per iteration."""
    return fn if name in NOT_INSTRUCTIONS or not callable(fn) else traced(fn)


@functools.lru_cache(maxsize=None)
def namespaces() -> dict[str, dict[str, Any]]:
    modules = (isa_act, isa_dma, isa_elementwise, isa_misc, isa_pe, isa_select, isa_sync)
    isa: dict[str, Any] = {}
    for name in ISA_IMPLEMENTED:
        for m in modules:
            if hasattr(m, name):
                isa[name] = _recorded(name, getattr(m, name))
                break
        else:  # pragma: no cover - guarded by tests
            raise ImportError(f"nki.isa.{name} listed as implemented but not found")
    for cls in (_en.dge_mode, _en.dma_engine, _en.engine, _en.matmul_perf_mode, _en.nc_version, _en.oob_mode,
                _en.reduce_cmd):
        isa[cls.__name__] = cls
    isa.update(
        NKIObject=_lang.NKIObject,
        NkiValidationError=NkiValidationError,
        VirtualRegister=VirtualRegister,
        gpsimd_engine=_en.engine.gpsimd,
        scalar_engine=_en.engine.scalar,
        tensor_engine=_en.engine.tensor,
        unknown_engine=_en.engine.unknown,
        vector_engine=_en.engine.vector,
    )
    fill_missing("nki.isa", isa)

    lang: dict[str, Any] = {name: _recorded(name, getattr(_lang, name)) for name in LANGUAGE_IMPLEMENTED}
    lang.update({name: _recorded(name, fn) for name, fn in _ops.OP_FUNCTIONS.items()})
    lang.update(
        MemoryRegion=_en.MemoryRegion,
        NKIObject=_lang.NKIObject,
        NkiTensor=NkiTensor,
        tile_size=_lang.tile_size,
        sbuf=_en.MemoryRegion.sbuf,
        psum=_en.MemoryRegion.psum,
        hbm=_en.MemoryRegion.private_hbm,
        private_hbm=_en.MemoryRegion.private_hbm,
        shared_hbm=_en.MemoryRegion.shared_hbm,
    )
    for dname, d in _dt.ALL.items():
        lang["bool_" if dname == "bool" else dname] = d
    fill_missing("nki.language", lang)

    coll: dict[str, Any] = {name: _recorded(name, getattr(_cc, name)) for name in COLLECTIVES_IMPLEMENTED}
    coll.update(NKIObject=_cc.NKIObject, ReplicaGroup=_cc.ReplicaGroup)
    fill_missing("nki.collectives", coll)

    top: dict[str, Any] = {"jit": _jit.jit, "simulate": _jit.simulate, "dtype": _dt.DType}
    fill_missing("nki", top)

    constants = {cls.__name__: cls for cls in (_en.dge_mode, _en.dma_engine, _en.engine, _en.matmul_perf_mode,
                                                 _en.nc_version, _en.oob_mode, _en.reduce_cmd)}
    typing_ns = {"tensor": _TensorAnnotation}
    return {
        "nki": top,
        "nki.language": lang,
        "nki.isa": isa,
        "nki.collectives": coll,
        "nki.typing": typing_ns,
        "nki.isa.constants": constants,
    }


def implemented(module: str) -> list[str]:
    """Official functions of ``module`` that the interpreter implements (the rest raise NotImplementedError)."""
    ns = namespaces()[module]
    from .stubs import load_table

    return sorted(
        n for n in load_table("0.3.0").functions(module) if not getattr(ns[n], "_nkisim_unimplemented", False)
    )


def unimplemented(module: str) -> list[str]:
    ns = namespaces()[module]
    from .stubs import load_table

    return sorted(n for n in load_table("0.3.0").functions(module) if getattr(ns[n], "_nkisim_unimplemented", False))
