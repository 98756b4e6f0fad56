"""DeepSpeed APIs that differ between the releases the suite supports (0.16 onwards): ONE module.

The suite installs beside any DeepSpeed from 0.16 (pyproject.toml has no upper bound). What a
release lacks is named here, by the release that added it, the way ``removed.py`` names what
a release took away:

- an **addition** (``ADDITIONS``) is a mode or API the suite's checks use that older releases
  do not have. On such a release the check SKIPS with a reason that names the feature, the
  release that added it, the upstream pull request and the release found
  (``Requires: [ZeRO stage 0 bf16 with bf16 gradient accumulation (added in DeepSpeed 0.17.6,
  PR #7515 https://...) (found DeepSpeed 0.16.9)]``); it never crashes on the missing API;
- a **hazard** (``HAZARDS``) is an API that exists but can hang on some releases: its checks
  skip there, naming the upstream fix (a hang is no strict xfail: it would cost its timeout);
- an **adapter** below is an API that exists on every supported release under another name or
  signature: the suite calls the adapter, never the release-specific spelling.

Versions are read from package metadata (no import of DeepSpeed), so the gate costs nothing in
a rank that has not imported it yet. ``dsconform radar`` (docs/radar.md) runs the suite under
0.16.9, 0.17.6, 0.18.9 and every 0.19.x: what broke there is what this module handles.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

from dsconform.base import versions


@dataclass(frozen=True)
class Addition:
    feature: str   # what the suite uses, in a user's words
    added_in: str  # the first release with it
    link: str      # the upstream pull request that added it

    @property
    def text(self) -> str:
        """"FEATURE (added in DeepSpeed 0.17.6, PR #7515 https://...)"."""
        number = self.link.rstrip("/").rsplit("/", 1)[-1]
        return f"{self.feature} (added in DeepSpeed {self.added_in}, PR #{number} {self.link})"


STAGE0_BF16 = "stage0_bf16"
AIO_HANDLE = "aio_handle"
PRECISION_CONFIG = "precision_config"
AIO_WAIT = "aio_wait"
MUON = "muon"
MUON_GROUPS = "muon_groups"
MUON_ZERO3 = "muon_zero3"
MUON_GRAM_NS = "muon_gram_ns"
ADDITIONS: dict[str, Addition] = {
    # Before it, bf16 without ZeRO was refused unless gradients accumulate in fp32
    # (NotImplementedError "Bfloat16 wrapper must use a gradient accumulation type of fp32,
    # enable ZeRO to use Bfloat16 gradient accumulation", 0.16.9): the suite's stage-0 bf16
    # cells accumulate in bf16, as DDP does (dsconform/checks/dsconfig.py data_types).
    STAGE0_BF16: Addition("ZeRO stage 0 bf16 with bf16 gradient accumulation", "0.17.6",
                          "https://github.com/deepspeedai/DeepSpeed/pull/7515"),
    # DeepSpeed 0.16.9's aio_handle has no get_alignment() (AttributeError, NVME-IO-4), aborted
    # the process on a size NVME-IO-2 draws (SIGABRT) and never returned from one wait() for
    # eight outstanding writes (NVME-IO-3 killed at its 900 s timeout); 0.18.9 passed all three
    # (0.17.1-0.19.3 can deadlock: the hazard below). The integrity round trip (NVME-IO-1)
    # runs on 0.16.9.
    AIO_HANDLE: Addition("DeepNVMe's reworked aio handle (get_alignment(), any aligned size, "
                         "several operations outstanding at one wait())", "0.17.1",
                         "https://github.com/deepspeedai/DeepSpeed/pull/7215"),
    # ZeRO-Infinity's optimizer swapper writes through the same handle: on 0.16.9 the first
    # swap-out aborts the process (SIGABRT in partitioned_optimizer_swapper, NVME-ZINF-1).
    # ZERO-DEF-1 reads the parsed fp16/bf16 sections and the stage-0 loss-scale profiles; on
    # 0.16.9 DeepSpeedConfig has no float16_config (AttributeError) and loss_scaler.py no
    # LOSS_SCALE_PROFILE_DEFAULTS.
    PRECISION_CONFIG: Addition("DeepSpeedConfig.float16_config / bfloat16_config and the "
                               "loss-scale profiles", "0.17.1",
                               "https://github.com/deepspeedai/DeepSpeed/pull/6976"),
    # 0.16.9 has no deepspeed/runtime/zero/muon; 0.17.6 has it (the optimizer suite's Muon).
    MUON: Addition("the Muon optimizer (\"type\": \"Muon\")", "0.17.6",
                   "https://github.com/deepspeedai/DeepSpeed/pull/7509"),
    # Before it, _configure_basic_optimizer reads p.use_muon off every item of model_parameters:
    # parameter groups raise AttributeError "'dict' object has no attribute 'use_muon'" (the
    # radar: 0.17.6); AutoEP's PR flattens the groups (and so drops their settings: DS-8440).
    MUON_GROUPS: Addition("the Muon optimizer given parameter groups (dicts in model_parameters)",
                          "0.19.2", "https://github.com/deepspeedai/DeepSpeed/pull/7938"),
    # Before it, Newton-Schulz runs in bf16 (zeropower_via_newtonschulz5: G.bfloat16(), the
    # published Muon's choice), coarser than the Muon tolerance of the table bounds (fp16/fp32).
    MUON_GRAM_NS: Addition("Muon's Newton-Schulz in fp16 where the accelerator has it, else "
                           "fp32 (the Gram iteration; before it bf16, beyond the suite's Muon "
                           "tolerance)", "0.19.0",
                           "https://github.com/deepspeedai/DeepSpeed/pull/7953"),
    # Before it, ZeRO-3 refuses Muon: "Muon optimizer is not yet compatible with ZeRO Stage 3".
    MUON_ZERO3: Addition("the Muon optimizer under ZeRO stage 3", "0.18.9",
                         "https://github.com/deepspeedai/DeepSpeed/pull/7919"),
}


@dataclass(frozen=True)
class Hazard:
    """Releases on which an API the suite uses exists but can hang: its checks skip there,
    naming the fix, instead of waiting out their timeouts (a hang is no strict xfail)."""
    what: str
    deepspeed: str  # the releases that have it, as a specifier
    link: str
    fixed_in: str

    @property
    def text(self) -> str:
        number = self.link.rstrip("/").rsplit("/", 1)[-1]
        return (f"{self.what} (DeepSpeed {self.deepspeed}; PR #{number} {self.link}, fixed in "
                f"{self.fixed_in})")


HAZARDS: dict[str, Hazard] = {
    # 0.17.6 (2 cores, torch 2.13): a 64 MiB async_io round trip and a DeepNVMe rank of the
    # radar stayed in aio_handle.wait() until their 900 s timeouts; #7727 releases the GIL in
    # wait() (0.18.4). 0.19.0, whose aio sources equal 0.18.9's: NVME-IO-3 (eight writes, one
    # wait, then the blocking reads that check them) hung in one radar run where 0.18.9 passed
    # in 0.3 s: the blocking bindings (pread, pwrite, sync_pread, sync_pwrite) still call the
    # handle's wait() holding the GIL, which an I/O thread may need; #8196 releases it there,
    # with a lock around the handle's queue (0.19.4). The range starts at the reworked handle
    # (#7215, 0.17.1).
    AIO_WAIT: Hazard("aio_handle.wait() and the blocking aio bindings can deadlock holding the "
                     "Python GIL (wait() fixed in 0.18.4 by PR #7727)",
                     ">=0.17.1,<0.19.4", "https://github.com/deepspeedai/DeepSpeed/pull/8196",
                     "0.19.4"),
}


def installed_deepspeed() -> str | None:
    """The installed DeepSpeed's version, from its metadata; None without DeepSpeed."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(name: str, deepspeed_version: str | None = None) -> Addition | None:
    """The addition ``name`` when the DeepSpeed given (default: the installed one) predates it,
    else None. KeyError for a name not in ``ADDITIONS``."""
    if name in HAZARDS and name not in ADDITIONS:
        return None  # present everywhere; some releases hang (skip_reason)
    add = ADDITIONS[name]
    found = versions.parse(deepspeed_version or installed_deepspeed())
    if found is not None and found >= versions.Version(add.added_in):
        return None
    return add


