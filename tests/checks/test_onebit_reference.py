"""The 1-bit reference (dsconform/checks/onebit.py) and the onebit suite's checks built on it.

The suite's property tests (ONEBIT-REF-1/2) must go red when the reference loses what error
feedback exists for: each perturbation below breaks the real reference module (monkeypatched
for one test) and runs the suite's own hypothesis tests, which must find a counterexample and
say which property broke. The GPU comparison (ONEBIT-AR-1) is fed traces the reference made,
as DeepSpeed's would look, then the same traces with one defect each.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsconform.checks import onebit as ref
from dsconform.checks.tolerances import tolerance
from suites import onebit_ranks
from suites import test_onebit as suite

# ---------------------------------------------------------------- the reference by hand


def test_padding_follows_deepspeed():
    # world * lcm(world, 8): whole bytes of signs for every server chunk.
    assert [ref.padded_numel(n, 2) for n in (0, 1, 16, 17, 53)] == [0, 16, 16, 32, 64]
    assert ref.padded_numel(1, 3) == 72 and ref.padded_numel(1, 8) == 64
    with pytest.raises(ValueError, match="world=0"):
        ref.padded_numel(4, 0)


def test_one_round_by_hand():
    """Two ranks, two elements (padded to 16): every number written out."""
    x0, x1 = torch.tensor([3.0, -1.0]), torch.tensor([1.0, 1.0])
    workers, servers = ref.zero_errors(2, 2)
    r = ref.compressed_allreduce([x0, x1], workers, servers)
    s0, s1 = math.sqrt(10 / 16), math.sqrt(2 / 16)  # rms over the padded 16 elements
    # Zeros of the padding count as +1: 1-bit compression has no zero.
    assert torch.allclose(r.worker_sent[0], torch.tensor([s0, -s0] + [s0] * 14))
    assert torch.allclose(r.worker_sent[1], torch.full((16,), s1))
    assert torch.allclose(r.worker_errors[0][:2], torch.tensor([3 - s0, -1 + s0]))
    assert torch.allclose(r.worker_errors[0][2:], torch.full((14,), -s0))
    # Server 0 owns elements 0-7: their average, compressed with its own rms.
    a = torch.tensor([(s0 + s1) / 2, (s1 - s0) / 2] + [(s0 + s1) / 2] * 6)
    assert torch.allclose(r.server_averages[0], a)
    big = math.sqrt(float((a * a).mean()))
    assert torch.allclose(r.output, torch.tensor([big, -big]))
    assert torch.allclose(r.server_errors[0], a - big * ref.sign_pm1(a))
    assert ref.round_violations([x0, x1], workers, servers, r) == []


def test_empty_buffer_zeroes_the_errors_like_deepspeed():
    workers, servers = ref.zero_errors(0, 2)
    r = ref.compressed_allreduce([torch.zeros(0), torch.zeros(0)], workers, servers)
    assert r.output.numel() == 0 and ref.round_violations([torch.zeros(0)] * 2, workers,
                                                          servers, r) == []


def test_inputs_are_left_untouched_and_shapes_checked():
    x = [torch.randn(3, 5), torch.randn(3, 5)]
    keep = [t.clone() for t in x]
    workers, servers = ref.zero_errors(15, 2)
    r = ref.compressed_allreduce(x, workers, servers)
    assert all(torch.equal(a, b) for a, b in zip(x, keep))
    assert r.output.shape == (3, 5) and not bool(workers[0].any())
    with pytest.raises(ValueError, match="same shape"):
        ref.compressed_allreduce([torch.randn(3), torch.randn(4)], workers, servers)
    with pytest.raises(ValueError, match="padded_numel"):
        ref.compressed_allreduce(x, [torch.zeros(3)] * 2, servers)


def test_bus_bytes_are_one_bit_per_element_plus_scales():
    b = ref.bus_bytes(64 << 20, 2)
    assert b["plain"] == (64 << 20) * 4                  # 2(n-1)/n = 1 on two ranks
    assert b["compressed"] == (64 << 20) / 8 + 8         # signs twice at half, two scales
    assert 31.99 < b["plain"] / b["compressed"] <= 32


# ---------------------------------------------------------------- the suite's properties, red

def _drop_server_feedback(value, error):
    return ref.scaled_sign(value), torch.zeros_like(error)


def _drop_worker_feedback(value, error):
    return ref.scaled_sign(value), torch.zeros_like(error)


def _sign_without_scale(x):
    return ref.sign_pm1(x)


def _flipped_signs(x):
    return -ref.rms(x) * ref.sign_pm1(x)


def _constant_signs(x):
    return ref.rms(x) * torch.ones_like(x)


PERTURBATIONS = {
    "server error feedback dropped": ("server_step", _drop_server_feedback,
                                      "server error feedback loses"),
    "worker error feedback dropped": ("worker_step", _drop_worker_feedback,
                                      "worker error feedback loses"),
    "sign without scale": ("scaled_sign", _sign_without_scale, "the scale must keep the norm"),
    # Both keep one magnitude, the norm and the feedback sum: only the sign property sees them.
    "signs flipped": ("scaled_sign", _flipped_signs, "one bit must carry the sign"),
    "every sign +1": ("scaled_sign", _constant_signs, "one bit must carry the sign"),
}


def test_properties_hold_for_the_real_reference():
    """The controls: the suite's property tests pass on the reference as it is."""
    suite.test_reference_properties()
    suite.test_reference_error_feedback_averages_out()


