"""The rank harness: run a function on N ranks with torch.distributed initialised by DeepSpeed.

Every distributed test in the suite goes through `run_ranks`. Two modes:

* Spawned (the default on one node): `world_size` rank processes started with the
  multiprocessing *spawn* context, kept alive between calls (a pool per world size,
  accelerator and GPU slice) so only the first call pays for importing deepspeed and
  initialising the process group. A failing, dying or hanging rank fails that one call and
  tears its pool down; the next call starts fresh processes.
* Standby ranks (spares, on cuda on machines with >= 8 cores): another set of ranks per key,
  started in the background, so a call that needs new processes does not wait for a CUDA
  context, deepspeed and NCCL. Those for pooled calls also warm up (dist_rank.warm_up); a
  fresh-process call (reuse=False) only takes ranks that never built an engine.
* Lanes (run_concurrently): independent calls at once over several pools per world size,
  one-rank pools on every GPU in turn; a failure kills only its own lane's ranks. Cell batches
  (dsconform.harness.batch) use them from a background thread while the main thread runs other tests
  (their run_ranks calls and the lanes only share the pool tables' lock); they never run beside
  a measurement. Ranks reply in plain pickle bytes (no tensor travels as a shared descriptor).
* External (under torchrun, the DeepSpeed launcher or Slurm, see `external_rendezvous`): the
  current process is one rank of a job that already has a rendezvous; fn runs in-process and
  the ranks exchange outcomes so that every rank returns, skips or fails alike. Nobody can
  kill a rank here, so a hang cannot be contained to one call: at timeout_s every rank writes
  its stacks to stderr, and the process-group timeout (timeout_s of the first call) ends
  collectives still blocked; a rank blocked outside a collective holds the job until the
  launcher's own time limit.

Inside fn, use the helpers re-exported here: rank(), world(), device(), seed_everything(),
gather(), all_agree().

Call `shutdown_pools()` at the end of a pytest session (an atexit hook also does it).
run_ranks calls are serialised (one lock per process); a pytest-xdist worker has its own pools,
ports and GPUs (see dsconform.harness.xdist).
"""

from __future__ import annotations

import atexit
import faulthandler
import glob
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as _wait_any
from typing import Any

from dsconform.harness.rank import (
    RANK_OWNED_ENV,
    STACK_DUMP_SIGNAL,
    all_agree,
    call_outcome,
    device,
    gather,
    picklable_outcome,
    rank,
    rank_main,
    seed_everything,
    world,
)
from dsconform.harness.xdist import (
    InsufficientGPUs,
    free_port,
    gpu_slice,
    gpus_per_worker,
    port_range,
    visible_gpus,
    worker_gpus,
    xdist_worker,
)

__all__ = [
    "InsufficientGPUs", "RankCall", "RankError", "RankTimeout", "WorldSizeMismatch",
    "all_agree", "close_lanes", "device", "external_rendezvous", "free_port", "gather", "gpu_slice",
    "gpus_per_worker", "hold_spares", "lanes_for", "port_range", "rank", "run_concurrently",
    "run_ranks", "run_steps", "seed_everything", "start_lanes",
    "settle_spares", "shutdown_pools", "spares_enabled", "start_spares", "startup_stats",
    "visible_gpus", "worker_gpus", "world", "xdist_worker",
]

#: Seconds allowed for spawning ranks, importing deepspeed and init_distributed. Separate from
#: a call's timeout_s because the first init on a machine JIT-builds DeepSpeed's shm comm op
#: (about 30 s on 2 cores), which a 10 s test timeout must not turn into a failure.
STARTUP_TIMEOUT_S = float(os.environ.get("DSCONFORM_STARTUP_TIMEOUT_S", "300"))
#: Once one rank skipped, how long the others may take to finish: a rank that did not skip is
#: usually blocked in a collective waiting for the one that did.
SKIP_GRACE_S = 10.0
#: How long a hung rank gets to write its stacks after the dump signal.
STACK_DUMP_WAIT_S = 1.0
#: Pools kept alive at once (least recently used is closed first). Each holds world_size
#: processes and, on GPUs, a CUDA context per rank.
MAX_POOLS = int(os.environ.get("DSCONFORM_MAX_POOLS", "2"))
#: Standby pools ("spares"): once a pool has been started for a (world size, accelerator, GPUs)
#: key, a second set of ranks for that key is started in the background, so the next call that
#: needs new processes (a fresh-process test, or the call after a failure killed the pool) finds
#: them imported and initialised instead of paying 8-20 s for a CUDA context, deepspeed and NCCL
#: (2xH200). A spare has never run a test function, so it is as fresh as a new spawn. "auto":
#: cuda pools on machines with at least SPARE_MIN_CORES cores (on 2 CPU cores the extra start-up
#: would slow the test it overlaps); "1"/"0" force it.
SPARE_POOLS = os.environ.get("DSCONFORM_SPARE_POOLS", "auto").strip().lower()
SPARE_MIN_CORES = 8
#: Whether standby ranks build and destroy a tiny engine before they report ready
#: (dist_rank.warm_up); DSCONFORM_RANK_WARMUP=0 turns it off.
RANK_WARMUP = os.environ.get("DSCONFORM_RANK_WARMUP", "1").strip().lower() not in (
    "0", "off", "no", "false")
#: Process-group timeout of pooled ranks: the parent enforces each call's timeout_s, so this
#: only has to outlast the longest call; a call asking for more respawns the pool.
POOL_PG_TIMEOUT_S = 3600.0


