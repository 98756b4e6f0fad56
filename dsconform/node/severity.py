"""The one severity table of the hardware error gate: each condition the gate can find on a GPU,
the action it calls for, and the source that says so.

Actions, most severe first:

- ISOLATE: drain the node and replace (RMA) the GPU;
- REBOOT: drain the node and reboot it;
- RESET: drain the node and reset the GPU (``nvidia-smi -r``) before it takes work again;
- MONITOR: no action now; recorded in the results and shown in the summary.

ISOLATE, REBOOT and RESET fail the node with the action in the reason; MONITOR does not.
``judge`` applies the table to what dsconform/node/health.py read, with the profile's
``[health]`` limits (Thresholds); a Report holds the findings and says the exit code.

XIDs follow NVIDIA's Xid catalogue (XID_CATALOG): its "Resolution Bucket (Immediate Action)"
column maps RESTART_APP and IGNORE to MONITOR (an application's fault, or information), RESET_GPU
to RESET, RESTART_BM (restart the bare-metal node) to REBOOT. Where the catalogue's
investigatory action is CONTACT_SUPPORT for a failure of the hardware itself (a GPU off the bus,
a failed row remap), an acceptance gate drains it for replacement: ISOLATE. An XID the table
does not list is MONITOR, named with its number so it can be looked up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from dsconform.node.readings import GpuSnapshot, KernelXid, XidEvent


class Action(StrEnum):
    ISOLATE = "ISOLATE"
    REBOOT = "REBOOT"
    RESET = "RESET"
    MONITOR = "MONITOR"

    @property
    def rank(self) -> int:
        """Higher is more severe."""
        return {"ISOLATE": 3, "REBOOT": 2, "RESET": 1, "MONITOR": 0}[self.value]

    @property
    def fails(self) -> bool:
        return self is not Action.MONITOR

    @property
    def meaning(self) -> str:
        return MEANING[self]


MEANING = {
    Action.ISOLATE: "drain the node and replace the GPU",
    Action.REBOOT: "drain the node and reboot it",
    Action.RESET: "drain the node and reset the GPU (nvidia-smi -r)",
    Action.MONITOR: "no action now: recorded and watched",
}
#: The actions that fail a node, most severe first (dsconform/results/aggregate.py names them in
#: the drain reason; tests/node/test_health.py holds the two lists equal).
FAILING = tuple(a for a in Action if a.fails)

XID_CATALOG = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
NVML_QUERIES = "https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html"
NVML_RETURNS = "https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceEnumvs.html"
MEMORY_FLAGS = ("https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/"
                "error-recovery-and-response-flags.html")
MEMORY_SUPPORT = "https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/supported-gpus.html"
DCGM_HEALTH = "https://github.com/NVIDIA/DCGM/blob/master/modules/health/DcgmHealthWatch.cpp"
FABRIC_MANAGER = "https://docs.nvidia.com/datacenter/tesla/fabric-manager-user-guide/"


@dataclass(frozen=True)
class Rule:
    action: Action
    what: str    # the condition, in words
    source: str  # where the action comes from (a URL a user can open)
    why: str     # the source's words that decide the action


MONITOR, RESET, REBOOT, ISOLATE = Action.MONITOR, Action.RESET, Action.REBOOT, Action.ISOLATE
# XID: (action, what, the catalogue's words that decide the action)
_XIDS: dict[int, tuple[Action, str, str]] = {
    8: (MONITOR, "GPU stopped processing", "immediate action RESTART_APP"),
    13: (MONITOR, "graphics engine exception",
         "RESTART_APP: an application fault, typically an out-of-bounds access"),
    31: (MONITOR, "GPU memory page fault",
         "RESTART_APP: typically an application's illegal address"),
    32: (MONITOR, "invalid or corrupted push buffer stream", "immediate action RESTART_APP"),
    43: (MONITOR, "GPU stopped processing",
         "IGNORE: an application hit a software fault; the GPU remains healthy"),
    45: (MONITOR, "preemptive cleanup",
         "not solo: IGNORE, follow the other Xid (an application was aborted)"),
    46: (RESET, "GPU stopped processing", "immediate action RESET_GPU"),
    48: (RESET, "double-bit ECC error", "a GPU reset or node reboot is needed to clear this error"),
    62: (RESET, "internal micro-controller halt", "immediate action RESET_GPU"),
    63: (MONITOR, "row remapping event",
         "IGNORE: the pending remap it announces is judged from the remapped rows"),
    64: (ISOLATE, "row remapping failure",
         "RESET_GPU, then CONTACT_SUPPORT: the memory could not be repaired"),
    74: (RESET, "NVLink error", "a GPU reset or node reboot is needed to clear this error"),
    79: (ISOLATE, "GPU has fallen off the bus",
         "RESTART_BM, then CONTACT_SUPPORT: the GPU left its PCI Express link"),
    92: (MONITOR, "high single-bit ECC error rate", "immediate action IGNORE"),
    94: (RESET, "contained ECC error", "reset the GPU when convenient; between jobs it is"),
    95: (RESET, "uncontained ECC error",
         "the GPU must be reset before applications can restart"),
    109: (RESET, "context switch timeout", "immediate action RESET_GPU"),
    110: (REBOOT, "security fault", "cold reset the system"),
    119: (RESET, "GSP RPC timeout", "immediate action RESET_GPU"),
    120: (RESET, "GSP error", "immediate action RESET_GPU"),
    136: (RESET, "link training failed", "immediate action RESET_GPU"),
    140: (RESET, "ECC unrecovered error", "reset the GPU; if it persists, contact the vendor"),
    143: (RESET, "GPU initialization error", "immediate action RESET_GPU"),
    154: (MONITOR, "GPU recovery action changed",
          "informational: the recovery action itself is read from NVML and judged"),
    155: (RESET, "NVLink software-defined error", "immediate action RESET_GPU"),
    156: (RESET, "resource retirement event", "immediate action RESET_GPU"),
    158: (RESET, "GPU fatal timeout", "immediate action RESET_GPU"),
}
XID_RULES: dict[int, Rule] = {xid: Rule(action, what, XID_CATALOG, why)
                              for xid, (action, what, why) in _XIDS.items()}


def xid_rule(xid: int) -> Rule:
    """The table's rule for an XID; MONITOR for one it does not list."""
    return XID_RULES.get(xid) or Rule(
        MONITOR, f"XID {xid}", XID_CATALOG, "not in dsconform's table: look it up in the catalogue")


