"""LNC=2 synchronisation (sendrecv, core_barrier), virtual registers and get_nc_version.

With ``kernel[2]`` the two programs run as two threads: ``sendrecv`` exchanges SBUF tiles between them
(matched by ``pipe_id`` and call order) and ``core_barrier`` blocks until both programs reach it.
"""

from __future__ import annotations

import numpy as np

from . import access
from . import enums as E
from .checks import SBUF, Instr
from .context import maybe_current, session_target
from .enums import dma_engine, engine, require_enum
from .isa_common import name_arg, store
from .registers import VirtualRegister
from .targets import get_target


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None):
    """Send src to the peer program's dst and receive the peer's src into this program's dst (LNC=2)."""
    I = Instr("nisa.sendrecv")
    de = require_enum(dma_engine, E.dma_engine, "dma_engine", I.name)
    ctx = I.ctx
    if ctx.run.lnc < 2:
        raise I.fail("sendrecv needs an LNC=2 launch (kernel[2](...)); this launch has a single program", "lnc")
    for arg, v in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if not isinstance(v, (int, np.integer)) or int(v) not in (0, 1):
            raise I.fail(f"{arg} must be 0 or 1, got {v!r}", "lnc")
    if not isinstance(pipe_id, (int, np.integer)):
        raise I.fail(f"pipe_id must be an int, got {pipe_id!r}", "lnc")
    gs = I.onchip(src, "src", allowed=(SBUF,), compute=False)
    gd = I.onchip(dst, "dst", allowed=(SBUF,), compute=False)
    if src.dtype is not dst.dtype:
        raise I.fail(f"src ({src.dtype.name}) and dst ({dst.dtype.name}) must have the same dtype", "dtype")
    if gs.partitions != gd.partitions or gs.free_elems != gd.free_elems:
        raise I.fail(f"src {src.shape} and dst {dst.shape} must have the same partitions and elements", "shape")
    if de is E.dma_engine.gpsimd_dma:
        limit = {4: 1024, 2: 512, 1: 256}.get(src.dtype.itemsize, 1024)
        if gs.partitions % 16 or gs.free_elems * src.dtype.itemsize > limit:
            raise I.fail(
                f"gpsimd_dma needs a partition count that is a multiple of 16 and at most {limit} bytes per partition",
                "shape",
            )
    pipe = int(pipe_id)
    seq = ctx.sendrecv_seq.get(pipe, 0)
    ctx.sendrecv_seq[pipe] = seq + 1
    payload = (
        src.shape,
        src.dtype.name,
        None if ctx.shape_only else np.array(access.read(ctx, src)),
    )
    got = ctx.run.sync.sendrecv(
        ctx.rank, pipe, seq, ctx.program_id, int(send_to_rank), int(recv_from_rank), payload, I.name, I.where()
    )
    shape, dname, data = got
    if dname != dst.dtype.name or int(np.prod(shape)) != dst.size:
        raise I.fail(
            f"received a {dname} tile of shape {shape} from program {recv_from_rank} but dst is {dst.dtype.name} "
            f"{dst.shape}",
            "shape",
        )
    if data is not None and I.data:
        store(I, dst, data.reshape(dst.shape))
    nbytes = src.size * src.dtype.itemsize
    ctx.rec.dma(ctx.site(), "sendrecv", ("sbuf", src._st.name), ("sbuf", dst._st.name),
                "gpsimd" if de is E.dma_engine.gpsimd_dma else "dma", "none", nbytes, gs.partitions, gs.partitions)
    I.record("sendrecv", "dma", gs.partitions, gs.free_elems, src.dtype.name, name_arg(name))


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Block until both programs of the LNC=2 pair reach the barrier (data: the shared HBM tensor)."""
    I = Instr("nisa.core_barrier")
    require_enum(engine, E.engine, "engine", I.name)
    ctx = I.ctx
    if ctx.run.lnc < 2:
        raise I.fail("core_barrier needs an LNC=2 launch (kernel[2](...))", "lnc")
    if tuple(cores) != (0, 1):
        raise I.fail(f"only cores=(0, 1) is supported, got {cores!r}", "lnc")
    t = I.tensor(data, "data")
    if t.buffer is not E.MemoryRegion.shared_hbm:
        raise I.fail(f"data must be a shared_hbm tensor, got {t.buffer.name}", "buffer")
    ctx.run.sync.barrier(ctx.rank, I.name, I.where)
    eng = "gpsimd" if engine in (E.engine.gpsimd, E.engine.unknown) else {
        E.engine.vector: "vector", E.engine.scalar: "scalar", E.engine.tensor: "tensor"}.get(engine, "dma")
    I.record("core_barrier", eng, 1, 1, t.dtype.name, name_arg(name))


# ----------------------------------------------------------------------------------------- registers


def register_alloc(x=None):
    """Allocate a virtual register, optionally initialised with an int."""
    if x is not None and not isinstance(x, (int, np.integer)):
        raise Instr("nisa.register_alloc").fail(f"x must be None or an int, got {x!r}", "register")
    return VirtualRegister(None if x is None else int(x))


def register_move(dst, src):
    """dst = src (a compile-time int or another register); one register instruction in the profile."""
    I = Instr("nisa.register_move")
    if not isinstance(dst, VirtualRegister):
        raise I.fail("dst must be a VirtualRegister (from nisa.register_alloc)", "register")
    _writable(I, dst)
    if isinstance(src, VirtualRegister):
        dst.value = src.value
        _touch_register(I, src, write=False)
    elif isinstance(src, (int, np.integer)):
        dst.value = int(src)
    else:
        raise I.fail(f"src must be an int or a VirtualRegister, got {src!r}", "register")
    _touch_register(I, dst, write=True)
    I.record("register_move", "gpsimd", 1, 1, "int32", None)


def _writable(I: Instr, reg: VirtualRegister) -> None:
    """The induction register of nl.dynamic_range is frozen (nki/get-started/nki-language-guide.rst: "you cannot
    write to it with register_move or register_load")."""
    if reg.frozen:
        raise I.fail(f"dst {reg.name} is the induction variable of a nl.dynamic_range loop, which is frozen "
                     f"(no register_move / register_load into it)", "register")


def register_load(dst, src):
    """Load one 32-bit scalar from a 1-element HBM/SBUF tensor into a register."""
    I = Instr("nisa.register_load")
    if not isinstance(dst, VirtualRegister):
        raise I.fail("dst must be a VirtualRegister (from nisa.register_alloc)", "register")
    _writable(I, dst)
    t = I.tensor(src, "src")
    if t.size != 1:
        raise I.fail(f"src must have exactly one element, got shape {t.shape}", "shape")
    if t.buffer is E.MemoryRegion.psum:
        raise I.fail("src must be in HBM or SBUF", "buffer")
    if t.dtype.itemsize > 4:
        raise I.fail("src must be a 32-bit (or smaller) value", "dtype")
    if I.data and not t._st.abstract:
        v = np.asarray(access.read(I.ctx, t)).reshape(-1)[0]
        dst.value = int(v)
    else:
        vals = access.index_values(I.ctx, t, "register", 1, 0, "", I.where)
        dst.value = int(vals[0])
    dst.source = t._st.label
    _touch_register(I, dst, write=True)
    I.record("register_load", "gpsimd", 1, 1, t.dtype.name, None)


def register_store(dst, src):
    """Store a register into a 1-element HBM/SBUF tensor."""
    I = Instr("nisa.register_store")
    t = I.tensor(dst, "dst")
    if not isinstance(src, VirtualRegister):
        raise I.fail("src must be a VirtualRegister", "register")
    if t.size != 1:
        raise I.fail(f"dst must have exactly one element, got shape {t.shape}", "shape")
    if src.value is None:
        raise I.fail(f"register {src.name} is stored before it was written", "register")
    if I.data:
        store(I, t, np.array([src.value], dtype=np.int64 if t.dtype.is_int else np.float32))
    _touch_register(I, src, write=False)
    I.record("register_store", "gpsimd", 1, 1, t.dtype.name, None)


def _touch_register(I: Instr, reg: VirtualRegister, write: bool) -> None:
    """Registers are dependencies too (a DMA with a register ``scalar_offset`` waits for the load)."""
    tr = I.ctx.rec.tracer
    if tr is not None:
        tr.touch(f"r{reg.id}", write)


def get_nc_version():
    """The nc_version of the current target (gen3 = trn2, gen4 = trn3)."""
    ctx = maybe_current()
    if ctx is not None:
        return ctx.target.nc_version
    return get_target(session_target()).nc_version