class RankError(AssertionError):
    """A rank raised, died, or the ranks disagreed about skipping. AssertionError so that
    pytest reports a test failure, not an error in the harness."""

    def __init__(self, message: str, *, rank: int | None = None, world_size: int | None = None,
                 exc_type: str | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


class RankTimeout(AssertionError):
    """Ranks were still running after timeout_s; the message holds each rank's Python stacks."""

    def __init__(self, message: str, *, stacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.stacks = stacks or {}


class WorldSizeMismatch(RuntimeError):
    """Under torchrun/Slurm the job's world size is fixed; the call asked for another one."""


# ---------------------------------------------------------------------------------------------
# Environment detection
# ---------------------------------------------------------------------------------------------

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")


def external_rendezvous() -> bool:
    """True when a launcher already made this process one rank of a job (torchrun, DeepSpeed's
    launcher, or Slurm with MASTER_ADDR/MASTER_PORT exported); run_ranks then does not spawn.

    Spawned ranks also see these variables, so run_ranks called inside a rank runs in-process.
    """
    return all(v in os.environ for v in _TORCHRUN_VARS) or all(v in os.environ for v in _SLURM_VARS)


def _default_accelerator() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_accelerator(accelerator: str | None) -> str:
    if accelerator is None:
        return _default_accelerator()
    if accelerator not in ("cuda", "cpu"):
        raise ValueError(f"accelerator must be 'cuda', 'cpu' or None, got {accelerator!r}")
    return accelerator


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ---------------------------------------------------------------------------------------------
# Turning per-rank outcomes into the call's result
# ---------------------------------------------------------------------------------------------

def _describe(outcome: tuple | None) -> str:
    if outcome is None:
        return "did not finish"
    kind = outcome[0]
    if kind == "ok":
        return "returned"
    if kind == "skip":
        return f"skipped ({outcome[1]})"
    return f"raised {outcome[1]}: {outcome[2]}"


def _raise_skip(reason: str) -> None:
    import pytest  # only a skip needs pytest, and then the caller is a pytest test

    raise pytest.skip.Exception(reason)


def _rank_error(index: int, world_size: int, outcome: tuple, others: str = "") -> RankError:
    _, exc_type, message, remote_tb = outcome
    text = f"rank {index} of {world_size} raised {exc_type}: {message}"
    if others:
        text += f"\n{others}"
    if remote_tb:
        text += f"\n\nRemote traceback (rank {index}):\n{remote_tb.rstrip()}"
    return RankError(text, rank=index, world_size=world_size, exc_type=exc_type,
                     remote_traceback=remote_tb)


def _resolve(outcomes: list[tuple]) -> list:
    """All ranks reported: return their values, or raise one RankError / skip for the call."""
    world_size = len(outcomes)
    errors = [i for i, o in enumerate(outcomes) if o[0] == "error"]
    if errors:
        first = errors[0]
        others = "".join(f"\nalso rank {i}: {_describe(outcomes[i])}" for i in errors[1:])
        raise _rank_error(first, world_size, outcomes[first], others.lstrip("\n"))
    skips = {o[1] for o in outcomes if o[0] == "skip"}
    if skips:
        if len(skips) == 1 and all(o[0] == "skip" for o in outcomes):
            _raise_skip(skips.pop())
        listing = "\n".join(f"  rank {i}: {_describe(o)}" for i, o in enumerate(outcomes))
        raise RankError(f"the {world_size} ranks disagree about skipping; a skip must be "
                        f"decided identically on every rank (gate in the parent):\n{listing}",
                        world_size=world_size)
    return [o[1] for o in outcomes]


# ---------------------------------------------------------------------------------------------
# Spawned ranks
# ---------------------------------------------------------------------------------------------

def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class _Pool:
    """world_size live rank processes sharing one process group."""

    def __init__(self, world_size: int, accelerator: str, gpus: tuple[str, ...],
                 pg_timeout_s: float, warm: bool = False, threads: int | None = None) -> None:
        self.world_size = world_size
        self.accelerator = accelerator
        self.gpus = gpus
        self.pg_timeout_s = pg_timeout_s
        self.owner_pid = os.getpid()
        self.port = free_port()
        self.tmpdir = tempfile.mkdtemp(prefix="dsconform-ranks-")
        self.stack_paths = [os.path.join(self.tmpdir, f"rank{i}.stacks") for i in range(world_size)]
        self.procs: list = []
        self.conns: list = []
        self.pids: list[int] = []
        self.closed = False
        self.ready = False  # every rank said "ready" (see _await_start)
        self.started = time.monotonic()
        # What the ranks inherited; each call forwards the parent's changes since (see env_delta).
        self.spawn_env = dict(os.environ)
        ctx = multiprocessing.get_context("spawn")  # never the global start method
        base_env = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(world_size),  # DeepSpeed's CPU accelerator and shm op read it
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "DS_ACCELERATOR": accelerator,
            # A cpu run sees no GPU, so it cannot touch another xdist worker's devices.
            "CUDA_VISIBLE_DEVICES": ",".join(gpus) if accelerator == "cuda" else "",
        }
        if threads:  # lanes share the cores (CPU Adam, torch's CPU ops), read at import
            base_env["OMP_NUM_THREADS"] = str(threads)
        try:
            for index in range(world_size):
                env = dict(base_env, RANK=str(index), LOCAL_RANK=str(index))
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=rank_main, name=f"dsconform-rank{index}",
                    args=(index, world_size, env, child_conn, self.stack_paths[index],
                          accelerator, pg_timeout_s, os.getpid(), warm),
                )
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
                self.pids.append(proc.pid)
        except BaseException:
            self.kill()
            raise

    def env_delta(self, now: dict | None = None) -> tuple[dict, list]:
        """Variables the parent set or removed since the ranks started (a test's monkeypatch),
        so a pooled rank sees the same environment a fresh one would. now: the environment to
        send (a background batch's snapshot), else the parent's current one."""
        now = os.environ if now is None else now
        changed = {k: v for k, v in now.items()
                   if self.spawn_env.get(k) != v and k not in RANK_OWNED_ENV}
        removed = [k for k in self.spawn_env if k not in now and k not in RANK_OWNED_ENV]
        return changed, removed

    def alive(self) -> bool:
        return not self.closed and all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        """SIGKILL every rank and whatever it started, reap them, remove their leftovers."""
        if self.closed or self.owner_pid != os.getpid():
            return  # done already, or a forked copy of the parent that must not kill its ranks
        self.closed = True
        descendants = []
        try:
            import psutil
        except ImportError:
            psutil = None
        for proc in self.procs:
            if psutil is not None and proc.exitcode is None:
                try:
                    descendants += psutil.Process(proc.pid).children(recursive=True)
                except psutil.Error:
                    pass
            # Ranks lead their own process group; kill it before reaping so the id is not reused.
            for kill in (os.killpg, os.kill):
                try:
                    kill(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for child in descendants:
            try:
                child.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        for proc in self.procs:
            proc.join(timeout=10)
        self._release()

    def close(self) -> None:
        """Ask healthy ranks to exit, then make sure of it."""
        if self.closed or self.owner_pid != os.getpid():
            return
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def _release(self) -> None:
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.close()
            except ValueError:
                pass  # still running after SIGKILL + 10 s: leave the handle, nothing else to do
        # DeepSpeed's shm comm op never unlinks its segments (~tens of MiB per rank, named after
        # the port); without this /dev/shm fills up over a long session.
        pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{self.port}_*"
        for path in glob.glob(pattern):
            try:
                os.unlink(path)
            except OSError:
                pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def read_stacks(self, ranks: list[int]) -> dict[int, str]:
        stacks = {}
        for index in ranks:
            try:
                with open(self.stack_paths[index]) as handle:
                    stacks[index] = handle.read().strip()
            except OSError:
                stacks[index] = ""
        return stacks

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Make the given live ranks write their Python stacks (faulthandler) and read them."""
        signalled = []
        for index in ranks:
            try:
                os.kill(self.pids[index], STACK_DUMP_SIGNAL)
                signalled.append(index)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            if all(os.path.getsize(self.stack_paths[i]) > 0 for i in signalled
                   if os.path.exists(self.stack_paths[i])):
                time.sleep(0.1)  # let a dump that has started finish writing
                break
            time.sleep(0.05)
        return self.read_stacks(ranks)

    def collect(self, deadline: float, phase: str, limit: str) -> list[tuple]:
        """Wait for one reply per rank; fail fast on the first error or death, dump on timeout.

        phase says what the ranks were doing ("in module.fn"), limit which setting ran out.
        """
        replies: list[tuple | None] = [None] * self.world_size
        pending = set(range(self.world_size))
        first_skip: float | None = None
        while pending:
            until = deadline if first_skip is None else min(deadline, first_skip + SKIP_GRACE_S)
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            waitables = [self.conns[i] for i in pending] + [self.procs[i].sentinel for i in pending]
            _wait_any(waitables, timeout=remaining)
            dead = self._sweep(pending, replies)
            if first_skip is None and any(r is not None and r[0] == "skip" for r in replies):
                first_skip = time.monotonic()
            errors = [i for i, r in enumerate(replies) if r is not None and r[0] == "error"]
            if dead or errors:
                # Ranks often fail together (a dead peer makes gloo raise in the others): take
                # one more look so the report names the cause, not only the first symptom.
                time.sleep(0.05)
                dead += self._sweep(pending, replies)
                errors = [i for i, r in enumerate(replies) if r is not None and r[0] == "error"]
                self._fail(dead, errors, replies, phase)
        if pending:
            self._timeout(sorted(pending), replies, deadline, first_skip, phase, limit)
        return replies  # type: ignore[return-value]

    def _sweep(self, pending: set[int], replies: list) -> list[int]:
        dead = []
        for index in sorted(pending):
            conn, proc = self.conns[index], self.procs[index]
            try:
                if conn.poll():
                    # Plain pickle bytes (dist_rank._reply): no tensor arrives as a shared fd.
                    replies[index] = pickle.loads(conn.recv_bytes())
                    pending.discard(index)
                    continue
            except (EOFError, OSError):
                proc.join(timeout=2.0)  # the pipe closes a moment before the process is reaped
            if proc.exitcode is not None:
                pending.discard(index)
                dead.append(index)
        return dead

    def _fail(self, dead: list[int], errors: list[int], replies: list, phase: str) -> None:
        exitcodes = {i: self.procs[i].exitcode for i in dead}
        crash_stacks = self.read_stacks(dead)
        self.kill()
        n = self.world_size
        if dead:
            # A dead rank comes first: the errors of its peers are usually its consequence.
            index = min(dead)
            code = exitcodes[index]
            how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
            text = f"rank {index} of {n} {how} {phase}"
            for other in sorted(set(dead) - {index}):
                text += f"\nalso rank {other}: exited ({exitcodes[other]})"
            for other in errors:
                text += f"\nalso rank {other}: {_describe(replies[other])}"
            if crash_stacks.get(index):
                text += f"\n\nFatal-signal stacks of rank {index}:\n{crash_stacks[index]}"
            else:
                text += "\n(the rank's own stderr, in the captured output, may say why)"
            raise RankError(text, rank=index, world_size=n, exc_type=None)
        index = errors[0]
        others = "\n".join(f"also rank {i}: {_describe(replies[i])}" for i in errors[1:])
        if phase.startswith("while starting"):
            others = f"(raised {phase})\n{others}".rstrip()
        raise _rank_error(index, n, replies[index], others)

    def _timeout(self, pending: list[int], replies: list, deadline: float,
                 first_skip: float | None, phase: str, limit: str) -> None:
        stacks = self.dump_stacks(pending)
        self.kill()
        n = self.world_size
        sections = "\n\n".join(
            f"--- rank {i} (pid {self.pids[i]}) ---\n{stacks.get(i) or '(no stack written)'}"
            for i in pending)
        names = ", ".join(str(i) for i in pending)
        if first_skip is not None and time.monotonic() < deadline:
            listing = "\n".join(f"  rank {i}: {_describe(r)}" for i, r in enumerate(replies))
            raise RankError(
                f"the {n} ranks disagree about skipping: rank(s) {names} still running "
                f"{SKIP_GRACE_S:g} s after another rank skipped (probably waiting in a collective "
                f"for it); decide skips identically on every rank or gate in the parent:\n"
                f"{listing}\n\nPython stacks of the ranks still running:\n{sections}",
                world_size=n)
        done = "; ".join(f"rank {i} {_describe(r)}" for i, r in enumerate(replies) if r is not None)
        raise RankTimeout(
            f"rank(s) {names} of {n} still running {phase} after {limit}"
            + (f" ({done})" if done else "")
            + f"; all ranks killed. Python stacks at the timeout:\n\n{sections}",
            stacks=stacks)


_POOLS: OrderedDict[tuple, _Pool] = OrderedDict()
_LOCK = threading.RLock()  # the pool tables (_POOLS, _SPARES, _LANES, _HOLD)
_CALLS = threading.RLock()  # one run_ranks call at a time in this process


def _close_idle(pools: list[_Pool]) -> None:
    for pool in pools:
        if pool.ready:
            pool.close()
        else:
            pool.kill()  # still starting: nothing of it to flush


def shutdown_pools() -> None:
    """Stop every pooled rank process. The pytest plugin calls this at session end."""
    with _LOCK:
        while _POOLS:
            _, pool = _POOLS.popitem()
            pool.close()
        idle = list(_SPARES.values()) + [p for pools in _LANES.values() for p in pools]
        _SPARES.clear()
        _LANES.clear()
        _close_idle(idle)


def close_lanes() -> None:
    """Stop the idle lane pools (a cell batch that ended: its lanes' CUDA contexts and memory
    must not stay on the GPUs through the measurements that follow)."""
    with _LOCK:
        idle = [p for pools in _LANES.values() for p in pools]
        _LANES.clear()
    _close_idle(idle)


atexit.register(shutdown_pools)


def _clear_build_locks() -> None:
    """Ranks build DeepSpeed ops (shm_comm inside init_distributed on CPU) in the extensions
    cache they inherit: a lock left there by a killed build would hold them until
    STARTUP_TIMEOUT_S with no cause given. Remove it when provably stale, else fail now."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not ext:
        return
    from dsconform.ops.buildlock import StaleBuildLock, clear_stale
    try:
        for line in clear_stale(ext):
            print(f"dsconform.harness.api: {line}", file=sys.stderr)
    except StaleBuildLock as exc:
        raise RankError(f"ranks not started: {exc}") from None


def _await_start(pool: _Pool) -> _Pool:
    """Wait for every rank of a starting pool to report ready (STARTUP_TIMEOUT_S after it was
    started); a pool that cannot start is killed and its RankError raised."""
    if pool.ready:
        return pool
    try:
        pool.collect(pool.started + STARTUP_TIMEOUT_S,
                     "while starting (import deepspeed, init_distributed)",
                     f"STARTUP_TIMEOUT_S={STARTUP_TIMEOUT_S:g} s "
                     "(env DSCONFORM_STARTUP_TIMEOUT_S)")
    except BaseException:
        pool.kill()
        raise
    pool.ready = True
    return pool


def _start_pool(world_size: int, accelerator: str, gpus: tuple[str, ...],
                pg_timeout_s: float) -> _Pool:
    _clear_build_locks()
    attempts = 3  # the probed port can be taken between the probe and rank 0's bind
    for attempt in range(attempts):
        try:
            return _await_start(_Pool(world_size, accelerator, gpus, pg_timeout_s))
        except RankError as exc:
            if "address already in use" in str(exc).lower() and attempt + 1 < attempts:
                continue
            raise
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Standby pools
# ---------------------------------------------------------------------------------------------

#: Standby pools by (world size, accelerator, GPUs, warmed up). Warmed-up ones serve pooled
#: calls; a fresh-process call (reuse=False) only ever takes ranks that never built an engine, so
#: "loads in a fresh process" keeps its meaning.
_SPARES: dict[tuple, _Pool] = {}
_HOLD = 0  # > 0 while a measurement runs (hold_spares): no spare starts then
_SPARE_ENV: dict[str, str] | None = None  # the environment spares are started in
#: Rank start-ups this process waited for: how many pools, how many of them were standbys, and
#: the seconds calls spent waiting for ranks to become ready (see startup_stats).
_STATS = {"pools": 0, "from_standby": 0, "waited_s": 0.0}


def startup_stats() -> dict[str, float]:
    """Rank pools started for calls in this process, how many came from standby, and the
    seconds calls waited for start-up; lane pools started (lanes), the calls run on lanes
    (lane_calls) and the seconds lanes waited for their ranks to start (lane_waited_s). The
    plugin prints them after a run."""
    return {**_STATS, "lanes": _LANE_STATS["started"], "lane_calls": _LANE_STATS["calls"],
            "lane_waited_s": _LANE_STATS["waited_s"]}


def spares_enabled(accelerator: str) -> bool:
    """Whether standby pools are kept for this accelerator (DSCONFORM_SPARE_POOLS)."""
    if SPARE_POOLS in ("0", "off", "no", "false"):
        return False
    if SPARE_POOLS in ("1", "on", "yes", "true"):
        return True
    return accelerator == "cuda" and (os.cpu_count() or 1) >= SPARE_MIN_CORES


#: Variables that change between tests by themselves and say nothing about a test's setup.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in RANK_OWNED_ENV and k not in _VOLATILE_ENV}


def _spare_key(world_size: int, accelerator: str, gpus: tuple[str, ...], fresh: bool) -> tuple:
    return (world_size, accelerator, gpus, RANK_WARMUP and not fresh)


def _start_spare(world_size: int, accelerator: str, gpus: tuple[str, ...], *,
                 fresh: bool = False) -> None:
    """Start (without waiting) a standby pool for this key unless one exists, a measurement is
    running, or the environment differs from the one the first spare saw (a test's
    monkeypatch is in force: its variables must not be baked into processes another test uses).
    fresh: for fresh-process calls, so never warmed up."""
    global _SPARE_ENV
    key = _spare_key(world_size, accelerator, gpus, fresh)
    if _HOLD or key in _SPARES or not spares_enabled(accelerator):
        return
    env = _plain_env()
    if _SPARE_ENV is None:
        _SPARE_ENV = env
    elif env != _SPARE_ENV:
        return
    try:
        _clear_build_locks()
        # Standby ranks for pooled calls also build a first engine (dist_rank.warm_up): nobody
        # waits for them.
        _SPARES[key] = _Pool(world_size, accelerator, gpus, POOL_PG_TIMEOUT_S, warm=key[3])
    except Exception as exc:  # noqa: BLE001 - a spare is an optimisation: the call will spawn
        print(f"dsconform.harness.api: standby ranks not started ({exc})", file=sys.stderr)


def _pop_spare(key: tuple, pg_timeout_s: float) -> _Pool | None:
    """Take the standby pool for key out of the table (call with _LOCK held), or None (none
    kept, or one that cannot serve this call)."""
    pool = _SPARES.pop(key, None)
    if pool is None:
        return None
    if pool.pg_timeout_s < pg_timeout_s or pool.closed:
        pool.kill()
        return None
    return pool


def _started_spare(pool: _Pool | None) -> _Pool | None:
    """A taken standby pool once started up, or None (none, or it failed to start: the caller
    then starts ranks the usual way, which reports a real start-up failure). Waits without
    _LOCK held."""
    if pool is None:
        return None
    try:
        return _await_start(pool)
    except RankError as exc:
        print(f"dsconform.harness.api: standby ranks failed to start, starting new ones ({exc})",
              file=sys.stderr)
        return None


def start_spares(world_sizes: list[int], accelerator: str = "cuda", *,
                 fresh: bool = False) -> list[tuple]:
    """Start standby pools for these world sizes now (a run starting on a GPU node calls this
    so rank start-up overlaps collection and op builds; fresh: the never-warmed ones that
    fresh-process calls take). Returns the keys started; world sizes this xdist worker has too
    few GPUs for are left out."""
    started = []
    with _LOCK:
        for ws in world_sizes:
            try:
                gpus = _gpus_for(ws, accelerator)
            except InsufficientGPUs:
                continue
            _start_spare(ws, accelerator, gpus, fresh=fresh)
            if _spare_key(ws, accelerator, gpus, fresh) in _SPARES:
                started.append((ws, accelerator, gpus))
    return started


def settle_spares() -> None:
    """Wait until every standby pool has finished starting (or drop those that failed), so
    nothing else starts up on the node while a measurement runs."""
    with _LOCK:
        for key, pool in list(_SPARES.items()):
            try:
                _await_start(pool)
            except RankError:
                _SPARES.pop(key, None)
        for pools in _LANES.values():  # idle lane pools still starting (start_lanes)
            for pool in list(pools):
                try:
                    _await_start(pool)
                except RankError:
                    pools.remove(pool)


def _started_now(pool: _Pool) -> bool:
    """Whether a starting pool has started by now (every rank answered), without waiting."""
    if pool.ready:
        return True
    if not all(conn.poll() for conn in pool.conns):
        return False
    try:
        _await_start(pool)
    except RankError:
        return False  # killed by _await_start
    return True


#: Standby keys (world size, accelerator, GPUs, fresh) whose starting pools a hold stopped; they
#: start again when the last hold ends.
_STOPPED: list[tuple] = []


def _stop_starting() -> None:
    """Kill the standby and idle lane pools still starting (call with _LOCK held). Standby pools
    are started again when the hold ends; lanes are started by the next batch that needs them."""
    for key, pool in list(_SPARES.items()):
        if not _started_now(pool):
            pool.kill()
            del _SPARES[key]
            _STOPPED.append((key[0], key[1], key[2], not key[3]))
    for pools in _LANES.values():
        for pool in list(pools):
            if not _started_now(pool):
                pool.kill()
                pools.remove(pool)


class hold_spares:  # noqa: N801 - used like a function: `with hold_spares():`
    """While in force no standby or lane pool starts, and those still starting are stopped (the
    standby ones start again when the hold ends): a performance measurement must not share the
    node with a starting rank (CPU, a CUDA context, NCCL set-up), and waiting for them cost
    12 s before a measurement on 2xH200. The metrics fixture holds them for the whole test."""

    def __enter__(self) -> hold_spares:
        global _HOLD
        with _LOCK:
            _HOLD += 1
            _stop_starting()
        return self

    def __exit__(self, *exc: object) -> None:
        global _HOLD
        with _LOCK:
            _HOLD -= 1
            if _HOLD == 0:
                while _STOPPED:
                    ws, accel, gpus, fresh = _STOPPED.pop(0)
                    _start_spare(ws, accel, gpus, fresh=fresh)


def _my_gpus() -> tuple[int, int, list[str], list[str]]:
    """(xdist worker index, worker count, visible GPUs, this worker's slice of them)."""
    index, count = xdist_worker()
    visible = visible_gpus()
    return index, count, visible, gpu_slice(index, gpus_per_worker(len(visible), count), visible)


def _gpus_for(world_size: int, accelerator: str) -> tuple[str, ...]:
    if accelerator != "cuda":
        return ()
    index, count, visible, mine = _my_gpus()
    if world_size > len(mine):
        raise InsufficientGPUs(
            f"run_ranks(world_size={world_size}, accelerator='cuda') needs {world_size} GPUs; "
            f"xdist worker gw{index} of {count} owns {len(mine)} ({','.join(mine) or 'none'}) of "
            f"{len(visible)} visible; run fewer xdist workers (-n) or set "
            "DSCONFORM_GPUS_PER_WORKER",
            needed=world_size, available=len(mine))
    return tuple(mine[:world_size])


def _pickle_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        # sys.path travels apart from fn: fn's module may only import with it.
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - lambdas, local functions, open files...
        raise TypeError(
            f"run_ranks cannot send {_fn_name(fn)} or its arguments to the ranks ({exc}); "
            "fn must be a module-level function of an importable module and args picklable"
        ) from exc


def _send_and_collect(pool: _Pool, fn: Callable, call: bytes, timeout_s: float,
                      context: tuple[list, dict] | None = None) -> list[tuple]:
    """Run one pickled call on a started pool; every rank's reply (collect kills the pool and
    raises when a rank fails, dies or runs past timeout_s). context: (sys.path, environment)
    to send, as the caller saw them when its batch started; else the parent's current ones."""
    path, environ = context if context is not None else (list(sys.path), None)
    payload = pickle.dumps((list(path), pool.env_delta(environ), call))
    for conn in pool.conns:
        conn.send_bytes(payload)
    return pool.collect(time.monotonic() + timeout_s, f"in {_fn_name(fn)}",
                        f"timeout_s={timeout_s:g} s")


def _healthy(replies: list[tuple]) -> bool:
    """Only a clean result or a unanimous skip keeps a pool: after any failure a rank's state
    (half-built engines, a process group out of step) must not reach the next test."""
    kinds = {r[0] for r in replies}
    return kinds == {"ok"} or (kinds == {"skip"} and len({r[1] for r in replies}) == 1)


def _run_spawned(fn: Callable, world_size: int, timeout_s: float, args: tuple, kwargs: dict,
                 accelerator: str, reuse: bool) -> list:
    call = _pickle_call(fn, args, kwargs)
    gpus = _gpus_for(world_size, accelerator)
    key = (world_size, accelerator, gpus)
    # _CALLS serialises run_ranks calls; _LOCK only guards the pool tables, so a background
    # cell batch (dsconform.harness.batch) can take and start its lanes while a call runs here.
    with _CALLS:
        with _LOCK:
            pool = _POOLS.pop(key, None) if reuse else None
            spare = None
            if pool is not None and (not pool.alive() or pool.pg_timeout_s < timeout_s + 60):
                pool.close()
                pool = None
            started = pool is None
            pg_timeout_s = _pg_timeout_for(timeout_s) if reuse else timeout_s + 60
            if pool is None:
                spare = _pop_spare(_spare_key(world_size, accelerator, gpus, not reuse),
                                   pg_timeout_s)
        if pool is None:
            t0 = time.monotonic()
            pool = _started_spare(spare)
            _STATS["from_standby"] += pool is not None
            pool = pool or _start_pool(world_size, accelerator, gpus, pg_timeout_s)
            _STATS["pools"] += 1
            _STATS["waited_s"] += time.monotonic() - t0
            if not reuse:
                # A fresh-process call is often followed by another (save, then load in new
                # processes): its replacement starts now. Held off during measurements.
                with _LOCK:
                    _start_spare(world_size, accelerator, gpus, fresh=True)
        healthy = False
        try:
            replies = _send_and_collect(pool, fn, call, timeout_s)
            healthy = _healthy(replies)
            return _resolve(replies)
        finally:
            # Anything else (an exception, a timeout, Ctrl-C) leaves ranks mid-call: never reuse.
            if not healthy:
                pool.kill()
            elif not reuse:
                pool.close()
            with _LOCK:
                if healthy and reuse:
                    _POOLS[key] = pool
                    while len(_POOLS) > MAX_POOLS:
                        _POOLS.popitem(last=False)[1].close()
                if reuse and (started or not healthy):
                    # After the call, not during it: the replacement must not share the node
                    # with what the call measured. (A fresh-process call started its own before.)
                    _start_spare(world_size, accelerator, gpus)


# ---------------------------------------------------------------------------------------------
# Lanes: independent calls at once
# ---------------------------------------------------------------------------------------------

#: How many pools per world size run_concurrently spreads independent calls over ("lanes");
#: one-rank lanes take the GPUs in turn. "auto": LANES_AUTO on cuda machines with at least
#: LANES_MIN_CORES cores, else 1 (every call in turn, as run_ranks). DSCONFORM_LANES=N forces N.
#: Correctness cells are latency-bound (Python, kernel launches, engine set-up): a 2xH200 node
#: runs several at once in about the time of one.
LANES = os.environ.get("DSCONFORM_LANES", "auto").strip().lower()
#: 3, not 4: on 2xH200 the batch took as long with 3 lanes per world size as with 4 (42.5 s
#: and 43.7 s, one machine, warm), and fewer ranks starting at once left the other tests less
#: to wait for (15 s against 21 s of rank start-up waited; the tier 77 s against 83 s).
LANES_AUTO = 3
LANES_MIN_CORES = 16


@dataclass(frozen=True)
class RankCall:
    """One run_ranks call, to be run with others by run_concurrently. fresh: run it on new
    processes that ran no call and built no warm-up engine (run_ranks(reuse=False)): the
    second step of a save-then-resume-in-new-processes cell."""

    fn: Callable
    world_size: int
    timeout_s: float
    args: tuple = ()
    kwargs: dict | None = None
    accelerator: str | None = None
    fresh: bool = False


def _steps(entry: RankCall | list[RankCall]) -> tuple[RankCall, ...]:
    return (entry,) if isinstance(entry, RankCall) else tuple(entry)


def run_steps(entry: RankCall | list[RankCall]) -> Any:
    """One run_concurrently entry through run_ranks here: a call's per-rank results, or for a
    list of steps, one after another (a fresh step on new processes), the list of theirs."""
    _check_steps(_steps(entry))
    results = [run_ranks(c.fn, c.world_size, timeout_s=c.timeout_s, args=c.args,
                         kwargs=c.kwargs, accelerator=c.accelerator, reuse=not c.fresh)
               for c in _steps(entry)]
    return results if isinstance(entry, list) else results[0]


#: Idle lane pools by (world size, accelerator, GPUs), kept between batches (shutdown_pools
#: closes them); several per key.
_LANES: dict[tuple, list[_Pool]] = {}
_LANE_STATS = {"started": 0, "calls": 0, "waited_s": 0.0}
_LANE_STATS_LOCK = threading.Lock()  # lanes update them from their threads


def lanes_for(accelerator: str | None = None) -> int:
    """The number of lanes run_concurrently uses by default here (DSCONFORM_LANES)."""
    if LANES not in ("", "auto"):
        try:
            return max(1, int(LANES))
        except ValueError:
            raise ValueError(f"DSCONFORM_LANES must be 'auto' or a number, got {LANES!r}") from None
    if _check_accelerator(accelerator) != "cuda" or (os.cpu_count() or 1) < LANES_MIN_CORES:
        return 1
    return LANES_AUTO


def _lane_keys(world_size: int, accelerator: str, count: int) -> list[tuple]:
    """The pool keys of count lanes: one-rank lanes go round this worker's GPUs, wider ones all
    use the first world_size GPUs (their processes share them)."""
    gpus = _gpus_for(world_size, accelerator)  # raises InsufficientGPUs
    if accelerator == "cuda" and world_size == 1:
        mine = _my_gpus()[3]
        return [(1, accelerator, (mine[i % len(mine)],)) for i in range(count)]
    return [(world_size, accelerator, gpus)] * count


def _lane_threads() -> int:
    """CPU threads per lane rank: the cores shared by every lane of one- and two-rank calls
    (9 ranks with 3 lanes), so CPU Adam in several lanes at once does not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // (3 * lanes_for()))


def _new_lane(key: tuple, pg_timeout_s: float, fresh: bool = False) -> _Pool:
    """Start (without waiting) a lane pool; call with _LOCK held. fresh: for a fresh step, so
    never warmed up (as run_ranks' fresh-process standby ranks)."""
    _clear_build_locks()
    _LANE_STATS["started"] += 1
    return _Pool(key[0], key[1], key[2], pg_timeout_s, warm=RANK_WARMUP and not fresh,
                 threads=_lane_threads())


def start_lanes(world_sizes: list[int], accelerator: str = "cuda",
                lanes: int | None = None) -> int:
    """Start lane pools for these world sizes now, in the background (a GPU run calls this at
    collection, so they start while ops build); returns how many were started. Nothing starts
    while a measurement holds standby ranks (hold_spares), or with one lane."""
    lanes = lanes_for(accelerator) if lanes is None else lanes
    started = 0
    if lanes <= 1:
        return 0
    with _LOCK:
        if _HOLD:
            return 0
        for ws in world_sizes:
            try:
                keys = _lane_keys(ws, accelerator, lanes)
            except InsufficientGPUs:
                continue
            for key in set(keys):
                idle = _LANES.setdefault(key, [])
                while len(idle) < keys.count(key):
                    try:
                        idle.append(_new_lane(key, POOL_PG_TIMEOUT_S))
                    except Exception as exc:  # noqa: BLE001 - an optimisation: calls start their own
                        print(f"dsconform.harness: lane ranks not started ({exc})",
                              file=sys.stderr)
                        return started
                    started += 1
    return started


class _Spawner:
    """Starts lane pools for lane threads from the thread that runs the batch. Ranks die with
    the *thread* that started them (PR_SET_PDEATHSIG, dist_rank._exit_when_orphaned): a pool a
    lane thread started itself would be killed when that thread ends, and its idle ranks with it.
    The batch's thread calls serve() while it waits for the lanes."""

    def __init__(self) -> None:
        self.requests: deque = deque()
        self.lock = threading.Lock()

    def new_lane(self, key: tuple, pg_timeout_s: float, cancel: threading.Event,
                 fresh: bool = False) -> _Pool:
        done = threading.Event()
        slot: list = []
        with self.lock:
            self.requests.append((key, pg_timeout_s, fresh, slot, done))
        while not done.wait(0.05):
            if cancel.is_set():
                raise RankError("the batch was interrupted before this lane's ranks started")
        if isinstance(slot[0], BaseException):
            raise slot[0]
        return slot[0]

    def serve(self) -> None:
        while True:
            with self.lock:
                if not self.requests:
                    return
                key, pg_timeout_s, fresh, slot, done = self.requests.popleft()
            try:
                with _LOCK:
                    slot.append(_new_lane(key, pg_timeout_s, fresh))
            except BaseException as exc:  # noqa: BLE001 - the lane's call reports it
                slot.append(exc)
            done.set()


def _lane_pool(key: tuple, pg_timeout_s: float, spawner: _Spawner,
               cancel: threading.Event, fresh: bool = False,
               started: _Pool | None = None) -> _Pool:
    """An idle lane pool for key, else a new one; fresh: always a new one, never warmed up
    (started: one started ahead for it). Started up (RankError if it cannot start)."""
    for attempt in range(3):  # the probed port can be taken between the probe and the bind
        pool, started = started, None
        with _LOCK:
            idle = _LANES.get(key, [])
            while idle and pool is None and not fresh:
                pool = idle.pop()
                if pool.closed or pool.pg_timeout_s < pg_timeout_s:
                    pool.kill()
                    pool = None
        if pool is None:
            pool = spawner.new_lane(key, pg_timeout_s, cancel, fresh)
        t0 = time.monotonic()
        try:
            return _await_start(pool)
        except RankError as exc:
            if "address already in use" not in str(exc).lower() or attempt == 2:
                raise
        finally:
            with _LANE_STATS_LOCK:
                _LANE_STATS["waited_s"] += time.monotonic() - t0
    raise AssertionError("unreachable")


def _pg_timeout_for(timeout_s: float) -> float:
    """The process-group timeout a reusable pool needs for a call of timeout_s."""
    return max(POOL_PG_TIMEOUT_S, timeout_s + 60)


def _key_of(lane_key: tuple, step: RankCall, index: int = 0) -> tuple:
    """The pool key a step runs on: its lane's, or for a fresh step of another world size a
    pool key of that size, one-rank ones taking the GPUs in turn by entry index
    (InsufficientGPUs if the node has too few)."""
    if step.world_size == lane_key[0]:
        return lane_key
    return _lane_keys(step.world_size, lane_key[1], index + 1)[index]


def _check_steps(steps: tuple[RankCall, ...]) -> str:
    """The entry's accelerator; ValueError for steps that cannot run in turn on one lane: every
    step shares the accelerator, and only a fresh step (new ranks anyway) changes world size."""
    if not steps:
        raise ValueError("an entry of run_concurrently has no steps")
    accels = {_check_accelerator(step.accelerator) for step in steps}
    if len(accels) > 1:
        raise ValueError("the steps of one entry must share their accelerator")
    for before, step in zip(steps, steps[1:]):
        if step.world_size != before.world_size and not step.fresh:
            raise ValueError(f"a step of world size {step.world_size} after one of "
                             f"{before.world_size}: only a fresh step (fresh=True, new ranks) "
                             "may change the world size")
    return accels.pop()


def _lane(key: tuple, queue: deque, calls: list, pickled: list, outcomes: list,
          qlock: threading.Lock, active: set, cancel: threading.Event, spawner: _Spawner,
          on_done: Callable[[int, tuple, float], None] | None,
          context: tuple[list, dict]) -> None:
    """One lane: take calls of its world size off the shared queue until none is left; an
    entry of several steps runs them in turn, a fresh step on ranks that ran no call (of
    another world size, if it says so: that pool is not kept for the lane)."""
    pool: _Pool | None = None
    ahead: _Pool | None = None  # started while the step before a fresh step runs
    try:
        while not cancel.is_set():
            with qlock:
                if not queue:
                    return
                i = queue.popleft()
            steps = _steps(calls[i])
            healthy = True
            t0 = time.monotonic()
            try:
                results = []
                for j, (step, payload) in enumerate(zip(steps, pickled[i])):
                    need = _pg_timeout_for(step.timeout_s)
                    if pool is not None and (not pool.alive() or pool.pg_timeout_s < need
                                             or step.fresh):
                        active.discard(pool)
                        pool.close()
                        pool = None
                    if pool is None:
                        pool, ahead = _lane_pool(_key_of(key, step, i), need, spawner, cancel,
                                                 fresh=step.fresh, started=ahead), None
                        active.add(pool)
                    if j + 1 < len(steps) and steps[j + 1].fresh and ahead is None:
                        ahead = spawner.new_lane(_key_of(key, steps[j + 1], i),
                                                 _pg_timeout_for(steps[j + 1].timeout_s),
                                                 cancel, fresh=True)
                        active.add(ahead)
                    healthy = False
                    replies = _send_and_collect(pool, step.fn, payload, step.timeout_s, context)
                    healthy = _healthy(replies)
                    results.append(_resolve(replies))
                outcome: tuple = ("ok", results if isinstance(calls[i], list) else results[0])
            except BaseException as exc:  # noqa: BLE001 - the call's own outcome, raised in its test
                outcome = ("raise", exc)
            finally:
                with _LANE_STATS_LOCK:
                    _LANE_STATS["calls"] += len(steps)
                if not healthy and pool is not None:
                    pool.kill()
                    active.discard(pool)
                    pool = None
                if ahead is not None:  # a step before the fresh one failed: not needed
                    ahead.kill()
                    active.discard(ahead)
                    ahead = None
                if pool is not None and pool.world_size != key[0]:  # another size's ranks
                    active.discard(pool)
                    pool.close()
                    pool = None
            if cancel.is_set():  # stopped from outside: what the kill did is no outcome
                return
            outcomes[i] = outcome
            if on_done is not None:
                on_done(i, outcome, time.monotonic() - t0)
    finally:
        if pool is not None:
            active.discard(pool)
            if cancel.is_set() or not pool.alive():
                pool.kill()
            else:
                with _LOCK:
                    _LANES.setdefault(key, []).append(pool)


def run_concurrently(calls: list[RankCall | list[RankCall]], *, lanes: int | None = None,
                     on_done: Callable[[int, tuple, float], None] | None = None,
                     cancel: threading.Event | None = None) -> list[tuple]:
    """Run independent calls at once, spread over `lanes` pools per world size (one-rank pools
    on every GPU in turn). Each outcome is ("ok", the per-rank results) or ("raise", the
    exception run_ranks would have raised for that call alone: RankError, RankTimeout, a
    unanimous skip, InsufficientGPUs...). A failing call kills only its own lane's ranks; that
    lane starts new ones for its next call. on_done(index, outcome, seconds) runs as each call
    ends (seconds: from taking the call, its lane's start-up included).

    On lanes, the calls see sys.path and the environment as they were when run_concurrently
    was called, whatever the calling process changes meanwhile (it may run other tests: a
    background batch); through run_ranks (one lane) they see them as each call starts.
    cancel: setting it stops the batch from another thread: every lane's ranks are killed, the
    calls not finished get no outcome (None) and no on_done.

    With one lane, under torchrun/Slurm, or for a single call, the calls run one after another
    through run_ranks. Ctrl-C kills every lane and re-raises.

    An entry may be a list of steps (RankCalls of one accelerator): they run in turn on one
    lane, a step with fresh=True on new processes (started while the step before it runs),
    which may be of another world size (a save on 2 ranks, the load on 1); the outcome is
    ("ok", the list of each step's per-rank results), or the first failing step's exception."""
    outcomes: list = [None] * len(calls)
    lanes = lanes_for() if lanes is None else lanes

    def finish(i: int, outcome: tuple, seconds: float = 0.0) -> None:
        outcomes[i] = outcome
        if on_done is not None:
            on_done(i, outcome, seconds)

    if lanes <= 1 or len(calls) < 2 or external_rendezvous():
        for i, c in enumerate(calls):
            if cancel is not None and cancel.is_set():
                break
            t0 = time.monotonic()
            try:
                outcome: tuple = ("ok", run_steps(c))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - the call's own outcome (a skip too)
                outcome = ("raise", exc)
            finish(i, outcome, time.monotonic() - t0)
        return outcomes
    groups: OrderedDict[tuple, deque] = OrderedDict()
    pickled: list = [None] * len(calls)
    for i, c in enumerate(calls):
        try:  # what run_ranks would refuse, each call's own outcome
            steps = _steps(c)
            for step in steps:
                _check_world_size(step.world_size)
                _check_timeout(step.timeout_s)
            accel = _check_steps(steps)
            pickled[i] = [_pickle_call(step.fn, tuple(step.args), dict(step.kwargs or {}))
                          for step in steps]
        except Exception as exc:  # noqa: BLE001
            finish(i, ("raise", exc))
            continue
        groups.setdefault((steps[0].world_size, accel), deque()).append(i)
    cancel = threading.Event() if cancel is None else cancel
    qlock, active, spawner = threading.Lock(), set(), _Spawner()
    context = (list(sys.path), dict(os.environ))
    threads = []
    for (ws, accel), queue in groups.items():
        try:
            keys = _lane_keys(ws, accel, min(lanes, len(queue)))
        except InsufficientGPUs as exc:
            for i in queue:
                finish(i, ("raise", exc))
            continue
        for key in keys:
            threads.append(threading.Thread(
                target=_lane, name=f"dsconform-lane-ws{ws}",
                args=(key, queue, calls, pickled, outcomes, qlock, active, cancel, spawner,
                      on_done, context),
                daemon=True))
    for t in threads:
        t.start()
    def stop() -> None:
        cancel.set()
        for pool in list(active):
            pool.kill()
        for t in threads:
            t.join(15)

    try:
        for t in threads:
            while t.is_alive():
                if cancel.is_set():
                    stop()
                    return outcomes
                spawner.serve()
                t.join(0.05)
    except BaseException:
        stop()
        raise
    return outcomes


# ---------------------------------------------------------------------------------------------
# External rendezvous (torchrun, DeepSpeed launcher, Slurm)
# ---------------------------------------------------------------------------------------------

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
    import dsconform.harness.rank as dist_rank

    _, _, local_rank = _external_env()
    import torch
    import torch.distributed as tdist

    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        chosen = get_accelerator().device_name()
        accel = _check_accelerator(accelerator or (chosen if chosen in ("cuda", "cpu") else None))
        if chosen != accel:
            raise RuntimeError(
                f"run_ranks(accelerator={accel!r}) but deepspeed already runs on {chosen!r} in "
                "this process; export DS_ACCELERATOR before the job starts")
    else:
        accel = _check_accelerator(accelerator or os.environ.get("DS_ACCELERATOR"))
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
    if dist_rank._accelerator is None:
        dist_rank._accelerator = accel
    if _outcome_group is None:
        # Outcomes travel on their own gloo group: a rank that raised early must not pair its
        # outcome exchange with a collective its peers are still blocked in.
        _outcome_group = tdist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=max(2 * timeout_s + 60, 1800)))


