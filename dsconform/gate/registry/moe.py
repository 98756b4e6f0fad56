"""Known upstream issues of Mixture of Experts: the layer, expert parallelism and its checkpoints
(test_moe.py)."""

from __future__ import annotations

from dsconform.gate.known_issue import TORCH, KnownIssue

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
    KnownIssue(
        id="DS-7948-MOE-FLAT-BUFFER-VIEW",
        title="DS-7948-Z12-FLAT-BUFFER-VIEW in the MoE suite: ZeRO 1/2 on two ranks flattens "
              "the parameters into a buffer that keeps autograd history, and the first "
              "all-gather into its split views raises 'Output 0 of SplitBackward0 is a view "
              "and is being modified inplace'",
        deepspeed="==0.18.9",
        kind=TORCH,
        torch=">=2.11",
        link="https://github.com/deepspeedai/DeepSpeed/pull/7948",
        fixed_in="0.19.0",
        cases=("test_moe.py::test_expert_parallel_trains_like_ep1[cpu-z1]",
               "test_moe.py::test_expert_parallel_trains_like_ep1[cpu-z2*]",
               "test_moe.py::test_clip_norm_counts_every_expert_once[cpu-*]",
               "test_moe.py::test_checkpoint_round_trip[cpu-z1-*]",
               "test_moe.py::test_checkpoint_round_trip[cpu-z2-*]"),
        failure=r"Output 0 of Split(Backward0)? is a view and is being modified inplace",
        seen="CPU machine (2 cores), the radar's CPU timeline, 0.18.9 with its period torch "
             "2.11.0: every two-rank ZeRO-1/2 MoE engine raised it in its first step(); the "
             "ZeRO-0 cell trains; 0.18.5 (torch 2.10.0) and 0.19.0 (torch 2.11.0) train them",
    ),
)
