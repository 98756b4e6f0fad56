"""A checkpoint test leaves nothing in --scratch, also when it fails: in its own body after the
ranks wrote a real checkpoint, and inside the ranks (a failing load stops them mid-call).

A small pytest session (pytester) runs against the real plugin with a --scratch directory of
its own; its tests use the checkpoint suite's own rank code and directory helper.
"""

from __future__ import annotations

SUITE = '''
from dsconform.suite import run_ranks
from suites import checkpoint_files_ranks as file_ranks
from suites import checkpoint_ranks as ranks
from suites.checkpoint_ranks import CkptCase
from suites.checkpoint_cells import ckpt_dir

CAPABILITY = "checkpoint"
CASE = CkptCase(stage=2, dtype="fp32")


def test_fails_after_the_ranks_wrote(scratch):
    d = ckpt_dir(scratch, CASE)
    run_ranks(ranks.round_trip, 2, args=(CASE, d), accelerator="cpu", timeout_s=300)
    assert any((scratch / "ckpt" / "roundtrip").iterdir()), "nothing was written"
    assert False, "deliberate failure after a real checkpoint was written"


def test_fails_inside_the_ranks(scratch):
    d = ckpt_dir(scratch, CASE, tags=2)
    run_ranks(file_ranks.save_good_then_bad, 2, args=(CASE, d), accelerator="cpu", timeout_s=300)
    run_ranks(file_ranks.load_tag, 2, args=(CASE, d, "no-such-tag"), accelerator="cpu",
              timeout_s=300)


def test_passes(scratch):
    d = ckpt_dir(scratch, CASE)
    run_ranks(ranks.round_trip, 2, args=(CASE, d), accelerator="cpu", timeout_s=300)
'''


def test_nothing_is_left_in_scratch_after_failing_checkpoint_tests(pytester, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    pytester.makepyfile(test_ckpt_scratch=SUITE)
    result = pytester.runpytest("-p", "fixtures.plugin", "--scratch", str(scratch),
                                "--results", "", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2, passed=1)
    result.stdout.fnmatch_lines(["*deliberate failure after a real checkpoint was written*",
                                 "*CheckpointRefused*no-such-tag*"])
    assert sorted(p.relative_to(scratch) for p in scratch.rglob("*")) == []
