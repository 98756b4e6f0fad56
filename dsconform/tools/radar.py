"""The upgrade radar: ``dsconform radar VERSION...`` runs the suite under many DeepSpeed releases
(or one release under many torch releases) and puts the runs side by side.

Each column is a (DeepSpeed, torch) pair. By default a release runs with the torch of its time
(``tools/periods.py``: the newest torch published before it), because users ran it so and a
period's bugs show only there; ``VERSION@TORCH`` or ``--torch`` choose another, and several
``--torch`` values with one release make a torch axis (which torch release changed what). For
each column, in order:

1. **its environment**: the venv of its torch under ``--venvs``, with the release swapped in
   (``tools/radar_envs.py``);
2. **a warm-up** on CPU machines: DeepSpeed's CPU accelerator JIT-builds its shm comm op inside
   ``init_distributed``, and the DeepNVMe suite loads async_io; both are built once per release
   and torch into the suite's op cache, before any rank waits for them;
3. **the tier**, into ``--out/ds-VERSION`` (``ds-VERSION-torch-T`` on a torch axis; the run's
   --results folder, its pytest log beside it): ``-m "not gpu and not slow"`` on a CPU machine,
   ``-m gpu`` where a GPU is present, ``--tier radar`` for the radar's own selection
   (``radar_selection``), or ``--pytest-args``.

``--from-results VERSION=DIR`` takes a finished run's folder for a release instead (a node with
no package index), ``--venv VERSION=PATH`` an environment already holding that release. The
timeline, the changes by column and the verdict are the results layer's
(``dsconform.results.render.timeline.report``, handed in by the CLI).

Exit codes as ``dsconform compare``: 0 no regression from the first column to the last, 1 a
regression, 2 unusable input (a release that did not install or whose run recorded nothing;
the timeline of the others is still written).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from dsconform.tools.periods import UnknownRelease, period_torch
from dsconform.tools.radar_envs import (
    INSTALL_TIMEOUT_S,
    RadarError,
    ensure_env,
    has_gpu,
    installed_deepspeed,
    run_logged,
    sees_the_suite,
    torch_release,
    warm_up,
)

__all__ = ["RadarError", "Release", "add_cli", "main", "radar_selection", "releases"]

CPU_TIER = ("-m", "not gpu and not slow")
GPU_TIER = ("-m", "gpu")
RADAR_RUN = ("-m", "not gpu", "--nightly")
#: Left out of the radar tier: property-based tests whose budget, not DeepSpeed, sets their
#: cost (the scaler state machine; the DeepNVMe size and getter properties start a rank per
#: example, and an older release's handle that hangs is started again for every example
#: hypothesis shrinks: docs/radar.md#the-radar-tier). The deterministic checks of the same
#: things stay (LOSS-SCALE-1's _on_sequence cells, NVME-IO-1 and NVME-IO-3). And the ops
#: suite's check of the profile's promised ops: a hang in an older release's async_io is no
#: strict xfail (docs/known-issues.md); DeepNVMe's and the ZeRO suite's cells load the ops.
RADAR_LEAVES_OUT = ("test_scaler_follows_model", "test_aio_offsets_and_sizes",
                    "test_aio_handle_getters", "test_promised_op")
#: The ZeRO matrix the radar covers 3-way: every combination of three of its axes' values that
#: the nightly matrix has, on two ranks (partitioning needs a peer).
THREE_WAY_TEST = "test_zero_matches_ddp"
#: The positions of stage, offload, dtype, optimizer and GAS in that test's case ids
#: (``cpu-z1-off_none-fp32-adam-gas1-ws2``).
THREE_WAY_AXES = (1, 2, 3, 4, 5)
THREE_WAY_RANKS = "ws2"


@dataclass
class Release:
    """One column: a DeepSpeed release and the torch it runs with."""
    version: str
    torch: str | None = None  # installed for the run (None: the run's own, --from-results/--venv)
    results: Path | None = None  # a finished run (--from-results)
    python: Path | None = None  # an environment holding this release (--venv, or installed)
    note: str = ""  # why this column is missing from the timeline
    label: str = ""  # the column's name on the timeline

    @property
    def folder(self) -> str:
        return f"ds-{self.version}" + (f"-torch-{self.torch}" if self.label.startswith("torch")
                                       else "")


def parse_version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise RadarError(f"{text!r} is not a DeepSpeed version such as 0.19.8") from None


def _pairs(items: Sequence[str], option: str) -> dict[str, Path]:
    out = {}
    for item in items:
        version, sep, path = item.partition("=")
        if not sep or not path:
            raise RadarError(f"{option} {item!r}: expected VERSION=PATH, e.g. 0.19.6=DIR")
        parse_version(version)
        out[version] = Path(path)
    return out


def _with_torch(item: str, torches: Sequence[str]) -> list[tuple[str, str]]:
    """``0.18.9`` or ``0.18.9@2.11.0`` -> [(release, torch)], the torch of its time by default."""
    version, at, torch = item.partition("@")
    parse_version(version)
    if at:
        return [(version, torch_release(torch))]
    if torches:
        return [(version, torch_release(t)) for t in torches]
    try:
        return [(version, period_torch(version))]
    except UnknownRelease as e:
        raise RadarError(str(e)) from None


def releases(versions: Sequence[str], from_results: Sequence[str] = (),
             venvs: Sequence[str] = (), torches: Sequence[str] = ()) -> list[Release]:
    """Every column asked for, in (DeepSpeed, torch) version order, each with where its run
    comes from and its label: the release, or ``torch T`` on a torch axis (one release, several
    ``--torch``), or ``RELEASE@T`` where one release appears with several torches otherwise."""
    made, envs = _pairs(from_results, "--from-results"), _pairs(venvs, "--venv")
    both = sorted(set(made) & set(envs))
    if both:
        raise RadarError(f"{', '.join(both)}: given both --from-results and --venv")
    if len(torches) > 1 and len({v.partition("@")[0] for v in versions}) != 1:
        raise RadarError("several --torch values make a torch axis: give exactly one DeepSpeed "
                         "release (dsconform radar 0.19.8 --torch 2.13 2.14.1), or pair each "
                         "release with its torch as VERSION@TORCH")
    pairs = sorted({p for v in versions for p in _with_torch(v, torches)},
                   key=lambda p: (parse_version(p[0]), Version(p[1])))
    out = [Release(v, t) for v, t in pairs if v not in made and v not in envs]
    for v in sorted(set(made) | set(envs), key=parse_version):
        python = envs.get(v)
        if python is not None and python.is_dir():
            python = python / "bin" / "python"
        out.append(Release(v, None, made.get(v), python))
    out.sort(key=lambda r: (parse_version(r.version), Version(r.torch or "0")))
    if len(out) < 2:
        raise RadarError(f"a radar needs at least two columns, got "
                         f"{[r.version for r in out] or 'none'}")
    names = [r.version for r in out]
    for r in out:
        if len(set(names)) == 1:
            r.label = f"torch {r.torch}"
        elif names.count(r.version) > 1:
            r.label = f"{r.version}@{r.torch}"
        else:
            r.label = r.version
    return out


# ------------------------------------------------------------------ the radar tier

def radar_selection(tier: Sequence[str], nightly: Sequence[str] = ()) -> list[str]:
    """The radar tier: the CPU tier's node ids ``tier`` (every suite's acceptance covering
    arrays) less ``RADAR_LEAVES_OUT``, and, from ``nightly`` (the nightly tier's full ZeRO
    matrix), the cells of ``THREE_WAY_TEST`` that complete a 3-way covering array of its stage,
    offload, dtype, optimizer and GAS (``three_way``)."""
    chosen = [n for n in tier if n.partition("[")[0].rsplit("::", 1)[-1] not in RADAR_LEAVES_OUT]
    zero = [n for n in nightly if n.partition("[")[0].endswith("::" + THREE_WAY_TEST)]
    have = set(chosen)
    return chosen + [n for n in three_way(zero, [n for n in chosen if n in set(zero)] or
                                          [n for n in chosen if THREE_WAY_TEST in n])
                     if n not in have]


def _axes(nodeid: str) -> tuple[str, ...] | None:
    parts = nodeid.partition("[")[2].rstrip("]").split("-")
    if len(parts) <= max(THREE_WAY_AXES):
        return None
    return tuple(parts[i] for i in THREE_WAY_AXES)


def three_way(cells: Sequence[str], given: Sequence[str] = ()) -> list[str]:
    """Cells of ``cells`` (node ids of one test), picked greedily, so that with ``given`` every
    combination of values of three axes that some cell of ``cells`` has is in a picked or given
    cell; two-rank cells only (``THREE_WAY_RANKS``). In the order of ``cells``."""
    def triples(nodeid: str) -> set[tuple]:
        axes = _axes(nodeid)
        if axes is None:
            return set()
        return {tuple((i, axes[i]) for i in combo)
                for combo in itertools.combinations(range(len(axes)), 3)}

    pool = [c for c in cells if THREE_WAY_RANKS in c.partition("[")[2].split("-")
            or THREE_WAY_RANKS + "]" in c]
    need = set().union(*(triples(c) for c in pool)) if pool else set()
    for c in given:
        need -= triples(c)
    picked: list[str] = []
    while need:
        best = max(pool, key=lambda c: len(need & triples(c)))
        if not need & triples(best):
            break
        picked.append(best)
        need -= triples(best)
    return sorted(picked, key=cells.index)


def collect(python: Path, suites: Path, tier: Sequence[str], log: Path,
            env: dict[str, str]) -> list[str]:
    """The node ids ``tier`` selects, collected by ``python``."""
    cmd = [str(python), "-m", "pytest", str(suites), *tier, "--collect-only", "-q",
           "-p", "no:cacheprovider"]
    checkout = suites.parent if suites.is_dir() else suites.parent.parent
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=checkout,
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
        # its node ids name nightly (`slow`) ZeRO cells, which -m "not gpu and not slow" and the
        # acceptance tier's selection would drop
        return [*RADAR_RUN, *extra], "the radar tier (docs/radar.md)"
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
    tag = f"[{index}/{total}] " + (release.label if release.label.startswith("torch")
                                   else f"{release.version}"
                                   + (f" (torch {release.torch})" if release.torch else ""))

    def say(text: str) -> None:
        print(f"{tag}: {text}", flush=True)

    if release.results is not None:
        say(f"results from {release.results}")
        return release.results
    out = Path(args.out) / release.folder
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pytest.log"
    log.write_text("")
    try:
        python = release.python or ensure_env(Path(args.venvs), release.torch or "",
                                              release.version, suites.parent, say)
        found = installed_deepspeed(python)
        if found != release.version:
            raise RadarError(f"{python} imports deepspeed {found}, not {release.version}")
        if not sees_the_suite(python):
            raise RadarError(f"{python} cannot import dsconform and its pytest plugin: "
                             "install the suite there (pip install -e CHECKOUT), or give "
                             "--venv VERSION=PATH of an environment that has both")
    except RadarError as e:
        release.note = str(e)
        say(f"NOT RUN: {e}")
        return None
    warm_up(python, log, say, env, gpu=has_gpu())
    # The selection's node ids name their files (suites/...): the folder itself would add the
    # whole tier back.
    cmd = [str(python), "-m", "pytest", *(selection or [str(suites)]), "-p", "no:cacheprovider",
           "--results", str(out.resolve()), *tier]
    shown = shlex.join([*tier]) + (f" + {len(selection)} selected tests" if selection else "")
    say(f"running pytest {shown} (log {log})")
    started = time.monotonic()
    rc = run_logged(cmd, log, timeout_s=args.timeout_s, env=env, cwd=suites.parent)
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
        every = releases(args.versions, args.from_results, args.venv, args.torch or ())
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
    shown = ", ".join(r.label + (f" (torch {r.torch})" if r.torch and r.label == r.version
                                  else "") for r in every)
    print(f"dsconform radar: {len(every)} columns ({shown}), "
          f"{words}, into {out}", flush=True)
    selection: list[str] = []
    if args.tier == "radar" and need_runs:
        first = next(r for r in reversed(every) if r.results is None)
        try:
            python = first.python or ensure_env(Path(args.venvs), first.torch or "",
                                                first.version, suites.parent,
                                                lambda t: print(f"tier: {t}", flush=True))
            ids = collect(python, suites, [*CPU_TIER, *shlex.split(args.pytest_args or "")],
                          out / "collect.log", env)
            nightly = collect(python, suites / "test_zero.py",
                              ["-m", "not gpu", "--nightly", "-k", THREE_WAY_TEST],
                              out / "collect-nightly.log", env)
        except RadarError as e:
            print(f"dsconform radar: {e}", file=sys.stderr)
            return 2
        selection = radar_selection(ids, nightly)
        (out / "radar-tier.txt").write_text("\n".join(selection) + "\n")
        print(f"radar tier: the CPU tier's {len(ids)} tests less {len(RADAR_LEAVES_OUT)} "
              f"left out, and {len(selection) - len([i for i in ids if i in selection])} "
              f"ZeRO cells of the nightly matrix for 3-way coverage: {len(selection)} tests "
              f"({out / 'radar-tier.txt'})", flush=True)
    columns, missing = [], []
    for i, release in enumerate(every, start=1):
        folder = run_release(release, index=i, total=len(every), args=args, suites=suites,
                             tier=tier, selection=selection, env=env)
        if folder is None:
            missing.append(f"{release.label} is not on the timeline: {release.note}")
        else:
            columns.append((release.label, str(folder)))
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
    r.add_argument("versions", nargs="*", metavar="VERSION[@TORCH]",
                   help="a DeepSpeed release to run (0.18.9), with the torch of its time unless "
                        "one is given (0.18.9@2.11.0)")
    r.add_argument("--from-results", action="append", default=[], metavar="VERSION=DIR",
                   help="a finished run's --results folder for that release (repeatable)")
    r.add_argument("--venv", action="append", default=[], metavar="VERSION=PATH",
                   help="an environment (venv folder or python) already holding that release "
                        "(repeatable)")
    r.add_argument("--venvs", default=str(Path.home() / ".cache" / "dsconform" / "radar-venvs"),
                   metavar="DIR", help="where the venvs are kept, one per torch (default "
                                       "~/.cache/dsconform/radar-venvs)")
    r.add_argument("--torch", nargs="+", metavar="TORCH",
                   help="run every release with this torch (2.14.1, or 2.13 for its newest "
                        "2.13.x) instead of the torch of its time; several values with one "
                        "release: a torch axis")
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
