"""Every official 0.3.0 function exists in the interpreter with exactly the official parameter names, order,
kinds and defaults; the unimplemented ones raise a NotImplementedError naming them."""

import enum
import inspect

import pytest

from fusegraph.nkiapi import load_table
from fusegraph.nkisim import api
from fusegraph.nkisim.modules import nki_modules

TABLE = load_table("0.3.0")
MODULES = ("nki", "nki.language", "nki.isa", "nki.collectives")
ALL = [(m, f) for m in MODULES for f in sorted(TABLE.functions(m))]

_KIND = {
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
}


def default_text(value):
    """The default as the stub spells it (enum members as Class.member, operator tokens as nl.name)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if callable(value) and getattr(value, "__module__", "") == "nki.language":
        return f"nl.{value.__name__}"
    return repr(value)


def test_every_official_function_exists():
    for m, f in ALL:
        assert hasattr(nki_modules()[m], f), f"{m}.{f} missing"


@pytest.mark.parametrize("module,name", ALL, ids=[f"{m}.{f}" for m, f in ALL])
def test_signature_matches_table(module, name):
    fn = getattr(nki_modules()[module], name)
    sig = inspect.signature(fn)
    want = TABLE.function(module, name).params
    got = list(sig.parameters.values())
    assert [p.name for p in got] == [p.name for p in want]
    for g, w in zip(got, want):
        assert _KIND[g.kind] == w.kind, (g.name, g.kind)
        if w.default is None:
            assert g.default is inspect.Parameter.empty, g.name
        else:
            assert g.default is not inspect.Parameter.empty, g.name
            assert default_text(g.default) == w.default, (g.name, g.default, w.default)


IMPLEMENTED = [(m, f) for m in MODULES for f in api.implemented(m)]


def test_implemented_list_is_substantial():
    isa = api.implemented("nki.isa")
    for must in ("dma_copy", "dma_transpose", "tensor_copy", "nc_matmul", "nc_transpose", "tensor_tensor",
                 "tensor_scalar", "scalar_tensor_tensor", "activation", "activation_reduce", "tensor_reduce",
                 "reciprocal", "exponential", "iota", "affine_select", "memset", "max8", "nc_find_index8",
                 "nc_match_replace8", "select_reduce", "range_select", "tensor_copy_predicated", "sendrecv",
                 "core_barrier"):
        assert must in isa
    assert {"all_reduce", "rank_id"} <= set(api.implemented("nki.collectives"))
    assert {"jit", "simulate"} <= set(api.implemented("nki"))


@pytest.mark.parametrize(
    "module,name",
    [(m, f) for m in MODULES for f in api.unimplemented(m)],
    ids=[f"{m}.{f}" for m in MODULES for f in api.unimplemented(m)],
)
def test_unimplemented_raise_named_not_implemented(module, name):
    fn = getattr(nki_modules()[module], name)
    args = [None] * sum(1 for p in inspect.signature(fn).parameters.values()
                        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD)
    with pytest.raises(NotImplementedError, match=f"{module}.{name} is not implemented by fusegraph's interpreter"):
        fn(*args)


def test_enums_and_names_of_the_table_exist():
    for m in MODULES:
        mod = nki_modules()[m]
        for cname, c in TABLE.modules[m].classes.items():
            cls = getattr(mod, cname)
            for member in c.members:
                # static lookup: tile_size's unpublished constants are properties that raise NotImplementedError
                holders = (*cls.__mro__, type(cls))
                assert any(member in vars(h) for h in holders), f"{m}.{cname}.{member}"
        for n in TABLE.names(m):
            assert hasattr(mod, n), f"{m}.{n}"


def test_enum_values_match_stub():
    isa = nki_modules()["nki.isa"]
    assert isa.dge_mode.hwdge.value == 2 and isa.dge_mode.none.value == 3
    assert isa.engine.vector.value == 5 and isa.engine.sync.value == 6
    assert isa.reduce_cmd.reset_reduce.value == 3
    nl = nki_modules()["nki.language"]
    assert nl.hbm is nl.private_hbm
    assert nl.bfloat16 == "bfloat16" and nl.bool_ == "bool"
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_fmax == 512
    assert nl.tile_size.gemm_stationary_fmax == 128 and nl.tile_size.gemm_moving_fmax == 512


def test_unpublished_tile_size_constants_raise():
    nl = nki_modules()["nki.language"]
    with pytest.raises(NotImplementedError, match="psum_min_align"):
        nl.tile_size.psum_min_align