def skip_reason(name: str, deepspeed_version: str | None = None) -> str | None:
    """``Requires: [FEATURE (added in ...) (found DeepSpeed X)]`` when it is missing, or
    ``Skipped: HAZARD ... (found DeepSpeed X)`` on a release where it can hang."""
    found = deepspeed_version or installed_deepspeed() or "none"
    add = missing(name, deepspeed_version)
    if add is not None:
        return f"Requires: [{add.text} (found DeepSpeed {found})]"
    hazard = HAZARDS.get(name)
    v = versions.parse(found)
    if hazard is not None and v is not None and v in versions.specifier(hazard.deepspeed):
        return f"Skipped: {hazard.text} (found DeepSpeed {found})"
    return None


def require(name: str, deepspeed_version: str | None = None) -> None:
    """Skip the calling test (or the rank it runs in: the harness reports the skip) when the
    DeepSpeed installed lacks ``name``."""
    reason = skip_reason(name, deepspeed_version)
    if reason is not None:
        import pytest

        pytest.skip(reason)


# ------------------------------------------------------------------ adapters


def muon_offload_reduce_scatter(deepspeed_version: str | None = None) -> bool:
    """Whether ZeRO 1/2 takes the Muon optimizer with its optimizer offloaded and reduce_scatter
    on. 0.19.3 to 0.19.7 refuse it (ValueError "Muon with reduce scatter does not support
    optimizer offload", PR #8090 https://github.com/deepspeedai/DeepSpeed/pull/8090): the
    suite then reduces by all-reduce, as the message asks. 0.19.8 takes it (PR #8464
    https://github.com/deepspeedai/DeepSpeed/pull/8464); before 0.19.3 it is taken, and a
    matrix that crosses a partition gets a wrong update (DS-7807-MUON-Z12-REDUCE-SCATTER)."""
    found = versions.parse(deepspeed_version or installed_deepspeed())
    return found is None or found not in versions.specifier(">=0.19.3,<0.19.8")

