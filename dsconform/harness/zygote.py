"""Where rank processes come from: forks of one server process per run that imported torch
once (multiprocessing's forkserver), or new interpreters (spawn).

A new interpreter imports torch, torch._dynamo and inductor before its first engine: most of a
rank's start-up (docs/performance.md#rank-start-up), paid by every rank, and by every lane's
ranks at once at a cell batch's start. A fork of a server that imported them pays
none of it. The server imports torch's Python only: no DeepSpeed (which picks its accelerator
at import, from DS_ACCELERATOR, per rank), no CUDA context and no thread pool (CUDA and OpenMP
do not survive a fork); each rank sets its own environment, GPUs and threads before it starts
either (dsconform.harness.rank.rank_main), so a forked rank is as fresh as a spawned one.

DSCONFORM_FORKSERVER=0 spawns every rank. A server that cannot start or dies makes the rank
start that saw it, and every later one, spawn instead, and the rank log says why.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

from dsconform import settings

#: What the server imports before it forks: the script pytest runs from (so a rank does not
#: import it again) and dsconform.harness.preload (torch and what a first engine imports).
PRELOAD = ["__main__", "dsconform.harness.preload"]

_LOCK = threading.Lock()
_STATE: dict = {"configured": False, "broken": None}


def enabled() -> bool:
    """Whether ranks are forked from the server: on Linux, DSCONFORM_FORKSERVER on, and no
    failure of the server seen in this process."""
    return (sys.platform.startswith("linux") and settings.get("DSCONFORM_FORKSERVER")
            and _STATE["broken"] is None)


def method() -> str:
    """"forkserver" or "spawn": how the next rank starts."""
    return "forkserver" if enabled() else "spawn"


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context ranks start from (never the global start method)."""
    if not enabled():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    with _LOCK:
        if not _STATE["configured"]:
            ctx.set_forkserver_preload(list(PRELOAD))
            _STATE["configured"] = True
    return ctx


def give_up(exc: BaseException) -> str:
    """Spawn every rank from now on, after the server failed with exc; returns the line the
    rank log gets."""
    with _LOCK:
        if _STATE["broken"] is None:
            _STATE["broken"] = f"{type(exc).__name__}: {exc}"
    return (f"rank processes are spawned from now on: the fork server failed "
            f"({_STATE['broken']}); DSCONFORM_FORKSERVER=0 spawns them from the start")


def broken() -> str | None:
    """Why the server was given up, or None."""
    return _STATE["broken"]


def start_ahead() -> None:
    """Start the server now, so its imports run while the caller does other work (the first
    rank start waits for them otherwise). Does nothing when ranks are spawned."""
    if not enabled():
        return
    context()
    from multiprocessing import forkserver

    try:
        forkserver.ensure_running()
    except Exception as exc:  # an optimisation: the first rank start reports it
        give_up(exc)


def stop() -> None:
    """Stop the server, then multiprocessing's resource tracker (the server held it open too),
    and reap both, so neither outlives pytest's process; a later rank start starts them again.
    The server holds nothing to clean up once no rank is left, so it is killed rather than
    left to tear torch down on its own (about a second). The tracker is asked to end: at its
    end it names and removes what killed ranks leaked. The stdlib offers no public stop: each
    object's own _stop() (which CPython's tests use) closes the pipe the process watches and
    reaps it. Call it once no rank is left."""
    import signal
    from multiprocessing import forkserver, resource_tracker

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass
    for holder in (server, getattr(resource_tracker, "_resource_tracker", None)):
        stopper = getattr(holder, "_stop", None)
        if stopper is None:
            continue
        try:
            stopper()
        except (OSError, ChildProcessError):  # gone already
            pass
