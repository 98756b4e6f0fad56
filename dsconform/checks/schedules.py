"""DeepSpeed's learning-rate schedules: the config section a user writes for each, and a
plain-Python model of the learning rate each one documents, step by step.

Documented at https://deepspeed.readthedocs.io/en/latest/schedulers.html (the docstrings of
``deepspeed/runtime/lr_schedules.py``). Where the page is silent the model follows that file,
which is the same in 0.19.6 and 0.19.8:

- ``deepspeed.initialize`` builds the scheduler from the config's ``"scheduler"`` section on the
  engine's optimizer; building it sets the lr of iteration -1. The engine steps the scheduler
  once after every applied optimizer step (a skipped fp16 step does not step it), so the
  scheduler's iteration ``i`` (``last_batch_iteration``) after ``k`` applied steps is ``k - 1``
  and **training step k (0-based) uses lr_at(k - 1)**.
- ``W = max(2, warmup_num_steps)``: DeepSpeed never warms up over fewer than 2 steps.
- WarmupLR: ``min + (max - min) * g(i)``, ``g = log(i + 1) / log(W)`` (``warmup_type`` "log") or
  ``i / W`` ("linear") while ``i < W``, then 1: the lr stays at ``warmup_max_lr``. Iteration -1
  gives ``warmup_min_lr``.
- WarmupDecayLR: WarmupLR up to ``W``, then ``g = max(0, (T - i) / max(1, T - W))`` with
  ``T = total_num_steps``: linear decay to ``warmup_min_lr`` at ``T``, and there it stays.
- WarmupCosineLR: the optimizer's own lr (``base_lr``) times a ratio: during warmup
  ``warmup_min_ratio + g(i) * (1 - warmup_min_ratio)``, then
  ``max(0, c + (1 - c) * (1 + cos(pi * p)) / 2)`` with ``c = cos_min_ratio`` and
  ``p = min(1, (i - W + 1) / max(1, T - W))``. Iteration -1 gives ratio 0, not
  ``warmup_min_ratio``: the first optimizer step runs at lr 0.
- OneCycle ("1Cycle"): a cycle of ``F = cycle_first_step_size`` rising and ``S =
  cycle_second_step_size`` (None: ``F``) falling iterations, ``T = F + S``. At iteration ``i < T``
  the position in the cycle is ``c = (i + 1) mod T``; the scale is ``c / F`` while ``c <= F``,
  else ``(T - c) / S``; a stair count ``n > 0`` of that half holds it at ``floor(scale * n) / n``
  (computed from the integer position); lr = ``cycle_min_lr + (cycle_max_lr - cycle_min_lr) *
  scale``. From ``i >= T``: ``cycle_min_lr / (1 + decay_lr_rate * (i - T + 1) /
  decay_step_size)``, or ``cycle_min_lr`` when either is 0. Momentum cycling is written out as
  off (``cycle_momentum`` false): the model covers the lr only.

Each schedule is a frozen dataclass whose fields are the section's ``params``, written out in
full by ``section()`` (what ``ds_config(scheduler=...)`` puts into the config), so a DeepSpeed
default that moves cannot reach a test by omission.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

WARMUP_TYPES = ("log", "linear")


def _fail(schedule: str, field: str, value: Any, reason: str) -> None:
    raise ValueError(f"{schedule}({field}={value!r}): {reason}")


def _check_int(schedule: str, field: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(schedule, field, value, f"must be an integer >= {low}")


def _check_number(schedule: str, field: str, value: Any, low: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < low:
        _fail(schedule, field, value, f"must be a finite number >= {low:g}")


def _warmup_gamma(iteration: int, warmup: int, warmup_type: str) -> float:
    """The warmup's fraction of the way up at ``iteration`` (0 <= iteration < warmup)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup)
    return iteration / warmup