def fp16_scaler_args(config: Any) -> tuple[float, bool, dict[str, Any] | None]:
    """(static loss scale, dynamic?, the dynamic scaler's arguments) of a parsed
    ``deepspeed.runtime.config.DeepSpeedConfig``: what ``deepspeed.initialize`` hands ZeRO's
    ``CreateLossScaler``. From 0.17.1 (PR #6976) the fp16 section is ``config.float16_config``;
    before, its values are attributes of the config itself (``loss_scale``,
    ``dynamic_loss_scale_args``)."""
    fp16 = getattr(config, "float16_config", None)
    if fp16 is not None:
        return fp16.loss_scale, fp16.loss_scale == 0, fp16.dynamic_loss_scale_args()
    return config.loss_scale, config.loss_scale == 0, config.dynamic_loss_scale_args


def loss_scale_profiles(loss_scaler_module: Any) -> dict[str, Any]:
    """The stage-0 fp16 wrappers' loss-scale profiles (``LOSS_SCALE_PROFILE_DEFAULTS`` of
    ``deepspeed.runtime.fp16.loss_scaler``, from 0.18.6, PR #7839); empty before."""
    return dict(getattr(loss_scaler_module, "LOSS_SCALE_PROFILE_DEFAULTS", None) or {})


# ------------------------------------------------------------------ defaults by release

#: What ZERO-DEF-1 records for a default a release does not have.
MISSING = "<missing>"


@dataclass(frozen=True)
class DefaultChange:
    """A DeepSpeed default that moved: ``before`` on every release older than ``changed_in``
    (``MISSING``: the key did not exist), ASSUMED_DEFAULTS' value from it on."""
    key: str
    before: Any
    changed_in: str
    why: str  # the upstream change, and where the radar saw it