def _run_external(fn: Callable, world_size: int | None, timeout_s: float, args: tuple,
                  kwargs: dict, accelerator: str | None) -> list:
    _, env_world, _ = _external_env()
    if world_size not in (None, -1) and world_size != env_world:
        raise WorldSizeMismatch(
            f"run_ranks(world_size={world_size}) but the launcher started {env_world} ranks "
            f"(WORLD_SIZE/SLURM_NTASKS); pass world_size=None to use the job's size, or gate the "
            "test on dsconform.harness.api.world()")
    _init_external(accelerator, timeout_s)
    import torch.distributed as tdist

    # A hang here cannot be contained to one call (no parent can kill this rank); at least the
    # job log shows where each rank was stuck, and the process-group timeout ends collectives.
    faulthandler.dump_traceback_later(timeout_s, exit=False)
    try:
        outcome = picklable_outcome(call_outcome(fn, args, kwargs))
    finally:
        faulthandler.cancel_dump_traceback_later()
    outcomes: list = [None] * env_world
    tdist.all_gather_object(outcomes, outcome, group=_outcome_group)
    return _resolve(outcomes)


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------

def _check_timeout(timeout_s: Any) -> None:
    if timeout_s is None or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def _check_world_size(world_size: Any) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be an int >= 1 outside torchrun/Slurm, got {world_size!r}")


