"""dsconform.checks.equivalence with plain tensors: what counts as equal, and what a failure
says."""

from __future__ import annotations

import math

import pytest
import torch

from dsconform.checks.equivalence import Comparison, compare_traces, tensor_difference
from dsconform.checks.tolerances import Tol

EXACT = Tol(0.0, 0.0, "bit-exact")
LOOSE = Tol(1e-3, 1e-6, "loose for the test")


def _trace(steps: int = 3, *, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"losses": [1.0 / (s + 1) for s in range(steps)],
            "grads": [{"fc.weight": torch.randn(3, 5, generator=g),
                       "fc.bias": torch.randn(3, generator=g)} for _ in range(steps)],
            "params": {"fc.weight": torch.randn(3, 5, generator=g),
                       "fc.bias": torch.randn(3, generator=g)}}


def _clone(trace: dict) -> dict:
    return {"losses": list(trace["losses"]),
            "grads": [{k: v.clone() for k, v in g.items()} for g in trace["grads"]],
            "params": {k: v.clone() for k, v in trace["params"].items()}}


def test_identical_traces_are_exact():
    a = _trace()
    cmp = compare_traces(_clone(a), a, EXACT, label="case")
    assert cmp.ok and cmp.worst_abs == 0 and cmp.worst_rel == 0
    assert cmp.first_divergence is None
    assert "equivalent" in cmp.report()
    cmp.assert_ok()


def test_exact_tolerance_catches_one_ulp():
    x = torch.tensor([1.0, 2.0, 3.0])
    y = x.clone()
    y[1] = torch.nextafter(y[1], torch.tensor(math.inf))
    mabs, mrel, ok = tensor_difference(y, x, EXACT)
    assert not ok
    assert mabs == pytest.approx(2.0 ** -22)
    assert mrel == pytest.approx(2.0 ** -23)
    assert tensor_difference(y, x, LOOSE)[2]


def test_isclose_semantics_rtol_and_atol():
    tol = Tol(rtol=1e-2, atol=1e-3, why="")
    b = torch.tensor([0.0, 1.0, 100.0])
    assert tensor_difference(b + torch.tensor([0.9e-3, 1.05e-2, 1.0]), b, tol)[2]
    assert not tensor_difference(b + torch.tensor([2e-3, 0.0, 0.0]), b, tol)[2]
    assert not tensor_difference(b + torch.tensor([0.0, 0.0, 1.2]), b, tol)[2]


def test_rel_is_inf_where_reference_is_zero_and_nan_never_passes():
    mabs, mrel, ok = tensor_difference(torch.tensor([1e-9]), torch.tensor([0.0]), LOOSE)
    assert ok and mrel == math.inf and mabs == pytest.approx(1e-9)
    assert not tensor_difference(torch.tensor([math.nan]), torch.tensor([1.0]), LOOSE)[2]
    assert tensor_difference(torch.tensor([math.nan]), torch.tensor([math.nan]), EXACT)[2]
    assert tensor_difference(torch.tensor([math.inf]), torch.tensor([math.inf]), EXACT)[2]


def test_low_precision_is_compared_in_float64():
    b = torch.tensor([1.0, 3.0], dtype=torch.float32)
    a = b.to(torch.bfloat16)
    assert tensor_difference(a, b, EXACT) == (0.0, 0.0, True)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape mismatch"):
        tensor_difference(torch.zeros(3), torch.zeros(4), EXACT)


