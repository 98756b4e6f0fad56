"""``dsconform build-ops``: build the ops a run needs into the extensions cache it loads from
(dsconform.ops.cache), the way a run does (dsconform.ops.prebuild), ahead of it: for a node image
or a cache that nodes share (docs/performance.md#building-ahead-dsconform-build-ops). Exit 0:
every op built and loaded; 1: a build failed (its diagnosis printed); 2: bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dsconform.base.fdcapture import FdCapture


def _accelerator_and_ops() -> tuple[str, list[str]]:
    """DeepSpeed's accelerator here and its ops (importing DeepSpeed prints; kept off the
    console)."""
    with FdCapture(warnings_too=True).capture():
        from deepspeed.accelerator import get_accelerator

        from dsconform.ops.load import op_builders
        return get_accelerator()._name, list(op_builders())


def default_ops(profile_ops: list[str], accel: str) -> list[str]:
    """What a run of the suites builds here: the profile's promised ops, then those of
    RUN_OPS[accel] that DeepSpeed calls compatible here (the suites' gates run their tests
    there, and the run builds them at its start)."""
    from dsconform.gate.requires import op_compatible
    from dsconform.ops.prebuild import RUN_OPS

    ops = list(profile_ops)
    with FdCapture(warnings_too=True).capture():  # the probes print
        return ops + [op for op in RUN_OPS.get(accel, ()) if op not in ops and op_compatible(op)]


def _say(text: str) -> None:
    print(f"dsconform build-ops: {text}", flush=True)


class _Progress:
    """Prints each build's start and end as the builds report them (from their thread), and
    every PROGRESS_S the builds still running with their seconds so far."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def tick(self, progress: Any) -> None:
        with self.lock:
            if progress.building:
                _say("; ".join(f"{op}: building, {secs:.0f} s so far"
                               for op, secs in progress.building))

    def __call__(self, op: str, what: str, info: dict[str, Any]) -> None:
        with self.lock:
            if what == "start":  # a cached op only loads
                beside = (f", nice {info['nice']}, beside {', '.join(info['beside'])}"
                          if info.get("beside") else "")
                _say(f"{op}: cached, loading it" if info.get("cached")
                     else f"{op}: building (MAX_JOBS={info['jobs']}{beside})")
            elif info.get("loaded"):  # else another build built it meanwhile (CPU's shm_comm)
                how = ("built" if info.get("built_now") else "cached, loaded" if info.get("cached")
                       else "found built by then, loaded")
                _say(f"{op}: {how} in {info.get('wall_seconds', 0.0):.1f} s")
            else:
                failure = str(info.get("failure") or "no reason given").replace("\n", "\n    ")
                _say(f"{op}: FAILED after {info.get('wall_seconds', 0.0):.1f} s:\n    {failure}")


#: The most build-ops waits for its rank warm-up once the builds are done.
WARM_UP_WAIT_S = 120.0


def _warm_up_rank(accel: str, said: list[str]) -> None:
    """Start one rank as a run does (import torch and DeepSpeed, init_distributed, a first tiny
    engine) and stop it, so its imports are in the bytecode cache (docs/performance.md, "Building
    ahead"). Runs beside the builds, needs no op; a failure only leaves that
    cache colder. It says its lines to ``said``."""
    from dsconform.harness import output
    from dsconform.harness.pool import POOL_PG_TIMEOUT_S, Pool, gpus_for

    t0 = time.monotonic()
    sink = output.configure(None)  # DeepSpeed's start-up lines: only an error quotes them
    try:
        with contextlib.closing(Pool(1, accel, gpus_for(1, accel), POOL_PG_TIMEOUT_S,
                                     warm=True, label="(build-ops warm-up)")) as pool:
            pool.start_up()
    except Exception as exc:
        said.append(f"rank warm-up failed ({str(exc).splitlines()[0]}); runs compile its "
                    "imports themselves")
        return
    finally:
        output.release(sink)
    said.append(f"rank warm-up: {time.monotonic() - t0:.1f} s (its imports are in the bytecode "
                "cache)")


#: What a run's pytest process imports beside torch and DeepSpeed (their compiled files come
#: from the builds and the rank warm-up): pytest, its plugins, hypothesis and this package.
RUN_PACKAGES = ("_pytest", "pytest", "pluggy", "hypothesis", "dsconform")


def _compile_run_packages(said: list[str]) -> None:
    """Compile the Python of RUN_PACKAGES and of the installed pytest plugins (entry points
    ``pytest11``) into the bytecode cache: a first run after build-ops otherwise compiles them
    as it starts and collects (docs/performance.md#building-ahead-dsconform-build-ops)."""
    import compileall
    import importlib.metadata
    import importlib.util

    t0 = time.monotonic()
    names = [*RUN_PACKAGES, *(ep.value.split(":")[0].split(".")[0]
                              for ep in importlib.metadata.entry_points(group="pytest11"))]
    dirs, ok = 0, True
    for name in dict.fromkeys(names):
        try:
            origin = Path(importlib.util.find_spec(name).origin)
        except (ImportError, ValueError, AttributeError, TypeError):  # not found, no file
            continue
        dirs += 1
        if origin.name == "__init__.py":
            ok &= bool(compileall.compile_dir(origin.parent, quiet=2))
        elif origin.suffix == ".py":
            ok &= bool(compileall.compile_file(origin, quiet=2))
    said.append(f"run packages compiled: {dirs} in {time.monotonic() - t0:.1f} s"
                + ("" if ok else " (some files did not compile: runs compile them)"))


