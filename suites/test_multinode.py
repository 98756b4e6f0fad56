"""Multi-node: ZeRO and the collectives MUST work across nodes as they do inside one node.

Run under a launcher that spans several nodes (torchrun, Slurm's srun, the DeepSpeed launcher):
every pytest process is one rank of the job and ``run_ranks(..., world_size=None)`` uses the
job's size (see dsconform/harness/api.py, external rendezvous). Over the job's ranks, on the node's
accelerator (nccl on GPUs, gloo on CPUs):

- ZeRO stages 0-3 MUST give DDP's per-step losses, boundary gradients and final parameters
  within the one tolerance table (``dsconform/checks/tolerances.py``; fp32 SGD bit for bit), the
  ZeRO suite's check (suites/test_zero.py, dsconform/checks/zero_vs_ddp.py) with gradients
  reduced, partitioned and gathered over the network;
- every collective ZeRO uses (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all),
  through deepspeed.comm, MUST return the exact result on known data on every rank
  (dsconform/checks/collectives.py; the collectives suite's check,
  dsconform/checks/collective_calls.py);
- bus bandwidth across the nodes is measured (busbw as nccl-tests defines it, GB/s = 1e9 B/s)
  and MUST reach every floor of the profile measured at the job's world size
  (``[[nccl.floors]]`` with ``world_size`` above the GPUs of one node).

Every test is marked ``multinode`` and skips unless the rendezvous spans more than one node.
Every rank must run the same tests in the same order (same command line, same checkout).

Upstream: https://www.deepspeed.ai/getting-started/#resource-configuration-multi-node ,
https://pytorch.org/docs/stable/elastic/run.html ,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md

Stable ids: MN-ZERO-1 (ZeRO vs DDP across nodes), MN-COLL-1 (exact collectives),
MN-COLL-2 (busbw across nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dsconform.suite import (
    GB,
    Comparison,
    MetricsRecorder,
    Profile,
    ZeroCase,
    collective_calls,
    collectives,
    compare_rank_results,
    record_zero_comparison,
    rendezvous_info,
    requires,
    run_ranks,
    run_state,
    tolerance,
    zero_check_name,
)
from suites import multinode_ranks

CAPABILITY = "multinode"
pytestmark = pytest.mark.multinode

# One value for every call: under a launcher the first call's timeout_s also becomes the
# process-group timeout that ends a collective blocked by a dead peer.
TIMEOUT_S = 300
#: A placeholder world size: the rank code resolves it to the job's (suites/multinode_ranks.py).
JOB = "job"
#: Element counts of the exactness check: 1, a prime (ZeRO pads the partitions of 53 elements
#: on any world size) and an odd count beyond 64 Ki; on GPUs also one beyond 16 Mi.
EXACT_SIZES = {"cpu": (1, 53, 65537), "cuda": (1, 53, 65537, (1 << 24) + 3)}

# Each stage once in fp32 SGD (bit-exact: anything the network does to a gradient shows),
# accumulation over the network once, and the mixed-precision paths once each.
ZERO_CASES = [
    pytest.param(ZeroCase(stage=0, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=JOB)),
    pytest.param(ZeroCase(stage=1, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=JOB)),
    pytest.param(ZeroCase(stage=2, dtype="fp32", optimizer="sgd", grad_accum=4, world_size=JOB)),
    pytest.param(ZeroCase(stage=3, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=JOB)),
    pytest.param(ZeroCase(stage=3, dtype="bf16", optimizer="adam", grad_accum=1, world_size=JOB),
                 marks=requires(bf16=True)),
    pytest.param(ZeroCase(stage=2, dtype="fp16", optimizer="sgd", grad_accum=1, world_size=JOB),
                 marks=requires(fp16=True)),
]


@dataclass(frozen=True)
class Transfer:
    """One bandwidth measurement: a collective, its message size (bytes, nccl-tests' size) and
    the floor it is held to (GB/s, None: recorded for the cluster report only)."""
    collective: str
    bytes: int
    floor_gbps: float | None = None
    source: str = ""

    @property
    def id(self) -> str:
        return f"{self.collective}-{self.bytes}B"


# Measured without a floor (the cluster report compares nodes with the fleet): sizes where the
# network, not the per-call overhead, dominates. Gloo on CPUs moves far less: one small size.
DEFAULT_TRANSFERS = {
    "cuda": (Transfer("all_reduce", 64 << 20), Transfer("all_reduce", 1 << 30),
             Transfer("all_gather", 1 << 30)),
    "cpu": (Transfer("all_reduce", 1 << 20),),
}


def transfers(profile: Profile, accelerator: str, world_size: int | None) -> list[Transfer]:
    """The defaults for the accelerator, and every profile floor measured at the job's world
    size that is larger than one node (a floor at one node's size is test_collectives' job)."""
    per_node = profile.gpus_promised or 1
    floors = [Transfer(f.collective, f.bytes, f.busbw_gbps, f.source or "profile")
              for f in profile.nccl_floors
              if world_size and f.world_size == world_size and f.world_size > per_node]
    floored = {(t.collective, t.bytes) for t in floors}
    defaults = [t for t in DEFAULT_TRANSFERS[accelerator] if (t.collective, t.bytes) not in floored]
    return floors + defaults


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "transfer" not in metafunc.fixturenames:
        return
    state = run_state(metafunc.config)
    rdzv = rendezvous_info()
    found = transfers(state.profile, state.node.accelerator, rdzv.world_size if rdzv else None)
    metafunc.parametrize("transfer", [pytest.param(t, id=t.id) for t in found])


# ------------------------------------------------------------------ checks (the red tests reuse)

def zero_across_nodes(case: ZeroCase, profile: Profile, accelerator: str, *,
                      perturb: float = 1.0, perturb_from_step: int = 0,
                      ) -> tuple[Comparison, ZeroCase]:
    """Train ZeRO and DDP on every rank of the job; compare under the table's tolerance for the
    accelerator the ranks ran on. Returns the comparison and the case with its world size."""
    results = run_ranks(multinode_ranks.zero_across_nodes, None, accelerator=accelerator,
                        args=(case, perturb, perturb_from_step), timeout_s=TIMEOUT_S)
    ran = case.with_(world_size=len(results))
    ran_on = results[0]["accelerator"]
    tol = tolerance(zero_check_name(ran), ran.dtype, ran.optimizer, profile.tolerances,
                    accelerator=ran_on)
    rdzv = rendezvous_info()
    nodes = rdzv.nodes if rdzv else 1
    return compare_rank_results(results, tol, label=f"{ran_on}-{ran.id}-{nodes}nodes"), ran


def mismatches(collective: str, accelerator: str,
               perturb: dict[str, int] | None = None) -> list[collectives.Mismatch]:
    """collective_calls.check_exact over the whole job, fp32, at EXACT_SIZES: every rank's wrong
    outputs. ``perturb`` is the collectives suite's fault injection ({"rank", "numel",
    "index"}: that rank's result off by one unit there), for the red tests."""
    results = run_ranks(collective_calls.check_exact, None, accelerator=accelerator,
                        args=(collective, "fp32", EXACT_SIZES[accelerator]),
                        kwargs={"perturb": perturb}, timeout_s=TIMEOUT_S)
    return collectives.mismatches_from_ranks([r["mismatches"] for r in results])


