"""Known upstream issues of checkpoint save, load, tags and universal checkpoints
(test_checkpoint.py)."""

from __future__ import annotations

from dsconform.gate.known_issue import KnownIssue

ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="DS-8499-Z3-TAG-IGNORED-WITHOUT-OPTIMIZER",
        title="ZeRO-3 load_checkpoint(dir, tag, load_optimizer_states=False) rebuilds the "
              "weights from the tag `latest` names, not from the tag asked for: it returns that "
              "tag's path and step counter with the newest save's weights (a rollback to an "
              "earlier checkpoint silently keeps the later weights)",
        deepspeed=">=0.19.7,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/issues/8499",
        cases=("test_checkpoint_files.py::test_an_earlier_tag_loads_that_tag[*-z3*-no_optimizer]",),
        # The step counter is the tag's, the weights are no save's of that step.
        failure=(r"load_checkpoint did not load the tag asked for, s1:[\s\S]*at step (\d+) "
                 r"\(weights of no save\); asked for s1 at step \1\b"),
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13, 2 ranks, 2026-12-05: three saves s1-s3 "
             "one step apart, load of s1 without the optimizer state: every rank returns s1's "
             "path and step counter, its weights are not s1's (an outside reproduction on 0.19.7 "
             "and 0.19.8, 1 and 2 ranks, found them equal to the newest save's, 0.128 from s1's); "
             "with the optimizer state the same load is right, as are stages 1-2 (issue #8499, "
             "PR #8501 open)",
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
    KnownIssue(
        id="DS-7786-Z0-BF16-LOAD-AS-ZERO",
        title="ZeRO stage 0 bf16 (FP16_UnfusedOptimizer since #7515): load_checkpoint still "
              "takes the ZeRO path for any bf16 engine and reads the optimizer's "
              "dp_process_group, which the stage-0 wrapper has not: the load raises "
              "AttributeError",
        deepspeed="==0.17.6",
        fixed_in="0.18.0",
        link="https://github.com/deepspeedai/DeepSpeed/pull/7786",
        cases=("test_checkpoint.py::test_round_trip_is_exact[*-0-*-bf16]",),
        failure=r"'FP16_UnfusedOptimizer' object has no attribute 'dp_process_group'",
        seen="CPU machine (2 cores), 0.17.6, torch 2.8.0, 2 ranks (the radar): every rank "
             "raised it in _get_all_zero_checkpoint_state_dicts; engine.py's load_zero_checkpoint "
             "is `self.zero_optimization() or self.bfloat16_enabled()` in 0.17.6, "
             "`self.zero_optimization()` from 0.18.0 (#7786, fix checkpointing/loading of "
             "z0+bf16); 0.18.5 loads (and fails DS-7839's way)",
    ),
    # The 1-bit optimizers were removed in 0.19.7 (PR #8490): nothing will be fixed upstream.
    KnownIssue(
        id="DS-8500-WRITER-RELOAD",
        title="with a checkpoint writer configured (FastPersist), load_checkpoint reads through "
              "the writer's engine, whose torch.load keeps torch>=2.6's weights_only=True: "
              "DeepSpeed's own optimizer state (ZeroStageEnum, LossScaler) refuses to unpickle, "
              "so the checkpoint it just saved does not load",
        deepspeed=">=0.19.6,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/issues/8500",
        cases=("test_checkpoint_files.py::test_load_throughput[cuda-fast]",
               "test_checkpoint_files.py::test_load_throughput[cuda-fast-ws1]"),
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
        cases=("test_checkpoint_files.py::test_a_latest_naming_a_missing_tag_is_refused[*]",),
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
)
