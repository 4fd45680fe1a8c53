"""Static conformance checking of kernel source against the API tables."""

import pytest

from fusegraph.nkiapi import ConformanceError, Violation, assert_conforms, check_source

GOOD = '''
import nki
import nki.language as nl
import nki.isa as nisa
import nki.collectives as nccl
from nki import language as lang


@nki.jit
def kernel(x, w):
    out = nl.ndarray(shape=x.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
    t = nl.ndarray(shape=(nl.tile_size.pmax, 512), dtype=lang.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[0:128, nl.ds(0, 512)], dge_mode=nisa.dge_mode.hwdge)
    for i in nl.affine_range(4):
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0, engine=nisa.engine.vector)
    nisa.activation(dst=t, op=nl.exp, data=t, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    pid = nl.program_id(0)
    nccl.all_reduce(srcs=[t], dsts=[t], replica_group=nccl.ReplicaGroup([[0, 1]]), op=nl.add)
    v = t.reshape((128, 2, 256)).view(nl.float32)
    nisa.dma_copy(dst=out, src=t)
    return out
'''


def msgs(src, **kw):
    return [v.message for v in check_source(src, **kw)]


def test_good_source_passes():
    assert check_source(GOOD) == []
    assert_conforms(GOOD)


def test_generated_style_kernel_files_pass():
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = open(os.path.join(here, "nkisim", "nki_kernels.py")).read()
    assert msgs(src) == []


@pytest.mark.parametrize(
    "line,expected",
    [
        ("nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.add, dtype=nl.float32)",
         "line 4: nisa.tensor_tensor has no parameter 'dtype' in NKI 0.3.0, 0.6.0"),
        ("nisa.frobnicate(dst=t)", "line 4: nisa.frobnicate is not in NKI 0.3.0, 0.6.0"),
        ("nisa.topk(val_dst=t, idx_dst=t, src=t, n=8)", "line 4: nisa.topk is not in NKI 0.3.0"),
        ("nl.fori_loop(lower=0, upper=4, body_fn=None)", "line 4: nl.fori_loop is not in NKI 0.3.0"),
        ("x = nl.tile_size.psum_bank_fmax", "line 4: nl.tile_size.psum_bank_fmax is not in NKI 0.3.0"),
        ("x = nisa.dge_mode.fast", "line 4: nisa.dge_mode.fast is not in NKI 0.3.0, 0.6.0"),
        ("x = nl.float8_e8m0fnu", "line 4: nl.float8_e8m0fnu is not in NKI 0.3.0"),
        ("nisa.nc_matmul(dst=t, stationary=t)", "line 4: nisa.nc_matmul is missing required argument 'moving'"),
        ("nisa.tensor_tensor(t, t, t, nl.add)",
         "line 4: nisa.tensor_tensor is called with 4 positional argument(s); pass every argument by keyword"),
        ("nl.zeros((128, 4), nl.float32)", "line 4: nl.zeros is called with 2 positional argument(s)"),
        ("nisa.dma_copy(dst=t, src=t, priority=1)", "line 4: nisa.dma_copy has no parameter 'priority' in NKI 0.3.0"),
        ("y = t.permute((1, 0))", "line 4: tensor method .permute() only exists from NKI 0.5"),
        ("y = t.broadcast(1, 4)", "line 4: tensor method .broadcast() only exists from NKI 0.5"),
        ("nisa.memset(**kw)", "line 4: nisa.memset is called with **kwargs"),
        ("nisa.memset(dst=t, value=0, dst=t)", "line 4: nisa.memset got a keyword argument more than once"),
        ("nisa.memset(t, value=0, dst=t)", "line 4: nisa.memset got parameter 'dst' both by position and by keyword"),
    ],
)
def test_violations_are_flagged_precisely(line, expected):
    src = "import nki.language as nl\nimport nki.isa as nisa\nt = None\n" + line + "\n"
    got = msgs(src)
    assert any(m.startswith(expected) for m in got), got


def test_only_requested_versions_are_checked():
    src = "import nki.isa as nisa\nnisa.topk(val_dst=1, idx_dst=1, src=1, n=8)\n"
    assert check_source(src, versions=("0.6.0",)) == []
    assert check_source(src, versions="0.3.0")


def test_positional_args_allowed_without_require_keywords_and_for_conventional_functions():
    src = "import nki.isa as nisa\nimport nki.language as nl\nnisa.memset(1, 0)\nnl.ds(0, 4)\nnl.program_id(0)\n"
    assert msgs(src, require_keywords=False) == []
    assert [m for m in msgs(src) if "nl." in m] == []


def test_import_forms_and_unknown_modules():
    src = (
        "import nki.language\nfrom nki.language import add, frob\nfrom nki.isa.constants import oob_mode\n"
        "import nki.typing as nt\nx = nki.language.sbuf\ny = nki.language.nothing\nz = nt.tensor[128, 4]\n"
        "add(x=1, y=2)\nadd(1, 2, 3, 4)\n"
    )
    got = msgs(src)
    assert "line 2: nki.language.frob is not in NKI 0.3.0, 0.6.0" in got
    assert "line 3: module nki.isa.constants is not part of the NKI 0.3.0, 0.6.0 API" in got
    assert "line 6: nki.language.nothing is not in NKI 0.3.0, 0.6.0" in got
    assert any(m.startswith("line 9: add takes at most 3 positional argument(s), got 4") for m in got)
    assert not any(m.startswith("line 8") or m.startswith("line 7") or m.startswith("line 5") for m in got)


def test_assert_conforms_lists_all_violations():
    src = "import nki.isa as nisa\nnisa.topk(val_dst=1)\nnisa.nope(x=1)\n"
    with pytest.raises(ConformanceError) as ei:
        assert_conforms(src, filename="gen.py")
    assert len(ei.value.violations) >= 2
    text = str(ei.value)
    assert "gen.py" in text and "line 2: nisa.topk" in text and "line 3: nisa.nope" in text
    assert isinstance(ei.value.violations[0], Violation) and ei.value.violations[0].line == 2


def test_syntax_error_is_a_violation():
    v = check_source("def f(:\n")
    assert len(v) == 1 and v[0].message.startswith("line 1: syntax error")