def test_first_divergence_names_step_parameter_and_tolerance():
    ref = _trace(steps=5)
    cand = _clone(ref)
    cand["grads"][3]["fc.weight"][1, 2] += 1e-4   # the earliest fault
    cand["losses"][4] *= 1.01
    cand["params"]["fc.bias"][0] += 0.5
    cmp = compare_traces(cand, ref, Tol(0.0, 0.0, "fp32 SGD is bit-exact"), label="z3-fp32-sgd",
                         where="rank 1")
    assert not cmp.ok
    first = cmp.first_divergence
    assert (first.step, first.quantity, first.name, first.where) == (3, "grad", "fc.weight",
                                                                     "rank 1")
    assert first.max_abs == pytest.approx(1e-4, rel=1e-3)
    msg = cmp.report()
    assert msg.startswith("z3-fp32-sgd: first diverging step 3: step 3, grad of 'fc.weight' "
                          "(rank 1): max abs diff 0.0001")
    assert "max rel diff" in msg
    assert "tolerance rtol=0 atol=0 (fp32 SGD is bit-exact)" in msg
    assert "3 of " in msg  # grad, loss and param are out
    with pytest.raises(AssertionError, match="first diverging step 3"):
        cmp.assert_ok()


def test_loss_before_grad_before_param_within_a_step():
    ref = _trace(steps=2)
    cand = _clone(ref)
    cand["losses"][1] += 1.0
    cand["grads"][1]["fc.bias"] += 1.0
    cand["params"]["fc.bias"] += 1.0   # final params carry the last step (1)
    assert compare_traces(cand, ref, EXACT).first_divergence.quantity == "loss"


def test_worst_per_quantity_and_merge():
    ref = _trace()
    cand = _clone(ref)
    cand["params"]["fc.weight"] *= 1.0 + 1e-6
    a = compare_traces(cand, ref, LOOSE, where="rank 0")
    b = compare_traces(_clone(ref), ref, LOOSE, where="rank 1")
    merged = a.extend(b)
    assert merged.ok
    assert merged.worst("loss") == (0.0, 0.0)
    assert merged.worst("param")[1] == pytest.approx(1e-6, rel=1e-2)
    assert merged.worst_rel == merged.worst("param")[1]
    with pytest.raises(ValueError, match="different tolerances"):
        merged.extend(Comparison(tol=EXACT))


def test_structural_mismatches_fail_naming_what_differs():
    ref = _trace(steps=3)
    short = _clone(ref)
    short["losses"].pop()
    cmp = compare_traces(short, ref, EXACT)
    assert not cmp.ok and "losses: 2 steps in the candidate, 3 in the reference" in cmp.report()
    renamed = _clone(ref)
    renamed["params"]["fc.w"] = renamed["params"].pop("fc.weight")
    cmp = compare_traces(renamed, ref, EXACT)
    assert not cmp.ok and "only in the candidate ['fc.w']" in cmp.report()
    missing = _clone(ref)
    missing["grads"][0]["fc.bias"] = None
    cmp = compare_traces(missing, ref, EXACT)
    assert not cmp.ok and "step 0, grad of 'fc.bias': None in the candidate" in cmp.report()
    with pytest.raises(AssertionError, match="cannot vouch for equivalence"):
        cmp.assert_ok()


@pytest.mark.parametrize("side", ["candidate", "reference"])
@pytest.mark.parametrize("what", ["losses", "grads", "params"])
def test_an_empty_trace_is_a_failure(side, what):
    """Before: an empty candidate gradient list silently dropped the gradient check and the
    comparison passed. Now nothing to compare on either side fails, naming what is missing."""
    ref = _trace()
    cand = _clone(ref)
    target = cand if side == "candidate" else ref
    target[what] = [] if what != "params" else {}
    cmp = compare_traces(cand, ref, LOOSE, label="z2")
    assert not cmp.ok
    word = {"losses": "losses", "grads": "gradients", "params": "parameters"}[what]
    assert f"the {side} trace has no {word}" in cmp.report()
    assert cmp.report().startswith("z2: cannot vouch for equivalence")


def test_gradient_step_counts_must_match():
    ref = _trace(steps=3)
    cand = _clone(ref)
    cand["grads"].pop()
    cmp = compare_traces(cand, ref, LOOSE)
    assert not cmp.ok and "gradients: 2 steps in the candidate, 3 in the reference" in cmp.report()


