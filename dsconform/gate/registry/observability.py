"""Known upstream issues of the flops profiler, the monitor and the batch-size rule (test_flops.py,
test_monitor.py, test_batch_size.py)."""

from __future__ import annotations

from dsconform.gate.known_issue import KnownIssue

ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="DS-8419-FLOPS-LINEAR-BIAS",
        title="the flops profiler counts F.linear without its bias: a Linear with bias is "
              "short one flop per output element (its conv and addmm counters count theirs)",
        deepspeed=">=0.16.9,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8419",
        cases=("test_flops.py::test_model_profile[*-linear_bias]",),
        # 2 x 13 MACs per output element counted, 2 x 13 + 1 flops done: 26/27 = 0.963
        failure=r"get_model_profile of linear_bias .*: flops \d+, analytic \d+ \(0\.963x\)",
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13: Linear(13, 7) on (3, 5, 13) counted "
             "2730 flops where the matmul and the bias add are 2835 (MACs, parameters exact); "
             "the same 2730 on every release of the radar's CPU timeline, 0.16.9 (torch 2.7.0) "
             "to 0.19.8 (torch 2.14.1): _linear_flops_compute is unchanged since 0.16.9",
    ),
    KnownIssue(
        id="DS-8419-FLOPS-MATMUL-SHAPES",
        title="the flops profiler's torch.matmul counter multiplies the first operand's size by "
              "the second's last dimension: a broadcast batch of the second operand is dropped "
              "and a vector second operand is counted as a matrix",
        deepspeed=">=0.16.9,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8419",
        cases=("test_flops.py::test_model_profile[*-matmul_broadcast]",
               "test_flops.py::test_model_profile[*-matmul_vector]",
               "test_flops.py::test_model_profile[*-dot]"),
        failure=(r"get_model_profile of (matmul_broadcast|matmul_vector|dot) .*: flops \d+, "
                 r"analytic \d+ \((0\.3333|13)x\)"),
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13: (5, 13) @ (3, 13, 7) counted 455 MACs "
             "of 1365; (5, 13) @ (13,) 845 of 65, (13,) @ (13,) 169 of 13; 2-D, 3-D and bmm "
             "exact (_matmul_flops_compute: prod(input.shape) * other.shape[-1]); the same counts "
             "on every release of the radar's CPU timeline, 0.16.9 (torch 2.7.0) to 0.19.8 "
             "(torch 2.14.1)",
    ),
    KnownIssue(
        id="DS-3087-FLOPS-OPERATORS",
        title="the flops profiler counts torch.add/torch.mul but not the operators: x * w + b "
              "counts 0 flops (every residual add and scale in a model is free)",
        deepspeed=">=0.16.9,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/issues/3087",
        cases=("test_flops.py::test_model_profile[*-scale_shift_operators]",),
        failure=(r"get_model_profile of scale_shift_operators .*: flops 0, analytic \d+ "
                 r"\(0x\)"),
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13: x * w + b over (3, 5, 13) counted 0 "
             "flops, torch.add(torch.mul(x, w), b) the exact 390 (open pull request #8509); "
             "0 on every release of the radar's CPU timeline, 0.16.9 (torch 2.7.0) to 0.19.8 "
             "(torch 2.14.1)",
    ),
    KnownIssue(
        id="DS-8246-FLOPS-SDPA-WRAPPERS-PILE-UP",
        title="the flops profiler's end_profile leaves F.scaled_dot_product_attention (and "
              "Tensor.__matmul__) wrapped: every later profile in the process wraps it again, "
              "so the k-th profile counts an attention k times",
        deepspeed=">=0.16.9,<=0.19.5",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8246",
        fixed_in="0.19.6",
        # k is the number of profiles the rank's process ran before: the cell passes where it
        # is the process's first profile (run alone), so a pass proves nothing.
        intermittent=True,
        cases=("test_flops.py::test_model_profile[*-attention]",),
        failure=r"get_model_profile of attention .*: flops \d+, analytic \d+ \(([2-9]|\d\d+)x\)",
        seen="CPU machine (2 cores), the radar's CPU timeline: 0.16.9 (torch 2.7.0), 0.17.6 "
             "(2.8.0) and 0.18.5 (2.10.0) counted 58800 flops, 10x the analytic 5880, for the "
             "attention cell, the tenth get_model_profile in its pooled rank; alone in a fresh "
             "rank it is exact. _reload_functionals restores neither F.scaled_dot_product_"
             "attention nor Tensor.__matmul__ (and rebinds torch.bmm to torch.matmul) up to "
             "0.19.5; 0.19.6 restores each from its own saved original (#8246)",
    ),
    KnownIssue(
        id="DS-8324-FLOPS-BROADCAST-FROM-FRONT",
        title="the flops profiler counts a broadcasting elementwise op over a shape it aligns "
              "from the first dimension: torch.mul/torch.add of a (3, 5, 13) activation by a "
              "(13,) vector is counted over (13, 5, 13), 13/3 of its elements",
        deepspeed=">=0.16.9,<=0.19.6",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8324",
        fixed_in="0.19.7",
        cases=("test_flops.py::test_model_profile[*-scale_shift]",),
        failure=(r"get_model_profile of scale_shift \(inputs .*: flops \d+, analytic \d+ "
                 r"\(4\.333x\)"),
        seen="CPU machine (2 cores), the radar's CPU timeline: 0.16.9 (torch 2.7.0) to 0.19.6 "
             "(torch 2.13.0) counted 1690 flops for torch.add(torch.mul(x, w), b) over "
             "(3, 5, 13), 2 x 845 where the result has 195 elements (analytic 390); "
             "_elementwise_flops_compute padded the shorter shape on the right; 0.19.7 takes "
             "torch.broadcast_shapes (#8324) and counts 390",
    ),
    KnownIssue(
        id="DS-Z3-FLOPS-LINEAR-TWICE",
        title="the engine's flops profiler under ZeRO stage 3 counts every Linear twice: "
              "ZeRO-3 replaces F.linear by its memory-efficient wrapper, whose inner "
              "torch.matmul/addmm the profiler counts as well",
        deepspeed=">=0.19.4,<=0.19.8",
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
             "input.matmul (torch.addmm with a bias), both wrapped by the profiler. CPU "
             "machine (2 cores), torch 2.13: 0.19.4 counts 2x too, 0.19.3 the analytic counts: "
             "0.19.4 installs the wrapper for deepspeed.initialize(model=...) as well, not only "
             "inside zero.Init (PR #8189)",
    ),
    KnownIssue(
        id="DS-7665-MONITOR-NO-LOSS",
        title="the engine writes no training loss to its monitors (csv_monitor, tensorboard, "
              "wandb): Train/Samples/train_loss, which DeepSpeed's monitor docs list as logged "
              "automatically, is gone since the backward rework of PR #7665; only the lr (and "
              "the fp16 loss scale) remain",
        deepspeed=">=0.18.3,<=0.19.8",
        link="https://github.com/deepspeedai/DeepSpeed/pull/7665",
        cases=("test_monitor.py::test_csv_loss[*]", "test_monitor.py::test_tensorboard_loss[*]"),
        failure=r"(csv_monitor|tensorboard) Train/Samples/train_loss: nothing written",
        seen="CPU machine, DeepSpeed 0.19.8, torch 2.13, ZeRO 1, 2 ranks: csv and event files "
             "hold Train/Samples/lr alone; the pull request removed the write from backward() "
             "(first in 0.18.3: 0.18.2's engine.py still has it); the pipeline engine still "
             "writes it. The radar's CPU timeline saw nothing written on every release from "
             "0.18.5 (torch 2.10.0) to 0.19.8 (torch 2.14.1)",
    ),
    KnownIssue(
        id="DS-MONITOR-LOSS-STEP-EARLY",
        title="the engine writes each optimizer step's Train/Samples/train_loss at the sample "
              "count before that step (its Train/Samples/lr and the pipeline engine's loss at "
              "the count after it): the loss curve sits one step to the left of every other "
              "series",
        deepspeed=">=0.16.9,<=0.18.2",
        # No upstream report found: the link is the write in backward(), before step() counts
        # the step's samples; docs/known-issues.md#ds-monitor-loss-step-early describes it.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.18.2/deepspeed/runtime/"
             "engine.py#L2266-L2274",
        cases=("test_monitor.py::test_csv_loss[*]", "test_monitor.py::test_tensorboard_loss[*]"),
        # the first step's loss (the same to 5 digits) at step index 0, after a whole batch
        failure=(r"(csv_monitor|tensorboard) Train/Samples/train_loss: optimizer step 0 wrote "
                 r"(-?\d+\.\d{4})\d* at step index 0; the engine held \2\d* with [1-9]\d* "
                 r"samples"),
        seen="CPU machine (2 cores), the radar's CPU timeline, 0.16.9 (torch 2.7.0) and 0.17.6 "
             "(torch 2.8.0), ZeRO 1, 2 ranks, 16 samples a step: the csv monitor wrote the "
             "six losses at 0, 16, ..., 80 and the lr at 16, 32, ..., 96; the values equal the "
             "engine's losses (3.2e-8 rel) one step to the left",
    ),
    KnownIssue(
        id="DS-BATCH-ZERO-UNNAMED",
        title="a train_batch_size smaller than micro-batch (or accumulation) x world size is "
              "refused without naming it: the inferred third value is floor-divided to 0 and "
              "the error says only 'Gradient accumulation steps: 0' (or 'Micro batch size per "
              "gpu: 0') 'has to be greater than 0'",
        deepspeed=">=0.16.9,<=0.19.8",
        # No upstream issue or pull request names it yet: the link is the code at fault.
        link="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/"
             "config.py#L590-L629",
        cases=("test_batch_size.py::test_too_small_is_refused_by_name[*]",),
        failure=(r"refused, but the error does not name [^\n]*: 'AssertionError: (Gradient "
                 r"accumulation steps|Micro batch size per gpu): 0 has to be greater than 0'"),
        seen="CPU machine, DeepSpeed 0.19.8, 2 ranks: train_batch_size 5 with micro-batch 3, "
             "7 with accumulation 4; a quotient of 1 or more that is not whole is refused by "
             "the rule's assertion, which names all three. The radar (CPU machine (2 cores), "
             "2 ranks): 0.16.9 + torch 2.7.0, 0.17.6 + 2.8.0 and 0.18.5 + 2.10.0 refuse it "
             "the same way; _set_batch_related_parameters and its asserts differ only in "
             "comments from 0.16.9 to 0.19.8",
    ),
)
