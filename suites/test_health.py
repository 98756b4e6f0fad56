"""Hardware error state: no GPU MAY carry an error that calls for draining the node, at the start
of the run or at its end.

HEALTH-1 runs before every other test (marker ``run_first``) and HEALTH-2 after all of them
(``run_last``). Per GPU they read, from NVML (nvidia-ml-py) and the kernel log: XIDs (an NVML
event set open from HEALTH-1 to HEALTH-2, and the kernel log's ``NVRM: Xid`` lines since boot,
each with its time), uncorrected ECC errors (volatile and aggregate), the increase of corrected
ones, remapped rows pending or failed, retired pages pending, the NVLink CRC, replay and recovery
counters, the PCIe replay counter, the GPU recovery action and persistence mode. One table,
dsconform/node/severity.py, maps each condition to an action and cites its source:

- a condition whose action is ISOLATE, REBOOT or RESET MUST fail, the action first in the
  reason (``dsconform aggregate`` puts it in the node's drain reason);
- a MONITOR condition passes; it is recorded and shown in the summary;
- a counter the GPU does not support is listed once, "not supported on this GPU"; a counter NVML
  cannot read MUST fail: the GPU could not be checked, which is no pass;
- every counter read is recorded in the results (facts ``health.start.*``, ``health.end.*``).

The profile's ``[health]`` table sets the limits on increases (docs/health.md). ``dsconform
health`` is the same check alone, in about a second, for Slurm prologs and Kubernetes init
containers.

Upstream: https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html ,
https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html ,
https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/error-recovery-and-response-flags.html .

Stable ids: HEALTH-1 (at the start of the run), HEALTH-2 (at its end).
"""

from __future__ import annotations

from datetime import datetime

import pytest

from dsconform.suite import health

CAPABILITY = "health"
NO_GPU = ("no NVIDIA GPU: nothing to read (NVML, /proc/driver/nvidia and the PCI bus show "
          "none)")


@pytest.fixture(scope="session")
def gate(profile):
    """The run's gate: HEALTH-1 opens it, HEALTH-2 reads it; its XID event set is closed when
    the session ends."""
    g = health.Gate(health.Thresholds.from_profile(profile.health))
    yield g
    g.close()


def _run_started(run) -> float:
    """The run's start (pytest_configure): the cell batch and the standby ranks start before
    HEALTH-1, and kernel log lines after this belong to the run."""
    return datetime.strptime(run.started, "%Y-%m-%dT%H:%M:%S%z").timestamp()


def _verdict(report, when: str, facts, run) -> None:
    for name, value in report.facts(when).items():
        facts.record(name, value)
    run.notices.extend(health.monitor_notes(report, when))
    message = report.failure_message()
    if message:
        pytest.fail(message, pytrace=False)


@pytest.mark.anynode
@pytest.mark.run_first
def test_health_at_start(node, gate, facts, run):
    """HEALTH-1: No GPU MAY start the run with an error state whose action is ISOLATE, REBOOT or
    RESET (an XID since boot, uncorrected ECC errors, a pending or failed row remap, retired
    pages pending, a recovery action), and every counter MUST be read or be unsupported."""
    if not node.is_gpu_node:
        pytest.skip(NO_GPU)
    _verdict(gate.begin(since=_run_started(run)), "start", facts, run)


@pytest.mark.anynode
@pytest.mark.run_last
def test_health_at_end(node, gate, facts, run):
    """HEALTH-2: No GPU MAY end the run with a new error whose action is ISOLATE, REBOOT or RESET
    (an XID during the run, an uncorrected ECC error, corrected ECC errors, PCIe replays or NVLink
    errors beyond the profile's [health] limits, a GPU gone from NVML)."""
    if not node.is_gpu_node:
        pytest.skip(NO_GPU)
    _verdict(gate.end(since=_run_started(run)), "end", facts, run)