def test_notes_never_decide_and_survive_a_long_list_of_problems():
    ref = _trace(steps=2)
    cmp = compare_traces(_clone(ref), ref, EXACT)
    cmp.notes.append("a diagnosis")
    assert cmp.ok and cmp.report().endswith("\na diagnosis")
    cmp.problems += [f"problem {i}" for i in range(9)]
    report = cmp.report(limit=5)
    assert not cmp.ok and "... 4 more" in report and report.endswith("\na diagnosis")


def test_nothing_compared_is_not_ok():
    assert not Comparison(tol=EXACT).ok


@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_nan_in_the_reference_or_candidate_fails_naming_step_and_tensor(side):
    """Before: NaN == NaN passed, so a diverged reference matched a diverged candidate. Both
    sides carry the same NaN here; it still fails."""
    ref = _trace(steps=4)
    cand = _clone(ref)
    for t in (ref, cand) if side == "reference" else (cand,):
        t["grads"][2]["fc.weight"][0, 1] = math.nan
    cmp = compare_traces(cand, ref, LOOSE, where="rank 1")
    assert not cmp.ok
    assert (f"step 2, grad of 'fc.weight' (rank 1): 1 NaN of 15 elements in the {side}"
            in cmp.report())


def test_inf_loss_fails():
    ref = _trace(steps=2)
    cand = _clone(ref)
    ref["losses"][1] = cand["losses"][1] = math.inf
    cmp = compare_traces(cand, ref, LOOSE)
    assert not cmp.ok and "step 1, loss: inf in the reference" in cmp.report()


# ------------------------------------------------------------------ the tolerance table

from dsconform.checks import tolerances  # noqa: E402
from dsconform.checks.tolerances import known_tolerance_keys, tolerance  # noqa: E402


def test_table_covers_every_matrix_cell_with_a_reason():
    from dsconform.checks.zero_vs_ddp import zero_check_name as check_name
    from suites.zero_ranks import matrix

    for case in matrix():
        for accel in tolerances.ACCELERATORS:
            tol = tolerance(check_name(case), case.dtype, case.optimizer, accelerator=accel)
            assert tol.why and tol.rtol >= 0 and tol.atol >= 0
    for entry in tolerances.TABLE.values():
        assert set(entry) == set(tolerances.ACCELERATORS)


def test_fp32_sgd_is_bit_exact_and_low_precision_is_looser():
    assert tolerance("zero", "fp32", "sgd", accelerator="cpu") == \
        tolerance("zero", "fp32", "sgd", accelerator="cuda")
    exact = tolerance("zero", "fp32", "sgd", accelerator="cuda")
    assert (exact.rtol, exact.atol) == (0.0, 0.0)
    for accel in tolerances.ACCELERATORS:
        adam = tolerance("zero", "fp32", "adam", accelerator=accel)
        bf16 = tolerance("zero", "bf16", "sgd", accelerator=accel)
        assert 0 < adam.rtol < bf16.rtol and adam.atol < bf16.atol
    # Every entry says where its numbers come from: measured on a named machine, or not measured.
    for k, entry in tolerances.TABLE.items():
        for accel, tol in entry.items():
            assert "2026" in tol.why or "not measured" in tol.why, (k, accel, tol.why)


def test_known_keys_are_check_dtype_optimizer():
    keys = known_tolerance_keys()
    assert keys == sorted(keys) and len(keys) == len(set(keys))
    assert "zero.bf16.adam" in keys and "zero_accum.fp32.sgd" in keys
    assert all(len(k.split(".")) == 3 for k in keys)


