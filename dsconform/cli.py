"""The ``dsconform`` command: the suite's tools beside ``pytest suites`` (``build_parser`` lists
them, and ``--help`` names every one).

Exit codes: 0 success; 2 invalid input (a profile that does not validate, an unreadable file);
1 for a command that ran and found a problem (reserved for comparisons).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsconform import __version__
from dsconform.node import detect
from dsconform.profile import schema as profile
from dsconform.profile import toml_writer as toml_out


def cmd_detect(args: argparse.Namespace) -> int:
    facts = detect.probe()
    data = detect.profile_data(facts, args.name)
    text = toml_out.dumps(data, comments={
        "profile": "# Detected by `dsconform detect`: every promise is what this node has now.\n"
                   "# Add floors you measured (GB/s means 1e9 bytes per second).\n"
                   + detect.nvme_comment(facts)})
    # What we print must load: a detected profile that fails its own validation is our bug.
    profile.from_data(__import__("tomllib").loads(text), "detected")
    sys.stdout.write(text)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        if _is_catalogue_file(path):
            status = max(status, _validate_catalogue(path))
            continue
        try:
            p = profile.load(profile.resolve(path, named=path,  # an argument, not --profile
                                             hint="give a shipped NAME or a PATH"))
        except profile.ProfileError as e:
            for problem in e.problems:
                print(problem, file=sys.stderr)
            status = 2
            continue
        print(f"{path}: valid profile {p.name!r}")
    return status


def _is_catalogue_file(path: str) -> bool:
    import tomllib

    from dsconform.profile import catalogue
    try:
        return catalogue.is_catalogue(tomllib.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return False  # the profile loader names what is wrong with it


def _validate_catalogue(path: str) -> int:
    from dsconform.profile import catalogue
    try:
        models = catalogue.load(path)
    except catalogue.CatalogueError as e:
        for problem in e.problems:
            print(problem, file=sys.stderr)
        return 2
    print(f"{path}: valid GPU catalogue ({len(models)} models: {', '.join(models)})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dsconform.node import dsreport

    text = dsreport.run_ds_report()
    try:
        parsed = dsreport.parse_ds_report(text)
    except ValueError as e:
        print(f"dsconform report: cannot parse ds_report output: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(parsed, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        for name, op in sorted(parsed["ops"].items()):
            print(f"{name:<28} installed={op['installed']!s:<6} compatible={op['compatible']}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from dsconform.results import compare
    from dsconform.results import format as results_format
    from dsconform.results.render import compare as compare_report
    from dsconform.results.render import compare_chart as compare_plot

    def unusable(msg: object) -> int:
        print(f"dsconform compare: {msg}", file=sys.stderr)
        return 2

    if not args.threshold >= 0:
        return unusable(f"--threshold {args.threshold}: must be a number >= 0 (0.1 = 10%)")
    if args.threshold >= 1:  # likely meant as percent: say what it does
        print(f"dsconform compare: note: --threshold {args.threshold:g} is "
              f"{args.threshold:.0%}, a fraction (0.1 = 10%)", file=sys.stderr)
    if args.plot:  # before any work: a missing extra is said at once, in one line
        try:
            compare_plot.require()
        except compare_plot.PlotUnavailable as e:
            print(e, file=sys.stderr)
            return 2
    try:
        base = results_format.load_benchmarks(args.base)
        new = results_format.load_benchmarks(args.new)
    except results_format.ResultsFormatError as e:
        return unusable(e)
    for label, doc in ((args.base, base), (args.new, new)):
        if results_format.ran_nothing(doc):
            return unusable(f"{label}: the run recorded no test outcome and no measurement: "
                            "nothing to compare (a --collect-only run, a selection that matched "
                            "nothing, or a run stopped before its first test ended)")
    result = compare.compare(base, new, threshold=args.threshold, base_label=args.base,
                             new_label=args.new)
    if args.markdown == "-":
        print(compare_report.markdown(result))
        for w in result.warnings:  # stdout is the markdown: say it where a person sees it
            print(f"dsconform compare: WARNING: {w}", file=sys.stderr)
    else:
        print("\n".join(compare_report.terminal(result)))
    try:
        if args.markdown and args.markdown != "-":
            Path(args.markdown).write_text(compare_report.markdown(result) + "\n")
            print(f"markdown: {args.markdown}", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(compare_report.as_json(result), indent=1)
                                       + "\n")
            print(f"json: {args.json}", file=sys.stderr)
        if args.plot:
            compare_plot.draw(result, args.plot)
            print(f"chart: {args.plot}", file=sys.stderr)
    except OSError as e:
        return unusable(f"cannot write {e.filename}: {e.strerror or e}")
    if args.strict and result.different_hardware:
        return unusable("--strict: the runs are of different hardware ("
                        + "; ".join(result.warnings) + ")")
    return 1 if result.regressed else 0


def cmd_aggregate(args: argparse.Namespace) -> int:
    from dsconform.results.render import aggregate as aggregate_report

    expect = [n for n in (args.expect or "").replace(",", " ").split() if n]
    return aggregate_report.main(args.dirs, out=args.out, outlier_pct=args.outlier_pct,
                                 plot=not args.no_plot, expect=expect, scheduler=args.scheduler)


def cmd_health(args: argparse.Namespace) -> int:
    from dsconform.node import health  # NVML and dmesg only: neither torch nor DeepSpeed

    thresholds = None
    if args.profile:
        try:
            p = profile.load(profile.resolve(args.profile, named=f"--profile {args.profile}"))
        except profile.ProfileError as e:
            for problem in e.problems:
                print(problem, file=sys.stderr)
            return 2
        thresholds = health.Thresholds.from_profile(p.health)
    return health.command(as_json=args.json, thresholds=thresholds)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dsconform",
        description="The DeepSpeed conformance suite's tools; the suite itself runs as "
                    "`pytest suites`.",
        epilog="`dsconform COMMAND --help` for a command's options; all of them: "
               "docs/options.md.")
    ap.add_argument("--version", action="version", version=f"dsconform {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                            title="commands")
    d = sub.add_parser("detect", help="print a TOML hardware profile of this node")
    d.add_argument("--name", help="profile name (default: derived from the GPUs)")
    d.set_defaults(func=cmd_detect)
    v = sub.add_parser("validate", help="check profile files; exit 2 naming file, field, reason")
    v.add_argument("files", nargs="+", metavar="FILE", help="profile path or shipped name")
    v.set_defaults(func=cmd_validate)
    r = sub.add_parser("report", help="ds_report as data")
    r.add_argument("--json", action="store_true", help="print the parsed report as JSON")
    r.set_defaults(func=cmd_report)
    c = sub.add_parser("compare", help="compare two benchmarks.json: exit 0 no regression, "
                                       "1 regression, 2 unreadable input")
    c.add_argument("base", help="benchmarks.json (or the --results directory) of the reference "
                                "run (e.g. the old DeepSpeed)")
    c.add_argument("new", help="benchmarks.json (or the --results directory) of the run under "
                               "test")
    c.add_argument("--threshold", type=float, default=0.10,
                   help="relative change below which a metric is unchanged (default 0.10); the "
                        "noise of both runs' rounds, and a family's wider minimum "
                        "(dsconform/results/noise.py), can widen it")
    c.add_argument("--markdown", nargs="?", const="-", metavar="FILE",
                   help="write the comparison as markdown to FILE (for a pull request or a "
                        "wiki page); without FILE print it instead of the table. Put it after "
                        "BASE and NEW")
    c.add_argument("--json", metavar="FILE",
                   help="write the whole comparison as JSON to FILE: every change, with the full "
                        "values of facts the table summarises")
    c.add_argument("--plot", metavar="FILE.png",
                   help="draw the relative change of every metric with its noise band, "
                        "regressions in red (needs matplotlib: pip install 'dsconform[plot]')")
    c.add_argument("--strict", action="store_true",
                   help="exit 2 when the runs are of different profiles or GPUs (default: a "
                        "warning)")
    c.set_defaults(func=cmd_compare)
    g = sub.add_parser("aggregate", help="merge many nodes' results into one cluster report: "
                                         "exit 0 all passed, 1 a node failed, 2 unusable input")
    g.add_argument("dirs", nargs="+", metavar="DIR",
                   help="a node's --results folder, or a folder holding them (the shared "
                        "results directory of a nightly run)")
    g.add_argument("--out", default="dsconform-cluster", metavar="DIR",
                   help="where cluster.md, cluster.json, junit.xml and heatmap.png go "
                        "(default ./dsconform-cluster)")
    g.add_argument("--outlier-pct", type=float, default=90.0, metavar="PCT",
                   help="a node below PCT%% of the median of its node type (profile and GPUs) "
                        "on a performance metric is an outlier, even above its floor (default "
                        "90)")
    g.add_argument("--no-plot", action="store_true", help="do not draw heatmap.png")
    g.add_argument("--expect", metavar="NODES",
                   help="the nodes that should have results (comma-separated, e.g. the job's "
                        "node list): one without a folder fails too")
    from dsconform.results.aggregate import SCHEDULERS
    g.add_argument("--scheduler", choices=SCHEDULERS, default="slurm",
                   help="whose commands to print for the failing nodes: slurm (scontrol ... "
                        "state=drain, the default) or k8s (kubectl cordon, taint, label, "
                        "annotate); printed, never run")
    g.set_defaults(func=cmd_aggregate)
    h = sub.add_parser("health", help="the hardware error gate alone, in about a second (Slurm "
                                      "prologs, Kubernetes init containers): exit 0 healthy, 1 "
                                      "action needed, 2 could not check")
    h.add_argument("--json", action="store_true", help="print the report as JSON")
    h.add_argument("--profile", metavar="NAME|PATH",
                   help="take the limits from this profile's [health] table (default: the "
                        "gate's own, docs/health.md)")
    h.set_defaults(func=cmd_health)
    from dsconform.storage import tune as nvme_tune  # its command and arguments live with the sweep
    nvme_tune.add_cli(sub)
    from dsconform.tools import bundle  # air-gapped nodes: its command lives with it
    bundle.add_cli(sub)
    from dsconform.tools import build_ops  # dsconform build-ops: the op builds ahead of a run
    build_ops.add_cli(sub)
    from dsconform.results.render import timeline  # the radar's timeline and verdict
    from dsconform.tools import radar  # the upgrade radar: one run per DeepSpeed release
    radar.add_cli(sub, timeline.report)
    from dsconform.profile import known_answers  # the SDC suite's recorded answers
    known_answers.add_cli(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
