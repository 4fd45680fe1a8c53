"""``.ap()`` on a view (issue 25 item 1), per NKI version (``fusegraph.nkisim.apiversion``).

* NKI 0.3 (SDK 2.29): nki/deep-dives/nki-aps.rst of SDK 2.29, section "Restriction on Nested Indexing": "The ``.ap``
  method is only allowed on ``nl.ndarray`` and cannot be called on a tile produced by it" -> rule ``nested-ap``.
* NKI 0.6 (SDK 2.32): the same page, section "Composition and ``.ap`` on a view": "``.ap`` addresses the tensor's
  underlying storage directly: the pattern and offset are interpreted against ``storage``, ignoring any shape,
  strides, or offset carried by the view"; ``offset=None`` "inherits the current view's storage offset".
* Both: ``.ap`` on a whole tensor, a reshape of it, or an ``.ap()`` covering it as it is (nki-library's
  ``TensorView(t).get_view()`` chain in the hardware-tested ``moe_tkg``) means the same in either version.
"""
import itertools
import re
import textwrap

import numpy as np
import pytest
import torch

from fusegraph import nkisim
from fusegraph.codegen import ir
from fusegraph.codegen.testing import Builder, V
from fusegraph.nkisim import NkiSimError, load_kernel_source
from fusegraph.nkisim.apiversion import API_ENV, api_version, use_api_version
from fusegraph.patterns.attention.lowering import StreamSwitches, use_switches

HDR = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n"
_n = itertools.count()
RNG = np.random.default_rng(25)

# the streamed template's row-group copy: rows 64:128 of a [128, 8] tile, copied through a [64, 8] pattern
ROW_GROUP = """
@nki.jit
def k(x):
    out = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    src = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=x)
    dst = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=dst, value=0.0)
    nisa.tensor_copy(dst=dst{DST}, src=src{SRC})  # <-
    nisa.dma_copy(dst=out, src=dst)
    return out
"""


def _kernel(body: str):
    src = HDR + textwrap.dedent(body)
    fname = f"/virtual/ap_views_{next(_n)}.py"
    line = next(i + 1 for i, s in enumerate(src.splitlines()) if "# <-" in s)
    return load_kernel_source(src, fname, target="trn3")["k"], f"{fname}:{line}"


def _row_group(dst: str, src: str):
    return _kernel(ROW_GROUP.replace("{DST}", dst).replace("{SRC}", src))


X = RNG.standard_normal((128, 8)).astype(np.float32)
SLICED = ("[64:128].ap(pattern=[[8, 64], [1, 8]], offset=0)",) * 2  # the old emitted form
BASED = (".ap(pattern=[[8, 64], [1, 8]], offset=512)",) * 2  # the fixed form: the view's offset in offset=


def test_default_is_0_3_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv(API_ENV, raising=False)
    assert api_version() == "0.3.0"
    monkeypatch.setenv(API_ENV, "0.6.0")
    assert api_version() == "0.6.0"
    with use_api_version("0.3.0"):
        assert api_version() == "0.3.0"
    monkeypatch.setenv(API_ENV, "0.5")
    with pytest.raises(ValueError, match=API_ENV):
        api_version()
    with pytest.raises(ValueError):
        use_api_version("1.0").__enter__()


@pytest.mark.parametrize("expr", [
    "[64:128].ap(pattern=[[8, 64], [1, 8]], offset=0)",                            # a partition slice
    "[:, 2:4].ap(pattern=[[2, 128], [1, 2]], offset=0)",                           # a free-dim slice
    ".ap(pattern=[[8, 128], [2, 4]], offset=0).ap(pattern=[[8, 128], [1, 4]])",  # .ap().ap() (partial inner)
])
def test_0_3_rejects_ap_on_a_view(expr):
    """nki-aps.rst (SDK 2.29), "Restriction on Nested Indexing": the error names the rule, the kernel line and the
    fix (call .ap on the base tensor with the view's offset)."""
    k, loc = _kernel(f"""
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        v = t{expr}  # <-
        return x
    """)
    with use_api_version("0.3.0"), pytest.raises(NkiSimError) as ei:
        nkisim.run(k, X)
    assert ei.value.rule == "nested-ap", str(ei.value)
    assert loc in str(ei.value) and "Restriction on Nested Indexing" in str(ei.value)
    assert "base tensor" in str(ei.value)


@pytest.mark.parametrize("version", ["0.3.0", "0.6.0"])
def test_ap_on_the_base_with_the_offset_copies_the_row_group(version):
    """The fixed emitted form: .ap on the tile itself, offset = 64 partitions x 8 elements; the same in both."""
    k, _ = _row_group(*BASED)
    with use_api_version(version):
        out = nkisim.run(k, X)
    ref = np.zeros_like(X)
    ref[64:] = X[64:]
    np.testing.assert_array_equal(out, ref)


def test_0_6_resolves_ap_on_a_view_against_the_storage():
    """nki-aps.rst (SDK 2.32), "Composition and .ap on a view": the old emitted ``t[64:128].ap(..., offset=0)``
    addresses partitions 0-63 of the storage, so the row group lands on partitions 0-63 (what the issue measured
    in the streamed template under that rule)."""
    k, _ = _row_group(*SLICED)
    with use_api_version("0.6.0"):
        out = nkisim.run(k, X)
    ref = np.zeros_like(X)
    ref[:64] = X[:64]
    np.testing.assert_array_equal(out, ref)


