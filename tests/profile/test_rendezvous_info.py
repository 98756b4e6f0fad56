"""rendezvous_info MUST name the job, the rank and the node count the same way on every rank of
a torchrun or Slurm job (what `dsconform aggregate` groups rank folders by), and None outside."""

from __future__ import annotations

from dsconform.profile.select import rendezvous_info

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
            "MASTER_ADDR": "gpu-a01", "MASTER_PORT": "29400", "GROUP_RANK": "0"}
SLURM = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
         "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1",
         "MASTER_ADDR": "gpu-a01", "MASTER_PORT": "29511"}


def test_torchrun():
    r = rendezvous_info({**TORCHRUN, "TORCHELASTIC_RUN_ID": "nightly-7"})
    assert r.to_dict() == {"launcher": "torchrun", "job": "nightly-7", "world_size": 16,
                           "rank": 3, "local_rank": 3, "nodes": 2, "node_rank": 0}
    # torchrun's default run id ("none") says nothing: the rendezvous address names the job.
    assert rendezvous_info({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}).job == "gpu-a01:29400"


def test_slurm():
    r = rendezvous_info(SLURM)
    assert (r.launcher, r.job, r.world_size, r.rank, r.local_rank, r.nodes, r.node_rank) == (
        "slurm", "4242.1", 16, 9, 1, 2, 1)


def test_outside_a_job():
    assert rendezvous_info({}) is None
    # srun without MASTER_ADDR/MASTER_PORT (the nightly recipe's stage 1) is no rendezvous.
    assert rendezvous_info({k: v for k, v in SLURM.items() if not k.startswith("MASTER")}) is None