@pytest.mark.parametrize("name", list(PERTURBATIONS))
def test_property_test_goes_red(name, monkeypatch):
    attr, broken, message = PERTURBATIONS[name]
    monkeypatch.setattr(ref, attr, broken)
    with pytest.raises(AssertionError, match=message):
        suite.test_reference_properties()


@pytest.mark.parametrize("name", ["server error feedback dropped", "worker error feedback "
                                  "dropped"])
def test_averaging_test_goes_red_without_error_feedback(name, monkeypatch):
    attr, broken, _ = PERTURBATIONS[name]
    monkeypatch.setattr(ref, attr, broken)
    with pytest.raises(AssertionError, match="error feedback does not carry"):
        suite.test_reference_error_feedback_averages_out()


def test_losing_a_round_goes_red_over_rounds():
    """rounds_violations sees state that does not thread from round to round (errors reset
    between rounds), which no single round shows."""
    x = [[torch.randn(40), torch.randn(40)] for _ in range(3)]
    workers, servers = ref.zero_errors(40, 2)
    initial = (workers, servers)
    results = [ref.compressed_allreduce(x[0], workers, servers)]
    for t in (1, 2):  # errors reset every round: each round alone is fine
        results.append(ref.compressed_allreduce(x[t], workers, servers))
    assert all(ref.round_violations(x[t], workers, servers, results[t]) == [] for t in (1, 2))
    assert "never drop" in " ".join(ref.rounds_violations(x, initial, results))


# ---------------------------------------------------------------- the GPU comparison, on CPU

def _deepspeed_like_trace(shape, rounds, world=2, defect=None):
    """Per-rank round records as onebit_ranks.compressed_allreduce_rounds returns them, made by
    the reference; ``defect(t, r, record)`` may spoil one."""
    numel = math.prod(shape)
    workers, servers = ref.zero_errors(numel, world)
    ranks = [[] for _ in range(world)]
    for t in range(rounds):
        buffers = [onebit_ranks.round_input(suite.SEED_AR, t, r, shape) for r in range(world)]
        out = ref.compressed_allreduce(buffers, workers, servers)
        for r in range(world):
            record = {"worker_before": workers[r].clone(), "server_before": servers[r].clone(),
                      "output": out.output.clone(), "worker": out.worker_errors[r].clone(),
                      "server": out.server_errors[r].clone()}
            if defect:
                defect(t, r, record)
            ranks[r].append(record)
        # DeepSpeed carries its own buffers on: the spoiled ones, if any.
        workers = [ranks[r][t]["worker"] for r in range(world)]
        servers = [ranks[r][t]["server"] for r in range(world)]
    return ranks


