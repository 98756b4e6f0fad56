"""Known upstream issues: DeepSpeed defects that a node cannot fix, in ONE registry.

A known issue turns the cases it covers into strict xfails, for the DeepSpeed versions it was
verified to affect and no others:

- on an affected version the case is expected to fail, and only the way the issue fails: an
  assertion whose message matches the entry's ``failure`` pattern (``expects``). Anything else
  (a rank that crashed or hung, a NaN, an error of another kind) FAILS the run, saying which
  issue covered the case and what it expected, so a known issue never hides a new defect in the
  cells it covers. The summary and the results JSON list the issue once, with the number of
  cases it covered;
- where it unexpectedly passes (a patched build), the strict xfail FAILS and says to narrow or
  drop the entry;
- on a version outside ``deepspeed``, the case runs as a normal test. A release that is still
  broken then fails red until someone verifies it and widens the range: the registry only ever
  holds what was seen.

Tolerances are never loosened for a known issue: the case keeps its check and fails it.

Two kinds of entry (``kind``): ``upstream``, a defect of DeepSpeed itself; ``torch``, an
incompatibility of DeepSpeed releases with torch releases ("DeepSpeed 0.18.9 with torch >=
2.13"): the same code works beside an older torch, so the entry names the torch versions it was
seen with (``torch``, a specifier with a lower bound) and covers its cases only where both the
DeepSpeed and the torch installed are in range. Either kind links upstream's fix where there is
one (``fixed_in``: the first release that carries it).

Cases are patterns over ``FILE::TEST[PARAMS]`` (the test file's name, not its directory) in
which only ``*`` is special (brackets are the literal brackets of a parametrized id), so the
registry names cells of a matrix without listing them one by one.
"""

from __future__ import annotations

import functools

from dsconform.gate import known_issues_check
from dsconform.gate.known_issue import (
    KINDS,
    TORCH,
    UPSTREAM,
    KnownIssue,
    KnownIssueFailure,
    installed_torch,
)

# The entry's type lives in dsconform/gate/known_issue.py; its names are the registry's too.
__all__ = ["KINDS", "KNOWN_ISSUES", "TORCH", "UPSTREAM", "KnownIssue", "KnownIssueFailure",
           "by_id", "case_name", "check_registry", "expected_failure", "installed_torch",
           "issues_for"]

KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="DS-8393-Z0-FP16-UNSCALED",
        title="ZeRO stage 0 fp16 never scales the loss but unscales the gradients: updates are "
              "1/loss_scale too small",
        deepspeed=">=0.18.9,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8393",
        cases=(
            # every stage-0 fp16 cell of the ZeRO-vs-DDP matrix, on any accelerator with fp16
            "test_zero.py::test_zero_matches_ddp[*-z0-off_none-fp16-*]",
            # fp16 SGD on stage 0 moves 1/65536 as far and does not converge (Adam, being
            # scale-invariant, would; the suite trains SGD, so the failure is deterministic)
            "test_loss_scaling.py::test_fp16_bf16_converge[*-z0-fp16-*]",
            # every applied SGD step moves 1/loss_scale as far as fp32's (FusedAdam, nearly
            # scale-invariant, fails there for DS-5104 first)
            "test_loss_scaling.py::test_applied_steps_match_fp32[*-z0-*-sgd]",
        ),
        # Step 0's gradients are 1/1024 of DDP's (rel diff 0.999, 2xH200); an applied SGD step
        # moves 1/loss_scale as far (0.003907x at 256, CPU machine; 0.25x at 4, 1xH200; the
        # named groups hold the gain to 1/scale); the curve ends higher.
        failure=(r"first diverging step 0: .*max rel diff 0\.999"
                 r"|\(scale (?P<scale>\d+)\): moved the fp32 masters (?P<gain>[\d.e-]+)x as far"
                 r"|fp16 \(\w+\) ended at loss \S+ .*?, fp32 at \S+: \+"),
        seen="2xH200, DeepSpeed 0.19.6 and 0.19.8: engine.backward scales the loss only for "
             "ZeROOptimizer; FP16_Optimizer / FP16_UnfusedOptimizer still divide by cur_scale "
             "in step(); relative gradient difference 0.999 = 1 - 1/1024 in all 12 stage-0 fp16 "
             "cells (results/reference/h200-x2/ds-0.19.8; docs/findings.md#loss-scaling)"
             "; the radar: 0.18.9 on, 1/256 on CPU (0.17.6: DS-Z0-FP16-RAISE)",
    ),
    KnownIssue(
        id="DS-5104-Z0-ADAM-INIT-STEP",
        title="ZeRO stage 0 bf16/fp16 (FP16_Optimizer, FP16_UnfusedOptimizer) takes a real "
              "optimizer step with zero gradients at initialization: Adam's step count starts "
              "at 1, every bias correction is one step late, the first update is 0.74x torch's "
              "and 20 steps move 4-6% less",
        deepspeed=">=0.18.9,<=0.19.8",
        # The pull request removes the step from ZeRO 1-3's initialization (done there since);
        # the stage-0 wrappers' initialize_optimizer_states still calls optimizer.step().
        link="https://github.com/deepspeedai/DeepSpeed/pull/5104",
        cases=(
            # stage-0 fp16 cells are DS-8393's already (they fail for that first)
            "test_zero.py::test_zero_matches_ddp[*-z0-off_none-bf16-adam-*]",
            "test_zero.py::test_zero_matches_ddp[*-z0-off_none-bf16-fused_adam-*]",
            # the fp16 engine's stage-0 FusedAdam (FP16_Optimizer): its first step moves
            # 0.74x as far as fp32 Adam's
            "test_loss_scaling.py::test_applied_steps_match_fp32[*-z0-*-fused_adam]",
        ),
        # The whole update's gain 0.942-0.958 (CPU 0.949); FusedAdam's first fp16 step 0.73-0.74x
        failure=(r"gain of all parameters( \(rank \d+\))?: the update is 0\.9[3-6]\d*x the "
                 r"reference's|step 0 \(scale \d+\): moved the fp32 masters 0\.7\d*x as far"),
        seen="CPU machine (torch Adam, 1 and 2 ranks) and 1xH200 (torch Adam and FusedAdam, 1 "
             "rank; fp16 too), DeepSpeed 0.19.8, 2026-12-01: Adam's state['step'] is 21 after "
             "20 training steps and its moments match the 20 real gradients; the whole update "
             "has gain 0.942-0.958 against DDP where ZeRO 1-3 stay within 8e-4 of 1. SGD with "
             "momentum is unaffected (a zero first gradient leaves its buffer as torch's). "
             "DeepSpeed 0.19.6: the same code, and the same strict xfails on the CPU machine "
             "(the CPU tier's two stage-0 bf16 Adam cells)"
             "; the radar: 0.18.9 on (0.17.6 fails DS-7839 first)",
    ),
    KnownIssue(
        id="DS-8588-FP16-RAISE-STEP-HALVED",
        title="ZeRO 1-3 fp16: on a step where the dynamic loss scale rises, step() updates the "
              "scale before it unscales the gradients, so that step's gradients are divided by "
              "twice the scale backward multiplied them by (SGD moves 0.82x as far on that step "
              "and its momentum carries the deficit on)",
        deepspeed=">=0.16.9,<=0.19.8",
        # A comment on the pull request (2026-09-21) describes the ordering in
        # FP16_UnfusedOptimizer and reads the same split in zero/stage_1_and_2.py without
        # reproducing it; it is not fixed there ("out of scope for this PR").
        link="https://github.com/deepspeedai/DeepSpeed/pull/8588",
        cases=tuple(f"test_loss_scaling.py::test_applied_steps_match_fp32[*-z{stage}-*-{s}-*]"
                    for stage in (1, 2, 3) for s in ("h1", "h2")),
        # The step where the scale rises: SGD 0.79-0.82x, FusedAdam 0.94x (CPU machine, 1xH200)
        failure=r"\(scale \d+\): moved the fp32 masters 0\.(7[5-9]|8[0-5]|9[2-6])\d*x as far",
        seen="CPU machine (AVX512-FP16), DeepSpeed 0.19.8 and 0.19.6, 2026-12-01: ZeRO 1, 2 "
             "and 3, 1 and 2 ranks, SGD and FusedAdam: every applied step matches an fp32 "
             "replica's within 2.2e-4 (gain) except the one where the scale goes 128 -> 256, "
             "which moves 0.82x (SGD) / 0.94x (FusedAdam) as far. stage_1_and_2.py and "
             "stage3.py call _update_scale(self.overflow) and then unscale_and_clip_grads, "
             "which divides by the updated self.loss_scale (only the reported norm uses "
             "prev_scale). 1xH200, 0.19.8 and 0.19.6, 1 rank: the same numbers (strict xfails, "
             "results/reference/h200-x1/ds-0.19.8; docs/findings.md#loss-scaling)"
             "; the radar: 0.16.9 on (results/reference/radar/cpu)",
    ),
    KnownIssue(
        id="DS-Z0-FP16-NO-HYSTERESIS",
        title="ZeRO stage 0 fp16 (FP16_Optimizer, FP16_UnfusedOptimizer) ignores hysteresis and "
              "consecutive_hysteresis: every overflow halves the loss scale",
        deepspeed=">=0.19.6,<=0.19.8",
        # No upstream issue or pull request names this yet: the link is the code at fault.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/fp16/"
             "unfused_optimizer.py",
        cases=(
            "test_loss_scaling.py::test_overflow_handling[*-z0-*-h2-*]",
            "test_loss_scaling.py::test_overflow_handling[*-z0-*-h2c-*]",
        ),
        failure=(r"loss scale after the step [\d.]+, the model's [\d.]+ "
                 r"\(dynamic: [^)]*hysteresis 2"),
        seen="CPU machine, DeepSpeed 0.19.8 fp16 engines (the CPU accelerator's fp16 check "
             "lifted in tests/loss_scaling_cpu_fp16.py): with hysteresis 2 and the overflow "
             "pattern 0,1,1,0,0,0,1,1,1 stage 0 went 256,128,64,64,64,128,64,32,16 where ZeRO 1-3 "
             "(DynamicLossScaler) went 256,256,128,128,128,256,256,128,64; the stage-0 wrappers' "
             "_update_scale (LossScaleConfig) has no hysteresis in 0.19.6 and 0.19.8 alike",
    ),
    KnownIssue(
        id="DS-697-Z0-FP16-SILENT-FLOOR",
        title="ZeRO stage 0 fp16 skips overflowing steps at min_loss_scale forever, silently, "
              "where ZeRO 1-3 end the run with an error",
        deepspeed=">=0.19.6,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/issues/697",
        cases=("test_loss_scaling.py::test_overflow_handling[*-z0-*-floor-*]",),
        failure=(r"an overflow at min_loss_scale=[\d.]+ must end the run with an error; DeepSpeed "
                 r"skipped the step and went on"),
        seen="CPU machine, DeepSpeed 0.19.8 fp16 engines (fp16 check lifted): from 2**2 with "
             "min_loss_scale 1, stage 0 skipped a third overflow at scale 1 and trained on; "
             "ZeRO 1-3 raised 'Current loss scale already at minimum'. The stage-0 wrappers "
             "clamp with max(scale / 2, min_loss_scale) in 0.19.6 and 0.19.8 alike",
    ),
    KnownIssue(
        id="DS-Z3-INIT-DTYPE-NVME",
        title="ZeRO-3 without fp16 support on the accelerator ignores the model's dtype: fp32 "
              "parameters offloaded to NVMe come back as bf16 (zero.Init._set_dtype)",
        deepspeed="==0.19.8",
        # Pull request #8428 (open) adds the missing () to is_bf16_supported on the same line;
        # the precedence of `dtype or fp16 if ... else ...` that drops the dtype stays.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/zero/"
             "partition_parameters.py#L409-L410",
        cases=("test_deepnvme.py::test_zero_infinity_matches_ddp[*-cpu-param+opt-fp32-*]",),
        failure=r"must have the same dtype, but got Float and BFloat16",
        seen="CPU machine (no oneDNN fp16), DeepSpeed 0.19.8: ZeRO-3 fp32 with parameters "
             "offloaded to nvme fails at the first forward, 'self and mat2 must have the same "
             "dtype, but got Float and BFloat16': `self.dtype = dtype or torch.float16 if "
             "is_fp16_supported() else torch.bfloat16 if is_bf16_supported else torch.float32` "
             "parses as (dtype or fp16) if ... else bf16, so the engine's fp32 is dropped and the "
             "parameter swapper swaps bf16 (its folder is zero_stage_3/bfloat16params). CUDA has "
             "fp16 and keeps the dtype; a CPU with AVX512-FP16/AMX would too (this case then "
             "passes: narrow the entry). 0.19.6 has the same lines (not run)",
    ),
    KnownIssue(
        id="DS-Z3-LOAD-MODULE-ONLY",
        title="ZeRO-3 load_checkpoint(load_module_only=True) returns the checkpoint's path but "
              "loads no weights: the engine keeps its own (engine.py skips "
              "_load_zero_checkpoint and calls _restore_from_bit16_weights)",
        deepspeed=">=0.19.6,<=0.19.8",
        # Found by this suite; no upstream issue names it yet: the link is the code at fault.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/"
             "engine.py#L4455-L4467",
        cases=("test_checkpoint.py::test_partial_load[*-module_only-3-*]",),
        failure=(r"load_checkpoint\(load_module_only=True\) \(rank \d+\): module must be the "
                 r"saved engine's \(it holds the fresh values\)"),
        seen="CPU machine, DeepSpeed 0.19.6 and 0.19.8: after the load every ZeRO-3 module "
             "weight is the fresh engine's (fc1.bias max abs diff 0.52 from the saved one), fp32 "
             "and bf16; stages 1-2 load the weights. Kept in the suite as its own strict xfail "
             "until 2026-12-01, when it moved here",
    ),
    # The 1-bit optimizers were removed in 0.19.7 (PR #8490): nothing will be fixed upstream.
    KnownIssue(
        id="DS-ONEBIT-RESUME-LOCAL-STEP",
        title="1-bit optimizers resumed in their compressed stage spend one step re-initialising "
              "(the momentum becomes its own 1-bit copy) and the next one in warmup mode on "
              "rank-local gradients (load_state_dict already turned the engine's allreduce "
              "off): the frozen second moments differ per rank, the replicas drift apart",
        deepspeed="==0.19.6",
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.6/deepspeed/runtime/fp16/"
             "onebit/adam.py#L191-L254",
        cases=("test_onebit.py::test_replicas_agree_after_resume[*]",),
        failure=r"resumed at step \d+: the two data-parallel replicas hold different weights",
        seen="CPU stand-in (DeepSpeed 0.19.6's engine and OnebitAdam/ZeroOneAdam/OnebitLamb on "
             "gloo, fp32, dsconform/checks/onebit.py as their compressed allreduce; the "
             "suite's task), 2026-11-30: replicas 0 / 2.4e-7 / 0 apart without a resume, "
             "4.6e-3 / 3.9e-3 / 0.109 (max abs) 80 steps after resuming at step 120; the "
             "first step after the load makes no update, the second is the `adam_freeze_key is "
             "False` branch on un-reduced gradients. Seen on 2xH200 too (DeepSpeed 0.19.6, "
             "nccl, 2026-11-30): all three listed cases strict-xfailed "
             "(results/reference/h200-x2/ds-0.19.6)",
    ),
    KnownIssue(
        id="DS-ONEBIT-LAMB-RESUME",
        title="1-bit LAMB resumed in its compressed stage jumps 16x in loss on its first "
              "update after the load and ends far above the uninterrupted run",
        deepspeed="==0.19.6",
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.6/deepspeed/runtime/fp16/"
             "onebit/lamb.py#L374-L385",
        cases=("test_onebit.py::test_resume_keeps_converging[onebit_lamb-fp32]",),
        failure=(r"after resuming at step \d+ the loss went .* it must keep converging"
                 r"|resumed final loss .* against the uninterrupted run's"),
        seen="CPU stand-in (see DS-ONEBIT-RESUME-LOCAL-STEP), fp32, lr 0.1, 2026-11-30: loss "
             "0.0109 at the save, 0.18 two steps after the load, 0.045 at step 200 against the "
             "uninterrupted run's 0.0040 (ratio 11.4; 1-bit Adam 0.92, 0/1 Adam 0.99). Seen on "
             "2xH200 too (DeepSpeed 0.19.6, fp32, 2026-11-30: the listed case strict-xfailed, "
             "results/reference/h200-x2/ds-0.19.6)",
    ),
    KnownIssue(
        id="DS-8500-WRITER-RELOAD",
        title="with a checkpoint writer configured (FastPersist), load_checkpoint reads through "
              "the writer's engine, whose torch.load keeps torch>=2.6's weights_only=True: "
              "DeepSpeed's own optimizer state (ZeroStageEnum, LossScaler) refuses to unpickle, "
              "so the checkpoint it just saved does not load",
        deepspeed=">=0.19.6,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/issues/8500",
        cases=("test_checkpoint.py::test_load_throughput[cuda-fast]",
               "test_checkpoint.py::test_load_throughput[cuda-fast-ws1]"),
        failure=r"Weights only load failed",
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13: with checkpoint.writer type python "
             "(and fast, decoupled) every rank raised UnpicklingError 'Weights only load "
             "failed' in FastCheckpointEngine.load; fast itself needs a GPU (pinned buffer): "
             "the listed case ran on 2xH200 (2026-11-30, DeepSpeed 0.19.8) and strict-xfailed "
             "there (results/reference/h200-x2/ds-0.19.8); its one-rank twin failed the same "
             "way on 1xH200 (DeepSpeed 0.19.8, results/reference/h200-x1/ds-0.19.8; "
             "DeepSpeed 0.19.6, results/reference/h200-x1/ds-0.19.6)",
    ),
    KnownIssue(
        id="DS-3377-MISSING-TAG-UNNAMED",
        title="load_checkpoint of a tag whose files are missing (a `latest` naming a tag that "
              "was never written or was deleted) stops on a bare `assert len(self.ckpt_list) "
              "> 0` (runtime/state_dict_factory.py check_ckpt_list): refused, but the error "
              "names neither the tag nor the directory",
        deepspeed=">=0.16.9,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/issues/3377",
        cases=("test_checkpoint.py::test_a_latest_naming_a_missing_tag_is_refused[*]",),
        failure=r"was not refused by name:[\s\S]*raised 'AssertionError: '",
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13, ZeRO-2 on 2 ranks: every rank raised "
             "AssertionError with an empty message from check_ckpt_list; the weights stayed "
             "the fresh engine's; the radar: 0.16.9 on (results/reference/radar/cpu)",
    ),
    KnownIssue(
        id="DS-8474-UCP-FP32-REBOUND",
        title="after load_checkpoint of a universal checkpoint (ZeRO 1/2), each parameter's fp32 "
              "fragment is rebound to an optimizer moment (map_to_flat_opt_states): "
              "safe_get_full_fp32_param returns exp_avg_sq instead of the master weights",
        deepspeed=">=0.16.9,<=0.19.6",
        fixed_in="0.19.7",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8474",
        cases=("test_checkpoint.py::test_universal_reshard[*-z1-fp32-*]",
               "test_checkpoint.py::test_universal_reshard[*-z1-bf16-*]",
               "test_checkpoint.py::test_universal_reshard[*-z2-fp32-*]",
               "test_checkpoint.py::test_universal_reshard[*-z2-bf16-*]"),
        # The fp32 master read back is exp_avg_sq: max rel diff 1 (CPU machine, 0.19.6)
        failure=(r"state of 'fp32/[^']+'( \(rank \d+\))?: max abs diff \S+, "
                 r"max rel diff (1|0\.99\d*)\b"),
        seen="CPU machine, DeepSpeed 0.19.6, torch 2.13, 2 -> 1 and 1 -> 2 ranks: every fp32 "
             "master read back equals that parameter's exp_avg_sq (max rel diff 1), module "
             "weights and moments exact; stage 3 exact. The PR's description names the same "
             "rebinding (also #8385); its fix (map_to_flat_opt_states binds "
             "optim_fragment[key], utils/tensor_fragment.py) is in the 0.19.7 sdist, and "
             "0.19.7 passed the z2 fp32 2 -> 1 cell in 5 runs of 5; the radar: 0.16.9 to "
             "0.19.6, exact from 0.19.7",
    ),
    KnownIssue(
        id="DS-7948-Z12-FLAT-BUFFER-VIEW",
        title="ZeRO 1/2 on more than one rank flattens the parameters on the accelerator "
              "(#7828) into a buffer that keeps autograd history: the first all-gather into "
              "its split views raises 'Output 0 of Split is a view and is being modified "
              "inplace' (the CPU accelerator always takes that path)",
        deepspeed="==0.18.9",
        # DeepSpeed's half: the buffer keeps its history (#7828, in 0.18.7; detached by #7948 in
        # 0.19.0). torch's half: 2.13's gloo all-gather writes through autograd-visible views.
        kind=TORCH,
        torch=">=2.13",
        link="https://github.com/deepspeedai/DeepSpeed/pull/7948",
        fixed_in="0.19.0",
        cases=(
            "test_zero.py::test_zero_matches_ddp[cpu-z1-*-ws2]",
            "test_zero.py::test_zero_matches_ddp[cpu-z2-*-ws2]",
            "test_zero.py::test_zero_partition_padding[cpu-1]",
            "test_zero.py::test_zero_partition_padding[cpu-2]",
            "test_zero.py::test_zero_clipping_matches_ddp[cpu-z1-*]",
            "test_zero.py::test_zero_clipping_matches_ddp[cpu-z2-*]",
            "test_loss_scaling.py::test_bf16_has_no_scaler[cpu-z1-ws2]",
            "test_loss_scaling.py::test_bf16_has_no_scaler[cpu-z2-ws2]",
            "test_loss_scaling.py::test_overflow_handling[cpu-z1-ws2-*]",
            "test_loss_scaling.py::test_overflow_handling[cpu-z2-ws2-*]",
            "test_loss_scaling.py::test_applied_steps_match_fp32[cpu-z1-ws2-*]",
            "test_loss_scaling.py::test_applied_steps_match_fp32[cpu-z2-ws2-*]",
            "test_checkpoint.py::test_round_trip_is_exact[cpu-1-*]",
            "test_checkpoint.py::test_round_trip_is_exact[cpu-2-*]",
            "test_checkpoint.py::test_partial_load[cpu-*-1-*]",
            "test_checkpoint.py::test_partial_load[cpu-*-2-*]",
            "test_checkpoint.py::test_consolidated_fp32_equals_masters[cpu-1-*]",
            "test_checkpoint.py::test_consolidated_fp32_equals_masters[cpu-2-*]",
            "test_checkpoint.py::test_universal_reshard[cpu-z1-*-ws2to1]",
            "test_checkpoint.py::test_universal_reshard[cpu-z2-*-ws2to1]",
            "test_checkpoint.py::test_stage_change[cpu-z1-to-z2]",
            "test_checkpoint.py::test_stage_change[cpu-z2-to-z1]",
            "test_checkpoint.py::test_damaged_checkpoint_is_refused[cpu-z2-*]",
            "test_checkpoint.py::test_flipped_bit_is_detected[cpu]",
            "test_checkpoint.py::test_storage_returns_written_bytes[cpu]",
            "test_checkpoint.py::test_client_state_comes_back[cpu-z2]",
            "test_checkpoint.py::test_a_latest_naming_a_missing_tag_is_refused[cpu-z2]",
            "test_checkpoint.py::test_stage_change[cpu-z2-to-z3]",
            "test_schedules.py::test_resume_continues_the_curve[*]",
        ),
        failure=r"Output 0 of Split(Backward0)? is a view and is being modified inplace",
        seen="CPU machine, 0.18.9, torch 2.13.0+cpu, 2 ranks (the radar): every ZeRO-1/2 "
             "engine raised it in its first step(), inside torch's all_gather_single; one rank "
             "trains; 0.17.6 and 0.16.9 flatten a CPU copy. No older torch was run beside it",
    ),
    KnownIssue(
        id="DS-8142-WARMUP-COSINE-PAST-END",
        title="WarmupCosineLR with total_num_steps <= warmup_num_steps leaves the floor after "
              "the warmup: the cosine runs on past its end (progress not clamped to 1)",
        deepspeed=">=0.16.9,<=0.19.2",
        fixed_in="0.19.3",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8142",
        cases=("test_schedules.py::test_warmup_cosine_lr[*]",),
        failure=(r"WarmupCosineLR\(total_num_steps=(\d+), [^)]*warmup_num_steps=(\d+)[^)]*\) "
                 r"on ZeRO stage \d, optimizer lr [\d.]+: iteration \d+ \(the lr of step \d+\): "
                 r"the (lr the param group holds|scheduler's get_last_lr\(\)) is"),
        seen="CPU machine, 0.16.9, torch 2.13 (the radar): total 2, warmup 4, cos_min_ratio "
             "0.5: iteration 4 held 0.0375, the floor 0.025; 0.19.3 clamps it (#8142)",
    ),
    KnownIssue(
        id="DS-8179-ONECYCLE-STAIRS-IGNORED",
        title="OneCycle ignores cycle_first_stair_count and cycle_second_stair_count: the lr "
              "moves every step instead of in stairs",
        deepspeed=">=0.16.9,<=0.19.3",
        fixed_in="0.19.4",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8179",
        cases=("test_schedules.py::test_one_cycle[*]",),
        failure=(r"OneCycle\([^)]*cycle_first_stair_count=[1-9][^)]*\) on ZeRO stage \d, "
                 r"optimizer lr [\d.]+: iteration \d+ \(the lr of step \d+\): the (lr the param "
                 r"group holds|scheduler's get_last_lr\(\)) is"),
        seen="CPU machine, 0.16.9, torch 2.13 (the radar): stairs 3 and 2 over 6 steps: "
             "iteration 0 held 0.00167, the first stair 0.0; 0.19.4 quantises (#8179)",
    ),
    KnownIssue(
        id="DS-6976-SCALE-WINDOW-EARLY",
        title="ZeRO 1-3 fp16: the dynamic loss scale rises after loss_scale_window - 1 clean "
              "steps (the window counts the overflow step itself)",
        deepspeed="==0.16.9",
        fixed_in="0.17.1",
        link="https://github.com/deepspeedai/DeepSpeed/pull/6976",
        cases=("test_loss_scaling.py::test_measured_sequence",
               *(f"test_loss_scaling.py::test_overflow_handling[*-z{z}-*-h*]" for z in (1, 2, 3))),
        failure=(r"DeepSpeed's scaler went \[[^\]]*\], measured on ZeRO 1-3"
                 r"|step \d+ \(clean\): loss scale after the step [\d.]+, the model's [\d.]+"),
        seen="CPU machine, 0.16.9, torch 2.13 (the radar): window 2, hysteresis 2, .XX...XXX: "
             "256,256,128,128,256 where 0.17.1 on go 256,256,128,128,128 (#6976)",
    ),
    KnownIssue(
        id="DS-Z0-FP16-RAISE-STEP-HALVED",
        title="ZeRO stage 0 fp16 (FP16_UnfusedOptimizer): on a step where the dynamic loss scale "
              "rises, the gradients are unscaled by the raised scale (SGD moves 0.79x as far)",
        deepspeed=">=0.16.9,<=0.17.6",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8588",
        cases=("test_loss_scaling.py::test_applied_steps_match_fp32[*-z0-*-h1-*-sgd]",
               "test_loss_scaling.py::test_applied_steps_match_fp32[*-z0-*-h2-*-sgd]"),
        failure=r"\(scale \d+\): moved the fp32 masters 0\.(7[5-9]|8[0-5])\d*x as far",
        seen="CPU machine, 0.16.9 and 0.17.6, torch 2.13, 2 ranks (the radar): step 5 (scale "
             "rises to 128) moved 0.7879x as far; DS-8588's ordering in the stage-0 wrapper",
    ),
    KnownIssue(
        id="DS-7839-Z0-BF16-LOSS-SCALED",
        title="ZeRO stage 0 bf16 (the non-ZeRO mode of #7515) runs the fp16 dynamic loss "
              "scaler (scale 65536) and never unscales: gradients 65536x, training diverges",
        deepspeed="==0.17.6",
        fixed_in="0.18.6",
        link="https://github.com/deepspeedai/DeepSpeed/pull/7839",
        cases=("test_loss_scaling.py::test_bf16_has_no_scaler[*-z0-*]",
               "test_zero.py::test_zero_matches_ddp[*-z0-*-bf16-*]"),
        failure=(r"bf16 has a loss scaler \(dynamic=True, scale 65536(\.0)?\)"
                 r"|grad of '[^']+': max abs diff \S+, max rel diff [5-7]\.\d+e\+04"),
        seen="CPU machine, 0.17.6, torch 2.13 (the radar): scale 65536 for bf16, step 0's "
             "gradients 6.7e4x DDP's; 0.18.6 gives stage 0 per-dtype scale profiles (#7839)",
    ),
    KnownIssue(
        id="DS-Z12-EMPTY-PARTITION-ACCUM",
        title="ZeRO 1/2 with gradient accumulation: a rank whose partition holds no parameter "
              "raises IndexError in the backward epilogue (get_flat_partition)",
        deepspeed="==0.17.6",
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.17.6/deepspeed/runtime/zero/"
             "stage_1_and_2.py",
        cases=("test_schedules.py::test_resume_continues_the_curve[*]",),
        failure=r"IndexError: list index out of range[\s\S]*get_flat_partition",
        seen="CPU machine, 0.17.6, torch 2.13, 2 ranks (the radar): the one-weight schedule "
             "model on ZeRO-2; 0.16.9 and 0.18.x (all_grad_tensors) train it",
    ),
    KnownIssue(
        id="DS-8212-ZINF-SWAP-ABORT",
        title="ZeRO-3 with the optimizer on NVMe (CPU accelerator): the first optimizer-state "
              "swap-out aborts the process (SIGABRT in partitioned_optimizer_swapper)",
        deepspeed=">=0.17.6,<=0.19.3",
        fixed_in="0.19.4",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8212",
        cases=("test_deepnvme.py::test_zero_infinity_matches_ddp[*-cpu-opt-*]",),
        failure=(r"killed by SIGABRT in suites\.deepnvme_ranks\.train_zero_infinity"
                 r"[\s\S]*partitioned_optimizer_swapper\.py"),
        seen="CPU machine, 0.17.6, torch 2.13, 2 ranks (the radar): SIGABRT in "
             "_swap_out_optimizer_state; 0.19.4 swaps through the I/O handles (#8212)",
    ),
    KnownIssue(
        id="DS-8419-FLOPS-LINEAR-BIAS",
        title="the flops profiler counts F.linear without its bias: a Linear with bias is "
              "short one flop per output element (its conv and addmm counters count theirs)",
        deepspeed="==0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8419",
        cases=("test_flops.py::test_model_profile[*-linear_bias]",),
        # 2 x 13 MACs per output element counted, 2 x 13 + 1 flops done: 26/27 = 0.963
        failure=r"get_model_profile of linear_bias .*: flops \d+, analytic \d+ \(0\.963x\)",
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13: Linear(13, 7) on (3, 5, 13) counted "
             "2730 flops where the matmul and the bias add are 2835 (MACs, parameters exact)",
    ),
    KnownIssue(
        id="DS-8419-FLOPS-MATMUL-SHAPES",
        title="the flops profiler's torch.matmul counter multiplies the first operand's size by "
              "the second's last dimension: a broadcast batch of the second operand is dropped "
              "and a vector second operand is counted as a matrix",
        deepspeed="==0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8419",
        cases=("test_flops.py::test_model_profile[*-matmul_broadcast]",
               "test_flops.py::test_model_profile[*-matmul_vector]",
               "test_flops.py::test_model_profile[*-dot]"),
        failure=(r"get_model_profile of (matmul_broadcast|matmul_vector|dot) .*: flops \d+, "
                 r"analytic \d+ \((0\.3333|13)x\)"),
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13: (5, 13) @ (3, 13, 7) counted 455 MACs "
             "of 1365; (5, 13) @ (13,) 845 of 65, (13,) @ (13,) 169 of 13; 2-D, 3-D and bmm "
             "exact (_matmul_flops_compute: prod(input.shape) * other.shape[-1])",
    ),
    KnownIssue(
        id="DS-3087-FLOPS-OPERATORS",
        title="the flops profiler counts torch.add/torch.mul but not the operators: x * w + b "
              "counts 0 flops (every residual add and scale in a model is free)",
        deepspeed="==0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/issues/3087",
        cases=("test_flops.py::test_model_profile[*-scale_shift_operators]",),
        failure=(r"get_model_profile of scale_shift_operators .*: flops 0, analytic \d+ "
                 r"\(0x\)"),
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13: x * w + b over (3, 5, 13) counted 0 "
             "flops, torch.add(torch.mul(x, w), b) the exact 390 (open pull request #8509)",
    ),
    KnownIssue(
        id="DS-Z3-FLOPS-LINEAR-TWICE",
        title="the engine's flops profiler under ZeRO stage 3 counts every Linear twice: "
              "ZeRO-3 replaces F.linear by its memory-efficient wrapper, whose inner "
              "torch.matmul/addmm the profiler counts as well",
        deepspeed="==0.19.8",
        # No upstream issue or pull request names it yet: the link is the code at fault.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/zero/"
             "partition_parameters.py#L412-L419",
        cases=("test_flops.py::test_engine_profiler[*-z3]",),
        failure=(r"ZeRO stage 3, profile_step \d+: the profiler during step \d+: flops \d+, "
                 r"analytic \d+ \(2x\)"),
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13, one rank: two bias-free Linear layers "
             "counted 3840 flops and 1920 MACs where stage 0 counts the analytic 1920 and 960; "
             "_enable_mem_efficient_linear sets torch.nn.functional.linear = zero3_linear_wrap "
             "(for the life of the process), and LinearFunctionForZeroStage3.forward calls "
             "input.matmul (torch.addmm with a bias), both wrapped by the profiler",
    ),
    KnownIssue(
        id="DS-7665-MONITOR-NO-LOSS",
        title="the engine writes no training loss to its monitors (csv_monitor, tensorboard, "
              "wandb): Train/Samples/train_loss, which DeepSpeed's monitor docs list as logged "
              "automatically, is gone since the backward rework of PR #7665; only the lr (and "
              "the fp16 loss scale) remain",
        deepspeed="==0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/pull/7665",
        cases=("test_monitor.py::test_csv_loss[*]", "test_monitor.py::test_tensorboard_loss[*]"),
        failure=r"(csv_monitor|tensorboard) Train/Samples/train_loss: nothing written",
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13, ZeRO 1, 2 ranks: csv and event files "
             "hold Train/Samples/lr alone; the pull request removed the write from backward() "
             "(first in 0.18.3, not run); the pipeline engine still writes it",
    ),
    KnownIssue(
        id="DS-BATCH-ZERO-UNNAMED",
        title="a train_batch_size smaller than micro-batch (or accumulation) x world size is "
              "refused without naming it: the inferred third value is floor-divided to 0 and "
              "the error says only 'Gradient accumulation steps: 0' (or 'Micro batch size per "
              "gpu: 0') 'has to be greater than 0'",
        deepspeed="==0.19.8",
        # No upstream issue or pull request names it yet: the link is the code at fault.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/"
             "config.py#L590-L629",
        cases=("test_batch_size.py::test_too_small_is_refused_by_name[*]",),
        failure=(r"refused, but the error does not name [^\n]*: 'AssertionError: (Gradient "
                 r"accumulation steps|Micro batch size per gpu): 0 has to be greater than 0'"),
        seen="CPU machine, DeepSpeed 0.19.8, 2 ranks: train_batch_size 5 with micro-batch 3, "
             "7 with accumulation 4; a quotient of 1 or more that is not whole is refused by "
             "the rule's assertion, which names all three",
    ),
    KnownIssue(
        id="DS-8539-Z3-GLOO-GATHER-RACE",
        title="ZeRO-3 on gloo (the CPU accelerator, more than one rank): the coalesced parameter "
              "all-gather waits for its last handle only, so a parameter can be read while an "
              "earlier gather still writes it (torch.empty memory: NaN, inf, garbage); "
              "timing-dependent",
        deepspeed=">=0.16.9,<=0.19.7",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8539",
        fixed_in="0.19.8",
        intermittent=True,
        cases=(
            "test_zero.py::test_zero_matches_ddp[cpu-z3-*-ws2]",
            "test_zero.py::test_zero_partition_padding[cpu-3]",
            "test_zero.py::test_zero_clipping_matches_ddp[cpu-z3-*]",
            "test_loss_scaling.py::test_bf16_has_no_scaler[cpu-z3-ws2]",
            "test_loss_scaling.py::test_overflow_handling[cpu-z3-ws2-*]",
            "test_loss_scaling.py::test_applied_steps_match_fp32[cpu-z3-ws2-*]",
            "test_checkpoint.py::test_round_trip_is_exact[cpu-3-*]",
            "test_checkpoint.py::test_resume_in_fresh_process[cpu-3-*]",
            "test_checkpoint.py::test_partial_load[cpu-*-3-*]",
            "test_checkpoint.py::test_consolidated_fp32_equals_masters[cpu-3-*]",
            "test_checkpoint.py::test_universal_reshard[cpu-z3-*]",
            "test_checkpoint.py::test_load_without_a_tag_takes_the_newest[cpu-z3]",
            "test_deepnvme.py::test_zero_infinity_matches_ddp[*-cpu-*]",
        ),
        # A parameter read mid-gather holds torch.empty memory: NaN, inf, 1e30 and up, or a
        # stale value that diverges like any wrong one. On these cells and releases a
        # divergence from the reference cannot be told from the race; a crash or a hang FAILS.
        failure=(r"\d+ (NaN|inf)[^;\n]* of \d+ elements in the (candidate|reference)"
                 r"|loss( \(rank \d+\))?: -?(nan|inf) in the (candidate|reference)"
                 r"|max abs diff [\d.]+e\+(3\d|[4-9]\d)\b|first diverging step \d+: step"
                 r"|module must be the saved engine's|global gradient norm [\d.e+-]+, DDP's"
                 r"|\(weights of no save\)"),
        seen="CPU machine, 0.16.9-0.18.9, torch 2.13, 2 ranks (the radar): ZeRO-3 cells went "
             "NaN or inf in some runs only (a two-rank script matched DDP in 3 of 4 runs on "
             "0.18.9); launch_handles[-1].wait() up to 0.19.7, every handle in 0.19.8 (#8539)",
    ),
)

