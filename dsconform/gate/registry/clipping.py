"""Known upstream issues of DeepSpeed's gradient-norm and clipping helpers
(test_grad_clipping.py)."""

from __future__ import annotations

from dsconform.gate.known_issue import KnownIssue

ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="DS-8313-CLIP-NORM-SQUARED",
        title="deepspeed.runtime.utils.clip_grad_norm_ combines the per-tensor p-norms by "
              "squaring them whatever the norm type, then takes the 1/p root: right for the "
              "2-norm only; the 1-norm it returns (and clips by) is the sum of the squared "
              "per-tensor 1-norms",
        deepspeed=">=0.16.9,<=0.19.6",
        link="https://github.com/deepspeedai/DeepSpeed/pull/8313",
        fixed_in="0.19.7",
        cases=("test_grad_clipping.py::test_norm_matches_torch[*-1-*]",
               "test_grad_clipping.py::test_norm_across_ranks[*-1-*]"),
        # clip_grad_norm_'s norm and clipped gradients, and no other helper's
        failure=(r"^(?!.*rank \d+: (?!clip_grad_norm_ )\S+ (gave norm|clipped))"
                 r".*rank \d+: clip_grad_norm_ gave norm [\d.e+]+, torch [\d.e+]+ "
                 r"\(rel diff [\d.e+]+\)"),
        seen="CPU machine (2 cores), the radar's CPU timeline, 0.16.9 (torch 2.7.0) to 0.19.6 "
             "(torch 2.13.0): the 1-norm of gradients whose torch norm is 62272.95 came back "
             "as 3.649e9 on 1 and 2 replicated ranks and 1.826e9 over 2 ranks' slices, and "
             "the gradients were clipped by it; get_flattened_grad_norm and "
             "get_global_norm_of_tensors gave torch's norm, and the 2- and inf-norms were "
             "right. 0.19.7 raises each per-tensor norm to norm_type (#8313)",
    ),
)
