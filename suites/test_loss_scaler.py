"""Loss scaler: DeepSpeed's own fp16 dynamic loss scaler MUST behave as DeepSpeed documents it.

DeepSpeed's scaler (``DynamicLossScaler`` as ``CreateLossScaler`` builds it for ZeRO stages 1-3,
from the config ``ds_config`` writes) MUST follow the reference model of
``dsconform/checks/lossscale.py`` after every step of any sequence of clean and overflowing
steps: the initial scale ``2**initial_scale_power``, ``hysteresis`` and
``consecutive_hysteresis``, the raise after ``loss_scale_window`` clean steps, the lower and
raise factor 2, the floor ``min_loss_scale``, and an error (not an endless run of silent skips)
at the floor. The fp16 and bf16 engines are suites/test_loss_scaling.py's.

Upstream: https://www.deepspeed.ai/docs/config-json/#fp16-training-options ,
https://github.com/deepspeedai/DeepSpeed/blob/master/deepspeed/runtime/fp16/loss_scaler.py .

Stable ids: LOSS-SCALE-1 (scaler state machine), LOSS-SCALE-2 (measured sequence), LOSS-SCALE-3
(floor).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dsconform.suite import (
    ScalerModel,
    ScalerSettings,
    run_ranks,
)
from suites.loss_scaling_ranks import (
    SCALERS,
    overflow_flags,
    scaler_trace,
)

CAPABILITY = "loss_scaling"
TIMEOUT_S = 300  # per call; a scaler trace takes seconds

# ---------------------------------------------------------------------------------------------
# LOSS-SCALE-1..3: DeepSpeed's scaler object against the model (CPU tier)
# ---------------------------------------------------------------------------------------------


def check_scaler_step(s: ScalerSettings, history: list[bool], trace: list[dict],
                      expected: Any) -> list[str]:
    """The last step of a replayed ``trace`` against the model's ``expected`` step."""
    where = (f"{s.describe()}; steps {overflow_flags(history)} (X = overflow), "
             f"step {len(history) - 1} ({'overflow' if history[-1] else 'clean'})")
    if len(trace) != len(history):
        return [f"{where}: DeepSpeed's scaler ended the run after step {len(trace) - 1} "
                f"({trace[-1]['error']}), the model did not"]
    got = trace[-1]
    problems = []
    if got["scale_used"] != expected.scale_used:
        problems.append(f"{where}: DeepSpeed's scale before the step {got['scale_used']}, the "
                        f"model's {expected.scale_used}")
    if expected.outcome == "error":
        if not got["error"]:
            problems.append(f"{where}: an overflow at min_loss_scale={s.min_loss_scale:g} must "
                            f"end the run with an error; DeepSpeed's scaler went on at scale "
                            f"{got['state']['scale']} (an endless run of silent skips)")
        elif "minimum" not in got["error"]:
            problems.append(f"{where}: DeepSpeed raised {got['error']!r}, expected its "
                            f"'loss scale already at minimum' error")
        return problems
    if got["error"]:
        return problems + [f"{where}: DeepSpeed's scaler raised {got['error']!r}; the model "
                           f"says {expected.outcome} with scale {expected.scale_after}"]
    state = got["state"]
    if state["scale"] != expected.scale_after:
        problems.append(f"{where}: DeepSpeed's scale after the step {state['scale']}, the "
                        f"model's {expected.scale_after}")
    if state["hysteresis_left"] != expected.hysteresis_after:
        problems.append(f"{where}: DeepSpeed's hysteresis left {state['hysteresis_left']}, the "
                        f"model's {expected.hysteresis_after}")
    if state["dynamic"] != s.dynamic:
        problems.append(f"{where}: DeepSpeed's scaler dynamic={state['dynamic']}, the config "
                        f"says {s.dynamic} ({s.describe()})")
    return problems


@st.composite
def scaler_settings(draw: st.DrawFn) -> ScalerSettings:
    """Small powers, windows and floors, so a few dozen steps reach every corner: raises,
    hysteresis spent and refilled, the floor and the error there."""
    if draw(st.integers(0, 9)) == 0:
        return ScalerSettings(loss_scale=float(draw(st.sampled_from([1, 128, 1024, 65536]))))
    floor = draw(st.sampled_from([1, 2, 3, 4, 8]))
    lowest_power = math.ceil(math.log2(floor))
    return ScalerSettings(initial_scale_power=draw(st.integers(lowest_power, lowest_power + 6)),
                          loss_scale_window=draw(st.integers(1, 4)),
                          hysteresis=draw(st.integers(1, 4)),
                          consecutive_hysteresis=draw(st.booleans()),
                          min_loss_scale=float(floor))


