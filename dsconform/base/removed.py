"""DeepSpeed features removed upstream, by the release that removed them: ONE registry.

A test that needs a removed feature states it (``requires(onebit="OneBitAdam")``) and the gate
reports the removal by name, release and upstream link on every newer DeepSpeed: a skip that
says "removed in DeepSpeed 0.19.7", recorded in the results like any outcome, instead of an
ImportError somewhere in a traceback. Where the hardware profile promises the feature
(``[deepspeed] onebit = ["OneBitAdam"]``), the same removal is a FAILURE: a node whose users
were promised 1-bit Adam must not look green after an upgrade that took it away.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsconform.base import versions


@dataclass(frozen=True)
class Removal:
    feature: str     # as users name it in a DeepSpeed config / a profile: "OneBitAdam"
    removed_in: str  # the first release without it
    link: str        # the upstream pull request that removed it

    @property
    def text(self) -> str:
        """"OneBitAdam (removed in DeepSpeed 0.19.7, PR #8490 https://...)"."""
        number = self.link.rstrip("/").rsplit("/", 1)[-1]
        return (f"{self.feature} (removed in DeepSpeed {self.removed_in}, PR #{number} "
                f"{self.link})")


PR_8490 = "https://github.com/deepspeedai/DeepSpeed/pull/8490"
#: A DeepSpeed config's 1-bit optimizer "type" (lower case, as dsconform.checks.dsconfig takes it)
#: and its class name.
ONEBIT_TYPES = {"onebit_adam": "OneBitAdam", "zero_one_adam": "ZeroOneAdam",
                "onebit_lamb": "OneBitLamb"}
#: DeepSpeed's 1-bit optimizers by their config "type" (what a profile's deepspeed.onebit lists).
ONEBIT_OPTIMIZERS: tuple[str, ...] = tuple(ONEBIT_TYPES.values())
REMOVALS: dict[str, Removal] = {
    name: Removal(name, "0.19.7", PR_8490)  # with all of deepspeed/runtime/fp16/onebit/
    for name in ONEBIT_OPTIMIZERS
}


def removal(feature: str, deepspeed_version: str | None) -> Removal | None:
    """The feature's removal when the installed DeepSpeed is at or past it (or unknown: no
    DeepSpeed, nothing to train with), else None. KeyError for a feature not in the registry."""
    r = REMOVALS[feature]
    installed = versions.parse(deepspeed_version)
    if installed is not None and installed < versions.Version(r.removed_in):
        return None
    return r
