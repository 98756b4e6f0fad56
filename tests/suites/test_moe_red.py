"""The MoE suite's checks MUST go red when DeepSpeed's MoE path is perturbed.

The suite's own rank code (suites/moe_ranks.py) runs real DeepSpeed MoE layers and engines on
the CPU accelerator (gloo), first as they are (the control: no problem) and then with one fault
injected on the DeepSpeed side only:

- MOE-LAYER-1: the gate routes token 0's first choice to the next expert (``misroute``);
- MOE-EP-1 / MOE-EP-2: the norm the engine clips with counts expert 0's gradient twice on
  ZeRO-2 (``double_count_expert``);
- MOE-CKPT-1: one expert file of the saved checkpoint is removed before the load
  (``drop_expert_file``), or the load leaves the optimizer state out (``skip_optimizer_state``).

Each judgement MUST then fail and name what went wrong. Nothing is mocked.
"""

from __future__ import annotations

import re

from dsconform.harness.api import run_ranks
from suites import moe_ranks
from suites.test_moe import (
    CKPT_MORE,
    CKPT_STEPS,
    LAYER_CELLS,
    MICRO_BATCH,
    checkpoint_problems,
    ep_problems,
    ep_runs,
    layer_problems,
    layer_results,
    norm_problems,
)


def test_misrouted_token_fails_the_layer_check():
    control = layer_results("cpu")
    for cell in LAYER_CELLS:
        assert layer_problems(control[cell["id"]], cell, "cpu") == [], cell["id"]
    misrouted = layer_results("cpu", misroute=True)
    for cell in LAYER_CELLS:
        text = "\n".join(layer_problems(misrouted[cell["id"]], cell, "cpu"))
        if not any(t == 0 for t, _ in misrouted[cell["id"]]["reference"]["kept"]):
            continue  # token 0 dropped in the reference: no route of its to lose
        # Token 0's first choice is gone from DeepSpeed's routes (sorted: token 0 leads).
        assert re.search(r"kept by the reference only: \[\(0, \d\)", text), (cell["id"], text)
        assert f"{cell['id']}: output differs" in text, (cell["id"], text)


def test_expert_counted_twice_in_the_norm_fails():
    control = ep_runs("cpu", 2)
    assert ep_problems(control, "z2", "cpu") == []
    assert norm_problems(control, "z2") == []
    doubled = ep_runs("cpu", 2, double_count_expert=True)
    norms = "\n".join(norm_problems(doubled, "z2"))
    # Rank 0 holds expert 0 (ep_size 2): its norm is too large at every step.
    assert re.search(r"z2 ep_size=2 rank 0 step 0: the engine clipped with a global norm of "
                     r"\S+, the gradients' norm with every expert counted once is \S+ "
                     r"\(1\.\d+x\)", norms), norms


def test_dropped_expert_file_fails_the_checkpoint_check(tmp_path):
    def run(name: str, drop: bool):
        return run_ranks(moe_ranks.checkpoint_round_trip, 2, timeout_s=180, accelerator="cpu",
                         args=(2, 1, CKPT_STEPS, CKPT_MORE, MICRO_BATCH, str(tmp_path / name)),
                         kwargs={"drop_expert_file": drop})

    assert checkpoint_problems(run("control", False), 2, "cpu") == []
    text = "\n".join(checkpoint_problems(run("dropped", True), 2, "cpu"))
    assert re.search(r"rank 1: the load failed: \w+", text), text


def test_optimizer_state_left_out_of_the_load_fails(tmp_path):
    results = run_ranks(moe_ranks.checkpoint_round_trip, 2, timeout_s=180, accelerator="cpu",
                        args=(2, 1, CKPT_STEPS, CKPT_MORE, MICRO_BATCH, str(tmp_path)),
                        kwargs={"skip_optimizer_state": True})
    text = "\n".join(checkpoint_problems(results, 2, "cpu"))
    assert "ep_size=2 loaded weights" in text and "momentum/" in text, text
    assert "resumed losses" in text, text


def test_all_to_all_check_sees_its_data():
    """MOE-A2A-1's rank code on 2 CPU ranks (gloo): every size comes back exact, each timed
    3 times; the suite runs it on GPUs only."""
    points = run_ranks(moe_ranks.all_to_all_busbw, 2, timeout_s=120, accelerator="cpu",
                       args=([(4096, 3), (1 << 20, 2)], 3, 1))[0]
    assert [p["bytes"] for p in points] == [4096, 1 << 20]
    assert all(p["exact"] and len(p["seconds"]) == 3 and min(p["seconds"]) > 0
               for p in points), points