TOL = tolerance("onebit_allreduce", "fp32", "nccl", accelerator="cuda")


@pytest.mark.parametrize("shape", suite.AR_SHAPES)
def test_compare_round_accepts_the_reference(shape):
    ranks = _deepspeed_like_trace(shape, 3)
    assert [p for t in range(3) for p in suite.compare_round(t, shape, ranks, TOL)] == []


def test_compare_round_names_a_zeroed_server_error():
    def zero_server(t, r, rec):
        if t == 1:
            rec["server"] = torch.zeros_like(rec["server"])

    ranks = _deepspeed_like_trace((53,), 3, defect=zero_server)
    problems = suite.compare_round(1, (53,), ranks, TOL)
    assert any(p.startswith("round 1, rank 0 server error: max abs diff") for p in problems)
    # Round 2 is checked against what DeepSpeed held before it: the reference takes the zeroed
    # buffers as its input, so the defect is reported once, where it happened.
    assert suite.compare_round(2, (53,), ranks, TOL) == []


def test_compare_round_names_an_unscaled_output_and_a_wrong_shape():
    def unscaled(t, r, rec):
        if t == 0 and r == 1:
            rec["output"] = ref.sign_pm1(rec["output"])

    problems = suite.compare_round(0, (8, 129), _deepspeed_like_trace((8, 129), 1,
                                                                      defect=unscaled), TOL)
    assert problems and problems[0].startswith("round 0, rank 1 output: max abs diff")
    assert TOL.why in problems[0]

    def flat(t, r, rec):
        rec["output"] = rec["output"].reshape(-1)

    problems = suite.compare_round(0, (8, 129), _deepspeed_like_trace((8, 129), 1, defect=flat),
                                   TOL)
    assert "output shape (1032,), input (8, 129)" in problems[0]


def test_compare_round_excuses_only_ties():
    """A server value within atol of zero may round to either sign on GPU and CPU: excused.
    The same flip elsewhere is not."""
    shape = (1024,)
    ranks = _deepspeed_like_trace(shape, 2)
    t = 1
    buffers = [onebit_ranks.round_input(suite.SEED_AR, t, r, shape) for r in range(2)]
    expected = ref.compressed_allreduce(buffers, [d[t]["worker_before"] for d in ranks],
                                        [d[t]["server_before"] for d in ranks])
    m = torch.cat(expected.server_compensated)
    flip = int(m.abs().argmax())  # the value farthest from a tie
    for d in ranks:
        d[t]["output"][flip] *= -1
    problems = suite.compare_round(t, shape, ranks, TOL)
    assert problems and "output" in problems[0]
    # A tolerance wide enough to call that value a tie excuses it.
    wide = type(TOL)(TOL.rtol, float(m.abs().max()) + 1, "test")
    assert not [p for p in suite.compare_round(t, shape, ranks, wide) if "output" in p]


# ---------------------------------------------------------------- the convergence arithmetic

def test_ratio_check_is_one_sided():
    tol = tolerance("onebit_convergence", "fp32", "onebit_adam", accelerator="cuda")
    assert suite.within_ratio(0.001, 1.0, tol)              # far better than the baseline: fine
    assert suite.within_ratio((1 + tol.rtol) * 0.5, 0.5, tol)
    assert not suite.within_ratio((1 + tol.rtol) * 0.5 + 2 * tol.atol + 1e-9, 0.5, tol)


def test_curve_and_tail():
    ranks = [{"losses": [4.0, 2.0, 1.0]}, {"losses": [2.0, 2.0, 3.0]}]
    assert suite.curve(ranks) == [3.0, 2.0, 2.0]
    assert suite.tail(list(range(30))) == pytest.approx(24.5)
    assert suite.tail(list(range(30)), 10) == pytest.approx(4.5)