def measure(transfer: Transfer, accelerator: str) -> dict:
    """collective_calls.measure over the whole job: seconds per call, each round's slowest
    rank (every rank returns the same), with the iterations and nccl-tests' bus factor."""
    iters = collectives.iterations(transfer.bytes, accelerator)
    result = run_ranks(collective_calls.measure, None, accelerator=accelerator,
                       args=(transfer.collective, [(transfer.bytes, iters)]),
                       timeout_s=TIMEOUT_S)[0]
    counts = result["points"][0]["wrong"]
    wrong = collectives.wrong_output_message(transfer.collective, transfer.bytes, counts,
                                             [f"rank {r}" for r in range(len(counts))])
    assert not wrong, wrong
    return {"seconds": result["points"][0]["seconds"], "iters": iters,
            "bus_factor": collectives.bus_factor(transfer.collective, result["world_size"])}


def record_busbw(metrics: MetricsRecorder, transfer: Transfer, result: dict) -> None:
    """busbw = bytes * bus factor / time (nccl-tests); the recorder holds the median of the
    rounds to the floor, naming collective, size, world size and nodes when it is missed."""
    rdzv = rendezvous_info()
    metrics.record_rate(f"{transfer.collective}.busbw", result["seconds"],
                        amount=transfer.bytes * result["bus_factor"], unit="GB/s", scale=GB,
                        floor=transfer.floor_gbps, bytes=transfer.bytes,
                        world_size=rdzv.world_size if rdzv else None,
                        nodes=rdzv.nodes if rdzv else 1, iters=result["iters"],
                        source=transfer.source or "measured, no floor")