#: NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvml.h nvmlDeviceGpuRecoveryAction_t).
RECOVERY_ACTIONS: dict[int, Rule] = {
    1: Rule(RESET, "recovery action GPU_RESET", MEMORY_FLAGS,
            "the GPU has a fault that needs a reset to recover"),
    2: Rule(REBOOT, "recovery action NODE_REBOOT", MEMORY_FLAGS,
            "the fault may have left the OS inconsistent: reboot it"),
    3: Rule(RESET, "recovery action DRAIN_P2P", MEMORY_FLAGS,
            "peer-to-peer traffic must be drained, then NVML names the next action (at least a "
            "reset): run `dsconform health` again after draining"),
    4: Rule(RESET, "recovery action DRAIN_AND_RESET", MEMORY_FLAGS,
            "drain the GPU's work and reset it"),
    5: Rule(REBOOT, "recovery action RECOVER_IMEX_DOMAIN", MEMORY_FLAGS,
            "the multi-node NVLink domain must be recovered: not a single GPU's reset"),
    6: Rule(RESET, "recovery action BUS_RESET", MEMORY_FLAGS, "the GPU needs a bus reset"),
    7: Rule(REBOOT, "recovery action SYSTEM_REBOOT", MEMORY_FLAGS, "the system must be rebooted"),
}


def recovery_rule(value: int) -> Rule:
    return RECOVERY_ACTIONS.get(value) or Rule(
        REBOOT, f"recovery action {value}", MEMORY_FLAGS,
        "a value this table does not know: the broadest recovery short of a replacement")


