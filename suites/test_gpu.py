"""Each GPU on its own: its memory and its host link MUST run at the speed of its model, as
fast as its peers, with the PCIe link trained to its full generation and width.

- Memory (GPU-HBM-1): a device-to-device copy (4 GiB, or an eighth of the GPU's memory where
  that is less), every GPU at once, 5 rounds after a warm-up; the rate counts the bytes read
  and written (GB/s = 1e9 B/s, 2 x bytes / seconds), the way datasheets count memory
  bandwidth. Held to the profile's ``[gpus] hbm_gbps`` floor (from the GPU catalogue under
  ``--profile auto``: dsconform/profile/gpu_models.toml) and, with two GPUs or more, each GPU to
  ``100 - straggler_pct`` percent of its peers' median.
- Host transfers (GPU-PCIE-1): pinned host-to-device and device-to-host copies of 2 GiB, one
  GPU at a time (the host's links are shared), 5 rounds each, held to ``h2d_gbps`` /
  ``d2h_gbps`` and to the peers' median; NVML's current PCIe link generation and width, read
  every 20 ms while those copies run, MUST reach the maximum the GPU and its slot allow (a link
  that trained down to Gen3 or to x8 halves every host transfer of training: offload,
  checkpoints, data).

Failures name the GPU by nvidia-smi index and PCI bus id. A floor the profile does not set
records the value only. CUDA only: the CPU accelerator has no device memory to measure.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from dsconform.suite import GB, GIB, gpu_health, requires, run_ranks, worker_gpus
from suites import gpu_ranks

CAPABILITY = "gpu"
TIMEOUT_S = 300
ROUNDS = 5  # the recorder holds a floor to the median of at least 3 rounds
HBM_BYTES, HOST_BYTES = 4 * GIB, 2 * GIB


def hbm_bytes(node) -> int:
    """4 GiB, or an eighth of the smallest GPU's memory where that is less (two buffers)."""
    smallest = min((g.memory_bytes for g in node.gpus), default=HBM_BYTES * 8)
    return int(min(HBM_BYTES, smallest // 8) // (1 << 20) * (1 << 20))


def record_copies(metrics, results: list[dict[str, Any]], ids: list[gpu_health.GpuIdentity],
                  profile, straggler_pct: float, **params: Any) -> None:
    """Every GPU's three rates, each held to its floor and to its peers' median by the
    recorder, naming the GPU."""
    kinds = (("hbm", "hbm_seconds", "hbm_bytes", 2, profile.hbm_gbps),
             ("h2d", "h2d_seconds", "host_bytes", 1, profile.h2d_gbps),
             ("d2h", "d2h_seconds", "host_bytes", 1, profile.d2h_gbps))
    for kind, key, size_key, passes, floor in kinds:
        amount = passes * results[0][size_key]
        medians = [amount / GB / statistics.median(r[key]) for r in results]
        pct = gpu_health.pct_of_peer_median(medians) if len(results) > 1 else None
        for i, (res, ident) in enumerate(zip(results, ids)):
            where = {"who": ident.label, **params, **ident.params(), "bytes": res[size_key]}
            metrics.record_rate(f"gpu.{kind}", res[key], amount=amount, unit="GB/s", scale=GB,
                                floor=floor, **where)
            if pct is not None:
                metrics.record(f"gpu.{kind}.pct_of_peer_median", pct[i], unit="%",
                               better="higher", limit=100.0 - straggler_pct, **where)


def link_problems(results: list[dict[str, Any]], ids: list[gpu_health.GpuIdentity]
                  ) -> list[str]:
    """Each GPU whose PCIe link under load ran below the generation or width it allows, or
    whose link could not be read (the check would pass unseen)."""
    out = []
    for res, ident in zip(results, ids):
        link = res["pcie"]
        if not link["samples"] or link["max_gen"] is None:
            out.append(f"{ident.label}: the PCIe link could not be read under load "
                       f"({link['why'] or 'no sample'})")
            continue
        if link["gen"] < link["max_gen"] or link["width"] < link["max_width"]:
            out.append(f"{ident.label}: PCIe link Gen{link['gen']} x{link['width']} under load, "
                       f"the GPU and its slot allow Gen{link['max_gen']} x{link['max_width']} "
                       f"({link['samples']} reads during the host transfers)")
    return out


@pytest.mark.gpu
@pytest.mark.benchmark
@requires(min_gpus=1)
def test_memory_and_host_transfers(node, profile, metrics):
    """GPU-HBM-1 / GPU-PCIE-1: every GPU's memory bandwidth and pinned host transfers MUST
    reach their floors and their peers' speed, over a PCIe link at its full generation and
    width."""
    n = len(worker_gpus())
    results = run_ranks(gpu_ranks.copy_seconds, n, timeout_s=TIMEOUT_S,
                        args=(hbm_bytes(node), HOST_BYTES, ROUNDS), accelerator="cuda")
    ids = gpu_health.identify([r["identity"] for r in results], node.hardware.bus_ids)
    record_copies(metrics, results, ids, profile,
                  gpu_health.straggler_pct(profile.straggler_pct), world_size=n)
    problems = link_problems(results, ids)
    assert not problems, "a GPU's PCIe link is not at full speed:\n  " + "\n  ".join(problems)
