"""The ``dsconform`` command: detect, validate, report.

Exit codes: 0 success; 2 invalid input (a profile that does not validate, an unreadable file);
1 for a command that ran and found a problem (reserved for comparisons).
"""

from __future__ import annotations

import argparse
import json
import sys

from dsconform import detect, profile, toml_out


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
        try:
            p = profile.load(profile.resolve(path))
        except profile.ProfileError as e:
            for problem in e.problems:
                print(problem, file=sys.stderr)
            status = 2
            continue
        print(f"{path}: valid profile {p.name!r}")
    return status


def cmd_report(args: argparse.Namespace) -> int:
    from dsconform import dsreport

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
    from dsconform import compare

    try:
        base, new = compare.load(args.base), compare.load(args.new)
    except compare.CompareInputError as e:
        print(f"dsconform compare: {e}", file=sys.stderr)
        return 2
    result = compare.compare(base, new, threshold=args.threshold)
    print("\n".join(compare.report(result, base, new)))
    return 1 if result.regressed else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsconform", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
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
    c.add_argument("base", help="benchmarks.json of the reference run (e.g. the old DeepSpeed)")
    c.add_argument("new", help="benchmarks.json of the run under test")
    c.add_argument("--threshold", type=float, default=0.10,
                   help="relative change below which a metric is unchanged (default 0.10); "
                        "sample noise can widen it")
    c.set_defaults(func=cmd_compare)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