@dataclass(frozen=True)
class WarmupLR:
    """``"type": "WarmupLR"``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""
    type: ClassVar[str] = "WarmupLR"
    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 0.001
    warmup_num_steps: int = 1000
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        _check_number(self.type, "warmup_min_lr", self.warmup_min_lr)
        _check_number(self.type, "warmup_max_lr", self.warmup_max_lr)
        _check_int(self.type, "warmup_num_steps", self.warmup_num_steps, 1)
        if self.warmup_type not in WARMUP_TYPES:
            # DeepSpeed logs a warning and silently falls back to "log".
            _fail(self.type, "warmup_type", self.warmup_type, f"must be one of {WARMUP_TYPES}")

    @property
    def warmup(self) -> int:
        return max(2, self.warmup_num_steps)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup:
            return _warmup_gamma(iteration, self.warmup, self.warmup_type)
        return 1.0

    def lr_at(self, iteration: int, base_lr: float) -> float:
        """The lr the scheduler sets at ``iteration`` (-1: as built). ``base_lr`` (the
        optimizer's own lr) is unused: the section states both ends."""
        if iteration < 0:
            return float(self.warmup_min_lr)
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * \
            self._gamma(iteration)

    def peak(self, base_lr: float) -> float:
        return max(self.warmup_min_lr, self.warmup_max_lr)

    def boundaries(self) -> tuple[int, ...]:
        """Iterations where the formula changes piece (the last warmup one and the next)."""
        return (self.warmup - 1, self.warmup)

    def section(self) -> dict[str, Any]:
        return {"type": self.type, "params": asdict(self)}


@dataclass(frozen=True)
class WarmupDecayLR(WarmupLR):
    """``"type": "WarmupDecayLR"``: WarmupLR, then linear decay to ``warmup_min_lr`` at
    ``total_num_steps``."""
    type: ClassVar[str] = "WarmupDecayLR"
    total_num_steps: int = 10000

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self.type, "total_num_steps", self.total_num_steps, 1)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup:
            return _warmup_gamma(iteration, self.warmup, self.warmup_type)
        return max(0.0, (self.total_num_steps - iteration)
                   / max(1, self.total_num_steps - self.warmup))

    def boundaries(self) -> tuple[int, ...]:
        t = self.total_num_steps
        return tuple(sorted({self.warmup - 1, self.warmup, t - 1, t}))


@dataclass(frozen=True)
class WarmupCosineLR:
    """``"type": "WarmupCosineLR"``: the optimizer's lr times a ratio that warms up from
    ``warmup_min_ratio`` to 1, then follows a cosine down to ``cos_min_ratio`` at
    ``total_num_steps``."""
    type: ClassVar[str] = "WarmupCosineLR"
    total_num_steps: int = 10000
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        _check_int(self.type, "total_num_steps", self.total_num_steps, 1)
        _check_int(self.type, "warmup_num_steps", self.warmup_num_steps, 1)
        for field in ("warmup_min_ratio", "cos_min_ratio"):
            value = getattr(self, field)
            _check_number(self.type, field, value)
            if value > 1:
                _fail(self.type, field, value, "is a ratio of the optimizer's lr: at most 1")
        if self.warmup_type not in WARMUP_TYPES:
            _fail(self.type, "warmup_type", self.warmup_type, f"must be one of {WARMUP_TYPES}")

    @property
    def warmup(self) -> int:
        return max(2, self.warmup_num_steps)

    def ratio_at(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup:
            g = _warmup_gamma(iteration, self.warmup, self.warmup_type)
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (iteration - self.warmup + 1)
                       / max(1, self.total_num_steps - self.warmup))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int, base_lr: float) -> float:
        return base_lr * self.ratio_at(iteration)

    def peak(self, base_lr: float) -> float:
        return float(base_lr)

    def boundaries(self) -> tuple[int, ...]:
        t = self.total_num_steps
        return tuple(sorted({self.warmup - 1, self.warmup, t - 1, t}))

    def section(self) -> dict[str, Any]:
        return {"type": self.type, "params": asdict(self)}


