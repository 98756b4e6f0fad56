"""Hypothesis profiles, registered in one place (docs/options.md): ci (derandomized, no example
database, few examples), dev (the default; ci where CI is set and for the acceptance tier) and
soak (nightly: many examples). DSCONFORM_HYPOTHESIS_DIR moves hypothesis's example database out
of the working directory, so nodes never write into a shared (maybe read-only) checkout.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from dsconform import settings as dsconform_settings


def register() -> None:
    home = dsconform_settings.get("DSCONFORM_HYPOTHESIS_DIR")
    if home:
        from hypothesis.configuration import set_hypothesis_home_dir
        set_hypothesis_home_dir(home)
    # Distributed examples take seconds each; deadlines would only measure the machine.
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
    settings.register_profile("ci", max_examples=5, derandomize=True, database=None, **common)
    settings.register_profile("dev", max_examples=10, **common)
    settings.register_profile("soak", max_examples=200, **common)
    default = "ci" if os.environ.get("CI") else "dev"
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default))


def use_for_acceptance(config) -> None:
    """The acceptance tier (``-m gpu`` without ``--nightly``) takes ``ci`` unless a profile was
    chosen (``--hypothesis-profile``, HYPOTHESIS_PROFILE, CI)."""
    if (os.environ.get("HYPOTHESIS_PROFILE") or os.environ.get("CI")
            or config.getoption("hypothesis_profile", None)):
        return
    settings.load_profile("ci")
