"""One default target (issue 25 item 6): ``fusegraph.settings.DEFAULT_TARGET`` is ``Settings.target``'s default and
every CLI ``--target``'s; the interpreter's own fallback (no target anywhere) is ``nki.simulate``'s trn3
(nki/guides/nki_simulator.rst of SDK 2.29, "Target Platform": "otherwise defaults to trn3"), and fusegraph never
relies on it: the executors pass the setting."""
from __future__ import annotations

import argparse

from fusegraph import nkisim
from fusegraph.cli import build_parser
from fusegraph.nkisim import targets
from fusegraph.settings import DEFAULT_TARGET, TARGETS, Settings


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_settings_and_every_cli_target_share_one_default():
    assert DEFAULT_TARGET in TARGETS and Settings().target == DEFAULT_TARGET
    commands = _subparsers(build_parser())
    with_target = {}
    for name, sub in commands.items():
        for a in sub._actions:
            if "--target" in a.option_strings:
                with_target[name] = (a.default, tuple(a.choices or ()))
    assert {"export-sft", "llm-eval", "kernel"} <= set(with_target), with_target
    for name, (default, choices) in with_target.items():
        if name == "nki-run":  # runs a user's file: None = the interpreter's rule, like nki.simulate
            assert default is None
            continue
        assert default == DEFAULT_TARGET and set(choices) == set(TARGETS), (name, default, choices)


def test_the_interpreter_fallback_is_nki_simulates(monkeypatch):
    monkeypatch.delenv(targets.ENV_TARGET, raising=False)
    assert targets.DEFAULT_TARGET == "trn3" and nkisim.get_target(None).name == "trn3"
    assert nkisim.get_target(DEFAULT_TARGET).name == DEFAULT_TARGET
