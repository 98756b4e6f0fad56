"""The fork server starts as soon as the suite's plugin is loaded with its conftest.py
(dsconform.plugin.early.start_at_load, from the entry point's pytest_load_initial_conftests):
only for a run of the GPU tests on a node with NVIDIA device files, with its output in the rank
log, which configure then keeps; never in a pytest run that did not load the suite."""

from __future__ import annotations

import sys
from argparse import Namespace
from types import SimpleNamespace

import pytest

from dsconform.plugin import early

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the fork server is used on Linux only")


def _config(**known) -> SimpleNamespace:
    ns = dict(collectonly=False, markexpr="gpu", results=None)
    ns.update(known)
    return SimpleNamespace(known_args_namespace=Namespace(**ns))


@pytest.fixture
def starts(monkeypatch):
    """The fork server's starts (counted, not made) on a node with NVIDIA device files."""
    calls = []
    monkeypatch.setattr(early, "gpu_device_files", lambda: True)
    monkeypatch.setattr(early.zygote, "start_ahead", lambda: calls.append(True))
    monkeypatch.setattr(early.zygote, "enabled", lambda: True)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(early, "_LOG_AT_LOAD", [])
    monkeypatch.setattr(early, "_start_builds_at_load", lambda: calls.append("builds"))
    return calls


def test_a_gpu_run_starts_it_writing_into_the_rank_log_configure_keeps(starts, tmp_path):
    results = tmp_path / "results"
    (results).mkdir()
    (results / "ranks.log").write_text("the last run's lines\n")
    early.start_at_load(_config(results=str(results)))
    assert starts == [True, "builds"]
    log = results / "ranks.log"
    assert log.read_text() == "", "the last run's rank log is started anew"
    assert early.log_started_at_load(log)
    assert not early.log_started_at_load(tmp_path / "elsewhere" / "ranks.log")


@pytest.mark.parametrize("known, env", [
    (dict(collectonly=True), {}),
    (dict(markexpr="not gpu"), {}),
    (dict(markexpr=""), {}),
    (dict(results=None), {}),
    ({}, {"PYTEST_XDIST_WORKER": "gw0"}),
], ids=["collect-only", "not-gpu", "no-m", "no-results", "xdist-worker"])
def test_other_runs_leave_it_to_configure(starts, tmp_path, monkeypatch, known, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    known.setdefault("results", str(tmp_path / "results"))
    early.start_at_load(_config(**known))
    assert starts == []
    assert not early.log_started_at_load(tmp_path / "results" / "ranks.log")


def test_a_node_without_nvidia_devices_leaves_it_to_configure(starts, tmp_path, monkeypatch):
    monkeypatch.setattr(early, "gpu_device_files", lambda: False)
    early.start_at_load(_config(results=str(tmp_path)))
    assert starts == []


def test_an_unwritable_results_folder_leaves_it_to_configure(starts, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    early.start_at_load(_config(results=str(blocker / "results")))
    assert starts == []


def test_a_pytest_run_without_the_suite_starts_nothing(pytester, monkeypatch):
    """The entry point acts only once the suite's plugin is loaded."""
    seen = []
    monkeypatch.setattr(early, "start_at_load", lambda config: seen.append(config))
    pytester.makepyfile(test_other="def test_a():\n    pass\n")
    pytester.runpytest_inprocess("-m", "gpu", "-p", "no:cacheprovider").assert_outcomes()
    assert seen == []
    pytester.runpytest_inprocess("-m", "gpu", "-p", "no:cacheprovider", "-p", "fixtures.plugin",
                                 "--results", str(pytester.path / "r"))
    assert len(seen) == 1
