"""The upgrade radar: ``dsconform radar VERSION...`` runs the suite under many DeepSpeed releases
and puts the runs side by side.

For each release, in version order:

1. **a virtualenv** under ``--venvs`` (``deepspeed-VERSION``, reused when present): created
   with ``--system-site-packages``, so this machine's torch and this dsconform (an editable
   install) are seen, with ``deepspeed==VERSION`` installed into it (a PyPI sdist builds as a
   pure-Python wheel, ``DS_BUILD_OPS=0``, against the machine's torch: ``--no-build-isolation``),
   and ``--torch SPEC`` installed there too when given (``deepspeed-VERSION-torch-SPEC``). A
   venv is ready once its marker file names the DeepSpeed it holds;
2. **a warm-up** on CPU machines: DeepSpeed's CPU accelerator JIT-builds its shm comm op inside
   ``init_distributed``, and the DeepNVMe suite loads async_io; both are built once per venv
   into the suite's op cache, before any rank waits for them;
3. **the tier**, into ``--out/ds-VERSION`` (the run's --results folder, its pytest log beside
   it): ``-m "not gpu and not slow"`` on a CPU machine, ``-m gpu`` where a GPU is present,
   ``--tier radar`` for the radar's own selection (``radar_selection``), or ``--pytest-args``.

``--from-results VERSION=DIR`` takes a finished run's folder for a release instead (a node with
no package index), ``--venv VERSION=PATH`` an environment already holding that release. The
timeline, the changes by release and the verdict are the results layer's
(``dsconform.results.render.timeline.report``, handed in by the CLI).

Exit codes as ``dsconform compare``: 0 no regression from the first release to the last, 1 a
regression, 2 unusable input (a release that did not install or whose run recorded nothing;
the timeline of the others is still written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

READY = ".dsconform-radar-ready"  # in a venv: the DeepSpeed version it holds
WARM = ".dsconform-radar-warm"  # in a venv: its CPU comm op is built
CPU_TIER = ("-m", "not gpu and not slow")
GPU_TIER = ("-m", "gpu")
#: Left out of the radar tier: property-based tests whose budget, not DeepSpeed, sets their
#: cost (the scaler state machine: 143 s of a 10-minute CPU tier on the CPU machine; the
#: DeepNVMe size and getter properties start a rank per example, and an older release's handle
#: that hangs is started again for every example hypothesis shrinks). The deterministic checks
#: of the same things stay (LOSS-SCALE-1's _on_sequence cells, NVME-IO-1 and NVME-IO-3).
#: And the ops suite's check of the profile's promised ops: DeepNVMe's and the ZeRO suite's
#: cells load them already, and on 0.17.6 its 64 MiB async_io round trip hangs in
#: aio_handle.wait() (DeepSpeed #7727, fixed in 0.18.4; #8196 in 0.19.4) until its 900 s
#: timeout: a hang is no strict xfail (docs/known-issues.md). The ops capability keeps its
#: two ds_report tests.
RADAR_LEAVES_OUT = ("test_scaler_follows_model", "test_aio_offsets_and_sizes",
                    "test_aio_handle_getters", "test_promised_op")
#: Cells whose parameters name an op that compiles on first use in each release (cpu_adam's
#: -O3 AVX-512 build: minutes; fused_adam, which the CPU accelerator JIT-builds too: about 100 s
#: on the 2-core CPU machine): the radar tier takes their test's other cells.
RADAR_SLOW_OPS = ("cpu_adam", "cpu_adam_l2", "fused_adam")
#: The axis the radar tier covers in full: the ZeRO stage, where releases differ the most (each
#: stage has its own optimizer wrapper and partitioning code); other axes get one cell.
RADAR_AXIS = re.compile(r"^z?[0-3]$")
INSTALL_TIMEOUT_S = 1800
WARM_UP = r"""
import sys
from dsconform.ops.cache import ensure_extensions_dir
print(ensure_extensions_dir())
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
if acc.device_name() == "cpu":
    for name in ("ShareMemCommBuilder", "AsyncIOBuilder"):
        builder = acc.create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load()
            print(name, "built")