def cmd_build_ops(args: argparse.Namespace) -> int:
    from dsconform.base.buildlock import StaleBuildLock, clear_stale
    from dsconform.ops.cache import enable_bytecode_cache, ensure_extensions_dir
    from dsconform.ops.prebuild import ParallelBuilds, available_cores

    def bad(msg: str) -> int:
        print(f"dsconform build-ops: {msg}", file=sys.stderr)
        return 2

    if args.jobs is not None and args.jobs < 1:
        return bad(f"--jobs {args.jobs}: must be at least 1")
    ext_dir = ensure_extensions_dir()
    # The build processes' imports fill it for the runs after, and a rank's warm-up (below).
    bytecode = enable_bytecode_cache()
    try:
        for line in clear_stale(ext_dir):
            _say(line)
    except StaleBuildLock as e:
        return bad(str(e))
    accel, builders = _accelerator_and_ops()
    how = ""
    if args.ops:
        unknown = [op for op in args.ops if op not in builders]
        if unknown:
            return bad(f"{', '.join(unknown)}: not an op of DeepSpeed's {accel} accelerator "
                       f"(its ops: {', '.join(sorted(builders))})")
        ops = list(dict.fromkeys(args.ops))
    else:
        from dsconform.profile.schema import ProfileError
        from dsconform.profile.select import select_profile
        try:
            sel = select_profile(args.profile, named=f"--profile {args.profile}")
        except (ProfileError, ValueError) as e:
            problems = getattr(e, "problems", None) or [str(e)]
            return bad("; ".join(problems))
        if sel.profile.gpu_count and accel != "cuda":
            return bad(f"profile {sel.profile.name} is of a GPU node, but DeepSpeed builds for "
                       f"its {accel} accelerator here (no GPU seen): export DS_ACCELERATOR=cuda "
                       "and TORCH_CUDA_ARCH_LIST (e.g. 9.0 for H100/H200) to build for the GPUs")
        ops = default_ops(list(sel.profile.ops), accel)
        how = f", profile {sel.profile.name}"
    cores = args.jobs or available_cores()
    _say(f"{len(ops)} ops ({', '.join(ops) or 'none'}) for DeepSpeed's {accel} accelerator into "
         f"{ext_dir} ({cores} cores{how})")
    if not ops:
        return 0
    progress = _Progress()
    builds = ParallelBuilds.start(ops, cores, on_event=progress, on_progress=progress.tick)
    said: list[str] = []
    warm = None
    if bytecode is not None:  # else pip compiled them at install, or nothing is kept
        def warm_up() -> None:
            _warm_up_rank(accel, said)
            _compile_run_packages(said)
        warm = threading.Thread(target=warm_up, name="dsconform-warm-up", daemon=True)
        warm.start()
    try:
        results = builds.wait_all(timeout_s=args.timeout)
    finally:
        builds.close()
    if warm is not None:
        warm.join(timeout=WARM_UP_WAIT_S)
        for line in said or [f"rank warm-up: not done within {WARM_UP_WAIT_S:.0f} s of the "
                             "builds; runs compile the rest of its imports themselves"]:
            _say(line)
    failed = [op for op, r in results.items() if not (r and r.get("loaded"))]
    if failed:
        _say(f"{len(failed)} of {len(ops)} failed: {', '.join(failed)}")
        return 1
    _say(f"all {len(ops)} built; a run in this environment finds them in {ext_dir}")
    return 0


def add_cli(sub: Any) -> None:
    """Register ``dsconform build-ops`` on the CLI's subparsers."""
    b = sub.add_parser("build-ops", help="build the ops a run needs into the extensions cache "
                                         "(a node image, a shared cache): exit 0 all built, 1 a "
                                         "build failed, 2 bad input")
    b.add_argument("ops", nargs="*", metavar="OP",
                   help="ops to build (DeepSpeed's names: fused_adam, cpu_adam, async_io, ...); "
                        "default: the profile's promised ops and the others the suites load on "
                        "this accelerator")
    b.add_argument("--profile", default="auto", metavar="NAME|PATH",
                   help="whose promised ops to build (default auto: this node's, as a run "
                        "picks it)")
    b.add_argument("--jobs", type=int, metavar="N",
                   help="cores to use (MAX_JOBS of each build; default: all of this machine's)")
    b.add_argument("--timeout", type=float, default=3600, metavar="S",
                   help="seconds each build may take (default 3600)")
    b.set_defaults(func=cmd_build_ops)
