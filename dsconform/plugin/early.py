"""Rank processes started ahead of the tests that use them: the fork server and, on a GPU
node whose op cache holds the run's ops, the standby ranks and the cell batch's lanes before
collection (a rank's start-up is the first thing the batch and the first tests wait for); at
collection's end, the cuda pools the selection needs beyond them. docs/performance.md says what
each saves on 1xH200."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dsconform.harness import output as rank_output
from dsconform.harness import timeline, zygote
from dsconform.plugin.runstate import RunState
from dsconform.profile.select import selects_gpu_tests

#: The rank log's name in --results (its lines: dsconform.harness.output).
RANK_LOG_NAME = "ranks.log"

#: The rank log the fork server was started writing into before configure (start_at_load), which
#: configure then does not empty.
_LOG_AT_LOAD: list[Path] = []


def start_at_load(config: pytest.Config) -> None:
    """Start the fork server as soon as the suite's plugin is loaded with its conftest.py (from
    the entry point's pytest_load_initial_conftests, dsconform.plugin.options) instead of at
    configure: pytest parses its arguments and configures its plugins meanwhile (0.3-0.5 s), and
    the server's imports (3.6 s on 1xH200) are what the first ranks wait for. Only where
    configure would start it (early_ranks_wanted, NVIDIA device files), with its output (and the
    resource tracker's, started with it) in the rank log of --results, which configure then
    keeps. Anything unusable here (no --results, a directory it cannot write) leaves the start
    to configure, which names the problem."""
    ns = config.known_args_namespace
    results = getattr(ns, "results", None)
    if (getattr(ns, "collectonly", False) or os.environ.get("PYTEST_XDIST_WORKER")
            or not selects_gpu_tests(getattr(ns, "markexpr", "")) or not results
            or not zygote.enabled() or not gpu_device_files()):
        return
    try:
        folder = Path(results).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        log = folder.resolve() / RANK_LOG_NAME
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
    except OSError:
        return
    try:
        with rank_output.fds_to(fd):
            from multiprocessing import resource_tracker
            resource_tracker.ensure_running()
            zygote.start_ahead()
    finally:
        os.close(fd)
    _LOG_AT_LOAD.append(log)
    _start_builds_at_load()


#: Op builds started before the profile was known (start_at_load), for configure to adopt.
_BUILDS_AT_LOAD: list = []


def _start_builds_at_load() -> None:
    """With a cold op cache, start building the ops every acceptance run on a GPU node loads
    (prebuild.acceptance_ops without the profile's promises: fused_adam, cpu_adam, async_io,
    utils), longest first, before pytest imports torch to find the node and the profile: on
    1xH200 that took 7-9 s of a cold run's start-up, before which no build ran. Configure keeps
    the builds of the ops the run needs (an op DeepSpeed calls incompatible here is stopped and
    forgotten) and adds the profile's own (adopt_builds)."""
    from dsconform.ops.cache import ensure_extensions_dir
    from dsconform.ops.prebuild import ParallelBuilds, acceptance_ops, is_cached, longest_first

    try:
        ext_dir = ensure_extensions_dir()
    except OSError:
        return  # configure names the problem
    ops = [op for op in longest_first(acceptance_ops("cuda", ())) if not is_cached(op, ext_dir)]
    if ops:
        # py-cpuinfo's answer is not waited for here: each build asks once itself.
        _BUILDS_AT_LOAD.append(ParallelBuilds.start(ops, skip_cached=True, ext_dir=ext_dir,
                                                    share_cpu_info=False))


def adopt_builds(state: RunState, ops: list[str]) -> bool:
    """Keep, of the builds started at load (if any), those of ``ops`` (the run's uncached ops,
    longest first) and add the missing ones: the run's builds from then on. Returns whether
    there were builds to adopt; where ``ops`` is empty they are all stopped."""
    if not _BUILDS_AT_LOAD:
        return False
    builds = _BUILDS_AT_LOAD.pop()
    builds.retain(ops)
    if ops:
        state.op_builds = builds
    else:
        builds.close()
    return True


def drop_builds_at_load() -> None:
    """Stop builds started at load that no run adopted (the node's GPUs are not usable)."""
    while _BUILDS_AT_LOAD:
        _BUILDS_AT_LOAD.pop().close()


def log_started_at_load(path: Path | None) -> bool:
    """Whether the rank log ``path`` was started before configure (start_at_load)."""
    return path is not None and path.resolve() in _LOG_AT_LOAD


def is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def early_ranks_wanted(config: pytest.Config) -> bool:
    """Whether this run starts ranks before collection: a run of the GPU tests (-m gpu), not
    an xdist worker (its ranks start with its tests) or --collect-only."""
    return (not config.option.collectonly and not is_xdist_worker(config)
            and selects_gpu_tests(config.option.markexpr))


def gpu_device_files() -> bool:
    """Whether the NVIDIA driver's device files are here (/dev/nvidia0, ...): a hint, before
    the node is detected, that ranks will run on GPUs."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def start_ranks_early(config: pytest.Config, state: RunState) -> None:
    """Under ``-m gpu`` on a GPU node whose op cache holds the run's ops, start the one-GPU
    standby ranks and the cell batch's lanes now, before collection (4 s of a warm 1xH200 run)
    instead of at its end: a lane's start-up (a CUDA context, deepspeed, a first engine: about
    8 s) is the first thing the batch waits for. Collection's end starts what the selection
    needs beyond them (start_standby_ranks); what it does not use is stopped with the rest at
    the end. With ops to build (a cold cache) they start at collection's end as before: started
    beside the builds, ten rank processes took the cores the build scheduler waits for, and on
    1xH200 fused_adam's build started 26 s later and the batch, which waits for it, ended 21 s
    later (docs/performance.md)."""
    if not early_ranks_wanted(config) or state.node.gpu_count < 1:
        return
    with rank_output.fds_to_log():
        zygote.start_ahead()  # started already where GPU device files are found
    with rank_output.capture("(start-up)"):  # DeepSpeed's probes print
        missing = uncached_run_ops(state)
        from dsconform.ops.prebuild import longest_first
        adopted = adopt_builds(state, longest_first(missing))
    if missing:
        if not adopted:
            start_builds_early(state, missing)
        return
    from dsconform.plugin import batch
    if not zygote.enabled():
        with rank_output.capture("(start-up)"):
            start_cuda_pools([1], lanes=batch.enabled(state))
        return
    # A forked rank's start waits for the fork server's imports (about 4 s): collection goes on
    # meanwhile. Its parent is the server, so it does not die with this thread.
    early = threading.Thread(target=_start_early_in_thread, args=(batch.enabled(state),),
                             name="dsconform-early-ranks", daemon=True)
    early.start()
    _EARLY.append(early)


def uncached_run_ops(state: RunState) -> list[str]:
    """The ops ``pytest -m gpu`` loads on this GPU node (prebuild.acceptance_ops: the promised
    ones and those the suites load beside them) that DeepSpeed calls compatible here and the
    extensions cache lacks."""
    from dsconform.ops.cache import ensure_extensions_dir
    from dsconform.ops.prebuild import acceptance_ops, is_cached

    ext_dir = ensure_extensions_dir()
    return [op for op in acceptance_ops("cuda", state.profile.ops)
            if not is_cached(op, ext_dir) and state.op_compatible(op)]


def start_builds_early(state: RunState, ops: list[str]) -> None:
    """Start building ``ops`` now, as pytest configures itself: with a cold cache the start-up
    and collection before the first build took 11 s on 1xH200 (Python compiling torch's and
    DeepSpeed's sources without a bytecode cache). Collection's end gives the builds the run's
    own order and ops (ParallelBuilds.extend); until then the longest build starts first
    (prebuild.longest_first). What the builds print goes to the rank log."""
    from dsconform.ops.prebuild import ParallelBuilds, longest_first

    with rank_output.capture("(start-up)"):
        state.op_builds = ParallelBuilds.start(longest_first(ops), skip_cached=True)


#: The thread starting ranks before collection (joined before collection's end starts more).
_EARLY: list[threading.Thread] = []


def _start_early_in_thread(lanes: bool) -> None:
    with rank_output.labelled("(start-up)"):
        try:
            timeline.mark("early ranks requested")
            start_cuda_pools([1], lanes=lanes)
            timeline.mark("early ranks forked")
        except Exception as exc:  # an optimisation: calls start their own ranks
            rank_output.record("(start-up)", "dsconform.harness",
                               f"ranks not started before collection ({exc})")


def join_early() -> None:
    """Wait for the thread starting ranks before collection (not when called from it)."""
    me = threading.current_thread()
    while _EARLY:
        thread = _EARLY.pop()
        if thread is not me:
            thread.join()


def start_standby_ranks(session: pytest.Session, state: RunState) -> None:
    """On a GPU node whose selection has GPU tests, start the cuda rank pools now (one GPU, and
    two when a multi-GPU test is selected): their start-up (a CUDA context, deepspeed, NCCL;
    8-20 s each on 2xH200) overlaps collection, the op builds and the promise tests."""
    gpu_items = [it for it in session.items if it.get_closest_marker("gpu")]
    if not gpu_items or state.node.gpu_count < 1:
        return
    sizes = [1]
    if state.node.gpu_count >= 2 and any(it.get_closest_marker("multigpu") for it in gpu_items):
        sizes.append(2)
    from dsconform.plugin import batch
    start_cuda_pools(sizes, lanes=batch.enabled(state)
                      and any(batch.has_plan(it) for it in gpu_items))


def start_cuda_pools(sizes: list[int], *, lanes: bool) -> None:
    """Start, without waiting, the cuda standby ranks of these world sizes, warmed up and
    never-warmed (the ones fresh-process calls take: a resume, GDS; their first call in a run
    would otherwise start its ranks while the test waits, 8-12 s on 2xH200), and with lanes the
    cell batch's lanes (dsconform.plugin.batch). Each is started once: a second call starts only
    what is missing. Nothing under torchrun/Slurm or with standby ranks off."""
    from dsconform.harness import api as dist
    join_early()
    if dist.external_rendezvous() or not dist.spares_enabled("cuda"):
        return
    dist.start_spares(sizes, "cuda")
    dist.start_spares(sizes, "cuda", fresh=True)
    if lanes:
        from dsconform.harness.lanes import start_lanes
        start_lanes(sizes, "cuda")
