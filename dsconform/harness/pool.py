"""A rank group ("pool"): world_size live rank processes, started together, sent a call,
their replies collected; a failing, dying or hanging rank fails its call and tears its pool
down. Which groups exist and who uses them: dsconform.harness.groups."""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait as _wait_any

from dsconform import settings
from dsconform.harness import output, timeline, zygote
from dsconform.harness.errors import RankError, RankTimeout, describe, fn_name, rank_error
from dsconform.harness.rank import RANK_OWNED_ENV, SPAWNED_AT_ENV, STACK_DUMP_SIGNAL, rank_main
from dsconform.harness.xdist import (
    AGENT_STORE_ENV,
    InsufficientGPUs,
    bind_rendezvous_store,
    gpu_slice,
    gpus_per_worker,
    visible_gpus,
    xdist_worker,
)

#: Seconds allowed for a rank's start-up (import deepspeed, init_distributed), apart from a call's
#: timeout_s: a machine's first init JIT-builds DeepSpeed's shm op (docs/performance.md#op-builds).
STARTUP_TIMEOUT_S = settings.get("DSCONFORM_STARTUP_TIMEOUT_S")

#: Once one rank skipped, how long the others may take to finish: a rank that did not skip is
#: usually blocked in a collective waiting for the one that did.
SKIP_GRACE_S = 10.0

#: How long a hung rank gets to write its stacks after the dump signal.
STACK_DUMP_WAIT_S = 1.0

#: How long stopping ranks may take to exit by themselves (flushing their output, a CUDA
#: context's teardown) before they are killed; pools stopped together share it.
EXIT_WAIT_S = 2.0

#: The last lines of a rank's output kept to explain its death (a native abort prints no
#: Python traceback).
TAIL_LINES = 20

