"""Known upstream issues of Mixture of Experts: the layer, expert parallelism and its checkpoints
(test_moe.py)."""

from __future__ import annotations

from dsconform.gate.known_issue import KnownIssue

ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="DS-8475-MOE-CLIP-NORM-AVERAGED",
        title="without ZeRO (stage 0, fp32) clip_grad_norm_ averages every rank's local norm "
              "over the data-parallel group: with ep_size > 1 each rank's norm covers only its "
              "own experts, so the clipping norm is not the global norm and clipping changes "
              "the update where ep_size = 1 would not",
        deepspeed=">=0.16.9,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/issues/8475",
        cases=("test_moe.py::test_expert_parallel_trains_like_ep1[*-z0]",),
        failure=r"z0: first diverging step \d+: step \d+, (loss|grad of '[^']+') \(rank \d\)",
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13, gloo, 2 ranks: 4 experts, "
             "gradient_clipping 0.3 biting at step 0; ep_size = 2 and ep_size = 1 have equal "
             "step-0 gradients, then the losses part at step 1 (4.5e-4 abs by step 4) and the "
             "parameters end up to 5.2e-4 apart after 5 steps; the same cell with clipping off, "
             "and ZeRO 1-2 (the optimizer's own norm) with it on, match to 1.5e-8. Open fix: "
             "https://github.com/deepspeedai/DeepSpeed/pull/8478. The radar's CPU timeline "
             "saw the z0 cell part at step 1 on every release from 0.16.9 (torch 2.7.0) to "
             "0.19.8 (torch 2.14.1); clip_grad_norm_'s averaging is in each of them",
    ),
)
