"""The ``--help`` layout of every lqe command line (``lqe``, ``lqe serve``, ``python -m tools.convert``)."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless it has no meaningful default (None / False: the help then
    says in words what happens) or already names it."""

    def _get_help_string(self, action):
        if (action.default is None or action.default is False or action.default == argparse.SUPPRESS
                or not action.option_strings or action.nargs == 0 or "default" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)
