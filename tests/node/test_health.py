"""The hardware error gate (dsconform/node/health.py, dsconform/node/severity.py) MUST fail each
condition with its action, list what a GPU does not support once, and never pass a GPU it could
not read; ``dsconform health`` MUST exit 0/1/2 without importing torch or DeepSpeed.

NVML is a fake passed in (FakeNvml: the pynvml calls the gate makes, answering what a test
chose, raising pynvml's own errors); the kernel log is a text. The fake's defaults are what the
one-GPU H200 reference node (driver 580) shows: ECC on, every count 0, remapped rows (0, 0, 0, 0),
PCIe x16 of x16, recovery action 0; retired pages pending and NVLink not supported.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from dsconform.node import health, severity
from dsconform.node.detect import GpuHardware
from dsconform.node.severity import Action
from dsconform.profile import schema
from dsconform.results import aggregate

ROOT = Path(__file__).resolve().parents[2]
BUS = "00000000:2A:00.0"  # as NVML writes it
PCI = "0000:2a:00.0"      # as the gate reports it
BOOT_AT = 1_700_000_000.0  # the epoch second the fake kernel log counts from


def h200(**changes):
    """One GPU as the reference H200 shows it; ``changes`` override (an exception instance is
    raised by the call that reads it)."""
    gpu = {"bus": BUS, "name": "NVIDIA H200", "persistence": 1, "ecc_mode": 1,
           "ecc": {("UNCORRECTED", "VOLATILE"): 0, ("UNCORRECTED", "AGGREGATE"): 0,
                   ("CORRECTED", "VOLATILE"): 0, ("CORRECTED", "AGGREGATE"): 0},
           "remapped_rows": (0, 0, 0, 0),
           "retired_pending": pynvml.NVMLError_NotSupported(),
           "pcie_replays": 0, "pcie_width": 16, "pcie_max_width": 16,
           "nvlink": pynvml.NVMLError_NotSupported(),  # or a list of (active, {counter: n})
           "recovery_action": 0, "processes": [], "register": None}
    gpu.update(changes)
    return gpu


class FakeNvml:
    """The pynvml functions the gate calls, answering from ``gpus`` (handle = index)."""

    def __init__(self, gpus):
        self.gpus = gpus
        self.events = []  # (handle, xid) the event set returns, oldest first
        self.inits = 0

    def __getattr__(self, name):  # the constants are pynvml's own
        if name.startswith(("NVML_", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def _get(self, h, key):
        value = self.gpus[h][key]
        if isinstance(value, BaseException):
            raise value
        return value

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._get(h, "bus"))

    def nvmlDeviceGetName(self, h):
        return self._get(h, "name")

    def nvmlDeviceGetPersistenceMode(self, h):
        return self._get(h, "persistence")

    def nvmlDeviceGetEccMode(self, h):
        return [self._get(h, "ecc_mode")] * 2

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        kind = {pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "UNCORRECTED",
                pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "CORRECTED"}[error_type]
        counter = {pynvml.NVML_VOLATILE_ECC: "VOLATILE",
                   pynvml.NVML_AGGREGATE_ECC: "AGGREGATE"}[counter_type]
        value = self._get(h, "ecc")[(kind, counter)]
        if isinstance(value, BaseException):
            raise value
        return value

    def nvmlDeviceGetRemappedRows(self, h):
        return self._get(h, "remapped_rows")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._get(h, "retired_pending")

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return self._get(h, "pcie_replays")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._get(h, "pcie_width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._get(h, "pcie_max_width")

    def nvmlDeviceGetNvLinkState(self, h, link):
        links = self._get(h, "nvlink")
        if link >= len(links):
            raise pynvml.NVMLError_InvalidArgument()
        return int(links[link][0])

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        value = self._get(h, "nvlink")[link][1]
        if isinstance(value, BaseException):
            raise value
        return value[counter]

    def nvmlDeviceGetFieldValues(self, h, ids):
        assert ids == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        value = self.gpus[h]["recovery_action"]
        if isinstance(value, BaseException):
            return [SimpleNamespace(nvmlReturn=value.value, valueType=0, value=None)]
        return [SimpleNamespace(nvmlReturn=0, valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                                value=SimpleNamespace(uiVal=value))]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._get(h, "processes")

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlEventSetCreate(self):
        return "event set"

    def nvmlDeviceRegisterEvents(self, h, types, event_set):
        assert types == pynvml.nvmlEventTypeXidCriticalError and event_set == "event set"
        if self.gpus[h]["register"] is not None:
            raise self.gpus[h]["register"]

    def nvmlEventSetWait(self, event_set, timeout_ms):
        if not self.events:
            raise pynvml.NVMLError_Timeout()
        h, xid = self.events.pop(0)
        return SimpleNamespace(device=h, eventData=xid)

    def nvmlEventSetFree(self, event_set):
        pass


def gate_for(nvml, kernel_text="", thresholds=None):
    log = {"text": kernel_text}
    gate = health.Gate(thresholds, open_nvml=lambda: contextlib.nullcontext(
        (nvml, list(range(len(nvml.gpus))))), kernel_log=lambda: (log["text"], ""),
        boot_at=BOOT_AT)
    return gate, log


def kernel_line(at: float, text: str) -> str:
    """A dmesg line stamped ``at`` (seconds since the epoch)."""
    return f"[{at - BOOT_AT:12.6f}] {text}"


def run_gate(nvml, during=None, kernel_text="", thresholds=None):
    """HEALTH-1, then ``during(nvml, log, gate)`` changes the fake, then HEALTH-2."""
    gate, log = gate_for(nvml, kernel_text, thresholds)
    start = gate.begin()
    if during:
        during(nvml, log, gate)
    return start, gate.end()


def assert_fails_with(report, action: Action, *words: str):
    message = report.failure_message()
    assert message is not None, report.lines()
    first = message.splitlines()[0]
    assert first.startswith(f"{action.value} ("), first
    for word in words:
        assert word in first, first
    assert report.exit_code == 1


# ------------------------------------------------------------------ the reference node


def test_reference_h200_passes_and_lists_what_it_does_not_support():
    nvml = FakeNvml([h200()])
    start, end = run_gate(nvml)
    for report in (start, end):
        assert report.failure_message() is None, report.lines()
        assert report.exit_code == 0
        assert report.not_supported == {"retired pages pending": [0], "NVLink": [0]}
    s = start.gpus[0]
    assert (s.bus_id, s.remapped_rows, s.pcie_width, s.recovery_action) == (
        PCI, health.RemappedRows(0, 0, False, False), 16, 0)
    line = start.gpu_line(s)
    assert line.startswith(f"GPU 0 (PCI {PCI}) NVIDIA H200: healthy | read: ")
    assert line.endswith("| not supported on this GPU: retired pages pending, NVLink")
    assert nvml.inits == 0, "the XID event set's NVML reference was not given back"
    facts = end.facts("end")
    json.dumps(facts)  # recordable
    assert facts["health.end.gpu0"]["uncorrected_volatile"] == 0


def test_not_supported_is_listed_once_however_often_it_is_asked():
    """Every active link asks for four NVLink counters; a GPU that supports none of them says
    so once."""
    no = pynvml.NVMLError_NotSupported()
    nvml = FakeNvml([h200(nvlink=[(True, no)] * 18)])
    report = health.Gate(open_nvml=lambda: contextlib.nullcontext((nvml, [0])),
                         kernel_log=lambda: ("", "")).state()
    assert report.gpus[0].not_supported == ["retired pages pending", "NVLink error counters"]
    assert report.lines()[0].count("NVLink error counters") == 1
    assert report.exit_code == 0


# ------------------------------------------------------------------ each condition, red


def test_xid_79_during_the_run_isolates():
    def fall_off(nvml, log, gate):
        nvml.events.append((0, 79))
        log["text"] += kernel_line(gate.started_at + 5, "NVRM: Xid (PCI:0000:2a:00): 79, "
                                   "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    start, end = run_gate(FakeNvml([h200()]), fall_off)
    assert start.failure_message() is None
    assert_fails_with(end, Action.ISOLATE, f"GPU 0 (PCI {PCI})", "Xid 79 x1 during the run")


def test_xid_79_seen_only_by_the_nvml_event_set_isolates():
    def fall_off(nvml, log, gate):
        nvml.events.append((0, 79))  # the kernel log shows nothing (not readable, say)
    _, end = run_gate(FakeNvml([h200()]), fall_off)
    assert_fails_with(end, Action.ISOLATE, "GPU has fallen off the bus", "Xid 79 x1")


def test_a_pending_row_remap_needs_a_reset():
    start, end = run_gate(FakeNvml([h200(remapped_rows=(0, 1, 1, 0))]))
    assert_fails_with(start, Action.RESET, "row remapping pending", "isPending=1")
    assert end.failure_message() is None, "found at the start: not repeated at the end"


def test_a_failed_row_remap_isolates():
    report = run_gate(FakeNvml([h200(remapped_rows=(0, 512, 0, 1))]))[0]
    assert_fails_with(report, Action.ISOLATE, "row remapping failed")


def test_an_uncorrected_ecc_error_during_the_run_needs_a_reset():
    def one_error(nvml, log, gate):
        nvml.gpus[0]["ecc"][("UNCORRECTED", "VOLATILE")] = 1
        nvml.gpus[0]["ecc"][("UNCORRECTED", "AGGREGATE")] = 1
    start, end = run_gate(FakeNvml([h200()]), one_error)
    assert start.failure_message() is None
    assert_fails_with(end, Action.RESET, "uncorrected ECC", "+1 during the run (volatile 0 -> 1)")
    assert not any(f.action is Action.ISOLATE for f in end.findings), \
        "a GPU with row remapping is not isolated for an aggregate uncorrected error"


def test_uncorrected_aggregate_ecc_without_row_remapping_isolates():
    """A GPU older than Ampere retires pages and cannot remap rows."""
    gpu = h200(remapped_rows=pynvml.NVMLError_NotSupported(), retired_pending=0)
    gpu["ecc"][("UNCORRECTED", "AGGREGATE")] = 3
    assert_fails_with(run_gate(FakeNvml([gpu]))[0], Action.ISOLATE, "no row remapping")


def test_retired_pages_pending_needs_a_reboot():
    gpu = h200(remapped_rows=pynvml.NVMLError_NotSupported(), retired_pending=1)
    assert_fails_with(run_gate(FakeNvml([gpu]))[0], Action.REBOOT, "retired pages pending")


def test_a_pcie_replay_burst_isolates():
    def burst(nvml, log, gate):
        nvml.gpus[0]["pcie_replays"] = 500
    start, end = run_gate(FakeNvml([h200(pcie_replays=12)]), burst)
    assert start.failure_message() is None, "a count since the driver loaded is not judged"
    assert_fails_with(end, Action.ISOLATE, "PCIe replays above the limit", "+488")


def test_pcie_replays_under_the_limit_are_only_monitored():
    def few(nvml, log, gate):
        nvml.gpus[0]["pcie_replays"] = 3
    _, end = run_gate(FakeNvml([h200()]), few)
    assert end.failure_message() is None
    assert [f.what for f in end.monitor] == ["PCIe replays during the run, under the limit"]


@pytest.mark.parametrize(("value", "action"), [(1, Action.RESET), (2, Action.REBOOT),
                                               (4, Action.RESET), (99, Action.REBOOT)])
def test_a_recovery_action_fails_with_its_action(value, action):
    report = run_gate(FakeNvml([h200(recovery_action=value)]))[0]
    assert_fails_with(report, action, f"value {value}")


def test_nvlink_replay_errors_during_the_run_need_a_reset():
    counters = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 0, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: 0,
                pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 0, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: 0}

    def replays(nvml, log, gate):
        nvml.gpus[0]["nvlink"][1][1][pynvml.NVML_NVLINK_ERROR_DL_REPLAY] = 2
    links = [(True, dict(counters)), (True, dict(counters))]
    _, end = run_gate(FakeNvml([h200(nvlink=links)]), replays)
    assert_fails_with(end, Action.RESET, "link 1: +2 replay")


def test_the_gpu_lost_isolates():
    lost = pynvml.NVMLError_GpuIsLost()
    report = run_gate(FakeNvml([h200(bus=lost, name=lost)]))[0]
    assert_fails_with(report, Action.ISOLATE, "the GPU is lost")


def test_a_counter_nvml_cannot_read_fails_as_could_not_check():
    nvml = FakeNvml([h200(remapped_rows=pynvml.NVMLError_NoPermission())])
    report = run_gate(nvml)[0]
    message = report.failure_message()
    assert message and message.startswith("could not check the GPUs' error state: GPU 0 (PCI "
                                          f"{PCI}): remapped rows: NVMLError_NoPermission")
    assert report.exit_code == 2


def test_nvml_that_cannot_start_fails_the_gate():
    def broken():
        raise pynvml.NVMLError_DriverNotLoaded()
    report = health.Gate(open_nvml=broken, kernel_log=lambda: ("", "")).begin()
    assert report.failure_message().startswith("could not check the GPUs' error state: NVML "
                                               "cannot be read: NVMLError_DriverNotLoaded")


# ------------------------------------------------------------------ the kernel log

KERNEL_LOG = "\n".join([
    kernel_line(BOOT_AT + 10, "nvidia: loading out-of-tree module taints kernel."),
    kernel_line(BOOT_AT + 20, "NVRM: Xid (PCI:0000:2a:00): 13, pid=1234, name=python, Graphics "
                "Exception: ESR 0x404490=0x80000001"),
    kernel_line(BOOT_AT + 21, "NVRM: Xid (PCI:0000:2a:00): 13, pid=1234, name=python, Graphics "
                "SM Warp Exception"),
    kernel_line(BOOT_AT + 30, "NVRM: Xid (PCI:0000:2a:00): 48, pid=1234, name=python, An "
                "uncorrectable double bit error (DBE) has been detected on GPU."),
    kernel_line(BOOT_AT + 40, "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Fatal, Link "
                "30 LTSSM Fault Up"),
    kernel_line(BOOT_AT + 41, "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Non-fatal, "
                "Link 32 egress non-posted PRIV error"),
])


def test_kernel_log_lines_are_parsed_with_their_time():
    xids = health.parse_kernel_log(KERNEL_LOG, BOOT_AT)
    assert [(k.kind, k.code, k.bus_id, k.at, k.fatal) for k in xids] == [
        ("Xid", 13, PCI, BOOT_AT + 20, False), ("Xid", 13, PCI, BOOT_AT + 21, False),
        ("Xid", 48, PCI, BOOT_AT + 30, False), ("SXid", 20034, "0000:07:00.0", BOOT_AT + 40, True),
        ("SXid", 12028, "0000:07:00.0", BOOT_AT + 41, False)]


def test_xids_from_before_the_run_are_reported_and_judged_by_the_table():
    """Application XIDs are monitored. A double-bit error or a fatal SXid since boot is reported,
    but whether its reset is still owed is what the GPU's own counters say (the volatile ECC
    count, the recovery action): a GPU reset after it leaves no line in the kernel log."""
    report = run_gate(FakeNvml([h200()]), kernel_text=KERNEL_LOG)[0]
    by_code = {f.key.split("|", 1)[1]: f for f in report.findings}
    assert set(by_code) == {"Xid|13|before", "Xid|48|before", "SXid|20034|before",
                            "SXid|12028|before"}
    assert {f.action for f in by_code.values()} == {Action.MONITOR}
    assert by_code["Xid|13|before"].detail.startswith("Xid 13 x2 before the run, at ")
    assert report.failure_message() is None


def test_a_double_bit_error_since_boot_with_its_count_still_set_needs_a_reset():
    gpu = h200()
    gpu["ecc"][("UNCORRECTED", "VOLATILE")] = 1
    assert_fails_with(run_gate(FakeNvml([gpu]), kernel_text=KERNEL_LOG)[0], Action.RESET,
                      "uncorrected ECC errors since the driver loaded", "1 volatile")


def test_a_fatal_sxid_during_the_run_needs_a_reset():
    def fatal(nvml, log, gate):
        log["text"] += "\n" + kernel_line(gate.started_at + 1, "nvidia-nvswitch0: SXid "
                                          "(PCI:0000:05:00.0): 20034, Fatal, Link 30 LTSSM Fault")
    _, end = run_gate(FakeNvml([h200()]), fatal, kernel_text=KERNEL_LOG)
    assert_fails_with(end, Action.RESET, "node (PCI 0000:05:00.0)", "fatal NVSwitch error",
                      "SXid 20034 x1 during the run")
    assert not end.monitor, "what HEALTH-1 reported is not repeated"


def test_an_xid_79_since_boot_isolates_even_before_the_run():
    log = kernel_line(BOOT_AT + 50, "NVRM: Xid (PCI:0000:2a:00): 79, GPU has fallen off the bus.")
    report = run_gate(FakeNvml([h200()]), kernel_text=log)[0]
    assert_fails_with(report, Action.ISOLATE, "Xid 79 x1 before the run")


# ------------------------------------------------------------------ the command


def _command(nvml=None, as_json=False, hardware=1):
    out = io.StringIO()
    opener = (lambda: contextlib.nullcontext((nvml, list(range(len(nvml.gpus)))))) \
        if nvml is not None else _no_nvml
    code = health.command(as_json=as_json, out=out, open_nvml=opener,
                          kernel_log=lambda: ("", ""),
                          hardware=lambda: GpuHardware(count=hardware))
    return code, out.getvalue()


def _no_nvml():
    raise pynvml.NVMLError_LibraryNotFound()


def test_command_exit_0_healthy_one_line_per_gpu():
    code, text = _command(FakeNvml([h200(), h200(bus="00000000:2B:00.0")]))
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith(f"GPU 0 (PCI {PCI}) NVIDIA H200: healthy")
    assert lines[1].startswith("GPU 1 (PCI 0000:2b:00.0) NVIDIA H200: healthy")
    assert lines[-1].startswith("dsconform health: exit 0: healthy (")


def test_command_exit_1_names_the_action():
    code, text = _command(FakeNvml([h200(remapped_rows=(0, 1, 1, 0))]))
    assert code == 1
    assert "RESET: row remapping pending" in text.splitlines()[0]
    assert text.splitlines()[-1].startswith(
        f"dsconform health: exit 1: RESET: GPU 0 (PCI {PCI}): row remapping pending (")


def test_command_exit_2_on_a_machine_without_gpus_says_why():
    code, text = _command(None, hardware=0)
    assert code == 2
    assert text.splitlines()[-1].startswith("dsconform health: exit 2: could not check: no "
                                            "NVIDIA GPU on this machine: nothing to read (NVML")


def test_command_exit_2_when_nvml_fails_on_a_gpu_node():
    code, text = _command(None, hardware=2)
    assert code == 2
    assert "NVML cannot be read" in text and "2 NVIDIA GPUs on the PCI bus" in text


def test_command_json():
    code, text = _command(FakeNvml([h200(recovery_action=2)]), as_json=True)
    doc = json.loads(text)
    assert code == 1 and doc["exit_code"] == 1 and doc["action"] == "REBOOT"
    assert doc["gpus"][0]["bus_id"] == PCI
    assert doc["not_supported"] == {"retired pages pending": [0], "NVLink": [0]}
    assert [f["action"] for f in doc["findings"]] == ["REBOOT"]


def test_dsconform_health_imports_neither_torch_nor_deepspeed():
    code = ("import io, json, sys, contextlib\n"
            "from dsconform.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    rc = main(['health', '--json', '--profile', 'h200-x8'])\n"
            "print(json.dumps({'rc': rc, 'report': json.loads(out.getvalue()),\n"
            "                  'imported': [m for m in ('torch', 'deepspeed') if m in sys.modules]"
            "}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["imported"] == []
    if not result["report"]["gpus"]:  # this machine: no NVIDIA GPU
        assert result["rc"] == 2
        assert result["report"]["could_not_check"][0].startswith("no NVIDIA GPU on this machine")


# ------------------------------------------------------------------ the table, the profile, drains


def test_every_rule_cites_a_source_a_user_can_open():
    rules = [*severity.XID_RULES.values(), *severity.RECOVERY_ACTIONS.values(),
             *severity.RULES.values()]
    assert all(r.source.startswith("https://") and r.why and r.what for r in rules)
    assert severity.XID_RULES[79].action is Action.ISOLATE
    assert severity.XID_RULES[48].action is Action.RESET
    assert {severity.XID_RULES[x].action for x in (13, 31, 43, 45)} == {Action.MONITOR}
    assert severity.xid_rule(999).action is Action.MONITOR


def test_aggregate_names_the_failing_actions_the_table_has():
    assert aggregate.HARDWARE_ACTIONS == tuple(a.value for a in severity.FAILING)


def test_profile_health_table_is_the_gates_thresholds():
    assert set(schema.SCHEMA["health"]) == set(severity.THRESHOLD_KEYS)
    base = {"profile": {"name": "t"}, "gpus": {"count": 1}}
    p = schema.from_data({**base, "health": {"max_corrected_ecc_per_hour": 10,
                                             "max_pcie_replays_per_minute": 2.5}}, "t.toml")
    t = severity.Thresholds.from_profile(p.health)
    assert (t.max_corrected_ecc_per_hour, t.max_pcie_replays_per_minute) == (10, 2.5)
    problems = schema.validate_data({**base, "health": {"max_pcie_replays": 5,
                                                        "max_nvlink_replay_errors": -1}}, "t.toml")
    assert any("health.max_pcie_replays: unknown key" in p for p in problems), problems
    assert any("health.max_nvlink_replay_errors: must be >= 0" in p for p in problems), problems


@pytest.mark.parametrize(("limit", "found"), [(None, 11), (10, 10), (10, 11)])
def test_corrected_ecc_fails_only_above_the_profiles_rate(limit, found):
    def corrected(nvml, log, gate):
        nvml.gpus[0]["ecc"][("CORRECTED", "VOLATILE")] = found
    _, end = run_gate(FakeNvml([h200()]), corrected,
                      thresholds=severity.Thresholds(max_corrected_ecc_per_hour=limit))
    if limit is not None and found > limit:
        assert_fails_with(end, Action.ISOLATE, "corrected ECC errors above the profile's rate",
                          f"+{found}")
    else:
        assert end.failure_message() is None
        assert [f.what for f in end.monitor] == ["corrected ECC errors during the run"]


def test_drain_reason_puts_the_hardware_action_first():
    node = aggregate.NodeResult.missing("gpu-node-7")
    node.absent, node.finished, node.exitstatus = False, True, 1
    node.outcomes = [{"nodeid": "x"}]
    node.failures = [
        {"reason": "zero: loss differs at step 3", "count": 4},
        {"reason": f"RESET (drain the node and reset the GPU (nvidia-smi -r)): GPU 0 (PCI {PCI}): "
                   "row remapping pending: isPending=1", "count": 1},
        {"reason": f"ISOLATE (drain the node and replace the GPU): GPU 0 (PCI {PCI}): GPU has "
                   "fallen off the bus: Xid 79 x1 during the run", "count": 1}]
    report = aggregate.analyse([node])
    [line] = aggregate.drain_commands(report)
    assert line.startswith('scontrol update nodename=gpu-node-7 state=drain reason="dsconform: '
                           '1 x ISOLATE (drain the node and replace the GPU)'), line


def test_nvlink_crc_errors_under_the_limit_are_one_note_per_gpu():
    """Two GPUs whose 18 links each saw a few CRC errors: MONITOR, one summary note per GPU
    (not 36), with the count of links and the first ones' values."""
    counters = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 0, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: 0,
                pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 0, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: 0}

    def crc(nvml, log, gate):
        for gpu in nvml.gpus:
            for _, link in gpu["nvlink"]:
                link[pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT] = 2
    gpus = [h200(nvlink=[(True, dict(counters)) for _ in range(18)]),
            h200(bus="00000000:2B:00.0", nvlink=[(True, dict(counters)) for _ in range(18)])]
    _, end = run_gate(FakeNvml(gpus), crc)
    assert end.failure_message() is None and len(end.monitor) == 36
    notes = health.monitor_notes(end, "end")
    assert len(notes) == 2, notes
    assert notes[0].startswith(f"hardware MONITOR at the end of the run: GPU 0 (PCI {PCI}): "
                               "NVLink CRC errors during the run, under the limit: 18 x link 0: "
                               "+2 CRC errors ("), notes[0]
    assert notes[0].endswith("; and 15 more") and "GPU 1 (PCI 0000:2b:00.0)" in notes[1]
