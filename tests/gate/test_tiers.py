"""The acceptance tier is smaller than the matrix and no weaker: every axis value and every pair
of axis values still runs, plus every cell a known issue or a tolerance entry names."""

from __future__ import annotations

import itertools

import pytest

from dsconform.base.compat import installed_deepspeed
from dsconform.base.pairwise import pairwise, uncovered_pairs
from dsconform.gate.known_issues import KNOWN_ISSUES

AXES = {"a": [0, 1, 2, 3], "b": ["x", "y", "z"], "c": [True, False], "d": [1, 2]}


def test_pairwise_covers_every_pair_with_few_cells():
    cells = pairwise(AXES)
    assert uncovered_pairs(AXES, cells) == set()
    assert len(cells) < len(list(itertools.product(*AXES.values()))) / 2


def test_invalid_cells_are_never_chosen_and_their_pairs_not_required():
    def valid(c):
        return not (c["a"] == 0 and c["b"] != "x")
    cells = pairwise(AXES, valid=valid)
    assert all(valid(c) for c in cells)
    assert uncovered_pairs(AXES, cells, valid=valid) == set()


def test_must_cells_come_first_and_bad_must_cells_are_refused():
    must = [{"a": 3, "b": "z", "c": False, "d": 2}]
    assert pairwise(AXES, must=must)[0] == must[0]
    with pytest.raises(ValueError, match="not a valid cell"):
        pairwise(AXES, must=[{"a": 9, "b": "x", "c": True, "d": 1}],
                 valid=lambda c: c["a"] != 9)


def test_deterministic():
    assert pairwise(AXES) == pairwise(AXES)


def test_a_dropped_cell_leaves_pairs_uncovered():
    """The completeness check can fail: remove a cell of the covering array."""
    cells = pairwise(AXES)
    assert uncovered_pairs(AXES, cells[1:]) != set()


@pytest.mark.parametrize("gpus", [2, 8])
def test_zero_gpu_tier_is_complete(gpus):
    from dsconform.checks.zero_vs_ddp import zero_check_name as check_name
    from suites.test_zero import _axes, _world_sizes, gpu_tier
    from suites.zero_ranks import matrix

    cases = matrix(world_sizes=_world_sizes("cuda", gpus))
    tier = gpu_tier(cases)
    assert len(tier) < len(cases) / 4, (len(tier), len(cases))
    axes: dict = {}
    for c in cases:
        for k, v in _axes(c).items():
            axes.setdefault(k, set()).add(v)
    universe = {tuple(_axes(c).items()) for c in cases}
    missing = uncovered_pairs({k: sorted(v, key=str) for k, v in axes.items()},
                              [_axes(c) for c in tier],
                              valid=lambda cell: tuple(cell.items()) in universe)
    assert missing == set()
    here = installed_deepspeed()
    for c in cases:  # every cell of a known issue of this DeepSpeed, every tolerance entry
        if any(ki.affects(here) and ki.covers(f"test_zero.py::test_zero_matches_ddp[cuda-{c.id}]")
               for ki in KNOWN_ISSUES):
            assert c in tier, c.id
    keys = {(check_name(c), c.dtype, c.optimizer) for c in cases}
    assert keys == {(check_name(c), c.dtype, c.optimizer) for c in tier}
    assert ("all" in {c.world_size for c in cases}) == (gpus > 2)


def test_gpu_tier_selection_in_the_plugin(pytester, tmp_path):
    """`-m gpu` leaves `slow` out; `--nightly` or an -m that names slow brings it back."""
    pytester.makepyfile(test_t='''
import pytest

@pytest.mark.gpu
def test_fast():
    pass

@pytest.mark.gpu
@pytest.mark.slow
def test_full_matrix():
    pass
''')
    prof = tmp_path / "p.toml"
    prof.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    base = ["-p", "fixtures.plugin", "--profile", str(prof), "--results", "", "--collect-only",
            "-q"]
    assert "1/2 tests collected" in pytester.runpytest(*base, "-m", "gpu").stdout.str()
    assert "2 tests collected" in pytester.runpytest(*base, "-m", "gpu", "--nightly").stdout.str()
    assert "1/2 tests collected" in pytester.runpytest(*base, "-m", "slow").stdout.str()
    assert "2 tests collected" in pytester.runpytest(*base, "-m", "").stdout.str()


def test_a_test_of_an_unpromised_op_joins_only_the_nightly_tier(pytester, tmp_path):
    """`promised_ops_only`: `-m gpu` keeps the test where the profile promises its op, leaves it
    out elsewhere and says so in the header; --nightly keeps it."""
    pytester.makepyfile(test_t='''
import pytest
from dsconform.suite import requires

@pytest.mark.gpu
def test_fast():
    pass

@pytest.mark.gpu
@pytest.mark.promised_ops_only
@requires(op="gds")
def test_gds_handle():
    pass
''')
    without, with_gds = tmp_path / "p.toml", tmp_path / "q.toml"
    without.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    with_gds.write_text('[profile]\nname = "q"\n[gpus]\ncount = 0\n[deepspeed]\nops = ["gds"]\n')

    def run(profile, *args):
        return pytester.runpytest("-p", "fixtures.plugin", "--profile", str(profile),
                                  "--results", "", "-m", "gpu", *args).stdout.str()

    out = run(without)
    assert "1 skipped, 1 deselected" in out  # no GPU here: the kept test skips
    assert ("NOTE: profile p does not promise op gds: the acceptance tier leaves out "
            "test_gds_handle; --nightly runs it where the op is compatible") in out
    kept = run(with_gds)  # kept: a promise this machine, with no gds, breaks
    assert "1 failed, 1 skipped" in kept and "profile q promises [op gds]" in kept
    assert "2 skipped" in run(without, "--nightly")