RULES: dict[str, Rule] = {
    "gpu_lost": Rule(ISOLATE, "NVML: the GPU is lost", NVML_RETURNS,
                     "NVML_ERROR_GPU_IS_LOST: the GPU has fallen off the bus or become "
                     "inaccessible (XID 79's state)"),
    "gpu_gone": Rule(ISOLATE, "the GPU is no longer listed by NVML", XID_CATALOG,
                     "a GPU that leaves NVML during a run has fallen off the bus (XID 79)"),
    "reset_required": Rule(RESET, "NVML: the GPU requires a reset", NVML_RETURNS,
                           "NVML_ERROR_RESET_REQUIRED: the GPU needs a reset before it can be "
                           "used again"),
    "remap_failed": Rule(ISOLATE, "row remapping failed", MEMORY_FLAGS,
                         "the row-remapping failure flag is defined by the RMA policy "
                         "thresholds for row remapping"),
    "remap_pending": Rule(RESET, "row remapping pending", NVML_QUERIES,
                          "nvmlDeviceGetRemappedRows: a reset will be required to actually "
                          "remap the row"),
    "retired_pages_pending": Rule(REBOOT, "retired pages pending", NVML_QUERIES,
                                  "nvmlDeviceGetRetiredPagesPendingStatus: pages pending "
                                  "retirement need a reboot to fully retire"),
    "ecc_uncorrected_volatile": Rule(RESET, "uncorrected ECC errors since the driver loaded",
                                     XID_CATALOG, "XID 48: a GPU reset or node reboot is "
                                     "needed to clear this error"),
    "ecc_uncorrected_no_remap": Rule(ISOLATE, "uncorrected ECC errors, no row remapping",
                                     MEMORY_SUPPORT, "without row remapping a faulty row is "
                                     "only retired by page, never repaired"),
    "ecc_uncorrected_aggregate": Rule(MONITOR, "uncorrected ECC errors in the GPU's lifetime",
                                      MEMORY_SUPPORT, "row remapping repairs them; its pending "
                                      "and failed flags are judged"),
    "ecc_corrected": Rule(MONITOR, "corrected ECC errors during the run", XID_CATALOG,
                          "corrected errors are repaired; a high rate is XID 92, IGNORE"),
    "ecc_corrected_rate": Rule(ISOLATE, "corrected ECC errors above the profile's rate",
                               XID_CATALOG, "XID 92's investigation is CONTACT_SUPPORT: a rate "
                               "above [health] max_corrected_ecc_per_hour is failing memory"),
    "pcie_replays": Rule(ISOLATE, "PCIe replays above the limit", DCGM_HEALTH,
                         "DCGM: more than 8 replays per minute, the most NVIDIA's driver team "
                         "recommends; a link that retries needs service (seating, riser, GPU)"),
    "pcie_replays_low": Rule(MONITOR, "PCIe replays during the run, under the limit", DCGM_HEALTH,
                             "under DCGM's limit of 8 per minute"),
    "nvlink_errors": Rule(RESET, "NVLink replay or recovery errors during the run", DCGM_HEALTH,
                          "DCGM fails any increase; XID 74: a GPU reset or node reboot is "
                          "needed to clear an NVLink error"),
    "nvlink_crc_rate": Rule(RESET, "NVLink CRC errors above the limit", DCGM_HEALTH,
                            "DCGM fails 100 or more CRC errors per second"),
    "nvlink_crc": Rule(MONITOR, "NVLink CRC errors during the run, under the limit", DCGM_HEALTH,
                       "DCGM warns below 100 per second"),
    "nvlink_down": Rule(RESET, "an NVLink went down during the run", XID_CATALOG,
                        "XID 74: a GPU reset or node reboot is needed to clear an NVLink "
                        "error"),
    "xid_before_run": Rule(MONITOR, "an XID or SXid from before the run, whose remedy is a reset",
                           XID_CATALOG, "a GPU reset after it does not show in the kernel log; "
                           "the recovery action, ECC counts and remapped rows show whether one "
                           "is still needed"),
    "sxid_fatal": Rule(RESET, "fatal NVSwitch error (SXid)", FABRIC_MANAGER,
                       "a fatal NVSwitch error stops the fabric: reset the GPUs and NVSwitches"),
    "sxid_nonfatal": Rule(MONITOR, "non-fatal NVSwitch error (SXid)", FABRIC_MANAGER,
                          "non-fatal: the fabric goes on"),
    "persistence_off": Rule(MONITOR, "persistence mode is off", NVML_QUERIES,
                            "not a hardware error: the driver tears the GPU state down between "
                            "jobs"),
    "ecc_disabled": Rule(MONITOR, "ECC is disabled", NVML_QUERIES,
                         "memory errors go undetected and uncounted"),
    "pcie_width": Rule(MONITOR, "PCIe link narrower than the GPU's maximum", NVML_QUERIES,
                       "the link trained below its width: bandwidth to the host is reduced"),
}


