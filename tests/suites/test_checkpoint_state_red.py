"""CKPT-CLIENT-1 and CKPT-LATEST-1 MUST go red on a DeepSpeed that drops the client state or
leaves `latest` naming an old tag: the suite's own tests, run with the rank functions of
tests/perturbed_ranks.py (real DeepSpeed, 2 CPU ranks, one method patched in the ranks)."""

from __future__ import annotations

import pytest

from dsconform.harness.api import run_ranks
from suites import test_checkpoint_files as suite
from tests import perturbed_ranks

CASE = suite.CkptCase(stage=2, dtype="fp32", world_size=2)


def _dir(tmp_path, name):
    (tmp_path / name).mkdir()
    return tmp_path / name


def _client_state(tmp_path, name, fn=None):
    """CKPT-CLIENT-1 as a cell of the batch runs it: the suite's rank function (or ``fn``) on 2
    CPU ranks, then the suite's check."""
    results = run_ranks(fn or suite.ranks.client_state_round_trip, 2, timeout_s=300,
                        args=(CASE, suite.ckpt_dir(_dir(tmp_path, name), CASE)),
                        accelerator="cpu")
    suite.check_client_state(results)


def _newest(tmp_path, name, case, fn=None):
    """CKPT-LATEST-1 as a cell of the batch runs it."""
    d = suite.ckpt_dir(_dir(tmp_path, name), case, tags=suite.LATEST_SAVES)
    results = run_ranks(fn or suite.ranks.load_latest, 2, timeout_s=300,
                        args=(case, d, suite.LATEST_SAVES), accelerator="cpu")
    suite.check_newest_loaded(results)


def test_a_dropped_client_state_fails_naming_what_is_missing(tmp_path):
    _client_state(tmp_path, "ok")  # the control
    with pytest.raises(AssertionError, match=r"client_state did not come back equal:\s+rank 0: "
                                             r"best_loss: saved 0\.1234567891234, loaded None"):
        _client_state(tmp_path, "dropped", perturbed_ranks.client_state_dropped)


def test_a_stale_latest_fails_naming_the_step_loaded(tmp_path):
    case = CASE.with_(stage=3)
    _newest(tmp_path, "ok", case)  # the control
    with pytest.raises(AssertionError, match=r"did not resume from the newest save:\s+rank 0: "
                                             r"loaded .* \(weights of \['s1'\]\); the newest is "
                                             r"s3"):
        _newest(tmp_path, "stale", case, perturbed_ranks.latest_left_stale)
