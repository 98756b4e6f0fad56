"""Code that runs inside a rank: the spawned rank's main loop and the helpers tests call there.
Nothing here imports torch or deepspeed at module level: a spawned rank imports this module
first, and DS_ACCELERATOR, CUDA_VISIBLE_DEVICES and the rendezvous variables must be in its
environment before deepspeed picks an accelerator."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import torch

#: Set by the parent in a rank's environment: when it spawned the rank (time.time()).
SPAWNED_AT_ENV = "DSC_RANK_SPAWNED_AT"  # the harness's own, not a setting
#: Variables the harness sets per rank; the parent's environment never overrides them.
RANK_OWNED_ENV = frozenset({SPAWNED_AT_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE",
                            "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR",
                            "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_USE_AGENT_STORE",
                            "TORCHELASTIC_RESTART_COUNT"})
#: The signal the parent sends to make a hung rank write its Python stacks.
STACK_DUMP_SIGNAL = signal.SIGUSR1

# Set once per process when it becomes a rank ("cuda" or "cpu").
_accelerator: str | None = None
# Whether this rank built a warm-up engine before its first call (warm_up).
_warmed_up = False


# -- Helpers for code running inside ranks ---------------------------------------------------

def _require_dist() -> Any:
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised here: call this inside a "
                           "function run by dsconform.harness.api.run_ranks")
    return tdist


def rank() -> int:
    """This process's global rank."""
    return _require_dist().get_rank()


def world() -> int:
    """Number of ranks in the job."""
    return _require_dist().get_world_size()


def device() -> torch.device:
    """The device this rank computes on: cuda:<local rank> under nccl, else cpu."""
    import torch

    _require_dist()
    if _accelerator == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int, per_rank: bool = False) -> int:
    """Seed python, numpy (if installed), torch and CUDA; returns the seed used. Identical on all
    ranks unless per_rank=True, which adds the rank so ranks draw different data."""
    import random

    import torch

    if per_rank:
        seed += rank()
    random.seed(seed)
    with contextlib.suppress(ImportError):
        import numpy
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return seed


def gather(obj: Any) -> list:
    """Every rank's `obj`, indexed by rank, returned on every rank (all_gather_object)."""
    tdist = _require_dist()
    gathered: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, obj)
    return gathered


def all_agree(ok: bool, message: str) -> None:
    """Collective assertion: if any rank is not ok, every rank raises with the failing messages
    (a plain `assert` on one rank would leave its peers blocked in their next collective)."""
    verdicts = gather((bool(ok), str(message)))
    if failing := [(index, text) for index, (good, text) in enumerate(verdicts) if not good]:
        lines = "\n".join(f"  rank {index}: {text}" for index, text in failing)
        raise AssertionError(f"{len(failing)} of {len(verdicts)} ranks failed:\n{lines}")


# -- Outcomes: what one rank reports about one call (spawned and external ranks) -------------

def _error_outcome(exc: BaseException, tb: Any = None) -> tuple:
    text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    return ("error", type(exc).__name__, str(exc), text)


def call_outcome(fn: Any, args: tuple, kwargs: dict) -> tuple:
    """Run fn and describe the result as a picklable tuple: ok / skip / error."""
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # SystemExit and pytest outcomes are reported too
        # pytest is never imported here: if fn called pytest.skip, pytest is already loaded.
        outcomes = sys.modules.get("_pytest.outcomes")
        if outcomes is not None and isinstance(exc, outcomes.Skipped):
            return ("skip", str(exc.msg) if getattr(exc, "msg", None) is not None else str(exc))
        # From fn's frame on: this frame is the harness's, in every rank's traceback.
        return _error_outcome(exc, exc.__traceback__ and exc.__traceback__.tb_next)
    return ("ok", value)


def picklable_outcome(outcome: tuple) -> tuple:
    """The outcome itself, or an error saying the return value cannot travel to the parent."""
    try:
        pickle.dumps(outcome)
    except Exception as exc:  # any pickling failure means the same thing here
        return ("error", type(exc).__name__,
                f"the value returned by fn cannot be pickled ({exc}); return plain data", "")
    return outcome


# -- The spawned rank -------------------------------------------------------------------------