def worst(actions: list[Action]) -> Action | None:
    """The most severe action, None for none."""
    return max(actions, key=lambda a: a.rank) if actions else None


@dataclass(frozen=True)
class Thresholds:
    """The profile's ``[health]`` table. Limits on increases during a run; each is judged over at
    least its own unit of time (an hour, a minute, a second), so a short run is not held to a
    rate its few events cannot show."""
    # None: corrected errors are recorded (MONITOR), never failed.
    max_corrected_ecc_per_hour: float | None = None
    # DCGM's limit: more than 8 per minute fails (RULES["pcie_replays"]).
    max_pcie_replays_per_minute: float = 8.0
    # DCGM's limit: 100 CRC errors per second on a link fail.
    max_nvlink_crc_errors_per_second: float = 100.0
    # DCGM fails any replay or recovery error on a link: 0 allowed.
    max_nvlink_replay_errors: int = 0

    @classmethod
    def from_profile(cls, table: Any) -> Thresholds:
        return cls(**dict(table or {}))


THRESHOLD_KEYS = tuple(f.name for f in fields(Thresholds))


def _clock(at: float | None) -> str:
    return "at an unknown time" if at is None else "at " + time.strftime(
        "%Y-%m-%dT%H:%M:%S%z", time.localtime(at))


# ------------------------------------------------------------------ judging

@dataclass(frozen=True)
class Finding:
    action: Action
    what: str
    detail: str  # what was found, with its values
    source: str
    why: str
    gpu: int | None = None  # NVML index; None: the node (an NVSwitch, the kernel log)
    bus_id: str | None = None
    key: str = ""  # what it is about: the same key at the start and the end is one finding

    @property
    def where(self) -> str:
        if self.gpu is None:
            return f"node (PCI {self.bus_id})" if self.bus_id else "node"
        return f"GPU {self.gpu} (PCI {self.bus_id or 'unknown'})"

    @property
    def line(self) -> str:
        return (f"{self.action.value} ({self.action.meaning}): {self.where}: {self.what}: "
                f"{self.detail} [{self.why}; {self.source}]")


def _finding(rule: Rule, detail: str, snap: GpuSnapshot | None, key: str,
             bus: str | None = None) -> Finding:
    return Finding(rule.action, rule.what, detail, rule.source, rule.why,
                   None if snap is None else snap.index, snap.bus_id if snap else bus,
                   f"{snap.bus_id if snap else bus}|{key}")


def _state(s: GpuSnapshot, before: GpuSnapshot | None) -> list[Finding]:
    """What one reading shows by itself (ECC uncorrected errors as an increase when there is an
    earlier reading)."""
    if s.lost:
        return [_finding(RULES["gpu_lost"], s.lost, s, "gpu_lost")]
    out = []
    if s.reset_required:
        out.append(_finding(RULES["reset_required"], "NVML_ERROR_RESET_REQUIRED", s, "reset"))
    rows = s.remapped_rows
    if rows and rows.failed:
        out.append(_finding(RULES["remap_failed"], f"failureOccurred=1 ({rows.uncorrected} rows "
                            f"remapped for uncorrected errors)", s, "remap_failed"))
    if rows and rows.pending:
        out.append(_finding(RULES["remap_pending"], f"isPending=1 ({rows.corrected} corrected, "
                            f"{rows.uncorrected} uncorrected rows remapped)", s, "remap_pending"))
    if s.retired_pages_pending:
        out.append(_finding(RULES["retired_pages_pending"], "pending=1", s, "retired_pending"))
    vol, old = s.uncorrected_volatile, before.uncorrected_volatile if before else None
    if vol and old is not None and vol > old:
        out.append(_finding(RULES["ecc_uncorrected_volatile"], f"+{vol - old} during the run "
                            f"(volatile {old} -> {vol})", s, "ecc_uncorrected_delta"))
    elif vol and before is None:
        out.append(_finding(RULES["ecc_uncorrected_volatile"], f"{vol} volatile", s,
                            "ecc_uncorrected_volatile"))
    if s.uncorrected_aggregate:
        no_remap = "remapped rows" in s.not_supported and s.retired_pages_pending is not None
        rule = RULES["ecc_uncorrected_no_remap" if no_remap else "ecc_uncorrected_aggregate"]
        out.append(_finding(rule, f"{s.uncorrected_aggregate} aggregate", s, "ecc_aggregate"))
    if s.recovery_action:
        out.append(_finding(recovery_rule(s.recovery_action), f"value {s.recovery_action}", s,
                            f"recovery_action|{s.recovery_action}"))
    if s.persistence is False:
        out.append(_finding(RULES["persistence_off"], "persistence mode 0", s, "persistence"))
    if s.ecc_enabled is False:
        out.append(_finding(RULES["ecc_disabled"], "ECC mode 0", s, "ecc_mode"))
    if s.pcie_width and s.pcie_max_width and s.pcie_width < s.pcie_max_width:
        out.append(_finding(RULES["pcie_width"], f"x{s.pcie_width} of x{s.pcie_max_width}", s,
                            "pcie_width"))
    return out


