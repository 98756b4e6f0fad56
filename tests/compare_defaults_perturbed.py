"""A pytest plugin for tests/results/test_compare_defaults.py: the ZeRO suite's defaults test
reads a DeepSpeed whose ``gradient_clipping`` default is 0.0, as DeepSpeed 0.19.0 had it (0.0 up to
0.19.0, 1.0 from 0.19.3: docs/findings.md#deepspeed-releases). The real DeepSpeed in the rank is
changed, not a fake: its config module reads the default from these module globals when it
parses a config."""

from __future__ import annotations

import sys
from typing import Any

import pytest

OLD_GRADIENT_CLIPPING_DEFAULT = 0.0


def read_defaults_of_old_deepspeed() -> dict[str, Any]:
    """Rank entry point: the suite's own reader, after moving DeepSpeed's default back."""
    from deepspeed.runtime import config as ds_cfg
    from deepspeed.runtime import constants

    from suites.zero_ranks import read_effective_defaults

    ds_cfg.GRADIENT_CLIPPING_DEFAULT = OLD_GRADIENT_CLIPPING_DEFAULT
    constants.GRADIENT_CLIPPING_DEFAULT = OLD_GRADIENT_CLIPPING_DEFAULT
    return read_effective_defaults()


def pytest_collection_finish(session: pytest.Session) -> None:
    # The suite module calls run_ranks(read_effective_defaults, ...) through its own global.
    module = sys.modules.get("suites.test_zero")
    if module is None:
        raise RuntimeError("suites.test_zero was not collected: nothing to perturb")
    module.read_effective_defaults = read_defaults_of_old_deepspeed