def test_profile_override_replaces_only_what_it_names():
    base = tolerance("zero", "bf16", "adam", accelerator="cuda")
    tol = tolerance("zero", "bf16", "adam",
                    {"zero.bf16.adam": {"rtol": 0.05, "why": "measured on h200-x8"}},
                    accelerator="cuda")
    assert (tol.rtol, tol.atol) == (0.05, base.atol)
    assert "measured on h200-x8" in tol.why and "zero.bf16.adam" in tol.why
    # Overrides of other keys leave this one alone.
    assert tolerance("zero", "bf16", "sgd", {"zero.bf16.adam": {"atol": 1.0}},
                     accelerator="cuda") == tolerance("zero", "bf16", "sgd", accelerator="cuda")


def test_unknown_override_key_names_it_and_the_known_keys():
    with pytest.raises(ValueError) as err:
        tolerance("zero", "fp32", "sgd", {"zero.bf16.lamb": {"rtol": 0.1}}, accelerator="cpu")
    msg = str(err.value)
    assert "'zero.bf16.lamb'" in msg and "zero.bf16.adam" in msg and "known keys" in msg


@pytest.mark.parametrize("value, match", [
    ({"rtol": -1.0}, "rtol must be a number >= 0"),
    ({"atol": True}, "atol must be a number >= 0"),
    ({"rtol": "0.1"}, "rtol must be a number >= 0"),
    ({"tol": 0.1}, "unknown field 'tol'"),
    (0.1, "expected a table"),
])
def test_bad_override_values(value, match):
    with pytest.raises(ValueError, match=match):
        tolerance("zero", "fp32", "sgd", {"zero.fp32.sgd": value}, accelerator="cpu")


def test_unknown_lookup_and_accelerator():
    with pytest.raises(ValueError, match="no tolerance for 'zero.fp8.sgd'"):
        tolerance("zero", "fp8", "sgd", accelerator="cpu")
    with pytest.raises(TypeError, match="accelerator"):
        tolerance("zero", "bf16", "sgd")  # no default: the looser value is never picked silently
    with pytest.raises(ValueError, match="accelerator must be one of"):
        tolerance("zero", "fp32", "sgd", accelerator="xpu")



def test_ops_checks_use_the_one_table():
    for op in ("cpu_adam", "fused_adam", "cpu_adagrad", "cpu_lion"):
        tol = tolerance("op", "fp32", op, accelerator="cpu")
        assert tol.why and tol.rtol <= 1e-5 and tol.atol <= 1e-6


# The whole update (Tol.update, Tol.gain): a run whose every element is within an element-wise
# bound wide enough for bf16 can still move uniformly too far (an lr error); the whole update
# sees it.
WHOLE = Tol(1.6e-2, 1e-2, "bf16-like element-wise bounds", update=0.1, gain=0.01)


def _moved(trace: dict, init: dict, factor: float, noise: float = 0.0, seed: int = 1) -> dict:
    """``trace`` with its parameters at init + factor * (trace's update) + noise."""
    g = torch.Generator().manual_seed(seed)
    out = _clone(trace)
    out["init"] = {k: v.clone() for k, v in init.items()}
    for k, v in trace["params"].items():
        delta = v - init[k]
        out["params"][k] = init[k] + factor * delta + noise * delta.abs().mean() * torch.randn(
            v.shape, generator=g)
    return out


def _with_init(trace: dict, scale: float = 1e-2, seed: int = 7) -> tuple[dict, dict]:
    """The reference: parameters that moved by a small update from an init."""
    g = torch.Generator().manual_seed(seed)
    ref = _clone(trace)
    init = {k: v.clone() for k, v in trace["params"].items()}
    ref["params"] = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in init.items()}
    ref["init"] = {k: v.clone() for k, v in init.items()}
    return ref, init