def _increases(s: GpuSnapshot, b: GpuSnapshot, t: Thresholds) -> list[Finding]:
    """What grew between two readings of one GPU."""
    out = []
    seconds = max(s.read_at - b.read_at, 0.0)
    if s.corrected_volatile is not None and b.corrected_volatile is not None:
        grew = s.corrected_volatile - b.corrected_volatile
        limit = (None if t.max_corrected_ecc_per_hour is None
                 else t.max_corrected_ecc_per_hour * max(seconds / 3600, 1.0))
        if grew > 0:
            rule = RULES["ecc_corrected" if limit is None or grew <= limit
                         else "ecc_corrected_rate"]
            out.append(_finding(rule, f"+{grew} in {seconds:.0f} s" + (
                f" (limit {limit:g})" if limit is not None else ""), s, "ecc_corrected"))
    if s.pcie_replays is not None and b.pcie_replays is not None:
        grew = s.pcie_replays - b.pcie_replays
        limit = t.max_pcie_replays_per_minute * max(seconds / 60, 1.0)
        if grew > 0:
            rule = RULES["pcie_replays" if grew > limit else "pcie_replays_low"]
            out.append(_finding(rule, f"+{grew} in {seconds:.0f} s (limit {limit:g}: "
                                f"{t.max_pcie_replays_per_minute:g} per minute)", s, "pcie"))
    old = {lk.link: lk for lk in b.nvlinks}
    for lk in s.nvlinks:
        was = old.get(lk.link)
        if was is None:
            continue
        if was.active and not lk.active:
            out.append(_finding(RULES["nvlink_down"], f"link {lk.link} inactive", s,
                                f"nvlink_down|{lk.link}"))
            continue
        errors = _grew(lk.replay, was.replay) + _grew(lk.recovery, was.recovery)
        if errors > t.max_nvlink_replay_errors:
            out.append(_finding(RULES["nvlink_errors"], f"link {lk.link}: +{errors} replay and "
                                f"recovery errors (limit {t.max_nvlink_replay_errors})", s,
                                f"nvlink|{lk.link}"))
        crc = _grew(lk.crc_flit, was.crc_flit) + _grew(lk.crc_data, was.crc_data)
        if crc:
            rate = crc / max(seconds, 1.0)
            rule = RULES["nvlink_crc_rate" if rate >= t.max_nvlink_crc_errors_per_second
                         else "nvlink_crc"]
            out.append(_finding(rule, f"link {lk.link}: +{crc} CRC errors ({rate:.1f}/s, limit "
                                f"{t.max_nvlink_crc_errors_per_second:g}/s)", s,
                                f"nvlink_crc|{lk.link}"))
    return out


def _grew(now: int | None, then: int | None) -> int:
    return max(now - then, 0) if now is not None and then is not None else 0


