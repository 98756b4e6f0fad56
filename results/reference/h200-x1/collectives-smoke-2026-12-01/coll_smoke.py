"""GPU smoke of the collectives rank code at world size 1 (the 1-GPU node): exact data of
every dtype through deepspeed.comm, and the timed point's output check at floor sizes."""
import json
import time

from dsconform.suite import run_ranks
from suites import collective_ranks
from suites.test_collectives import EXACT_SIZES

if __name__ == "__main__":
    out = {}
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        for dt in ("fp32", "bf16", "fp16"):
            r = run_ranks(collective_ranks.check_exact, 1, timeout_s=300,
                          args=(coll, dt, EXACT_SIZES["cuda"]), accelerator="cuda")[0]
            out[f"exact.{coll}.{dt}"] = r["mismatches"]
        t = time.time()
        r = run_ranks(collective_ranks.measure, 1, timeout_s=300,
                      args=(coll, [(1 << 30, 5), (4 << 30, 5)]), accelerator="cuda")[0]
        out[f"measure.{coll}"] = [(p["bytes"], p["wrong"], [round(s, 6) for s in p["seconds"]])
                                  for p in r["points"]]
        out[f"measure.{coll}.s"] = round(time.time() - t, 1)
        r = run_ranks(collective_ranks.measure, 1, timeout_s=300,
                      args=(coll, [(1 << 30, 5)]), kwargs={"partial_rank": 0},
                      accelerator="cuda")[0]
        out[f"partial.{coll}"] = r["points"][0]["wrong"]
    print("SMOKE " + json.dumps(out))
