"""The state a DeepSpeed checkpoint must carry, as flat named leaves, and what a partial load
must take from the checkpoint and what it must leave alone.

A snapshot is a flat mapping ``name -> leaf`` (a CPU tensor, a number, a string, a bool or
None) with names such as ``module/fc1.weight``, ``fp32/fc1.weight``,
``optimizer/base_optimizer_state/state/0/exp_avg``, ``scheduler/last_batch_iteration``,
``engine/global_steps``, ``loss_scaler/cur_scale``. ``flatten_state`` turns any nested state
dict (the optimizer wrappers of ZeRO stages 0-3 each have their own layout) into such leaves, so
one comparison (``dsconform.checks.equivalence.compare_states``) covers every layout.

Which component a name belongs to is decided here, once (``component``), and so is what each
load flag of ``DeepSpeedEngine.load_checkpoint`` must do to each component (``EXPECTED``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from dsconform.checks.equivalence import compare_states
from dsconform.checks.tolerances import Tol

# Optimizer state that exists per parameter: Adam's moments and step count (per parameter in
# torch Adam, per group in FusedAdam: its bias correction), SGD's momentum. A dropped optimizer
# state shows here first.
MOMENT_KEYS = frozenset({"exp_avg", "exp_avg_sq", "momentum_buffer", "step"})
COUNTERS = ("engine/global_steps", "engine/global_samples", "engine/skipped_steps")
COMPONENTS = ("module", "masters", "moments", "scheduler", "counters")
# Leaves whose value in an engine that trained and saved differs from a fresh engine's, once the
# run had an overflow (fp16): a check in which they are equal could not see a load that dropped
# them. The scaler's settings (window, floor, factor) and the optimizer's layout are the same in
# every engine of the configuration and are not listed.
STEP_STATE = ("engine/global_steps", "engine/global_samples")
SCALER_STATE = ("engine/skipped_steps", "loss_scaler/cur_scale", "loss_scaler/cur_iter",
                "loss_scaler/last_overflow_iter", "loss_scaler/cur_hysteresis")
_MAX_DEPTH = 12


def flatten_state(obj: Any, prefix: str) -> dict[str, Any]:
    """Nested dicts, lists and plain objects (DeepSpeed's LossScaler, fragment addresses) as flat
    ``prefix/key`` leaves: tensors are detached CPU clones, enums their values, objects their
    public non-callable attributes (``prefix.attr``) plus ``prefix:type``. Anything else becomes
    its repr, so a leaf is always comparable and picklable."""
    import torch

    out: dict[str, Any] = {}

    def walk(value: Any, name: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            out[name] = f"<deeper than {_MAX_DEPTH}: {type(value).__name__}>"
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach().to("cpu").clone()
        elif isinstance(value, enum.Enum):
            out[name] = value.value
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{name}/{k}", depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}[{i}]", depth + 1)
        elif hasattr(value, "__dict__"):
            out[f"{name}:type"] = type(value).__name__
            for k, v in vars(value).items():
                if not k.startswith("_") and not callable(v):
                    walk(v, f"{name}.{k}", depth + 1)
        else:
            out[name] = repr(value)

    walk(obj, prefix, 0)
    return out


def component(name: str) -> str | None:
    """The component a snapshot name belongs to, for partial loads (None: not judged there)."""
    if name.startswith("module/"):
        return "module"
    if name.startswith("fp32/"):  # the gathered fp32 master weights the optimizer steps
        return "masters"
    if name.startswith("optimizer/") and _last_key(name) in MOMENT_KEYS:
        return "moments"
    if name.startswith("scheduler/"):
        return "scheduler"
    if name in COUNTERS:
        return "counters"
    return None


def _last_key(name: str) -> str:
    tail = name.rsplit("/", 1)[-1]
    return tail.split("[", 1)[0]


def select(snapshot: Mapping[str, Any], which: str) -> dict[str, Any]:
    """The leaves of one component."""
    if which not in COMPONENTS:
        raise ValueError(f"unknown component {which!r}; known: {', '.join(COMPONENTS)}")
    return {k: v for k, v in snapshot.items() if component(k) == which}


# load_checkpoint keyword arguments of each partial-load mode, and where each component must
# come from afterwards: "saved" (the checkpoint) or "fresh" (the engine as it was before the
# load), or for the fp32 masters "module": restored from the loaded module weights (what
# load_module_only does: _restore_from_bit16_weights), or "saved|module": either (with
# load_optimizer_states=False, ZeRO 1-3 restore them from the weights, 0.19.8 engine.py
# load_checkpoint; stage 0 loads the saved ones). Never the fresh engine's: a partial load that
# leaves those would have its next step overwrite the weights it loaded.
# https://deepspeed.readthedocs.io/en/latest/model-checkpointing.html
LOAD_MODES: dict[str, dict[str, bool]] = {
    "full": {},
    "module_only": {"load_module_only": True},
    "no_optimizer": {"load_optimizer_states": False},
    "no_scheduler": {"load_lr_scheduler_states": False},
}
EXPECTED: dict[str, dict[str, str]] = {
    "full": {"module": "saved", "masters": "saved", "moments": "saved", "scheduler": "saved",
             "counters": "saved"},
    # Warm start: weights only; optimizer, schedule and step counters start over.
    "module_only": {"module": "saved", "masters": "module", "moments": "fresh",
                    "scheduler": "fresh", "counters": "fresh"},
    "no_optimizer": {"module": "saved", "masters": "saved|module", "moments": "fresh",
                     "scheduler": "saved", "counters": "saved"},
    "no_scheduler": {"module": "saved", "masters": "saved", "moments": "saved",
                     "scheduler": "fresh", "counters": "saved"},
}


def judge_load(mode: str, saved: Mapping[str, Any], fresh: Mapping[str, Any],
               loaded: Mapping[str, Any], tol: Tol, *, where: str = "") -> list[str]:
    """One line per component that did not come from where ``mode`` says it must.

    ``saved``: the snapshot of the engine that wrote the checkpoint; ``fresh``: the loading
    engine before the load; ``loaded``: the same engine after it. A component whose saved and
    fresh values cannot be told apart makes the check vacuous, which is a problem too.
    """
    if mode not in EXPECTED:
        raise ValueError(f"unknown load mode {mode!r}; known: {', '.join(EXPECTED)}")
    flags = ", ".join(f"{k}={v}" for k, v in LOAD_MODES[mode].items()) or "defaults"
    at = f" ({where})" if where else ""
    problems = []
    for which, source in EXPECTED[mode].items():
        s, f, got = select(saved, which), select(fresh, which), select(loaded, which)
        if which == "masters" and not (s or f or got):
            continue  # no fp32 masters in this engine (an fp32 stage-0 optimizer steps the weights)
        other = "fresh" if source != "fresh" else "saved"
        wants = [_masters_of(loaded, {**s, **f, **got}) if part == "module"
                 else s if part == "saved" else f for part in source.split("|")]
        want = wants[0]
        if len(wants) > 1 and not compare_states(got, want, tol).ok:
            want = wants[1]  # either source will do: judged against the second
        if not want and not got:
            if source == "fresh":
                continue  # nothing there before the load, nothing after: untouched
            problems.append(f"load_checkpoint({flags}){at}: no {which} in the checkpointed "
                            f"engine's state: nothing to check")
            continue
        if _same(s, f, tol):
            problems.append(f"load_checkpoint({flags}){at}: {which}: the checkpoint and the "
                            f"fresh engine hold the same values; the check cannot tell them "
                            f"apart")
            continue
        alike = same_as_fresh(saved, fresh, tuple(s)) if which == "counters" else []
        if alike:
            problems.append(f"load_checkpoint({flags}){at}: {which}: the checkpoint and the "
                            f"fresh engine hold the same {', '.join(alike)}; the check cannot "
                            f"tell them apart")
            continue
        cmp = compare_states(got, want, tol, label=which, where=where)
        if not cmp.ok:
            looks = " (it holds the " + other + " values)" if _same(got, s if other == "saved"
                                                                    else f, tol) else ""
            must = {"module": "restored from the loaded module weights",
                    "saved|module": "the saved engine's or restored from the loaded module "
                                    "weights"}.get(source, f"the {source} engine's")
            problems.append(f"load_checkpoint({flags}){at}: {which} must be {must}{looks}: "
                            f"{cmp.report(limit=2)}")
    return problems


def same_as_fresh(saved: Mapping[str, Any], fresh: Mapping[str, Any],
                  names: tuple[str, ...] | None = None) -> list[str]:
    """The step and scaler leaves (``STEP_STATE``, and ``SCALER_STATE`` where the saved engine's
    scaler is dynamic) that the saved engine and a fresh one hold alike, so that a load which
    dropped them would still match: each makes a round trip or a partial load vacuous for it.
    ``names`` narrows the leaves looked at."""
    wanted = STEP_STATE + (SCALER_STATE if saved.get("loss_scaler/dynamic") is True else ())
    out = []
    for name in wanted:
        if names is not None and name not in names:
            continue
        if name in saved and name in fresh and compare_states(
                {name: saved[name]}, {name: fresh[name]}, Tol(0.0, 0.0)).ok:
            out.append(f"{name} ({saved[name]!r})")
    return out


def _masters_of(snapshot: Mapping[str, Any], masters: Mapping[str, Any]) -> dict[str, Any]:
    """The fp32 masters restored from a snapshot's module weights (upcast), for every master
    name given (the saved, fresh and loaded ones: a master missing after the load is named)."""
    return {name: snapshot[f"module/{name[len('fp32/'):]}"].float() for name in masters
            if f"module/{name[len('fp32/'):]}" in snapshot}


def _same(a: Mapping[str, Any], b: Mapping[str, Any], tol: Tol) -> bool:
    if not a and not b:
        return True
    return compare_states(a, b, tol).ok