@dataclass(frozen=True)
class OneCycle:
    """``"type": "OneCycle"``: one cycle up from ``cycle_min_lr`` to ``cycle_max_lr`` and back,
    then (optionally) decay."""
    type: ClassVar[str] = "OneCycle"
    cycle_min_lr: float = 0.0001
    cycle_max_lr: float = 0.001
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0
    # The lr only: momentum cycling written out as off (with it on, the betas move as well).
    cycle_momentum: bool = False
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0

    def __post_init__(self) -> None:
        for field in ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate"):
            _check_number(self.type, field, getattr(self, field))
        _check_int(self.type, "cycle_first_step_size", self.cycle_first_step_size, 1)
        if self.cycle_second_step_size is not None:
            _check_int(self.type, "cycle_second_step_size", self.cycle_second_step_size, 0)
        _check_int(self.type, "cycle_first_stair_count", self.cycle_first_stair_count, 0)
        if self.cycle_second_stair_count is not None:
            _check_int(self.type, "cycle_second_stair_count", self.cycle_second_stair_count, 0)
        _check_int(self.type, "decay_step_size", self.decay_step_size, 0)
        if not isinstance(self.cycle_momentum, bool):
            _fail(self.type, "cycle_momentum", self.cycle_momentum, "must be True or False")

    @property
    def first(self) -> int:
        return self.cycle_first_step_size

    @property
    def second(self) -> int:
        s = self.cycle_second_step_size
        return self.first if s is None else s

    @property
    def total(self) -> int:
        return self.first + self.second

    def scale_at(self, iteration: int) -> float:
        """Where in [0, 1] between the cycle's bounds iteration ``iteration`` (< total) sits."""
        position = (iteration + 1) % self.total
        if position <= self.first:
            stairs, scale = self.cycle_first_stair_count, position / self.first
            held = position * stairs / self.first if stairs else None
        else:
            second_stairs = self.cycle_second_stair_count
            stairs = self.cycle_first_stair_count if second_stairs is None else second_stairs
            scale = (self.total - position) / self.second
            held = (self.total - position) * stairs / self.second if stairs else None
        return scale if held is None else math.floor(held) / stairs

    def lr_at(self, iteration: int, base_lr: float) -> float:
        low, high = self.cycle_min_lr, self.cycle_max_lr
        if iteration < self.total:
            return low + (high - low) * self.scale_at(iteration)
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return float(low)
        decayed = (iteration - self.total + 1) / self.decay_step_size
        return low / (1.0 + self.decay_lr_rate * decayed)

    def peak(self, base_lr: float) -> float:
        return max(self.cycle_min_lr, self.cycle_max_lr)

    def boundaries(self) -> tuple[int, ...]:
        """The last rising iteration and the next, the cycle's end and the first decay
        intervals after it."""
        f, t, d = self.first, self.total, self.decay_step_size
        return tuple(sorted({f - 1, f, t - 1, t} | ({t + d - 1, t + d} if d else set())))

    def section(self) -> dict[str, Any]:
        return {"type": self.type, "params": asdict(self)}


#: Every schedule the model knows, by the config's "type".
SCHEDULES: dict[str, type] = {cls.type: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR,
                                                         OneCycle)}
Schedule = WarmupLR | WarmupDecayLR | WarmupCosineLR | OneCycle


def lr_of_step(schedule: Schedule, step: int, base_lr: float) -> float:
    """The lr training step ``step`` (0-based) runs at: the scheduler's ``lr_at(step - 1)``."""
    return schedule.lr_at(step - 1, base_lr)


def steps_to_cover(schedule: Schedule, extra: int = 2) -> int:
    """Training steps after which the scheduler has set the lr of every boundary iteration and
    ``extra`` iterations beyond the last one."""
    return max(schedule.boundaries()) + 1 + extra


def first_divergence(found: list[float], schedule: Schedule, base_lr: float, atol: float,
                     *, first_iteration: int = -1) -> tuple[int, float, float] | None:
    """The first iteration whose lr in ``found`` (``found[j]`` is iteration
    ``first_iteration + j``) differs from the model's by more than ``atol`` times the
    schedule's peak lr: (iteration, found, expected), or None."""
    bound = atol * schedule.peak(base_lr)
    for j, lr in enumerate(found):
        iteration = first_iteration + j
        expected = schedule.lr_at(iteration, base_lr)
        if not abs(lr - expected) <= bound:
            return iteration, lr, expected
    return None
