"""The torch of a DeepSpeed release's time: the newest torch release published before that
DeepSpeed release, among those with a wheel for this Python.

Users ran each DeepSpeed release with the torch of its day, and the bugs of a period show only
there: the radar's default pairs each release with that torch (docs/radar.md#torch). The dates are
the first upload of each release to PyPI (https://pypi.org/project/deepspeed/#history,
https://pypi.org/project/torch/#history); a release newer than these tables is given with
``VERSION@TORCH`` or ``--torch``. docs/radar.md says how to extend them.
"""

from __future__ import annotations

import sys

from dsconform.base.versions import Version, parse

#: DeepSpeed release -> the day it was published on PyPI.
DEEPSPEED_RELEASED = {
    "0.14.0": "2024-03-08", "0.14.1": "2024-04-15", "0.14.2": "2024-04-23", "0.14.3": "2024-06-12",
    "0.14.4": "2024-06-21", "0.14.5": "2024-08-15", "0.15.0": "2024-08-22", "0.15.1": "2024-09-05",
    "0.15.2": "2024-10-09", "0.15.3": "2024-10-22", "0.15.4": "2024-11-08", "0.16.0": "2024-11-25",
    "0.16.1": "2024-12-05", "0.16.2": "2024-12-18", "0.16.3": "2025-01-21", "0.16.4": "2025-02-20",
    "0.16.5": "2025-03-27", "0.16.6": "2025-04-16", "0.16.7": "2025-04-18", "0.16.8": "2025-05-19",
    "0.16.9": "2025-05-22", "0.17.0": "2025-06-02", "0.17.1": "2025-06-09", "0.17.2": "2025-07-07",
    "0.17.3": "2025-07-28", "0.17.4": "2025-07-31", "0.17.5": "2025-08-20", "0.17.6": "2025-09-19",
    "0.18.0": "2025-10-07", "0.18.1": "2025-10-23", "0.18.2": "2025-11-05", "0.18.3": "2025-12-09",
    "0.18.4": "2026-01-07", "0.18.5": "2026-01-30", "0.18.6": "2026-02-12", "0.18.7": "2026-03-05",
    "0.18.8": "2026-03-13", "0.18.9": "2026-03-30", "0.19.0": "2026-05-06", "0.19.1": "2026-05-30",
    "0.19.2": "2026-06-16", "0.19.3": "2026-07-23", "0.19.4": "2026-08-06", "0.19.5": "2026-08-10",
    "0.19.6": "2026-08-27", "0.19.7": "2026-09-16", "0.19.8": "2026-10-20",
}

#: torch release -> (the day it was published on PyPI, the oldest and the newest Python 3 minor
#: it has a Linux x86_64 wheel for).
TORCH_RELEASED = {
    "2.4.0": ("2024-07-24", 8, 12), "2.4.1": ("2024-09-04", 8, 12),
    "2.5.0": ("2024-10-17", 9, 13), "2.5.1": ("2024-10-29", 9, 13),
    "2.6.0": ("2025-01-29", 9, 13), "2.7.0": ("2025-04-23", 9, 13),
    "2.7.1": ("2025-06-04", 9, 13), "2.8.0": ("2025-08-06", 9, 13),
    "2.9.0": ("2025-10-15", 10, 14), "2.9.1": ("2025-11-12", 10, 14),
    "2.10.0": ("2026-01-21", 10, 14), "2.11.0": ("2026-03-23", 10, 14),
    "2.12.0": ("2026-05-13", 10, 14), "2.12.1": ("2026-06-17", 10, 14),
    "2.13.0": ("2026-07-08", 10, 14), "2.14.0": ("2026-09-02", 10, 14),
    "2.14.1": ("2026-09-30", 10, 14), "2.15.0": ("2026-10-28", 11, 15),
}


class UnknownRelease(ValueError):
    """A DeepSpeed release the tables do not date: its torch must be given."""


def period_torch(deepspeed: str, python_minor: int | None = None) -> str:
    """The newest torch published before ``deepspeed`` that has a wheel for Python
    3.``python_minor`` (default: this interpreter's)."""
    v = parse(deepspeed)
    day = DEEPSPEED_RELEASED.get(str(v.public) if v is not None else deepspeed)
    if day is None:
        raise UnknownRelease(f"no publication date known for DeepSpeed {deepspeed}: give its torch "
                             f"as {deepspeed}@TORCH (e.g. {deepspeed}@2.14.1) or with --torch")
    minor = sys.version_info.minor if python_minor is None else python_minor
    older = [t for t, (published, lo, hi) in TORCH_RELEASED.items()
             if published < day and lo <= minor <= hi]
    if not older:
        raise UnknownRelease(f"no torch release before DeepSpeed {deepspeed} ({day}) has a wheel "
                             f"for Python 3.{minor}: give its torch as {deepspeed}@TORCH")
    return max(older, key=Version)
