"""Code run inside the ranks of suites/test_multinode.py.

The ZeRO suite's ZeRO-vs-DDP run (dsconform/checks/zero_vs_ddp.py), with the world size of the
job the launcher started; the collectives run dsconform/checks/collective_calls.py's functions as
they are. Under torchrun or Slurm every pytest process is one rank, so these run in-process, once
per rank.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from dsconform.suite import ZeroCase, device, rank, train_zero_and_ddp, world


def zero_across_nodes(case: ZeroCase, perturb: float = 1.0,
                      perturb_from_step: int = 0) -> dict[str, Any]:
    """ZeRO and DDP traces of ``case`` on every rank of the job (its world size resolved here),
    with the accelerator the ranks ran on, which picks the tolerance."""
    result = train_zero_and_ddp(case.with_(world_size=world()), perturb, perturb_from_step)
    return {**result, "accelerator": device().type}


def node_name() -> dict[str, Any]:
    """The node this rank runs on, as the cluster names it: Slurm's node name where there is
    one ($SLURMD_NODENAME, what examples/nightly-node.sh names result folders by), else the
    host name."""
    return {"rank": rank(), "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname()}
