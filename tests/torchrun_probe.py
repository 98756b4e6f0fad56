"""Run by tests/harness/test_dist.py under torchrun: one rank of an externally launched job.

Usage: torchrun ... tests/torchrun_probe.py OUT_DIR
Writes OUT_DIR/rank<RANK>.json with what run_ranks returned or raised in external mode.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repo root (dsconform) and tests/ (rank_fns)

import rank_fns  # noqa: E402

from dsconform.harness import api as dist  # noqa: E402


def main(out_dir: str) -> None:
    report: dict = {"external": dist.external_rendezvous()}
    report["result"] = dist.run_ranks(rank_fns.rank_and_sum, 2, timeout_s=60)
    report["result_any_size"] = dist.run_ranks(rank_fns.gather_ranks, None, timeout_s=60)
    try:
        # raise_alone, not raise_on: under a launcher nobody can kill a rank blocked in a
        # collective, so a peer waiting for the failed rank would sit out the group timeout.
        dist.run_ranks(rank_fns.raise_alone, 2, timeout_s=60, args=(1,))
        report["error"] = None
    except dist.RankError as exc:
        report["error"] = {"rank": exc.rank, "message": str(exc)}
    try:
        dist.run_ranks(rank_fns.noop, 3, timeout_s=60)
        report["mismatch"] = None
    except dist.WorldSizeMismatch as exc:
        report["mismatch"] = str(exc)
    # The job is still usable after a failed call: the ranks stayed in step.
    report["after_error"] = dist.run_ranks(rank_fns.rank_and_sum, 2, timeout_s=60)
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