class ScalerMachine(RuleBasedStateMachine):
    """Drives DeepSpeed's scaler (in a rank: it logs through deepspeed.comm) with clean and
    overflowing steps and checks it against the model after every step. Each step replays the
    whole history on a fresh scaler in the rank, so the rank keeps no state between calls."""

    trace_fn = staticmethod(scaler_trace)
    trace_kwargs: dict[str, Any] = {}

    def __init__(self) -> None:
        super().__init__()
        self.history: list[bool] = []
        self.ended = False

    @initialize(s=scaler_settings())
    def configure(self, s: ScalerSettings) -> None:
        self.settings = s
        self.model = ScalerModel(s)

    def _step(self, overflow: bool) -> None:
        self.history.append(overflow)
        expected = self.model.step(overflow)
        trace = run_ranks(self.trace_fn, 1, args=(asdict(self.settings), list(self.history)),
                          kwargs=self.trace_kwargs, timeout_s=TIMEOUT_S)[0]
        problems = check_scaler_step(self.settings, self.history, trace, expected)
        assert not problems, "\n".join(problems)
        self.ended = expected.outcome == "error"

    @precondition(lambda self: not self.ended)
    @rule()
    def clean(self) -> None:
        self._step(False)

    @precondition(lambda self: not self.ended)
    @rule()
    def overflow(self) -> None:
        self._step(True)

    @precondition(lambda self: self.ended)
    @rule()
    def run_ended(self) -> None:
        """Training is over after the floor's error: nothing left to step."""


def run_scaler_machine(machine: type[RuleBasedStateMachine] = ScalerMachine, *,
                       shrink: bool = True) -> None:
    """The machine under the loaded hypothesis profile (``ci``: derandomized), with at least 30
    examples of up to 30 steps (a step costs a millisecond or two) and the first failure found
    reported alone, as an AssertionError naming the sequence. ``shrink=False`` reports it
    unshrunk (the project's red tests only need to see it fail)."""
    current = settings()
    phases = current.phases if shrink else tuple(p for p in current.phases if p != Phase.shrink)
    run_state_machine_as_test(machine, settings=settings(
        current, max_examples=max(current.max_examples, 30), stateful_step_count=30,
        report_multiple_bugs=False, phases=phases))


def test_scaler_follows_model():
    """LOSS-SCALE-1: DeepSpeed's ZeRO loss scaler MUST follow the documented model every step."""
    run_scaler_machine()


def _hysteresis(h: int, consecutive: bool = False, *, window: int = 4, power: int = 8,
                floor: float = 1.0) -> ScalerSettings:
    return ScalerSettings(initial_scale_power=power, loss_scale_window=window, hysteresis=h,
                          consecutive_hysteresis=consecutive, min_loss_scale=floor)


# The sequences the state machine must never miss, replayed every run whatever the hypothesis
# profile or example database (X = overflow): hysteresis 1-4, with and without
# consecutive_hysteresis, clean steps between overflows (which refill the budget only with
# consecutive_hysteresis), the window's raise that refills it without, and the floor reached
# with a budget left.
SCALER_SEQUENCES: dict[str, tuple[ScalerSettings, str]] = {
    # every overflow lowers
    "h1-clean-between": (_hysteresis(1), "X.X..X"),
    # one clean step refills nothing: the second and third overflows lower
    "h2-clean-between": (_hysteresis(2), "X.X.X"),
    # each clean step refills: isolated overflows never lower, two in a row do
    "h2c-clean-between": (_hysteresis(2, True), "X.X.XX.X"),
    # the third overflow lowers, and so does the fourth (the budget stays spent)
    "h3-clean-between": (_hysteresis(3), "X..X..X.X"),
    # two in a row never lower, three do
    "h3c-clean-between": (_hysteresis(3, True), "XX.XX.XXX.X"),
    "h4-clean-between": (_hysteresis(4), "X.X.X.X.X"),
    "h4c-clean-between": (_hysteresis(4, True), "XXX.XXX.XXXX.X"),
    # the window's raise (third clean step after an overflow) refills the budget
    "h3-raise-refills": (_hysteresis(3, window=2), "XX...XX.X"),
    "h4c-raise": (_hysteresis(4, True, window=2), "XXX...XXXX"),
    # at the floor with the budget spent: the error, not another skip
    "h2-floor": (_hysteresis(2, window=1000, power=1), "XX.XX"),
    "h3c-floor": (_hysteresis(3, True, window=1000, power=1), "XXX.XXX"),
}


