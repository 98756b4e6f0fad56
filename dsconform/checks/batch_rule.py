"""DeepSpeed's batch-size rule and its judgement (the batch-size suite).

``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``:
given any two, DeepSpeed infers the third; all three that break the rule are refused, and so are
two from which no whole third follows (https://www.deepspeed.ai/docs/config-json/#batch-size-
related-parameters). A refusal must name the values the user gave, so the user can fix them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEYS = ("train", "micro", "accum")  # dsconfig.BATCH_KEYS' names
NAMES = {"train": "train_batch_size", "micro": "train_micro_batch_size_per_gpu",
         "accum": "gradient_accumulation_steps"}


@dataclass(frozen=True)
class BatchCase:
    """The values a config gives (``given``: which of them it writes) on ``world_size`` ranks."""
    train: int
    micro: int
    accum: int
    given: tuple[str, ...]
    world_size: int

    def __post_init__(self) -> None:
        if not set(self.given) <= set(KEYS) or len(self.given) < 2:
            raise ValueError(f"BatchCase: given {self.given!r}: two or three of {KEYS}")

    def value(self, key: str) -> int:
        return getattr(self, key)

    def __str__(self) -> str:
        written = ", ".join(f"{NAMES[k]}={self.value(k)}" for k in KEYS if k in self.given)
        return f"{{{written}}} on {self.world_size} ranks"


def expected(case: BatchCase) -> tuple[int, int, int] | None:
    """(train, micro, accum) by the rule, or None where the rule refuses the case."""
    ws, given = case.world_size, set(case.given)
    if given == set(KEYS):
        ok = case.train == case.micro * case.accum * ws
        return (case.train, case.micro, case.accum) if ok else None
    if "train" not in given:
        return case.micro * case.accum * ws, case.micro, case.accum
    known = case.micro if "micro" in given else case.accum
    third, rest = divmod(case.train, known * ws)
    if rest or third < 1:
        return None
    return (case.train, case.micro, third) if "micro" in given else (case.train, third,
                                                                       case.accum)


def judge(case: BatchCase, found: dict) -> list[str]:
    """DeepSpeed's outcome for ``case`` (``{"values": (train, micro, accum)}`` or ``{"error":
    "Type: message"}``) against the rule: the same three values, or a refusal whose message
    names every value the config gave and the world size."""
    want = expected(case)
    if want is not None:
        if "error" in found:
            return [f"{case}: refused ({found['error']}); the rule gives "
                    f"{_triple(want)}"]
        got = tuple(found["values"])
        if got != want:
            return [f"{case}: DeepSpeed took {_triple(got)}, the rule gives {_triple(want)}"]
        return []
    if "error" not in found:
        return [f"{case}: accepted as {_triple(tuple(found['values']))}; the rule refuses it "
                f"({_why(case)})"]
    unnamed = [f"{NAMES[k]}={case.value(k)}" for k in case.given
               if not re.search(rf"(?<![\d.]){case.value(k)}(?![\d.])", found["error"])]
    if unnamed:
        return [f"{case}: refused, but the error does not name {', '.join(unnamed)}: "
                f"{found['error']!r}"]
    return []


def _triple(v: tuple) -> str:
    return ", ".join(f"{NAMES[k]}={x}" for k, x in zip(KEYS, v))


def _why(case: BatchCase) -> str:
    if set(case.given) == set(KEYS):
        return (f"{case.train} != {case.micro} * {case.accum} * {case.world_size}")
    missing = next(k for k in KEYS if k not in case.given)
    return f"no whole {NAMES[missing]} >= 1 gives {case.train}"