def _xids(events: Sequence[XidEvent], kernel: Sequence[KernelXid], since: float | None,
          gpus: dict[str | None, GpuSnapshot]) -> list[Finding]:
    """XIDs grouped by GPU, code and window: before ``since`` (every kernel line when it is None)
    or during the run. NVML's events count for a group the kernel log does not show."""
    groups: dict[tuple, list[float | None]] = {}
    for k in kernel:
        during = since is not None and k.at is not None and k.at >= since
        groups.setdefault((k.kind, k.bus_id, k.code, during, k.fatal), []).append(k.at)
    for e in events:
        if not any(g[1] == e.bus_id and g[2] == e.xid and g[3] for g in groups if g[0] == "Xid"):
            groups.setdefault(("Xid", e.bus_id, e.xid, True, False), []).append(e.seen_at)
    out = []
    for (kind, bus, code, during, fatal), times in sorted(groups.items(), key=str):
        rule = RULES["sxid_fatal" if fatal else "sxid_nonfatal"] if kind == "SXid" \
            else xid_rule(code)
        if not during and rule.action is Action.RESET:
            rule = Rule(Action.MONITOR, rule.what, rule.source, RULES["xid_before_run"].why)
        when = "during the run" if during else ("before the run" if since else "since boot")
        known = [t for t in times if t is not None]
        span = (_clock(min(known)) + (f" .. {_clock(max(known))[3:]}" if len(known) > 1 else "")
                if known else _clock(None))
        snap = gpus.get(bus)
        out.append(_finding(rule, f"{kind} {code} x{len(times)} {when}, {span}", snap,
                            f"{kind}|{code}|{'during' if during else 'before'}", bus))
    return out


def judge(now: Sequence[GpuSnapshot], *, before: Sequence[GpuSnapshot] | None = None,
          events: Sequence[XidEvent] = (), kernel: Sequence[KernelXid] = (),
          since: float | None = None, thresholds: Thresholds | None = None) -> list[Finding]:
    """Every finding: each GPU's state, what grew since ``before``, XIDs (kernel lines before
    ``since`` are from before the run)."""
    thresholds = thresholds or Thresholds()
    old = {s.bus_id: s for s in before or ()}
    # XIDs first: when one explains the counters (an XID 79 and the replays before it), the
    # failure's first line names it.
    out = _xids(events, kernel, since, {s.bus_id: s for s in now})
    for s in now:
        b = old.get(s.bus_id) if before is not None else None
        out += _state(s, b)
        if b is not None and not s.lost:
            out += _increases(s, b, thresholds)
    listed = {s.bus_id for s in now}
    for b in before or ():
        if b.bus_id not in listed:
            out.append(_finding(RULES["gpu_gone"], "listed at the start, not at the end", b,
                                "gpu_gone"))
    return out


# ------------------------------------------------------------------ the report