def test_0_6_offset_none_inherits_the_view_offset_and_outer_ap_overrides_inner():
    k, _ = _row_group("[64:128].ap(pattern=[[8, 64], [1, 8]])",
                      ".ap(pattern=[[8, 128], [2, 4]], offset=0).ap(pattern=[[8, 64], [1, 8]], offset=512)")
    with use_api_version("0.6.0"):
        out = nkisim.run(k, X)
    ref = np.zeros_like(X)
    ref[64:] = X[64:]
    np.testing.assert_array_equal(out, ref)


def test_sdk_2_27_keeps_the_view_relative_reading_of_the_hand_kernel():
    """The hand-written Qwen3 megakernel (SDK 2.27) reads ``col_all[0:P, l:l + 1].ap(...)`` as column ``l``."""
    k, _ = _row_group(*SLICED)
    with use_api_version("sdk-2.27"):
        out = nkisim.run(k, X)
    ref = np.zeros_like(X)
    ref[64:] = X[64:]
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("version", ["0.3.0", "0.6.0"])
def test_whole_views_are_ap_bases_in_every_version(version):
    """A reshape of a kernel argument (the hand kernels' ``K_cache.reshape((B * S, d)).ap(...)``) and an .ap()
    covering its tensor as it is (nki-library's ``TensorView(t).get_view()`` then ``.slice().get_view()``)."""
    k, _ = _kernel("""
    @nki.jit
    def k(x):
        out = nl.ndarray((64, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.reshape((128, 2, 4)).ap(pattern=[[8, 128], [1, 8]], offset=0))
        whole = t.ap(pattern=[[8, 128], [1, 8]], offset=0)
        nisa.dma_copy(dst=out, src=whole.ap(pattern=[[8, 64], [1, 4]], offset=8 * 64 + 4))  # <-
        return out
    """)
    with use_api_version(version):
        out = nkisim.run(k, X)
    np.testing.assert_array_equal(out, X[64:, 4:])


# ------------------------------------------------------------------ the streamed template's row-group copies

def _row_group_attention(dtype=torch.float32):
    """4 kv heads x 8 query heads, 4,096 positions in blocks of 1,024: 32 score rows per head group, so 4 row
    groups of 32 partitions and the per-head diagonal copies (``HC > 1``) that emitted ``pTz[rows].ap(...)``."""
    torch.manual_seed(3)
    pos, L, Hq, Hkv, D = [5, 1279, 4095], 4096, 32, 4, 64
    B = len(pos)
    b = Builder(B)
    q = b.act("q", (2 * torch.randn(B, Hq * D)).to(dtype))
    kc = b.hbm("k_cache", torch.randn(B, Hkv, L, D, dtype=dtype), V.STATE)
    vc = b.hbm("v_cache", torch.randn(B, Hkv, L, D, dtype=dtype), V.STATE)
    mask = torch.zeros(B, L)
    for i, p in enumerate(pos):
        mask[i, p + 1:] = torch.finfo(torch.float32).min
    m = b.hbm("mask", mask.to(dtype), V.INPUT)
    o = b.new("o", Hq * D, dtype)
    b.ins.append(ir.Attention(q=q, k_cache=kc, v_cache=vc, mask=m, out=o, scale=D ** -0.5, groups=Hq // Hkv,
                              softcap=0.0, index=None, block=1024, layer=0))
    b.store(o)
    return b


def test_streamed_row_group_copies_call_ap_on_the_tiles_and_match_the_reference():
    """No ``.ap`` on a slice in the emitted kernel; under 0.3 (which would reject one) it matches the reference
    VM, and under 0.6 it computes bit for bit the same (no view-dependent addressing left)."""
    b = _row_group_attention()
    with use_api_version("0.3.0"), use_switches(StreamSwitches(row_groups=4)):  # 4 groups, not the modeled choice
        gen, res, ref, _ = b.run()
    copies = [s for s in gen.source.splitlines() if ".pT_copy" in s and ".ap(" in s]
    assert copies and not re.search(r"\]\.ap\(", gen.source)
    offsets = [int(v) for s in copies for v in re.findall(r"pTz\.ap\(pattern=\[.*?\]\], offset=(\d+)", s)]
    assert any(o >= 32 * 4 * 8 for o in offsets), offsets  # a row group past partition 0, in the offset
    torch.testing.assert_close(res["out_o"].float(), ref["o"].float(), atol=2e-5, rtol=2e-5)
    with use_api_version("0.6.0"), use_switches(StreamSwitches(row_groups=4)):
        _, res6, _, _ = b.run()
    assert torch.equal(res6["out_o"], res["out_o"])


@pytest.mark.slow
def test_two_layer_qwen3_30b_a3b_at_32k_has_no_ap_on_a_view():
    """The kernel the issue counted 8 ``pTz[64:128].ap(...)`` lines in (2 layers, 32,768 positions, trn3): built
    and run shape-only under 0.3, which rejects ``.ap`` on a view, and no such form in its source."""
    from fusegraph.api.kernel import build_decode_kernel

    with use_api_version("0.3.0"):
        built = build_decode_kernel("qwen3-30b-a3b", target="trn3",
                                    case_kwargs={"num_layers": 2, "max_cache_len": 32768})
    src = built.generated.source
    assert src.count("streamed in blocks of") == 2 and built.profile
    assert src.count(".pT_copy") >= 8 and "pTz.ap(" in src
    assert not re.search(r"\]\.ap\(", src)
