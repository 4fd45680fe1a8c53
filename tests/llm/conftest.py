import pytest

from fusegraph.settings import Settings


@pytest.fixture
def llm_settings(tmp_path):
    """Settings for the writer pointed at a URL, with a private cache and short limits."""

    def make(url: str, **llm) -> Settings:
        opts = {"url": url, "model": "fake-nki-coder", "cache_dir": str(tmp_path / "cache"), "max_rounds": 0,
                "run_timeout_s": 30, "timeout_s": 10}
        opts.update(llm)
        return Settings.from_options({"llm": opts}, env={})

    return make