def _exit_when_orphaned(parent_pid: int) -> None:
    """If the pytest process is SIGKILLed its atexit cleanup never runs: the ranks must leave
    by themselves instead of holding GPUs and ports forever. parent_pid: the process that
    started this one (a forked rank's is the fork server, which exits with pytest)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0:  # 1: PR_SET_PDEATHSIG
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os._exit(70)
            # The kernel kills us, so no watcher thread clutters the stack dumps. The signal
            # follows the parent *thread*: a pool started from a thread that then ends dies
            # with it, and the next call sees a dead pool and respawns.
            return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(70)

    threading.Thread(target=watch, daemon=True, name="dsconform-orphan-watch").start()


def _reply(conn: Connection, obj: Any) -> None:
    """Send obj to the parent as plain pickle bytes: Connection.send would send each CPU tensor
    as a shared-memory file descriptor, and a batch's results ran out of them (docs/findings.md)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _flush() -> None:
    """Flush Python's streams, then C stdio: printf and std::cout (NCCL_DEBUG, DeepSpeed's C++
    ops) are fully buffered into the rank's output file, and os._exit would drop what they hold."""
    for stream in (sys.stdout, sys.stderr):
        # A closed stream: nothing to keep, and it must not block the exit.
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        ctypes.CDLL(None).fflush(None)


def _flush_and_exit(code: int) -> None:
    _flush()
    # os._exit: interpreter teardown can block in gloo/NCCL destructors waiting on dead peers.
    os._exit(code)


def _take_environment(env: dict) -> None:
    """The rank's whole environment is env (the parent's, with the rank's own variables): a
    forked rank inherits the fork server's instead. What Python and torch read at start-up
    from it is set again: where compiled Python is kept, and the CPU threads
    (OMP_NUM_THREADS), which a forked rank's torch read in the server."""
    os.environ.clear()
    os.environ.update(env)
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.pycache_prefix = env.get("PYTHONPYCACHEPREFIX") or None
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _restore(environ: dict, cwd: str, default_dtype: Any, grad_enabled: bool) -> None:
    import torch

    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    torch.set_default_dtype(default_dtype)
    torch.set_grad_enabled(grad_enabled)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


#: What the first deepspeed.initialize of a process imports lazily (torch._dynamo, inductor;
#: docs/performance.md#rank-start-up); a module a release does not have is left out.
LAZY_IMPORTS = ("torch._dynamo", "torch._inductor.compile_fx", "deepspeed.runtime.engine",
                "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
                "deepspeed.runtime.zero.muon.muon_optimizer")


def prime() -> None:
    """Import LAZY_IMPORTS and run one matmul (cuBLAS' handle), building no engine and keeping
    no tensor: a fresh-process rank's first engine then pays for none of it, and the rank stays
    as fresh as a new process (docs/performance.md#rank-start-up)."""
    import torch

    for name in LAZY_IMPORTS:
        with contextlib.suppress(ImportError):  # not in this release
            importlib.import_module(name)
    a = torch.ones(16, 16, device=device())
    (a @ a).sum().item()
    del a


def warm_up() -> None:
    """Build, step and destroy a tiny ZeRO-2 engine, so that the first engine a test builds in
    this process does not pay for what DeepSpeed and torch set up lazily on first use (most of
    a first ZeRO call; docs/performance.md#rank-start-up). Standby ranks do it while nobody
    waits for them (dsconform.harness.api)."""
    import logging

    import deepspeed
    import torch
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        dev = device()
        model = torch.nn.Linear(4, 4).to(dev)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                  "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        engine.backward(engine(torch.ones(1, 4, device=dev)).sum())
        engine.step()
        engine.destroy()
        del engine, model
    finally:
        logger.setLevel(level)
        gc.collect()


def _start_facts(parent_pid: int | None) -> dict[str, float]:
    """The start-up line's steps this rank saw (time.time(); dsconform.harness.timeline): when
    it was ready and, forked, when its fork server started and ended its imports."""
    facts = {"first rank ready": time.time()}
    server = sys.modules.get("dsconform.harness.preload")
    if parent_pid is None and server is not None:
        from dsconform.harness.timeline import process_started_at
        if (started := process_started_at(os.getppid())) is not None:
            facts["fork server started"] = started
        facts["fork server imported torch"] = getattr(server, "READY_AT", facts["first rank ready"])
    return facts


