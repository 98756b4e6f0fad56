"""Rendezvous ports: a rank group binds its store in the parent, and a port another process
takes between the probe and the bind is skipped (dsconform.harness.xdist.bind_rendezvous_store),
so two suite runs on one machine, or a user's torchrun beside one, never fail a test with
EADDRINUSE."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from dsconform.harness import api as dist
from dsconform.harness import output, xdist

try:
    from tests import rank_fns
except ImportError:
    import rank_fns

from tests.harness.test_dist import REPO
from tests.harness.test_dist_lanes import clean  # noqa: F401 - the fixture: no pool before or after


def _listening() -> socket.socket:
    """A port held the way another job's store holds it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))
    sock.listen()
    return sock


@pytest.mark.usefixtures("clean")
def test_a_port_taken_after_the_probe_is_skipped_and_said_in_the_rank_log(monkeypatch):
    """The first port the probe finds is taken before the group binds it (a second run, a
    torchrun): the group binds the next one, its ranks train, and the rank log says so."""
    thief = _listening()
    taken = thief.getsockname()[1]
    real = xdist.free_port
    handed = []

    def free_port_then_stolen(worker_index=None):
        port = taken if not handed else real(worker_index)
        handed.append(port)
        return port

    monkeypatch.setattr(xdist, "free_port", free_port_then_stolen)
    lines = []
    monkeypatch.setattr(output, "record", lambda label, who, text: lines.append(text))
    try:
        results = dist.run_ranks(rank_fns.rank_and_sum, 2, timeout_s=120, reuse=False,
                                 accelerator="cpu")
    finally:
        thief.close()
    assert [r["rank"] for r in results] == [0, 1]
    assert handed[0] == taken and len(handed) >= 2
    assert any(f"port {taken} was taken" in line for line in lines), lines


def test_a_group_gives_up_after_its_bounded_tries(monkeypatch):
    thief = _listening()
    taken = thief.getsockname()[1]
    monkeypatch.setattr(xdist, "free_port", lambda worker_index=None: taken)
    try:
        with pytest.raises(RuntimeError, match=f"in {xdist.BIND_ATTEMPTS} tries"):
            xdist.bind_rendezvous_store(30)
    finally:
        thief.close()


RUNS = textwrap.dedent("""
    import pytest
    from dsconform.harness import api as dist
    from tests import rank_fns

    @pytest.mark.parametrize("turn", range(4))
    def test_a_fresh_group(turn):
        results = dist.run_ranks(rank_fns.rank_and_sum, 2, timeout_s=120, reuse=False,
                                 accelerator="cpu")
        assert [r["rank"] for r in results] == [0, 1]
""")


def test_two_pytest_runs_in_one_port_range_both_pass(tmp_path):
    """Two pytest processes start fresh rank groups at the same time, from the same range of
    ports (the same DSCONFORM_PORT_BASE, no xdist): every group of both runs starts."""
    (tmp_path / "test_groups.py").write_text(RUNS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=REPO, DSCONFORM_PORT_BASE="31500")
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              str(tmp_path / "test_groups.py")],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [run.communicate(timeout=600)[0] for run in runs]
    for run, out in zip(runs, outs):
        assert run.returncode == 0, out[-3000:]
        assert "4 passed" in out, out[-3000:]
