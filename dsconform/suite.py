"""The ONE module suites import: gates and the accelerator x cell parameters, the rank harness,
configs, comparisons, tolerances, the checks several suites share (ZeRO against DDP, the
collective calls), records, known issues and this run's state.

Suites read like specifications (build a config, run ranks, compare, record) and depend on this
surface only, never on the plugin's internals; what a suite needs that is not here belongs here.

Fixtures (from the plugin): ``run`` (RunState), ``profile`` (Profile), ``node`` (NodeFacts),
``scratch`` (a fresh directory under --scratch), ``metrics`` (MetricsRecorder), ``facts``
(FactsRecorder: non-numeric observations, e.g. effective defaults, that compare diffs).
"""

from __future__ import annotations

from dsconform.base import compat, versions
from dsconform.base.pairwise import axis_values, covering_cases, pairwise, uncovered_pairs
from dsconform.base.removed import ONEBIT_OPTIMIZERS
from dsconform.checks import (
    batch_rule,
    checkpoint_state,
    collective_calls,
    collectives,
    monitor_log,
    schedules,
    sdc,
    soak,
)
from dsconform.checks import onebit as onebit_reference
from dsconform.checks.dsconfig import (
    ASSUMED_DEFAULTS,
    ASSUMED_RESOLVED,
    BATCH_KEYS,
    MONITOR_JOB,
    ONEBIT_TYPES,
    OPTIMIZER_OPS,
    defaults_mismatches,
    ds_config,
)
from dsconform.checks.equivalence import (
    Comparison,
    compare_rank_results,
    compare_states,
    compare_traces,
    compare_update,
    non_finite,
    tensor_difference,
)
from dsconform.checks.lossscale import (
    ModelStep,
    ScalerModel,
    ScalerSettings,
    ScalerState,
    read_scaler,
)
from dsconform.checks.tolerances import Tol, tolerance
from dsconform.checks.zero_vs_ddp import (
    MLP,
    TORCH_DTYPES,
    ZERO_OFFLOADS,
    ZeroCase,
    clip_problems,
    cpu_fp32,
    rank_batches,
    record_zero_comparison,
    train_zero_and_ddp,
    zero_check_name,
)
from dsconform.gate.known_issues import KNOWN_ISSUES, KnownIssue, KnownIssueFailure
from dsconform.gate.requires import ACCELERATORS, accel_cell, accel_params, requires
from dsconform.gate.tiers import one_rank_twins, tier_params
from dsconform.harness.api import (
    InsufficientGPUs,
    RankError,
    RankTimeout,
    all_agree,
    device,
    external_rendezvous,
    gather,
    rank,
    run_ranks,
    seed_everything,
    worker_gpus,
    world,
    xdist_worker,
)
from dsconform.node import gpu_health, health, nccl_tests, neighbours, sampler
from dsconform.node.detect import (
    NodeFacts,
    nvml_devices,
    usable_cpu_cores,
    usable_memory_bytes,
)
from dsconform.node.dsreport import parse_ds_report, run_ds_report
from dsconform.ops.checks import (
    OpChecks,
    OpCrashed,
    OpUnavailableText,
    checks_for_run,
)
from dsconform.plugin.batch import RankCall, batched, cell_results
from dsconform.plugin.runstate import RunState, run_state
from dsconform.profile import known_answers
from dsconform.profile.catalogue import peak_tflops as gpu_peak_tflops
from dsconform.profile.schema import NcclFloor, NvmePath, Profile
from dsconform.profile.select import Rendezvous, rendezvous_info
from dsconform.results.records import FactsRecorder, MetricsRecorder
from dsconform.storage import checkpoint as checkpoint_storage
from dsconform.storage import io as nvme_io
from dsconform.storage import nvme
from dsconform.storage import tune as nvme_tune
from dsconform.storage import xcheck as nvme_xcheck
from dsconform.units import GB, GIB, TFLOPS

__all__ = [
    "ASSUMED_DEFAULTS", "ASSUMED_RESOLVED", "GB", "GIB", "TFLOPS", "KNOWN_ISSUES",
    "OPTIMIZER_OPS", "Comparison",
    "FactsRecorder", "Rendezvous", "rendezvous_info",
    "InsufficientGPUs", "KnownIssue", "KnownIssueFailure", "MetricsRecorder", "NcclFloor",
    "NodeFacts", "NvmePath",
    "OpChecks", "OpCrashed", "RankCall", "batched", "cell_results", "checks_for_run",
    "OpUnavailableText", "Profile", "parse_ds_report",
    "run_ds_report", "RankError", "RankTimeout", "RunState", "Tol", "accel_params", "all_agree",
    "compare_rank_results", "compare_traces", "defaults_mismatches", "device", "ds_config",
    "axis_values", "covering_cases", "one_rank_twins", "tier_params", "gather", "non_finite",
    "pairwise", "rank", "uncovered_pairs", "requires",
    "run_ranks",
    "run_state", "seed_everything",
    "tensor_difference", "tolerance", "versions", "world", "compat",
    "ModelStep", "ScalerModel", "ScalerSettings", "ScalerState", "read_scaler",
    "collectives", "gpu_health", "health", "nccl_tests", "worker_gpus",
    "ONEBIT_OPTIMIZERS", "ONEBIT_TYPES", "onebit_reference",
    "nvme", "nvme_io", "nvme_tune", "nvme_xcheck",
    "checkpoint_state", "checkpoint_storage", "compare_states",
    "ACCELERATORS", "accel_cell", "collective_calls", "compare_update", "external_rendezvous",
    "xdist_worker", "nvml_devices", "neighbours", "usable_cpu_cores", "usable_memory_bytes",
    "MLP", "TORCH_DTYPES", "ZERO_OFFLOADS", "ZeroCase", "cpu_fp32", "rank_batches",
    "record_zero_comparison", "train_zero_and_ddp", "zero_check_name", "clip_problems",
    "schedules", "gpu_peak_tflops", "monitor_log", "MONITOR_JOB", "BATCH_KEYS",
    "batch_rule", "sdc", "known_answers", "soak", "sampler",
]