def test_a_uniformly_larger_update_fails_the_gain_where_elements_pass():
    ref, init = _with_init(_trace())
    cand = _moved(ref, init, 1.2)
    cmp = compare_traces(cand, ref, WHOLE, label="z2-bf16")
    # Every element is within the element-wise bound: 0.2 x an update of about 1e-2.
    assert all(d.within for d in cmp.differences if d.quantity in ("loss", "grad", "param"))
    assert not cmp.ok
    assert [d.quantity for d in cmp.failures] == ["update", "gain"]
    gain = next(d for d in cmp.differences if d.quantity == "gain")
    assert gain.value == pytest.approx(1.2, rel=1e-5)
    assert gain.max_abs == pytest.approx(0.2, rel=1e-4)
    assert cmp.worst("update")[1] == pytest.approx(0.2, rel=1e-4)
    report = cmp.report()
    assert "step 2, update of all parameters: |delta - delta_ref| / |delta_ref| = 0.2" in report
    assert "gain of all parameters: the update is 1.2x the reference's" in report
    assert "update<=0.1 gain=1+/-0.01" in report


def test_a_slightly_scaled_update_fails_only_the_gain():
    ref, init = _with_init(_trace())
    cmp = compare_traces(_moved(ref, init, 0.95), ref, WHOLE)
    assert [d.quantity for d in cmp.failures] == ["gain"]
    assert cmp.failures[0].value == pytest.approx(0.95, rel=1e-5)


def test_noise_fails_the_norm_bound_but_not_the_gain():
    ref, init = _with_init(_trace(), scale=1e-3)  # element-wise bounds stay far away
    cmp = compare_traces(_moved(ref, init, 1.0, noise=0.3), ref, WHOLE)
    assert [d.quantity for d in cmp.failures] == ["update"]
    assert cmp.worst("update")[1] > 0.1 and cmp.worst("gain")[0] < 0.1


def test_an_exact_update_passes_and_is_recorded():
    ref, init = _with_init(_trace())
    cmp = compare_traces(_moved(ref, init, 1.0), ref, WHOLE)
    assert cmp.ok, cmp.report()
    assert cmp.worst("update") == (0.0, 0.0) and cmp.worst("gain") == (0.0, 0.0)
    assert {d.quantity for d in cmp.differences} >= {"update", "gain"}


def test_the_whole_update_is_checked_only_where_the_tolerance_bounds_it():
    ref, init = _with_init(_trace())
    cmp = compare_traces(_moved(ref, init, 1.2), ref, Tol(1.6e-2, 1e-2, "element-wise only"))
    assert cmp.ok and not any(d.quantity in ("update", "gain") for d in cmp.differences)
    only_gain = Tol(1.6e-2, 1e-2, "gain only", gain=0.01)
    cmp = compare_traces(_moved(ref, init, 1.2), ref, only_gain)
    assert [d.quantity for d in cmp.failures] == ["gain"]


@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_a_missing_init_is_a_problem_never_a_pass(side):
    ref, init = _with_init(_trace())
    cand = _moved(ref, init, 1.0)
    (cand if side == "candidate" else ref).pop("init")
    cmp = compare_traces(cand, ref, WHOLE)
    assert not cmp.ok
    assert cmp.problems == [f"the {side} trace has no initial parameters: the tolerance bounds "
                            f"the whole update"]
    partial = _moved(ref, init, 1.0) if side == "reference" else cand
    if side == "reference":
        ref["init"] = {"fc.weight": init["fc.weight"]}
        cmp = compare_traces(partial, ref, WHOLE)
        assert cmp.problems == ["the reference trace has no initial value of ['fc.bias']"]


def test_a_reference_that_did_not_move_is_a_problem():
    ref, init = _with_init(_trace(), scale=0.0)
    cmp = compare_traces(_moved(ref, init, 1.0), ref, WHOLE, where="rank 1")
    assert not cmp.ok
    assert cmp.problems == ["update (rank 1): the reference's parameters did not move, so its "
                            "update says nothing"]


