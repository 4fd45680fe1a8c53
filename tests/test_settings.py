import pytest

from fusegraph.settings import FusegraphOptionError, Settings, describe_options


def test_defaults_and_options():
    s = Settings.from_options({"target": "trn3", "dryrun": True}, env={})
    assert s.target == "trn3" and s.dryrun is True and s.executor == "auto"
    with pytest.raises(Exception):
        s.target = "trn2"  # frozen


def test_unknown_option_lists_valid_names():
    with pytest.raises(FusegraphOptionError) as e:
        Settings.from_options({"taget": "trn3"}, env={})
    msg = str(e.value)
    assert "'taget'" in msg
    for name in Settings.field_names():
        assert name in msg


def test_env_overrides_options():
    s = Settings.from_options({"target": "trn2"}, env={"FUSEGRAPH_TARGET": "trn3", "FUSEGRAPH_DRYRUN": "1"})
    assert s.target == "trn3" and s.dryrun is True


def test_bad_values_are_rejected():
    with pytest.raises(FusegraphOptionError, match="must be one of"):
        Settings.from_options({"target": "trn9"}, env={})
    with pytest.raises(FusegraphOptionError, match="expects bool"):
        Settings.from_options({"dryrun": "maybe"}, env={})
    with pytest.raises(FusegraphOptionError):
        Settings.from_options({}, env={"FUSEGRAPH_EXECUTOR": "gpu"})


def test_every_option_is_documented():
    text = describe_options()
    for name in Settings.field_names():
        assert name in text and f"FUSEGRAPH_{name.upper()}" in text


def test_options_page_is_up_to_date():
    import pathlib

    page = (pathlib.Path(__file__).parent.parent / "docs" / "options.md").read_text()
    assert describe_options(markdown=True) in page, "regenerate docs/options.md with `fusegraph options --markdown`"


@pytest.mark.parametrize("options, env, why", [
    ({"weight_buffers": 2.9}, {}, "expects int"),  # int(2.9) used to truncate it to 2, silently
    ({}, {"FUSEGRAPH_WEIGHT_BUFFERS": "2.9"}, "expects int"),
    ({"weight_buffers": 1}, {}, "must be >= 2"),
    ({"weight_chunk_kib": 0}, {}, "must be >= 1"),
    ({"min_region_size": -1}, {}, "must be >= 0"),
    ({"sbuf_budget": -4096}, {}, "must be >= 0"),
    ({"llm_timeout_s": 0}, {}, "must be > 0"),
    ({"llm_run_timeout_s": -1.0}, {}, "must be > 0"),
    ({"verify_tolerance": -1e-4}, {}, "must be >= 0"),
    ({}, {"FUSEGRAPH_VERIFY_TOLERANCE": "nan"}, "must be >= 0"),
    ({"attn_block_max": 200}, {}, "multiple of 128"),
    ({"attn_row_groups": 3}, {}, "must be one of"),
    ({"llm_timeout_s": True}, {}, "expects float"),
])
def test_out_of_range_values_name_the_option(options, env, why):
    with pytest.raises(FusegraphOptionError, match=why) as e:
        Settings.from_options(options, env=env)
    (name,) = {**options, **{k[len("FUSEGRAPH_"):].lower(): v for k, v in env.items()}}
    assert repr(name) in str(e.value)


def test_integral_values_and_bounds_are_accepted():
    s = Settings.from_options({"weight_buffers": 3.0, "weight_chunk_kib": "8", "sbuf_budget": 0}, env={})
    assert (s.weight_buffers, s.weight_chunk_kib, s.sbuf_budget) == (3, 8, 0)
    assert type(s.weight_buffers) is int
    assert Settings.from_options({}, env={"FUSEGRAPH_WEIGHT_BUFFERS": " 2 "}).weight_buffers == 2
    with pytest.raises(FusegraphOptionError, match="'weight_buffers' must be >= 2"):
        Settings().replace(weight_buffers=0)


def test_attention_switches_are_options_nested_or_flat():
    s = Settings.from_options({"attn": {"pipeline": False, "row_groups": 2}}, env={"FUSEGRAPH_ATTN_KT_BY_DMA": "1"})
    assert (s.attn_pipeline, s.attn_row_groups, s.attn_kt_by_dma) == (False, 2, True)
    with pytest.raises(FusegraphOptionError, match="unknown fusegraph option attn.pipelin"):
        Settings.from_options({"attn": {"pipelin": False}}, env={})


def test_bounds_are_documented():
    text = describe_options(markdown=True)
    assert "`FUSEGRAPH_WEIGHT_BUFFERS` | SBUF ring buffers" in text and "Must be >= 2." in text
    assert "Must be >= 128, a multiple of 128." in text


def test_sync_timeout_env_that_is_not_a_number_warns_and_names_it(monkeypatch):
    import warnings

    from fusegraph import FusegraphWarning
    from fusegraph.nkisim.sync import default_timeout
    from fusegraph.warnings import reset_warnings

    for raw, want in (("abc", 60.0), ("-3", 60.0), ("inf", 60.0), ("2.5", 2.5)):
        reset_warnings()
        monkeypatch.setenv("FUSEGRAPH_NKISIM_SYNC_TIMEOUT", raw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert default_timeout() == want
        msgs = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
        if want == 60.0:
            assert msgs == [f"fusegraph: FUSEGRAPH_NKISIM_SYNC_TIMEOUT={raw!r} is not a positive number of seconds; "
                            "using 60"]
        else:
            assert msgs == []


def test_direct_construction_is_held_to_the_bounds():
    with pytest.raises(FusegraphOptionError, match="'weight_chunk_kib' must be >= 1"):
        Settings(weight_chunk_kib=0)
