"""The bundled API tables load and answer signature/enum/name lookups."""

import pytest

from fusegraph.nkiapi import MODULES, SUPPORTED_VERSIONS, load_table


def test_supported_versions_and_caching():
    assert SUPPORTED_VERSIONS == ("0.3.0", "0.6.0")
    assert load_table() is load_table("0.3.0")
    with pytest.raises(ValueError, match="unsupported"):
        load_table("0.4.0")


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_modules_present(version):
    t = load_table(version)
    for m in MODULES:
        assert t.has_module(m)


def test_function_signature_lookup():
    t = load_table("0.3.0")
    sig = t.function("nki.isa", "dma_copy")
    assert sig.param_names == ("dst", "src", "oob_mode", "dge_mode", "engine", "name")
    assert sig.required == ("dst", "src")
    assert sig.param("dge_mode").default == "dge_mode.unknown"
    assert "priority" in load_table("0.6.0").function("nki.isa", "dma_copy").param_names
    assert t.function("nki.isa", "topk") is None and load_table("0.6.0").function("nki.isa", "topk")
    assert t.function("nki", "jit").accepts_var_keyword


def test_enums_and_names():
    t = load_table("0.3.0")
    assert t.enum_members("nki.isa", "dge_mode") == ("unknown", "swdge", "hwdge", "none")
    assert t.enum("nki.isa", "NkiValidationError") is None  # a class, not an enum
    assert "bfloat16" in t.names("nki.language") and "shared_hbm" in t.names("nki.language")
    assert t.has_attr("nki", "language") and t.has_attr("nki.language", "tile_size")
    assert "pmax" in t.attribute_namespace("nki.language", "tile_size")
    # 0.6 models tile_size as an instance of _TileSize
    assert "psum_bank_fmax" in load_table("0.6.0").attribute_namespace("nki.language", "tile_size")
    assert "psum_bank_fmax" not in t.attribute_namespace("nki.language", "tile_size")