DEFAULT_HISTORY: tuple[DefaultChange, ...] = (
    DefaultChange("fp16.stage0.scale_factor", MISSING, "0.18.6",
                  "the stage-0 loss-scale profiles (PR #7839) arrive in 0.18.6"),
    # GRADIENT_CLIPPING_DEFAULT = 0. in runtime/constants.py up to 0.19.2, 1.0 from 0.19.3
    DefaultChange("gradient_clipping", 0.0, "0.19.3", "clipping on by default from 0.19.3"),
    DefaultChange("constants.GRADIENT_CLIPPING_DEFAULT", 0.0, "0.19.3",
                  "clipping on by default from 0.19.3"),
    DefaultChange("bf16.check_grad_overflow", False, "0.19.3",
                  "bf16 checks for overflows by default from 0.19.3 (PR #8035)"),
    DefaultChange("zero.allgather_sequential", MISSING, "0.18.5",
                  "ZeRO-3's sequential all-gather option arrives in 0.18.5 (PR #7661)"),
    # ZERO-DEF-2 (ASSUMED_RESOLVED): engine.get_data_types up to 0.17.5 accumulates a stage-0
    # bf16 model's gradients in fp32 under BF16_Optimizer; from 0.17.6 in bf16 under
    # FP16_UnfusedOptimizer (the radar: 0.16.9 found both)
    DefaultChange("bf16.z0.grad_accum_dtype", "float32", "0.17.6",
                  "stage-0 bf16 accumulates gradients in bf16 from 0.17.6 (PR #7515)"),
    DefaultChange("bf16.z0.wrapper", "BF16_Optimizer", "0.17.6",
                  "stage-0 bf16 wraps the optimizer in FP16_UnfusedOptimizer from 0.17.6 "
                  "(PR #7515)"),
)


def assumed_defaults(assumed: dict[str, Any], deepspeed_version: str | None = None
                     ) -> dict[str, Any]:
    """``assumed`` (ASSUMED_DEFAULTS: the defaults of the newest release the suite verified) as
    they were on ``deepspeed_version`` (default: the installed one), by ``DEFAULT_HISTORY``: a
    release before a change is held to the value before it, so ZERO-DEF-1 fails only where a
    default moved that nobody recorded."""
    found = versions.parse(deepspeed_version or installed_deepspeed())
    out = dict(assumed)
    if found is None:
        return out
    # Oldest change last: a key that moved twice takes the value before its first move.
    for change in sorted(DEFAULT_HISTORY, key=lambda c: versions.Version(c.changed_in),
                         reverse=True):
        if change.key in out and found < versions.Version(change.changed_in):
            out[change.key] = change.before
    return out


def aio_alignment(handle: Any) -> int:
    """The byte multiple an aio handle's transfers must be: ``get_alignment()`` from 0.17.1
    (PR #7215); before, the same rule it states: intra_op_parallelism x 512 (O_DIRECT's
    alignment per thread)."""
    get = getattr(handle, "get_alignment", None)
    return int(get()) if get is not None else handle.get_intra_op_parallelism() * 512


def stage0_scaler(optimizer: Any) -> tuple[float, bool] | None:
    """(current scale, dynamic?) of a stage-0 fp16 wrapper (FP16_Optimizer,
    FP16_UnfusedOptimizer) that keeps its scaler's state on itself, as releases before 0.18.6
    do (from 0.18.6 it is ``optimizer.loss_scale_config``, PR #7839); None for other objects."""
    if hasattr(optimizer, "cur_scale") and hasattr(optimizer, "dynamic_loss_scale"):
        return float(optimizer.cur_scale), bool(optimizer.dynamic_loss_scale)
    return None


def moe_gate_routes(gate: Any, x: Any) -> tuple[int, set[tuple[int, int]]]:
    """(capacity, the (token, expert) routes that kept a slot) as an MoE ``TopKGate`` decides
    them for the tokens ``x``. From 0.19.4 the gate returns its routes sparsely
    (``sparse_routes=True``: per route the expert, or -1 where it was dropped); before, only as
    the dense dispatch mask ``[tokens, experts, capacity]``, which holds the same routes."""
    import inspect

    if "sparse_routes" in inspect.signature(gate.forward).parameters:
        _, capacity, _, indices, _, _, _ = gate(x, None, True, False)
        kept = {(t, int(indices[c, t])) for c in range(indices.shape[0])
                for t in range(indices.shape[1]) if int(indices[c, t]) >= 0}
        return int(capacity), kept
    _, _, dispatch, _ = gate(x, None, False)
    return int(dispatch.shape[2]), {(int(t), int(e)) for t, e in dispatch.any(dim=2).nonzero()}