# ------------------------------------------------------------------ tests

def test_ranks_span_the_nodes(node, profile):
    """MN-NODES-1: the job's ranks MUST run on as many distinct nodes as the rendezvous says
    (WORLD_SIZE / LOCAL_WORLD_SIZE or SLURM_NNODES is arithmetic: two launcher groups on one
    host, or overlapping Slurm steps, would pass every check below without crossing a node)."""
    _ran_on_gpus(node, profile)
    rdzv = rendezvous_info()
    claimed = rdzv.nodes if rdzv else 1
    names = run_ranks(multinode_ranks.node_name, None, accelerator=node.accelerator,
                      timeout_s=TIMEOUT_S)
    by_node: dict[str, list[int]] = {}
    for r in names:
        by_node.setdefault(r["node"], []).append(r["rank"])
    assert len(by_node) == claimed, (
        f"the rendezvous spans {claimed} nodes, the ranks ran on {len(by_node)}: "
        + "; ".join(f"{n}: ranks {sorted(rs)}" for n, rs in sorted(by_node.items()))
        + ": the multinode checks would not cross a node boundary")


@pytest.mark.parametrize("case", ZERO_CASES, ids=lambda c: c.id)
def test_zero_across_nodes(case: ZeroCase, node, profile, metrics):
    """MN-ZERO-1: ZeRO across nodes MUST give DDP's losses, boundary gradients and final
    parameters."""
    _ran_on_gpus(node, profile)
    cmp, ran = zero_across_nodes(case, profile, node.accelerator)
    record_zero_comparison(metrics, cmp, ran, node.accelerator)
    cmp.assert_ok()


@pytest.mark.parametrize("collective", collectives.COLLECTIVES)
def test_collective_exact_across_nodes(collective: str, node, profile):
    """MN-COLL-1: every collective through deepspeed.comm MUST return the exact result on
    every rank across nodes."""
    _ran_on_gpus(node, profile)
    found = mismatches(collective, node.accelerator)
    assert not found, collectives.exactness_message(found)


@pytest.mark.benchmark
def test_busbw_across_nodes(transfer: Transfer, node, profile, metrics):
    """MN-COLL-2: bus bandwidth across nodes MUST reach the profile's floor at the job's size.
    A size without a floor is measured and recorded (its output checked), then reported as
    skipped: nothing held it to a number."""
    _ran_on_gpus(node, profile)
    record_busbw(metrics, transfer, measure(transfer, node.accelerator))
    if transfer.floor_gbps is None:
        rdzv = rendezvous_info()
        pytest.skip(f"recorded only: profile {profile.name} has no [[nccl.floors]] for "
                    f"{transfer.collective} at {transfer.bytes} bytes with world_size = "
                    f"{rdzv.world_size if rdzv else '?'} (this job's size); add one to hold "
                    f"the network to it (InfiniBand falling back to TCP would pass unseen)")


def _ran_on_gpus(node, profile) -> None:
    """A profile that promises GPUs is not checked across nodes on the CPU: torch seeing none
    would otherwise move every multinode check to gloo and pass it there."""
    if profile.gpus_promised and node.accelerator != "cuda":
        pytest.fail(f"profile {profile.name} promises {profile.gpus_promised} GPUs per node, "
                    f"but torch sees none here ({node.gpu_count} usable): the multinode checks "
                    f"would run on the CPU (gloo) instead", pytrace=False)