def rank_main(rank_index: int, world_size: int, env: dict, conn: Connection, stack_path: str,
              accelerator: str, pg_timeout_s: float, parent_pid: int | None, output_path: str,
              warm: bool = False, primed: bool = False) -> None:
    """Entry point of a spawned rank: initialise once (warm: and warm_up(); primed: and prime(),
    for ranks that must stay fresh), then run tasks until told to stop. output_path: the file
    its stdout and stderr go to."""
    global _accelerator, _warmed_up
    # Own process group: the parent kills the rank together with anything it started
    # (compiler jobs of a JIT build, DataLoader workers).
    # parent_pid None: forked by the fork server (harness.zygote), which exits with pytest.
    watched = os.getppid() if parent_pid is None else parent_pid
    os.setpgrp()
    # fds 1 and 2, and so Python's streams, go to the rank's own file (O_APPEND), never to the
    # console: the parent logs each call's part with its test (dsconform.harness.output).
    # Native writers (NCCL, c10d, TORCH_CPP_LOG, a JIT build's compiler) write to the fds.
    _flush()
    fd = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _take_environment(env)
    with contextlib.suppress(Exception):  # a replaced stdout may not support it
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    stack_file = open(stack_path, "w")  # must stay open for the signal handler
    # Fatal signals (segfault) and the parent's timeout signal both write every thread's stack.
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack_file, all_threads=True, chain=False)
    _exit_when_orphaned(watched)

    # When each start-up phase ended (time.time(): the parent's spawn time is on the same
    # clock); the "ready" reply carries them (dsconform.harness.pool.Pool.start_up).
    marks = [("spawn", float(env.get(SPAWNED_AT_ENV) or time.time())), ("python", time.time())]
    try:
        import torch
        marks.append(("import torch", time.time()))
        import deepspeed  # once per rank process: pooled calls do not repay it
        from deepspeed.accelerator import get_accelerator

        chosen = get_accelerator().device_name()
        from dsconform.base import cpu_info
        cpu_info.install()  # DeepSpeed's CPU queries answered once (forked: by the server)
        marks.append(("import deepspeed", time.time()))
        if chosen != accelerator:
            raise RuntimeError(
                f"deepspeed picked accelerator {chosen!r} in this rank, not {accelerator!r}: it "
                "was imported before DS_ACCELERATOR was set, most likely by the __main__ module "
                "that spawn re-imports; import deepspeed inside functions or under "
                "`if __name__ == '__main__':` there")
        if accelerator == "cuda":
            torch.cuda.set_device(rank_index)
            torch.cuda.init()
            marks.append(("CUDA", time.time()))
        deepspeed.init_distributed(dist_backend="nccl" if accelerator == "cuda" else "gloo",
                                   timeout=timedelta(seconds=pg_timeout_s), verbose=False)
        marks.append(("init_distributed", time.time()))
        _accelerator = accelerator
        if warm:
            warm_up()
            _warmed_up = True
            marks.append(("warm-up", time.time()))
        elif primed:
            prime()
            marks.append(("prime", time.time()))
        # torch and deepspeed leave ~200k long-lived objects; freezing them keeps the full
        # gc.collect() after each call at milliseconds instead of ~0.1 s.
        gc.collect()
        gc.freeze()
        _flush()  # the parent reads the start-up's output next
        phases = {name: round(t - marks[i - 1][1], 3) for i, (name, t) in enumerate(marks) if i}
        _reply(conn, ("ready", os.getpid(), phases, _start_facts(parent_pid)))
    except BaseException as exc:  # the parent must hear why startup failed
        try:
            _reply(conn, _error_outcome(exc))
        finally:
            _flush_and_exit(1)

    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            _flush_and_exit(0)
        if not payload:  # the parent's stop message
            _flush_and_exit(0)
        environ, cwd = dict(os.environ), os.getcwd()
        default_dtype, grad_enabled = torch.get_default_dtype(), torch.is_grad_enabled()
        parent_path, (env_changed, env_removed), call = pickle.loads(payload)
        # Modules collected after this rank started (new sys.path entries) must import too.
        sys.path[:] = list(parent_path) + [p for p in sys.path if p not in parent_path]
        for name in env_removed:
            os.environ.pop(name, None)
        os.environ.update(env_changed)
        try:
            try:
                fn, args, kwargs = pickle.loads(call)
            except ImportError:
                importlib.invalidate_caches()  # a module file written after the rank started
                fn, args, kwargs = pickle.loads(call)
        except BaseException as exc:  # e.g. fn's module does not import here
            outcome = _error_outcome(exc)
        else:
            outcome = call_outcome(fn, args, kwargs)
            del fn, args, kwargs
        _flush()  # the parent reads this call's output next
        try:
            _reply(conn, outcome)
        except Exception:  # e.g. an unpicklable return value
            _reply(conn, picklable_outcome(outcome))
        del outcome
        # After the reply, so back-to-back calls overlap this with the parent's bookkeeping.
        _restore(environ, cwd, default_dtype, grad_enabled)
