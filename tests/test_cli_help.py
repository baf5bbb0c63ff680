"""Every flag of every lqe command line (``lqe generate / chat / serve``, ``python -m tools.convert``) has help text,
and that text states the default: the formatter appends concrete defaults, and a flag whose default is decided
later (None) says in words what happens."""
from __future__ import annotations

import argparse

import pytest

from lqe.entrypoints.cli import build_parser
from lqe.entrypoints.help_format import HelpFormatter


def _parsers():
    from tools.convert.cli import build_parser as convert_parser

    out = []

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        out.append((name, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    walk(sp, f"{name} {sub}")

    walk(build_parser(), "lqe")
    walk(convert_parser(), "tools.convert")
    return out


PARSERS = _parsers()


@pytest.mark.parametrize("name,parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_every_flag_has_help_with_its_default(name, parser):
    assert issubclass(parser.formatter_class, HelpFormatter) or parser.formatter_class.__name__ == "_Help", \
        f"{name}: --help does not show defaults"
    fmt = parser._get_formatter()
    missing, no_default = [], []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
            continue
        flag = a.option_strings[0] if a.option_strings else a.dest
        if not (a.help or "").strip():
            missing.append(flag)
            continue
        if not a.option_strings or a.required or a.nargs == 0 or isinstance(a.default, bool):
            continue  # positionals, required options and on/off switches have no default to state
        text = fmt._get_help_string(a) % {"default": a.default, "prog": parser.prog, "choices": a.choices}
        if "default" not in text.lower():
            no_default.append(flag)
    assert not missing, f"{name}: flags without help: {missing}"
    assert not no_default, f"{name}: flags whose help does not state the default: {no_default}"
