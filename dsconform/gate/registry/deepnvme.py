"""Known upstream issues of DeepNVMe and ZeRO-Infinity (test_deepnvme.py)."""

from __future__ import annotations

from dsconform.gate.known_issue import KnownIssue

ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="DS-Z3-INIT-DTYPE-NVME",
        title="ZeRO-3 without fp16 support on the accelerator ignores the model's dtype: fp32 "
              "parameters offloaded to NVMe come back as bf16 (zero.Init._set_dtype)",
        deepspeed="==0.19.8",
        # Pull request #8428 (open) adds the missing () to is_bf16_supported on the same line;
        # the precedence of `dtype or fp16 if ... else ...` that drops the dtype stays.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/zero/"
             "partition_parameters.py#L409-L410",
        cases=("test_zero_infinity.py::test_zero_infinity_matches_ddp[*-cpu-param+opt-fp32-*]",),
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
        id="DS-8212-ZINF-SWAP-ABORT",
        title="ZeRO-3 with the optimizer on NVMe (CPU accelerator): the first optimizer-state "
              "swap-out aborts the process (SIGABRT in partitioned_optimizer_swapper)",
        deepspeed=">=0.17.6,<=0.19.3",
        fixed_in="0.19.4",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8212",
        cases=("test_zero_infinity.py::test_zero_infinity_matches_ddp[*-cpu-opt-*]",),
        failure=(r"killed by SIGABRT in suites\.deepnvme_ranks\.train_zero_infinity"
                 r"[\s\S]*partitioned_optimizer_swapper\.py"),
        seen="CPU machine, 0.17.6, torch 2.13, 2 ranks (the radar): SIGABRT in "
             "_swap_out_optimizer_state; 0.19.4 swaps through the I/O handles (#8212)",
    ),
    KnownIssue(
        id="DS-8212-ZINF-PARAM-POOL-UNPINNED",
        title="ZeRO-3 with parameters offloaded to NVMe on the CPU accelerator: "
              "deepspeed.initialize fails an assertion in SwapBufferPool (every swap buffer "
              "must be pinned; the CPU accelerator's pin_memory returns the tensor unpinned)",
        deepspeed=">=0.17.6,<=0.19.3",
        fixed_in="0.19.4",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8212",
        cases=("test_zero_infinity.py::test_zero_infinity_matches_ddp[*-cpu-param+opt-*]",),
        failure=(r"raised AssertionError: [\s\S]*reserve_partitioned_swap_space[\s\S]*"
                 r"assert all\(\[get_accelerator\(\)\.is_pinned\(buf\)"),
        seen="CPU machine (2 cores), 2 ranks, the radar: 0.17.6 + torch 2.8.0 and 0.18.5 + "
             "torch 2.10.0, the bf16 SGD cell: every rank raised a bare AssertionError in "
             "swap_tensor/utils.py SwapBufferPool.__init__, from "
             "partitioned_param_swapper.reserve_partitioned_swap_space; tensor.is_pinned() "
             "is False there on torch 2.7.0, 2.8.0 and 2.10.0 alike. 0.19.4 allocates the "
             "swap buffers through the I/O handle and asks it (aio_handle.is_pinned, #8212). "
             "0.16.9 skips the cell (compat: the reworked aio handle)",
    ),
)