def replay_sequence(s: ScalerSettings, pattern: str,
                    machine: type[ScalerMachine] = ScalerMachine) -> list[str]:
    """``pattern`` (X overflow, . clean) on a fresh DeepSpeed scaler in one rank (the machine's
    trace function), checked against the model after every step as the state machine checks
    it; the problems of the first step that leaves the model."""
    flags = [c == "X" for c in pattern]
    expected = ScalerModel(s).run(flags)
    trace = run_ranks(machine.trace_fn, 1, args=(asdict(s), flags), kwargs=machine.trace_kwargs,
                      timeout_s=TIMEOUT_S)[0]
    for i, step in enumerate(expected):
        problems = check_scaler_step(s, flags[:i + 1], trace[:i + 1], step)
        if problems:
            return problems
    return []


@pytest.mark.anynode  # the installed scaler, on any node: on a GPU node it joins `-m gpu`
@pytest.mark.parametrize("name", sorted(SCALER_SEQUENCES))
def test_scaler_follows_model_on_sequence(name: str):
    """LOSS-SCALE-1: DeepSpeed's ZeRO loss scaler MUST follow the model on these sequences."""
    problems = replay_sequence(*SCALER_SEQUENCES[name])
    assert not problems, "\n".join(problems)


# docs/findings.md#loss-scaling: measured on ZeRO stages 1, 2 and 3 alike (initial 2**8, window
# 2, hysteresis 2).
MEASURED_PATTERN = (0, 1, 1, 0, 0, 0, 1, 1, 1)
MEASURED_SCALES = (256, 256, 128, 128, 128, 256, 256, 128, 64)
MEASURED_SKIPPED = (0, 1, 2, 2, 2, 2, 3, 4, 5)


def test_measured_sequence():
    """LOSS-SCALE-2: the scaler and the model MUST reproduce the sequence measured on ZeRO 1-3."""
    s, pattern = SCALERS["h2"]
    assert pattern == MEASURED_PATTERN
    flags = [bool(f) for f in pattern]
    expected = ScalerModel(s).run(flags)
    skipped = [sum(e.skipped for e in expected[:i + 1]) for i in range(len(expected))]
    assert ([e.scale_after for e in expected], skipped) == (list(MEASURED_SCALES),
                                                            list(MEASURED_SKIPPED)), \
        "the model no longer reproduces the measured sequence (docs/findings.md#loss-scaling)"
    trace = run_ranks(scaler_trace, 1, args=(asdict(s), flags), timeout_s=TIMEOUT_S)[0]
    found = [t["state"]["scale"] for t in trace]
    assert found == list(MEASURED_SCALES), (
        f"{s.describe()}, overflow pattern {overflow_flags(flags)}: DeepSpeed's scaler went "
        f"{found}, measured on ZeRO 1-3 {list(MEASURED_SCALES)}")


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_floor_ends_the_run(hysteresis: int):
    """LOSS-SCALE-3: an overflow at min_loss_scale MUST end the run with an error, not skip on."""
    s = ScalerSettings(initial_scale_power=2, loss_scale_window=1000, hysteresis=hysteresis,
                       min_loss_scale=1.0)
    flags = [True] * (2 + hysteresis + 2)
    expected = ScalerModel(s).run(flags)
    assert expected[-1].outcome == "error"
    trace = run_ranks(scaler_trace, 1, args=(asdict(s), flags), timeout_s=TIMEOUT_S)[0]
    steps = ", ".join(f"{t['state']['scale']:g}" for t in trace)
    assert len(trace) == len(expected) and trace[-1]["error"], (
        f"{s.describe()}: {len(flags)} overflows in a row must end the run at step "
        f"{len(expected) - 1} (scale 4 -> 2 -> 1 -> error); DeepSpeed's scaler went {steps}"
        f"{' and raised ' + repr(trace[-1]['error']) if trace[-1]['error'] else ' silently'}")
    assert "minimum" in trace[-1]["error"], trace[-1]["error"]
