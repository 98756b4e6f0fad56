"""Known upstream issues of a model's state through the engine and zero_to_fp32
(test_state_fidelity.py)."""

from __future__ import annotations

from dsconform.gate.known_issue import KnownIssue

ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="DS-5812-BUFFERS-CAST",
        title="bf16/fp16 engines cast every floating buffer to the training dtype "
              "(module.half() / module.bfloat16() in _configure_distributed_model): fp32 "
              "BatchNorm statistics, scales and rotary tables, persistent or not, lose "
              "precision, and an fp16 buffer becomes bf16",
        deepspeed=">=0.16.9,<=0.19.1",
        fixed_in="0.19.2",
        link="https://github.com/deepspeedai/DeepSpeed/issues/5812",
        cases=("test_state_fidelity.py::test_state_round_trip[*-bf16-*]",
               "test_state_fidelity.py::test_state_round_trip[*-fp16-*]"),
        failure=(r"state '[\w.]+' \(rank \d+, engine\): torch\.(bfloat16|float16) \(\d*,?\) "
                 r"in the candidate, torch\.(float32|float16|bfloat16) \(\d*,?\) in the "
                 r"reference"),
        seen="CPU machine, DeepSpeed 0.18.9, torch 2.11, bf16 at stages 0, 1 and 3: 'scale', "
             "'table_fp16', the BatchNorm statistics and the non-persistent 'cache' came back "
             "bf16 from the engine; 0.16.9, 0.17.6, 0.19.0 and 0.19.1 carry the same blanket "
             "cast (read in their sources, not run); PR 8066 (0.19.2) casts parameters only "
             "and keeps buffers unless data_types.buffer_dtype is set",
    ),
    KnownIssue(
        id="DS-8515-ZERO-TO-FP32-INT-BUFFERS",
        title="get_fp32_state_dict_from_zero_checkpoint casts every buffer with .float(): "
              "int64 counters (BatchNorm's num_batches_tracked) and bool masks come back "
              "float32, and int64 values above 2**24 change",
        deepspeed=">=0.16.9,<=0.19.7",
        fixed_in="0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8515",
        cases=("test_state_fidelity.py::test_state_round_trip[*-z1-*]",
               "test_state_fidelity.py::test_state_round_trip[*-z2-*]",
               "test_state_fidelity.py::test_state_round_trip[*-z3-*]"),
        # Only where nothing else failed: a value out of tolerance is never this issue.
        failure=(r"^(?!.*compared quantities out of tolerance).*state '[\w.]+' \(rank 0, "
                 r"get_fp32_state_dict_from_zero_checkpoint\): torch\.float32 \(\d*,?\) in "
                 r"the candidate, torch\.(int64|bool) \(\d*,?\) in the reference"),
        seen="CPU machine, DeepSpeed 0.18.9, torch 2.11, fp32 at stages 2 and 3 on one rank: "
             "'mask', 'calls' and 'norm.num_batches_tracked' came back float32, every other "
             "entry exact; 0.16.9, 0.17.6 and 0.19.0-0.19.7 carry the same "
             "`{k: v.float() ...}` in zero_to_fp32.parse_model_states (read in their "
             "sources, not run); 0.19.8 keeps non-floating buffers (the change PR 8515 "
             "describes) and passes",
    ),
    KnownIssue(
        id="DS-Z0-BF16-LOAD-NO-DP-GROUP",
        title="ZeRO stage 0 bf16 with bf16 gradient accumulation (FP16_UnfusedOptimizer) saves "
              "a zero checkpoint that load_checkpoint cannot read: "
              "_get_all_zero_checkpoint_state_dicts asks the optimizer for its "
              "dp_process_group, which that wrapper does not have",
        deepspeed="==0.17.6",
        # Found by this suite; no upstream report found: the link is the line at fault.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.17.6/deepspeed/runtime/"
             "engine.py#L3351",
        cases=("test_state_fidelity.py::test_state_round_trip[*-z0-bf16-*]",),
        failure=r"'FP16_UnfusedOptimizer' object has no attribute 'dp_process_group'",
        seen="CPU machine, DeepSpeed 0.17.6 (the first release with this stage-0 bf16 path, PR "
             "7515), torch 2.8, 2 ranks: every rank raised AttributeError in load_checkpoint; "
             "the save succeeded; 0.18.5 (torch 2.10) loads the same checkpoint",
    ),
)