def test_profile_override_of_the_whole_update_bounds():
    base = tolerance("zero", "bf16", "adam", accelerator="cuda")
    assert base.update is not None and base.gain is not None
    tol = tolerance("zero", "bf16", "adam", {"zero.bf16.adam": {"gain": 0.02, "why": "x8"}},
                    accelerator="cuda")
    assert (tol.rtol, tol.atol, tol.update, tol.gain) == (base.rtol, base.atol, base.update,
                                                          0.02)
    with pytest.raises(ValueError, match="update must be a number >= 0"):
        tolerance("zero", "bf16", "adam", {"zero.bf16.adam": {"update": -1}}, accelerator="cpu")


def test_every_low_precision_zero_entry_bounds_the_whole_update():
    for (check, dtype, _opt), entry in tolerances.TABLE.items():
        if check in ("zero", "zero_accum", "zero_infinity", "zero_clip") \
                and dtype in ("bf16", "fp16"):
            for accel, tol in entry.items():
                assert tol.update is not None and tol.gain is not None, (check, dtype, accel)
                assert tol.gain <= 0.01 and "gain" in tol.why, (check, dtype, accel)
        elif check == "loss_scaling":  # whole-update bounds only (check_step_sizes)
            for tol in entry.values():
                assert tol.update is not None and tol.gain is not None and tol.gain <= 0.01
        elif dtype == "fp32" or check not in ("zero", "zero_accum", "zero_infinity",
                                              "zero_clip"):
            for tol in entry.values():
                assert tol.update is None and tol.gain is None


def test_an_initial_value_of_another_shape_is_a_problem():
    ref, init = _with_init(_trace())
    cand = _moved(ref, init, 1.0)
    cand["init"]["fc.bias"] = torch.zeros(4)
    cmp = compare_traces(cand, ref, WHOLE)
    assert cmp.problems == ["update of 'fc.bias': initial (4,), final (3,) in the candidate"]


# --- compare_update: one step's (or one run's) update alone ----------------------------------

def _params(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values)}


STEP = tolerances.Tol(0.0, 0.0, "test", update=0.01, gain=0.01)


def test_compare_update_passes_the_same_step_and_fails_a_scaled_one():
    from dsconform.checks.equivalence import compare_update

    before, after = _params(0.0, 1.0, 2.0), _params(0.1, 0.8, 2.3)
    assert compare_update(before, after, before, after, STEP, step=3).ok
    half = _params(0.05, 0.9, 2.15)
    cmp = compare_update(before, half, before, after, STEP, step=3, where="rank 1")
    assert not cmp.ok
    gain = next(d for d in cmp.differences if d.quantity == "gain")
    assert abs(gain.value - 0.5) < 1e-6 and gain.step == 3 and gain.where == "rank 1"


def test_compare_update_measures_from_each_side_own_start():
    """The candidate and the reference may start apart (the candidate's previous step): only
    each side's own move is compared."""
    from dsconform.checks.equivalence import compare_update

    cmp = compare_update(_params(1.0, 1.0), _params(1.5, 0.5), _params(0.0, 0.0),
                         _params(0.5, -0.5), STEP, step=0)
    assert cmp.ok and cmp.worst("gain")[0] < 1e-6


@pytest.mark.parametrize("case, problem", [
    ("no_params", "the candidate has no parameters"),
    ("names", "parameter names differ"),
    ("nan", "nan"),
    ("still", "did not move"),
    ("no_bounds", "bounds no update"),
])
def test_compare_update_problems_never_pass(case, problem):
    from dsconform.checks.equivalence import compare_update

    before, after = _params(0.0, 1.0), _params(0.5, 1.5)
    tol, cand_after, ref_after = STEP, after, after
    if case == "no_params":
        cand_after = {}
    elif case == "names":
        cand_after = {"v": after["w"]}
    elif case == "nan":
        cand_after = _params(float("nan"), 1.5)
    elif case == "still":
        ref_after = before
    else:
        tol = tolerances.Tol(0.0, 0.0, "element-wise only")
    cmp = compare_update(before, cand_after, before, ref_after, tol, step=0)
    assert not cmp.ok
    assert any(problem in p.lower() for p in cmp.problems), cmp.problems