def run_ranks(fn: Callable, world_size: int | None, *, timeout_s: float, args: tuple = (),
              kwargs: dict | None = None, accelerator: str | None = None,
              reuse: bool = True) -> list:
    """Run fn(*args, **kwargs) on world_size ranks; return the per-rank results (index = rank).

    accelerator: "cuda" (nccl, rank i on the i-th GPU of this xdist worker), "cpu" (gloo,
    DeepSpeed's CPU accelerator even on a GPU node), or None (cuda if the parent sees a GPU).
    reuse: keep the rank processes for the next call of the same world size and accelerator.
    timeout_s: how long fn may run; startup has its own STARTUP_TIMEOUT_S.
    Raises RankError (a rank raised or died, or ranks disagreed on a skip), RankTimeout,
    pytest's Skipped when every rank skipped for the same reason, InsufficientGPUs.
    Under torchrun/Slurm (external_rendezvous()), runs fn in this process as one rank; there
    world_size must equal the job's size or be None/-1 ("whatever the job has").
    """
    _check_timeout(timeout_s)
    kwargs = dict(kwargs or {})
    if external_rendezvous():
        return _run_external(fn, world_size, timeout_s, tuple(args), kwargs, accelerator)
    _check_world_size(world_size)
    return _run_spawned(fn, world_size, float(timeout_s), tuple(args), kwargs,
                        _check_accelerator(accelerator), reuse)