def case_name(path_name: str, test_name: str) -> str:
    """The string cases are matched against: ``test_zero.py::test_zero_matches_ddp[cpu-z0-...]``."""
    return f"{path_name}::{test_name}"


def issues_for(case: str, deepspeed_version: str | None,
               issues: tuple[KnownIssue, ...] = KNOWN_ISSUES,
               torch_version: str | None = None) -> list[KnownIssue]:
    """The registry's issues that cover ``case`` on this DeepSpeed version (and torch:
    default the installed one)."""
    return [ki for ki in _affecting(issues, deepspeed_version, torch_version) if ki.covers(case)]


@functools.lru_cache(maxsize=32)
def _affecting(issues: tuple[KnownIssue, ...], deepspeed_version: str | None,
               torch_version: str | None) -> tuple[KnownIssue, ...]:
    """The issues of this DeepSpeed and torch (asked for each of a collection's cases)."""
    return tuple(ki for ki in issues if ki.affects(deepspeed_version, torch_version))


def by_id(issue_id: str, issues: tuple[KnownIssue, ...] = KNOWN_ISSUES) -> KnownIssue:
    for ki in issues:
        if ki.id == issue_id:
            return ki
    raise KeyError(f"no known issue {issue_id!r} (known: {', '.join(k.id for k in issues)})")


# The registry's rules live beside it (dsconform/gate/known_issues_check.py): how it checks
# itself, and what a covered case's exception becomes.
check_registry = known_issues_check.check_registry
expected_failure = known_issues_check.expected_failure