@dataclass
class Report:
    """One reading of the node, judged."""
    gpus: list[GpuSnapshot] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    could_not_check: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kernel: list[KernelXid] = field(default_factory=list)
    events: list[XidEvent] = field(default_factory=list)
    seconds: float = 0.0  # what the reading cost

    @property
    def failing(self) -> list[Finding]:
        """ISOLATE, REBOOT and RESET findings, most severe first."""
        return sorted((f for f in self.findings if f.action.fails), key=lambda f: -f.action.rank)

    @property
    def monitor(self) -> list[Finding]:
        return [f for f in self.findings if not f.action.fails]

    @property
    def action(self) -> Action | None:
        return worst([f.action for f in self.failing])

    @property
    def not_supported(self) -> dict[str, list[int]]:
        """Each counter some GPU does not support, once, with the GPUs."""
        out: dict[str, list[int]] = {}
        for s in self.gpus:
            for counter in s.not_supported:
                out.setdefault(counter, []).append(s.index)
        return out

    @property
    def exit_code(self) -> int:
        """0 healthy (MONITOR included), 1 an action is needed, 2 could not check."""
        return 1 if self.failing else 2 if self.could_not_check or not self.gpus else 0

    def gpu_line(self, s: GpuSnapshot) -> str:
        mine = [f for f in self.findings if f.gpu == s.index]
        bad = [f for f in mine if f.action.fails]
        verdict = "; ".join(f"{f.action.value}: {f.what} ({f.detail})" for f in bad) or "healthy"
        watch = [f for f in mine if not f.action.fails]
        if watch:
            verdict += "; MONITOR: " + "; ".join(f"{f.what} ({f.detail})" for f in watch)
        if s.lost:
            return f"{s.label} {s.name or ''}: {verdict}".replace("  ", " ")
        rows = s.remapped_rows
        read = [
            f"uncorrected ECC {_n(s.uncorrected_volatile)} volatile, "
            f"{_n(s.uncorrected_aggregate)} aggregate; corrected {_n(s.corrected_volatile)}, "
            f"{_n(s.corrected_aggregate)}",
            "remapped rows " + (f"{rows.corrected} corrected, {rows.uncorrected} uncorrected, "
                                f"pending {_yes(rows.pending)}, failed {_yes(rows.failed)}"
                                if rows else "-"),
            f"PCIe replays {_n(s.pcie_replays)}, width x{_n(s.pcie_width)} of "
            f"x{_n(s.pcie_max_width)}",
            f"recovery action {_n(s.recovery_action)}",
            f"persistence {_on(s.persistence)}, ECC {_on(s.ecc_enabled)}",
            f"{_n(s.compute_processes)} compute processes",
        ]
        if s.nvlinks:
            read.append(f"{sum(lk.active for lk in s.nvlinks)} of {len(s.nvlinks)} NVLinks "
                        "active")
        if s.retired_pages_pending is not None:
            read.append(f"retired pages pending {_yes(s.retired_pages_pending)}")
        line = f"{s.label} {s.name or ''}: {verdict} | read: {'; '.join(read)}"
        if s.not_supported:
            line += f" | not supported on this GPU: {', '.join(s.not_supported)}"
        return line

    def lines(self) -> list[str]:
        out = [self.gpu_line(s) for s in self.gpus]
        out += [f"  {f.line}" for f in self.findings]
        out += self.notes
        out += [f"could not check: {c}" for c in self.could_not_check]
        out.append(f"dsconform health: exit {self.exit_code}: {self.verdict} "
                   f"({self.seconds:.2f} s)")
        return out

    @property
    def verdict(self) -> str:
        """One line: the worst action with its GPU and condition, or why nothing was checked
        (a Slurm prolog puts it in the drain reason)."""
        bad = self.failing
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            return f"{bad[0].action.value}: {bad[0].where}: {bad[0].what}{more}"
        if self.exit_code == 2:
            return "could not check: " + (self.could_not_check or ["no GPU"])[0]
        return "healthy"

    def failure_message(self) -> str | None:
        """None when the gate passes; else the worst action first (the results' failure reason
        and the drain reason are this first line), then every finding with its source."""
        bad = self.failing
        if not bad and not self.could_not_check:
            return None
        if bad:
            f = bad[0]
            head = (f"{f.action.value} ({f.action.meaning}): {f.where}: {f.what}: {f.detail}"
                    + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        else:
            head = f"could not check the GPUs' error state: {self.could_not_check[0]}"
        return "\n".join([head, *(f.line for f in self.findings),
                          *(f"could not check: {c}" for c in self.could_not_check)])

    def facts(self, when: str) -> dict[str, Any]:
        """What to record in the results (``facts.record``), under ``health.<when>.*``: what
        every counter read, without the time of reading (``dsconform compare`` names a fact
        that differs between two runs; the test's duration is its cost)."""
        out: dict[str, Any] = {
            f"health.{when}.gpu{s.index}": {k: v for k, v in asdict(s).items() if k != "read_at"}
            for s in self.gpus}
        out[f"health.{when}.not_supported"] = self.not_supported
        out[f"health.{when}.findings"] = [f.line for f in self.findings]
        out[f"health.{when}.kernel_xids"] = [f"{k.kind} {k.code} {k.bus_id}" for k in self.kernel]
        out[f"health.{when}.xid_events"] = [f"Xid {e.xid} {e.bus_id}" for e in self.events]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code,
                "action": self.action.value if self.action else None,
                "seconds": round(self.seconds, 3),
                "gpus": [asdict(s) for s in self.gpus],
                "findings": [{**asdict(f), "line": f.line} for f in self.findings],
                "not_supported": self.not_supported,
                "could_not_check": self.could_not_check, "notes": self.notes,
                "kernel_xids": [asdict(k) for k in self.kernel],
                "xid_events": [asdict(e) for e in self.events]}


def _n(v: Any) -> str:
    return "-" if v is None else str(v)


def _yes(v: bool) -> str:
    return "yes" if v else "no"


def _on(v: bool | None) -> str:
    return "-" if v is None else "on" if v else "off"
