"""CKPT-CLIENT-1 and CKPT-LATEST-1 MUST go red on a DeepSpeed that drops the client state or
leaves `latest` naming an old tag: the suite's own tests, run with the rank functions of
tests/perturbed_ranks.py (real DeepSpeed, 2 CPU ranks, one method patched in the ranks)."""

from __future__ import annotations

import pytest

from suites import test_checkpoint as suite
from tests import perturbed_ranks

CASE = suite.CkptCase(stage=2, dtype="fp32", world_size=2)


def _dir(tmp_path, name):
    (tmp_path / name).mkdir()
    return tmp_path / name


def test_a_dropped_client_state_fails_naming_what_is_missing(tmp_path, monkeypatch):
    suite.test_client_state_comes_back("cpu", CASE, _dir(tmp_path, "ok"))  # the control
    monkeypatch.setattr(suite.ranks, "client_state_round_trip",
                        perturbed_ranks.client_state_dropped)
    with pytest.raises(AssertionError, match=r"client_state did not come back equal:\s+rank 0: "
                                             r"best_loss: saved 0\.1234567891234, loaded None"):
        suite.test_client_state_comes_back("cpu", CASE, _dir(tmp_path, "dropped"))


def test_a_stale_latest_fails_naming_the_step_loaded(tmp_path, monkeypatch):
    case = CASE.with_(stage=3)
    suite.test_load_without_a_tag_takes_the_newest("cpu", case, _dir(tmp_path, "ok"))
    monkeypatch.setattr(suite.ranks, "load_latest", perturbed_ranks.latest_left_stale)
    with pytest.raises(AssertionError, match=r"did not resume from the newest save:\s+rank 0: "
                                             r"loaded .* \(weights of \['s1'\]\); the newest is "
                                             r"s3"):
        suite.test_load_without_a_tag_takes_the_newest("cpu", case, _dir(tmp_path, "stale"))
