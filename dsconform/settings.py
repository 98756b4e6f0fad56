"""Every ``DSCONFORM_*`` environment variable the library reads, in ONE table: its default, its
meaning, and how its text is parsed. docs/options.md lists the same table for users
(tests/profile/test_settings.py holds the two together).

Modules read a setting through ``get(NAME)``: at import for knobs fixed for a process (a pool's
start-up timeout), at call time for those a test or a launcher may change (the cache
directory, the xdist port base). A value that does not parse is a ValueError that names the
variable and what it accepts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_OFF = ("0", "off", "no", "false")
_ON = ("1", "on", "yes", "true")


def _text(value: str) -> str:
    return value.strip()


def _lower(value: str) -> str:
    return value.strip().lower()


def _switch(value: str) -> bool:
    """A yes/no variable: 0/off/no/false (any case) is off; anything else is on."""
    return value.strip().lower() not in _OFF


def _flag(value: str) -> bool:
    """An opt-in flag: unset, empty or 0 is off (the pytest option's convention)."""
    return value not in ("", "0")


def _optional_int(value: str) -> int | None:
    text = value.strip()
    return int(text) if text else None


@dataclass(frozen=True)
class Setting:
    """One environment variable: its default (the text used when it is unset), what it means,
    and the parser that turns its text into the value the code uses."""

    name: str
    default: str
    meaning: str
    parse: Callable[[str], Any] = _text
    accepts: str = ""  # what a ValueError says the variable takes

    def value(self, env: Mapping[str, str] | None = None) -> Any:
        env = os.environ if env is None else env
        text = env.get(self.name)
        if text is None:
            text = self.default
        try:
            return self.parse(text)
        except ValueError:
            raise ValueError(f"{self.name}={text!r}: expected {self.accepts or 'a value'}"
                             ) from None


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("DSCONFORM_PROFILE", "auto",
            "default of --profile: a shipped profile NAME, a PATH to a .toml, or auto"),
    Setting("DSCONFORM_SCRATCH", "",
            "default of --scratch: the directory DeepNVMe and checkpoint tests may write in "
            "(empty: a temporary directory removed at the end)"),
    Setting("DSCONFORM_RESULTS", "dsconform-results",
            "default of --results: where benchmarks.json, junit.xml, summary.* and "
            "records.jsonl are written"),
    Setting("DSCONFORM_NIGHTLY", "", "1: the nightly tier, as --nightly", _flag, "0 or 1"),
    Setting("DSCONFORM_CACHE", "",
            "the suite's cache directory (JIT-built ops, keyed by torch/DeepSpeed/Python "
            "versions); empty: ~/.cache/dsconform"),
    Setting("DSCONFORM_PYCACHE", "1",
            "1: where PYTHONDONTWRITEBYTECODE is set, the suite's processes keep compiled "
            "Python in DSCONFORM_CACHE/pycache (PYTHONPYCACHEPREFIX) instead of compiling "
            "torch and DeepSpeed anew in every rank; 0: leave the environment as it is",
            _switch, "0 or 1"),
    Setting("DSCONFORM_HYPOTHESIS_DIR", "",
            "where hypothesis keeps its example database (empty: .hypothesis in the working "
            "directory)"),
    Setting("DSCONFORM_STARTUP_TIMEOUT_S", "300",
            "seconds allowed for spawning ranks, importing deepspeed and init_distributed "
            "(apart from each call's own timeout)", float, "a number of seconds"),
    Setting("DSCONFORM_MAX_POOLS", "2",
            "rank pools kept alive at once (least recently used is closed first)", int,
            "an integer"),
    Setting("DSCONFORM_SPARE_POOLS", "auto",
            "standby ranks: auto (cuda machines with at least 8 cores), 1 (always), 0 (never)",
            _lower, "auto, 0 or 1"),
    Setting("DSCONFORM_RANK_WARMUP", "1",
            "0: standby and lane ranks do not build a tiny engine before they report ready "
            "(fresh ones: do not import what a first engine imports)",
            _switch, "0 or 1"),
    Setting("DSCONFORM_FORKSERVER", "1",
            "1: ranks are forks of one server process per run that imported torch once "
            "(Linux); 0: every rank is a new interpreter (multiprocessing spawn)",
            _switch, "0 or 1"),
    Setting("DSCONFORM_LANES", "auto",
            "pools per world size that cell batches spread over: auto (on cuda machines "
            "with at least 16 cores 3, or 9 with one GPU; else 1) or a number", _lower,
            "auto or a number"),
    Setting("DSCONFORM_PORT_BASE", "",
            "first rendezvous port of xdist worker 0; each worker takes its own range of 100 "
            "(empty: 29500)", _optional_int, "an integer port"),
    Setting("DSCONFORM_GPUS_PER_WORKER", "",
            "GPUs each pytest-xdist worker owns (empty: an even share of the visible GPUs)",
            _optional_int, "an integer"),
)}


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of setting ``name`` in ``env`` (default: this process's environment)."""
    return SETTINGS[name].value(env)


def given(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The text of setting ``name`` as the environment gives it, None when it is unset (whether
    a value came from there, for messages that say where it came from)."""
    env = os.environ if env is None else env
    return env.get(SETTINGS[name].name)


def is_on(text: str) -> bool:
    """Whether a forced switch's text says on (1/on/yes/true)."""
    return text in _ON


def is_off(text: str) -> bool:
    """Whether a forced switch's text says off (0/off/no/false)."""
    return text in _OFF
