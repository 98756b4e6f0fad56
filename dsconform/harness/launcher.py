"""Launcher mode: under torchrun, the DeepSpeed launcher or Slurm, the current process is one
rank of a job that already has a rendezvous. fn runs in-process and the ranks exchange outcomes
so that every rank returns, skips or fails alike. Nobody can kill a rank here, so a hang cannot
be contained to one call: at timeout_s every rank writes its stacks to stderr, and the
process-group timeout (timeout_s of the first call) ends collectives still blocked; a rank
blocked outside a collective holds the job until the launcher's own time limit."""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dsconform.harness import output
from dsconform.harness.errors import WorldSizeMismatch, check_accelerator, resolve
from dsconform.harness.rank import call_outcome, picklable_outcome

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")


def external_rendezvous() -> bool:
    """True when a launcher already made this process one rank of a job (torchrun, DeepSpeed's
    launcher, or Slurm with MASTER_ADDR/MASTER_PORT exported); run_ranks then does not spawn.
    Spawned ranks see these variables too, so run_ranks called inside a rank runs in-process."""
    return all(v in os.environ for v in _TORCHRUN_VARS) or all(v in os.environ for v in _SLURM_VARS)


_outcome_group: Any = None


def _external_env() -> tuple[int, int, int]:
    """(rank, world size, local rank), exporting the torchrun names DeepSpeed reads."""
    if not all(v in os.environ for v in _TORCHRUN_VARS):
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ["SLURM_LOCALID"])
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        if per_node.isdigit():
            os.environ.setdefault("LOCAL_WORLD_SIZE", per_node)
    # DeepSpeed's CPU accelerator and shm op read LOCAL_SIZE; torchrun exports LOCAL_WORLD_SIZE.
    if "LOCAL_WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def _destroy_external_groups() -> None:
    global _outcome_group
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.destroy_process_group()
    _outcome_group = None


def _init_external(accelerator: str | None, timeout_s: float) -> None:
    global _outcome_group
    import dsconform.harness.rank as rank_module

    _, _, local_rank = _external_env()
    import torch
    import torch.distributed as tdist

    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        chosen = get_accelerator().device_name()
        accel = check_accelerator(accelerator or (chosen if chosen in ("cuda", "cpu") else None))
        if chosen != accel:
            raise RuntimeError(
                f"run_ranks(accelerator={accel!r}) but deepspeed already runs on {chosen!r} in "
                "this process; export DS_ACCELERATOR before the job starts")
    else:
        accel = check_accelerator(accelerator or os.environ.get("DS_ACCELERATOR"))
        os.environ["DS_ACCELERATOR"] = accel  # read when deepspeed is first imported
    import deepspeed

    if not tdist.is_initialized():
        if accel == "cuda":
            torch.cuda.set_device(local_rank)
        # Left to interpreter teardown, the gloo groups' destructors race their peers' and
        # abort ("terminate called without an active exception", SIGABRT) about half the time.
        atexit.register(_destroy_external_groups)
    # Idempotent; also adopts a process group the launcher's script initialised itself.
    deepspeed.init_distributed(dist_backend="nccl" if accel == "cuda" else "gloo",
                               timeout=timedelta(seconds=timeout_s), verbose=False)
    if rank_module._accelerator is None:
        rank_module._accelerator = accel
    if _outcome_group is None:
        # Outcomes travel on their own gloo group: a rank that raised early must not pair its
        # outcome exchange with a collective its peers are still blocked in.
        _outcome_group = tdist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=max(2 * timeout_s + 60, 1800)))


def run_external(fn: Callable, world_size: int | None, timeout_s: float, args: tuple,
                  kwargs: dict, accelerator: str | None) -> list:
    rank, env_world, _ = _external_env()
    if world_size not in (None, -1) and world_size != env_world:
        raise WorldSizeMismatch(
            f"run_ranks(world_size={world_size}) but the launcher started {env_world} ranks "
            f"(WORLD_SIZE/SLURM_NTASKS); pass world_size=None to use the job's size, or gate the "
            "test on dsconform.harness.api.world()")
    _init_external(accelerator, timeout_s)
    import torch.distributed as tdist

    # A hang's stacks go to the job's own stderr (a copy of fd 2), not into the capture below
    # that a hang never hands on.
    job_stderr = os.fdopen(os.dup(2), "w")
    faulthandler.dump_traceback_later(timeout_s, exit=False, file=job_stderr)
    try:
        # What fn prints (DeepSpeed's logger, c10d's warnings, NCCL) goes to the rank log as
        # this rank's, as a spawned rank's would (dsconform.harness.output).
        with output.capture(output.current_label(), f"rank {rank}/{env_world}"):
            outcome = picklable_outcome(call_outcome(fn, args, kwargs))
    finally:
        faulthandler.cancel_dump_traceback_later()
        job_stderr.close()
    outcomes: list = [None] * env_world
    tdist.all_gather_object(outcomes, outcome, group=_outcome_group)
    return resolve(outcomes)