#: Process-group timeout of pooled ranks: the parent enforces each call's timeout_s, so this
#: only has to outlast the longest call; a call asking for more respawns the pool.
POOL_PG_TIMEOUT_S = 3600.0


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class Pool:
    """world_size live rank processes sharing one process group."""

    def __init__(self, world_size: int, accelerator: str, gpus: tuple[str, ...],
                 pg_timeout_s: float, warm: bool = False, threads: int | None = None,
                 label: str | None = None, primed: bool = False) -> None:
        self.world_size = world_size
        self.accelerator = accelerator
        self.gpus = gpus
        self.pg_timeout_s = pg_timeout_s
        self.owner_pid = os.getpid()
        # What the output read next was printed for: the test that started the pool (label:
        # ranks started in the background), then the test of each call (Pool.call).
        self.label = label or output.current_label()
        # The group's store, held here for the pool's life: the ranks connect to it.
        self.store, self.port = bind_rendezvous_store(
            pg_timeout_s, log=lambda text: output.record(self.label, "dsconform.harness", text))
        self.tmpdir = tempfile.mkdtemp(prefix="dsconform-ranks-")
        self.stack_paths = [os.path.join(self.tmpdir, f"rank{i}.stacks") for i in range(world_size)]
        # Each rank's stdout and stderr; drain() reads what is new since the last time.
        self.output_paths = [os.path.join(self.tmpdir, f"rank{i}.out") for i in range(world_size)]
        self.output_offsets = [0] * world_size
        self.tails: list[deque] = [deque(maxlen=TAIL_LINES) for _ in range(world_size)]
        self.output_lock = threading.Lock()
        self.procs: list = []
        self.conns: list = []
        self.pids: list[int] = []
        self.closed = False
        self.ready = False  # every rank said "ready" (start_up)
        self.phases: list[dict[str, float]] = []  # each rank's start-up phases (seconds)
        self.started = time.monotonic()
        # What the ranks inherited; each call forwards the parent's changes since (see env_delta).
        self.spawn_env = dict(os.environ)
        base_env = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(world_size),  # DeepSpeed's CPU accelerator and shm op read it
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            **AGENT_STORE_ENV,
            "DS_ACCELERATOR": accelerator,
            # A cpu run sees no GPU, so it cannot touch another xdist worker's devices.
            "CUDA_VISIBLE_DEVICES": ",".join(gpus) if accelerator == "cuda" else "",
        }
        if threads:  # lanes share the cores (CPU Adam, torch's CPU ops), read at import
            base_env["OMP_NUM_THREADS"] = str(threads)
        try:
            for index in range(world_size):
                env = dict(self.spawn_env, **base_env, RANK=str(index), LOCAL_RANK=str(index),
                           **{SPAWNED_AT_ENV: repr(time.time())})
                self._start_rank(index, env, warm, primed)
        except BaseException:
            self.kill()
            raise

    def _start_rank(self, index: int, env: dict, warm: bool, primed: bool) -> None:
        """Start rank index: forked from the fork server, or spawned where it fails (then
        every later rank is spawned too; harness.zygote)."""
        while True:
            ctx = zygote.context()
            forked = ctx.get_start_method() == "forkserver"
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=rank_main, name=f"dsconform-rank{index}", args=(
                index, self.world_size, env, child_conn, self.stack_paths[index],
                self.accelerator, self.pg_timeout_s, None if forked else os.getpid(),
                self.output_paths[index], warm, primed))
            try:
                proc.start()
            except Exception as exc:
                parent_conn.close()
                if not forked:
                    raise
                output.record(self.label, "dsconform.harness", zygote.give_up(exc))
                continue
            finally:
                child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
            self.pids.append(proc.pid)
            return

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

    def drain(self, final: bool = False) -> None:
        """Log what the ranks printed since the last drain, as self.label (a line still being
        written waits for the next drain unless final)."""
        with self.output_lock:
            for index, path in enumerate(self.output_paths):
                try:
                    with open(path, "rb") as handle:
                        handle.seek(self.output_offsets[index])
                        data = handle.read()
                except OSError:
                    continue  # not written yet, or removed with the pool
                end = len(data) if final else data.rfind(b"\n") + 1
                if end <= 0:
                    continue
                self.output_offsets[index] += end
                text = data[:end].decode("utf-8", errors="replace")
                self.tails[index].extend(text.splitlines())
                output.record(self.label, f"rank {index}/{self.world_size}", text)

    def request_exit(self) -> None:
        """Ask the ranks to exit (they flush their output first); close_pools waits for them."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")

    def kill(self) -> None:
        """SIGKILL every rank and whatever it started, reap them, remove their leftovers."""
        if self.signal_kill():
            self.reap()

    def signal_kill(self) -> bool:
        """SIGKILL every rank and whatever it started, without waiting for them (reap() does);
        False when there is nothing to kill here."""
        if self.closed or self.owner_pid != os.getpid():
            return False  # done already, or a forked copy of the parent that must not kill
        self.closed = True
        import psutil
        descendants = []
        for proc in self.procs:
            if proc.exitcode is None:
                with contextlib.suppress(psutil.Error):
                    descendants += psutil.Process(proc.pid).children(recursive=True)
            # Ranks lead their own process group; kill it before reaping so the id is not reused.
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(proc.pid, signal.SIGKILL)
        for child in descendants:
            with contextlib.suppress(Exception):  # already gone
                child.kill()
        return True

    def reap(self) -> None:
        """After signal_kill: wait for the ranks, log their last output, remove leftovers."""
        for proc in self.procs:
            proc.join(timeout=10)
        self.drain(final=True)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
        for proc in self.procs:
            # ValueError: still running after SIGKILL + 10 s: leave the handle
            with contextlib.suppress(ValueError):
                proc.close()
        # DeepSpeed's shm comm op never unlinks its segments (~tens of MiB per rank, named after
        # the port); without this /dev/shm fills up over a long session.
        pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{self.port}_*"
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.store = None  # the port is free again once no rank is left to use it

    def close(self) -> None:
        """Ask healthy ranks to exit, then make sure of it."""
        close_pools([self])

    def start_up(self) -> Pool:
        """Wait for every rank to report ready (STARTUP_TIMEOUT_S after the start); a group
        that cannot start is killed and its RankError raised."""
        if self.ready:
            return self
        try:
            replies = self.collect(self.started + STARTUP_TIMEOUT_S,
                                   "while starting (import deepspeed, init_distributed)",
                                   f"STARTUP_TIMEOUT_S={STARTUP_TIMEOUT_S:g} s "
                                   "(env DSCONFORM_STARTUP_TIMEOUT_S)")
        except BaseException:
            self.kill()
            raise
        # rank.rank_main's ("ready", pid, start-up phases, start facts for the timeline)
        self.phases = [r[2] for r in replies]
        for r in replies:
            for step, at in r[3].items():
                timeline.mark(step, at)
        self.ready = True
        self.drain()
        return self

    def started_now(self) -> bool:
        """Whether every rank answered by now (started up, not waiting); False if it failed."""
        if not self.ready and all(conn.poll() for conn in self.conns):
            try:
                self.start_up()
            except RankError:
                return False
        return self.ready

    def call(self, fn: Callable, call: bytes, timeout_s: float,
             context: tuple[list, dict] | None = None) -> list[tuple]:
        """Run one pickled call; every rank's reply (collect kills the group and raises when a
        rank fails, dies or runs past timeout_s). context: (sys.path, environment) to send, as
        the caller's batch saw them when it started; else the parent's current ones."""
        path, environ = context if context is not None else (list(sys.path), None)
        payload = pickle.dumps((list(path), self.env_delta(environ), call))
        self.drain()  # what the ranks printed since their last reply is the last call's
        self.label = output.current_label()
        for conn in self.conns:
            conn.send_bytes(payload)
        try:
            return self.collect(time.monotonic() + timeout_s, f"in {fn_name(fn)}",
                                f"timeout_s={timeout_s:g} s")
        finally:
            if not self.closed:  # a failing call killed the group, which logged its output
                self.drain()

    def read_stacks(self, ranks: list[int]) -> dict[int, str]:
        stacks = dict.fromkeys(ranks, "")
        for index in ranks:
            with contextlib.suppress(OSError), open(self.stack_paths[index]) as handle:
                stacks[index] = handle.read().strip()
        return stacks

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Make the given live ranks write their Python stacks (faulthandler) and read them."""
        signalled = []
        for index in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids[index], STACK_DUMP_SIGNAL)
                signalled.append(index)
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
        phase says what the ranks were doing ("in module.fn"), limit which setting ran out."""
        replies: list[tuple | None] = [None] * self.world_size
        pending = set(range(self.world_size))
        first_skip: float | None = None
        while pending:
            until = deadline if first_skip is None else min(deadline, first_skip + SKIP_GRACE_S)
            if (remaining := until - time.monotonic()) <= 0:
                break
            waitables = [self.conns[i] for i in pending] + [self.procs[i].sentinel for i in pending]
            _wait_any(waitables, timeout=remaining)
            dead = self._sweep(pending, replies)
            if first_skip is None and any(r is not None and r[0] == "skip" for r in replies):
                first_skip = time.monotonic()
            if dead or any(r is not None and r[0] == "error" for r in replies):
                # Ranks often fail together (a dead peer makes gloo raise in the others): take
                # one more look so the report names the cause, not only the first symptom.
                time.sleep(0.05)
                self._fail(dead + self._sweep(pending, replies), replies, phase)
        if pending:
            self._timeout(sorted(pending), replies, deadline, first_skip, phase, limit)
        return replies  # type: ignore[return-value]

    def _sweep(self, pending: set[int], replies: list) -> list[int]:
        dead = []
        for index in sorted(pending):
            conn, proc = self.conns[index], self.procs[index]
            try:
                if conn.poll():
                    # Plain pickle bytes (harness.rank._reply): no tensor arrives as a shared fd.
                    replies[index] = pickle.loads(conn.recv_bytes())
                    pending.discard(index)
                    continue
            except (EOFError, OSError):
                proc.join(timeout=2.0)  # the pipe closes a moment before the process is reaped
            if proc.exitcode is not None:
                pending.discard(index)
                dead.append(index)
        return dead

    def _fail(self, dead: list[int], replies: list, phase: str) -> None:
        errors = [i for i, r in enumerate(replies) if r is not None and r[0] == "error"]
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
                text += f"\nalso rank {other}: {describe(replies[other])}"
            if crash_stacks.get(index):
                text += f"\n\nFatal-signal stacks of rank {index}:\n{crash_stacks[index]}"
            if tail := "\n".join(self.tails[index]):
                text += (f"\n\nLast output of rank {index} (all of it: ranks.log in --results):"
                         f"\n{tail}")
            elif not crash_stacks.get(index):
                text += f"\n(rank {index} printed nothing)"
            raise RankError(text, rank=index, world_size=n)
        raise rank_error(replies, f"(raised {phase})" if phase.startswith("while starting") else "")

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
            listing = "\n".join(f"  rank {i}: {describe(r)}" for i, r in enumerate(replies))
            raise RankError(
                f"the {n} ranks disagree about skipping: rank(s) {names} still running "
                f"{SKIP_GRACE_S:g} s after another rank skipped (probably waiting in a collective "
                f"for it); decide skips identically on every rank or gate in the parent:\n"
                f"{listing}\n\nPython stacks of the ranks still running:\n{sections}",
                world_size=n)
        done = "; ".join(f"rank {i} {describe(r)}" for i, r in enumerate(replies) if r is not None)
        raise RankTimeout(
            f"rank(s) {names} of {n} still running {phase} after {limit}"
            + (f" ({done})" if done else "")
            + f"; all ranks killed. Python stacks at the timeout:\n\n{sections}",
            stacks=stacks)


def close_pools(pools: list[Pool]) -> None:
    """Stop groups together: ask every started rank to exit, kill those still starting, give them
    all EXIT_WAIT_S at once, kill what is left, reap (docs/performance.md#the-end-of-a-run)."""
    mine = [p for p in pools if not p.closed and p.owner_pid == os.getpid()]
    for pool in mine:
        if pool.ready:
            pool.request_exit()
        else:
            pool.signal_kill()  # still starting: nothing of it to flush
    deadline = time.monotonic() + EXIT_WAIT_S
    for pool in mine:
        for proc in pool.procs:
            if not pool.closed:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for pool in mine:
        pool.signal_kill()
    for pool in mine:
        pool.reap()


def clear_build_locks() -> None:
    """Ranks build DeepSpeed ops (shm_comm inside init_distributed on CPU) in the extensions
    cache they inherit: a lock left there by a killed build would hold them until
    STARTUP_TIMEOUT_S with no cause given. Remove it when provably stale, else fail now."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not ext:
        return
    from dsconform.base.buildlock import StaleBuildLock, clear_stale
    try:
        for line in clear_stale(ext):
            output.record(output.current_label(), "dsconform.harness", line)
    except StaleBuildLock as exc:
        raise RankError(f"ranks not started: {exc}") from None


def gpus_for(world_size: int, accelerator: str) -> tuple[str, ...]:
    if accelerator != "cuda":
        return ()
    index, count = xdist_worker()
    visible = visible_gpus()
    mine = gpu_slice(index, gpus_per_worker(len(visible), count), visible)
    if world_size > len(mine):
        raise InsufficientGPUs(
            f"run_ranks(world_size={world_size}, accelerator='cuda') needs {world_size} GPUs; "
            f"xdist worker gw{index} of {count} owns {len(mine)} ({','.join(mine) or 'none'}) of "
            f"{len(visible)} visible; run fewer xdist workers (-n) or set "
            "DSCONFORM_GPUS_PER_WORKER",
            needed=world_size, available=len(mine))
    return tuple(mine[:world_size])


def pickle_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        # sys.path travels apart from fn: fn's module may only import with it.
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:  # lambdas, local functions, open files...
        raise TypeError(
            f"run_ranks cannot send {fn_name(fn)} or its arguments to the ranks ({exc}); "
            "fn must be a module-level function of an importable module and args picklable"
        ) from exc


def replies_healthy(replies: list[tuple]) -> bool:
    """Only a clean result or a unanimous skip keeps a group: after any failure a rank's state
    (half-built engines, a process group out of step) must not reach the next test."""
    kinds = {r[0] for r in replies}
    return kinds == {"ok"} or (kinds == {"skip"} and len({r[1] for r in replies}) == 1)


def pg_timeout_for(timeout_s: float) -> float:
    """The process-group timeout a reusable group needs for a call of timeout_s."""
    return max(POOL_PG_TIMEOUT_S, timeout_s + 60)
