"""matplotlib is an optional extra (``pip install 'dsconform[plot]'``): the one check that it is
there, with a message that says what to install and what the caller does without it."""

from __future__ import annotations

import importlib


class PlotUnavailable(RuntimeError):
    """matplotlib is missing; the message is the one line to show."""


def require(missing: str) -> None:
    """Raise PlotUnavailable(missing) when matplotlib cannot be imported."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise PlotUnavailable(missing) from None
