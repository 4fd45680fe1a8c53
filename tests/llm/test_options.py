"""The LLM option: nested options={"llm": {...}} and FUSEGRAPH_LLM_* environment variables."""
import pytest

from fusegraph.llm.writer import enabled
from fusegraph.settings import FusegraphOptionError, Settings


def test_nested_llm_options_flatten_to_the_env_overridable_fields():
    s = Settings.from_options({"llm": {"url": "http://h:8000/v1", "model": "nki-coder", "max_rounds": "3"}}, env={})
    assert (s.llm_url, s.llm_model, s.llm_max_rounds) == ("http://h:8000/v1", "nki-coder", 3)
    assert enabled(s) and not enabled(Settings.from_options({}, env={}))
    env = Settings.from_options({}, env={"FUSEGRAPH_LLM_URL": "http://e/v1", "FUSEGRAPH_LLM_MODEL": "m"})
    assert (env.llm_url, env.llm_model) == ("http://e/v1", "m") and enabled(env)
    over = Settings.from_options({"llm": {"model": "a"}}, env={"FUSEGRAPH_LLM_MODEL": "b"})
    assert over.llm_model == "b"


def test_bad_nested_llm_options():
    with pytest.raises(FusegraphOptionError, match=r"unknown fusegraph option llm\.uri.*url"):
        Settings.from_options({"llm": {"uri": "x"}}, env={})
    with pytest.raises(FusegraphOptionError, match="given twice"):
        Settings.from_options({"llm": {"url": "x"}, "llm_url": "y"}, env={})
    with pytest.raises(FusegraphOptionError, match="expects a dict"):
        Settings.from_options({"llm": "http://x"}, env={})
    with pytest.raises(FusegraphOptionError, match="expects int"):
        Settings.from_options({"llm": {"max_rounds": "many"}}, env={})