"""


class RadarError(RuntimeError):
    """One line that says what could not be done and how to fix it."""


@dataclass
class Release:
    version: str
    results: Path | None = None  # a finished run (--from-results)
    python: Path | None = None  # an environment holding this release (--venv, or installed)
    note: str = ""  # why this release is missing from the timeline


def parse_version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise RadarError(f"{text!r} is not a DeepSpeed version such as 0.19.8") from None


def _pairs(items: Iterable[str], option: str) -> dict[str, Path]:
    out = {}
    for item in items:
        version, sep, path = item.partition("=")
        if not sep or not path:
            raise RadarError(f"{option} {item!r}: expected VERSION=PATH, e.g. 0.19.6=DIR")
        parse_version(version)
        out[version] = Path(path)
    return out


def releases(versions: Sequence[str], from_results: Sequence[str] = (),
             venvs: Sequence[str] = ()) -> list[Release]:
    """Every release asked for, in version order, each with where its run comes from."""
    made, envs = _pairs(from_results, "--from-results"), _pairs(venvs, "--venv")
    both = sorted(set(made) & set(envs))
    if both:
        raise RadarError(f"{', '.join(both)}: given both --from-results and --venv")
    for v in versions:
        parse_version(v)
    every = sorted(set(versions) | set(made) | set(envs), key=parse_version)
    if len(every) < 2:
        raise RadarError(f"a radar needs at least two releases, got {every or 'none'}")
    out = []
    for v in every:
        python = envs.get(v)
        if python is not None and python.is_dir():
            python = python / "bin" / "python"
        out.append(Release(v, made.get(v), python))
    return out


def venv_dir(cache: Path, version: str, torch_spec: str | None) -> Path:
    name = f"deepspeed-{version}"
    if torch_spec:
        name += "-torch-" + re.sub(r"[^A-Za-z0-9.]+", "_", torch_spec).strip("_")
    return cache / name


def _run(cmd: Sequence[str], log: Path, *, timeout_s: float, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> int:
    """Run ``cmd`` with its output appended to ``log``; kill its process group at the timeout
    (exit 124)."""
    with open(log, "a") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[dsconform radar: killed after {timeout_s:g} s]\n")
            return 124


def installed_deepspeed(python: Path) -> str | None:
    """The DeepSpeed version ``python`` imports (from its metadata: no import of torch)."""
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('deepspeed'))"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def sees_the_suite(python: Path) -> bool:
    """``python`` finds dsconform and its pytest entry point (the options --results needs)."""
    code = ("import importlib.metadata as m, dsconform; "
            "print(any(e.value.startswith('dsconform') "
            "for e in m.entry_points(group='pytest11')))")
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "True"


def ensure_venv(cache: Path, version: str, torch_spec: str | None,
                say: Callable[[str], None]) -> Path:
    """The venv of ``version`` (its python), created and installed unless its marker says it
    is ready. RadarError when the install fails, naming its log."""
    where = venv_dir(cache, version, torch_spec)
    python = where / "bin" / "python"
    marker = where / READY
    if marker.is_file() and marker.read_text().strip() == version and python.exists():
        say(f"venv {where} (cached)")
        return python
    cache.mkdir(parents=True, exist_ok=True)
    log = where.with_name(where.name + ".install.log")
    log.write_text("")
    say(f"installing deepspeed=={version}" + (f" with torch {torch_spec}" if torch_spec else "")
        + f" into {where} (log {log})")
    started = time.monotonic()
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    steps = [[sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(where)],
             # the sdist builds with the venv's setuptools: bdist_wheel needs `wheel` there
             [str(python), "-m", "pip", "install", "wheel"]]
    if torch_spec:
        steps.append([str(python), "-m", "pip", "install", f"torch{_spec(torch_spec)}"])
    steps.append([str(python), "-m", "pip", "install", "--no-build-isolation",
                  f"deepspeed=={version}"])
    for cmd in steps:
        rc = _run(cmd, log, timeout_s=INSTALL_TIMEOUT_S, env=env)
        if rc != 0:
            raise RadarError(f"deepspeed=={version}: `{shlex.join(cmd[-3:])}` exited {rc} "
                             f"(see {log}): {_tail(log)}")
    found = installed_deepspeed(python)
    if found != version:
        raise RadarError(f"{where} imports deepspeed {found}, not {version} (see {log})")
    marker.write_text(version + "\n")
    say(f"installed in {time.monotonic() - started:.0f} s")
    return python


def _spec(torch_spec: str) -> str:
    """``2.11.0`` -> ``==2.11.0``; a specifier (``>=2.11,<2.12``) as given."""
    return torch_spec if re.match(r"^[<>=!~]", torch_spec) else f"=={torch_spec}"


def _tail(log: Path, lines: int = 1) -> str:
    text = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(text[-lines:])[-300:] if text else "no output"


def has_gpu() -> bool:
    """An NVIDIA GPU is present (the driver's own listing; no torch import)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def warm_up(python: Path, log: Path, say: Callable[[str], None], env: dict[str, str]) -> None:
    """Build the CPU accelerator's shm comm op and async_io once per venv, into the suite's op
    cache."""
    marker = python.parent.parent / WARM
    if marker.is_file() or has_gpu():
        return
    say("building DeepSpeed's CPU comm and async_io ops (once per venv)")
    rc = _run([str(python), "-c", WARM_UP], log, timeout_s=INSTALL_TIMEOUT_S, env=env)
    if rc == 0:
        marker.write_text("ok\n")
    else:  # the suite's rank start-up reports it, with its diagnosis
        say(f"warning: the ops did not build (exit {rc}, see {log})")


# ------------------------------------------------------------------ the radar tier

def radar_selection(nodeids: Sequence[str]) -> list[str]:
    """The radar tier from a CPU tier's node ids: for each test, the fewest cells that carry
    every ZeRO stage its cells have (``RADAR_AXIS``: the parts ``z0``..``z3``, or ``0``..``3``,
    of the case ids), else one cell; one-rank cells (``ws1``) first, then in collection order;
    no cell that builds an op of ``RADAR_SLOW_OPS``; none of ``RADAR_LEAVES_OUT``. A test
    without parameters is kept."""
    tests: dict[str, list[str]] = {}
    for nodeid in nodeids:
        test, _, case = nodeid.partition("[")
        if test.rsplit("::", 1)[-1] in RADAR_LEAVES_OUT:
            continue
        tests.setdefault(test, []).append(case[:-1] if case else "")
    chosen = []
    for test, cases in tests.items():
        if cases == [""]:
            chosen.append(test)
            continue
        cases = [c for c in cases if not set(c.split("-")) & set(RADAR_SLOW_OPS)]
        if not cases:
            continue
        need = {part for c in cases for part in c.split("-") if RADAR_AXIS.match(part)}
        picked = [_cheapest(cases, need)]
        need -= set(picked[0].split("-"))
        while need:
            picked.append(_cheapest(cases, need))
            need -= set(picked[-1].split("-"))
        chosen += [f"{test}[{c}]" for c in sorted(picked, key=cases.index)]
    return chosen


def _cheapest(cases: list[str], need: set[str]) -> str:
    """The case that carries the most values still needed, one-rank first, then the first."""
    return max(cases, key=lambda c: (len(need & set(c.split("-"))), "ws1" in c.split("-"),
                                     -cases.index(c)))


def collect(python: Path, suites: Path, tier: Sequence[str], log: Path,
            env: dict[str, str]) -> list[str]:
    """The node ids ``tier`` selects, collected by ``python``."""
    cmd = [str(python), "-m", "pytest", str(suites), *tier, "--collect-only", "-q",
           "-p", "no:cacheprovider"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=suites.parent,
                         timeout=INSTALL_TIMEOUT_S)
    log.write_text(out.stdout + out.stderr)
    ids = [ln.strip() for ln in out.stdout.splitlines() if "::" in ln and " " not in ln.strip()]
    if not ids:
        raise RadarError(f"collecting the tier ({shlex.join(tier)}) found no test (see {log})")
    return ids


def tier_args(tier: str, pytest_args: str | None) -> tuple[list[str], str]:
    """(pytest arguments, what they are in words)."""
    extra = shlex.split(pytest_args or "")
    if tier == "auto":
        tier = "gpu" if has_gpu() else "cpu"
    if tier == "cpu":
        return [*CPU_TIER, *extra], "the CPU tier (-m \"not gpu and not slow\")"
    if tier == "gpu":
        return [*GPU_TIER, *extra], "the GPU tier (-m gpu)"
    if tier == "radar":
        return [*CPU_TIER, *extra], "the radar tier (docs/radar.md)"
    if tier == "args":
        if not extra:
            raise RadarError("--tier args needs --pytest-args")
        return extra, f"pytest {shlex.join(extra)}"
    raise RadarError(f"--tier {tier!r}: one of auto, cpu, gpu, radar, args")


def outcome_counts(results: Path) -> str:
    """"120 passed, 3 failed, ..." from a run's benchmarks.json (or records.jsonl)."""
    counts: dict[str, int] = {}
    try:
        doc = json.loads((results / "benchmarks.json").read_text())
        outcomes = [o["outcome"] for o in doc["dsconform"]["outcomes"]]
    except (OSError, ValueError, KeyError, TypeError):
        outcomes = []
        for line in _lines(results / "records.jsonl"):
            try:
                outcomes.append(json.loads(line)["outcome"]["outcome"])
            except (ValueError, KeyError, TypeError):
                continue
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return ", ".join(f"{n} {o}" for o, n in sorted(counts.items(), key=lambda kv: -kv[1])) \
        or "no outcome recorded"


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def suites_dir(given: str | None) -> Path:
    if given:
        path = Path(given)
    else:
        here = Path.cwd() / "suites"
        path = here if here.is_dir() else Path(__file__).resolve().parents[2] / "suites"
    if not (path / "test_zero.py").is_file():
        raise RadarError(f"{path}: not the suite's suites/ folder (give --suites DIR)")
    return path.resolve()


# ------------------------------------------------------------------ the run

def run_release(release: Release, *, index: int, total: int, args: argparse.Namespace,
                suites: Path, tier: Sequence[str], selection: Sequence[str],
                env: dict[str, str]) -> Path | None:
    """Install (unless given), warm up and run one release; its results folder, or None with
    ``release.note`` saying why there is none."""
    tag = f"[{index}/{total}] {release.version}"

    def say(text: str) -> None:
        print(f"{tag}: {text}", flush=True)

    if release.results is not None:
        say(f"results from {release.results}")
        return release.results
    out = Path(args.out) / f"ds-{release.version}"
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pytest.log"
    log.write_text("")
    try:
        python = release.python or ensure_venv(Path(args.venvs), release.version, args.torch,
                                               say)
        found = installed_deepspeed(python)
        if found != release.version:
            raise RadarError(f"{python} imports deepspeed {found}, not {release.version}")
        if not sees_the_suite(python):
            raise RadarError(f"{python} cannot import dsconform: the venvs see the suite "
                             "through the system site-packages (pip install -e . with the "
                             "interpreter that created them), or give --venv VERSION=PATH of "
                             "an environment that has both")
    except RadarError as e:
        release.note = str(e)
        say(f"NOT RUN: {e}")
        return None
    warm_up(python, log, say, env)
    # The selection's node ids name their files (suites/...): the folder itself would add the
    # whole tier back.
    cmd = [str(python), "-m", "pytest", *(selection or [str(suites)]), "-p", "no:cacheprovider",
           "--results", str(out.resolve()), *tier]
    shown = shlex.join([*tier]) + (f" + {len(selection)} selected tests" if selection else "")
    say(f"running pytest {shown} (log {log})")
    started = time.monotonic()
    rc = _run(cmd, log, timeout_s=args.timeout_s, env=env, cwd=suites.parent)
    took = time.monotonic() - started
    counts = outcome_counts(out)
    say(f"done in {took:.0f} s: {counts} (pytest exit {rc})")
    if not (out / "benchmarks.json").is_file():
        release.note = (f"its run wrote no benchmarks.json (pytest exit {rc}"
                        + (", killed at --timeout-s" if rc == 124 else "") + f"; see {log})")
        return None
    return out


def finished_runs_words(every: Sequence[Release]) -> str:
    """What runs given by --from-results were, in words, from their summary.json: the node
    (its GPUs, or no GPU) and the profile, each distinct one named."""
    seen: list[str] = []
    for r in every:
        try:
            summary = json.loads((Path(r.results) / "summary.json").read_text())
        except (OSError, ValueError, TypeError):
            continue
        gpus = [g.get("name", "?") for g in (summary.get("node") or {}).get("gpus") or []]
        where = (f"{len(gpus)}x {', '.join(sorted(set(gpus)))}" if gpus else "no GPU")
        text = f"{where}, profile {(summary.get('profile') or {}).get('name', '?')}"
        if text not in seen:
            seen.append(text)
    return ("the finished runs given with --from-results"
            + (f" ({'; '.join(seen)})" if seen else ""))


def main(args: argparse.Namespace, report: Callable[..., int]) -> int:
    """``dsconform radar``: every release's run, then ``report`` (the timeline and verdict)."""
    try:
        every = releases(args.versions, args.from_results, args.venv)
        tier, words = tier_args(args.tier, args.pytest_args)
        need_runs = any(r.results is None for r in every)
        if not need_runs:  # nothing runs here: the tier is whatever those runs were
            words = finished_runs_words(every)
        suites = suites_dir(args.suites) if need_runs else Path(".")
    except RadarError as e:
        print(f"dsconform radar: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The property tests' ci budget (derandomized, few examples): the same examples in every
    # release, so a change on the timeline is DeepSpeed's, not a new example's.
    env = {"HYPOTHESIS_PROFILE": "ci", **os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    print(f"dsconform radar: {len(every)} releases ({', '.join(r.version for r in every)}), "
          f"{words}, into {out}", flush=True)
    selection: list[str] = []
    if args.tier == "radar" and need_runs:
        first = next(r for r in reversed(every) if r.results is None)
        try:
            python = first.python or ensure_venv(Path(args.venvs), first.version, args.torch,
                                                 lambda t: print(f"tier: {t}", flush=True))
            ids = collect(python, suites, tier, out / "collect.log", env)
        except RadarError as e:
            print(f"dsconform radar: {e}", file=sys.stderr)
            return 2
        selection = radar_selection(ids)
        (out / "radar-tier.txt").write_text("\n".join(selection) + "\n")
        print(f"radar tier: {len(selection)} of the CPU tier's {len(ids)} tests "
              f"({out / 'radar-tier.txt'})", flush=True)
    columns, missing = [], []
    for i, release in enumerate(every, start=1):
        folder = run_release(release, index=i, total=len(every), args=args, suites=suites,
                             tier=tier, selection=selection, env=env)
        if folder is None:
            missing.append(f"DeepSpeed {release.version} is not on the timeline: {release.note}")
        else:
            columns.append((release.version, str(folder)))
    for line in missing:
        print(f"dsconform radar: {line}", file=sys.stderr)
    if len(columns) < 2:
        print(f"dsconform radar: {len(columns)} release(s) ran: no timeline", file=sys.stderr)
        return 2
    notes = [f"Tier: {words}" + (f", {len(selection)} tests (radar-tier.txt)"
                                 if selection else "") + "."] + missing
    status = report(columns, out, plot=not args.no_plot, threshold=args.threshold,
                    notes=notes)
    return 2 if missing and status != 2 else status


def add_cli(sub: Any, report: Callable[..., int]) -> None:
    """``dsconform radar``'s arguments (sub: the CLI's subparsers; report: the results layer's
    timeline step, dsconform.results.render.timeline.report)."""
    r = sub.add_parser("radar", help="run the suite under several DeepSpeed releases and show "
                                     "when each behaviour changed: exit 0 no regression from "
                                     "the first to the last, 1 regression, 2 unusable input")
    r.add_argument("versions", nargs="*", metavar="VERSION",
                   help="a DeepSpeed release to install into its own venv and run (e.g. 0.18.9)")
    r.add_argument("--from-results", action="append", default=[], metavar="VERSION=DIR",
                   help="a finished run's --results folder for that release (repeatable)")
    r.add_argument("--venv", action="append", default=[], metavar="VERSION=PATH",
                   help="an environment (venv folder or python) already holding that release "
                        "(repeatable)")
    r.add_argument("--venvs", default=str(Path.home() / ".cache" / "dsconform" / "radar-venvs"),
                   metavar="DIR", help="where the releases' venvs are cached (default "
                                       "~/.cache/dsconform/radar-venvs)")
    r.add_argument("--torch", metavar="SPEC",
                   help="install this torch into each venv (2.11.0 or a specifier) instead of "
                        "using the machine's")
    r.add_argument("--tier", default="auto", choices=("auto", "cpu", "gpu", "radar", "args"),
                   help="auto (default): the CPU tier on a CPU machine, -m gpu where a GPU is; "
                        "radar: the CPU tier's cheapest cells (docs/radar.md); args: only "
                        "--pytest-args")
    r.add_argument("--pytest-args", metavar="ARGS",
                   help="more pytest arguments for every run, one string ('-k zero -x')")
    r.add_argument("--suites", metavar="DIR", help="the suite's suites/ folder (default: "
                                                   "./suites, else the checkout's)")
    r.add_argument("--out", default="dsconform-radar", metavar="DIR",
                   help="where each release's results (ds-VERSION/) and timeline.md, .json, "
                        ".png go (default ./dsconform-radar)")
    r.add_argument("--timeout-s", type=float, default=3600.0, metavar="S",
                   help="the most one release's pytest run may take (default 3600)")
    r.add_argument("--threshold", type=float, default=0.10,
                   help="as dsconform compare's, for the verdict (default 0.10)")
    r.add_argument("--no-plot", action="store_true", help="do not draw timeline.png")
    r.set_defaults(func=lambda a: main(a, report))
