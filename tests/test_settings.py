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
