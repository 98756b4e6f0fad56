"""Where rank processes come from: forks of one server process per run that imported torch
once (multiprocessing's forkserver), or new interpreters (spawn). Why, and what the server
may not hold: DSCONFORM_FORKSERVER in docs/options.md. A server that cannot start or dies makes
that rank start, and every later one, spawn instead, and the rank log says why."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys

from dsconform import settings

#: What the server imports before it forks: the script pytest runs from (so a rank does not
#: import it again) and dsconform.harness.preload (torch and what a first engine imports).
PRELOAD = ["__main__", "dsconform.harness.preload"]

_STATE: dict = {"broken": None}


def enabled() -> bool:
    """Whether ranks are forked from the server (on Linux, unless switched off or given up)."""
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
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts, ignored after
    return ctx


def give_up(exc: BaseException) -> str:
    """Spawn every rank from now on, after the server failed with exc; returns the line the
    rank log gets."""
    _STATE["broken"] = _STATE["broken"] or f"{type(exc).__name__}: {exc}"
    return (f"rank processes are spawned from now on: the fork server failed "
            f"({_STATE['broken']}); DSCONFORM_FORKSERVER=0 spawns them from the start")


def broken() -> str | None:
    """Why the server was given up, or None."""
    return _STATE["broken"]


def start_ahead() -> None:
    """Start the server now, so its imports run while the caller does other work."""
    if not enabled():
        return
    context()
    from multiprocessing import forkserver

    try:
        forkserver.ensure_running()
    except Exception as exc:  # an optimisation: the first rank start reports it
        give_up(exc)


def stop() -> None:
    """Stop the server (killed: it holds nothing once no rank is left, and tearing torch down
    takes about a second), then multiprocessing's resource tracker, which at its end removes
    what killed ranks leaked; each reaped through its own _stop() (the stdlib has no public
    one). A later rank start starts them again. Call it once no rank is left."""
    import signal
    from multiprocessing import forkserver, resource_tracker

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signal.SIGKILL)
    for holder in (server, getattr(resource_tracker, "_resource_tracker", None)):
        if (stopper := getattr(holder, "_stop", None)) is not None:
            with contextlib.suppress(OSError, ChildProcessError):  # gone already
                stopper()
