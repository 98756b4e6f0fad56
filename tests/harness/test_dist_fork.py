"""Ranks forked from the fork server (dsconform.harness.zygote): as fresh as spawned ones, with
the parent's environment and threads, gone when pytest is killed, and spawned instead when the
server fails. Run on the CPU accelerator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from dsconform.harness import api as dist
from dsconform.harness import zygote

try:
    from tests import rank_fns
except ImportError:
    import rank_fns

from tests.harness.test_dist import REPO
from tests.harness.test_dist_lanes import clean  # noqa: F401 - the fixture: no pool before or after

TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the fork server is used on Linux only")
_clean_pools = pytest.mark.usefixtures("clean")


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


@_clean_pools
def test_forked_ranks_take_the_parents_environment_and_threads(monkeypatch):
    """A variable set after the server started reaches the ranks; one only the server has
    does not; OMP_NUM_THREADS is applied although the server's torch read
    another; the ranks' parent is the server, and no CUDA context came with the fork."""
    dist.run_ranks(rank_fns.noop, 2, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
    server = _forkserver_pid()
    assert server is not None, "no fork server was started"
    monkeypatch.setenv("DSCONFORM_TEST_LATE", "yes")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    facts = dist.run_ranks(rank_fns.process_facts, 2, timeout_s=TIMEOUT_S, reuse=False,
                           accelerator="cpu")
    for fact in facts:
        assert fact == {"ppid": server, "dynamo": True, "threads": 1, "late": "yes",
                        "server_env": None, "cuda_initialized": False}, facts


@_clean_pools
def test_spawned_ranks_when_the_setting_is_off(monkeypatch):
    monkeypatch.setenv("DSCONFORM_FORKSERVER", "0")
    facts = dist.run_ranks(rank_fns.process_facts, 2, timeout_s=TIMEOUT_S, reuse=False,
                           accelerator="cpu")
    assert [f["ppid"] for f in facts] == [os.getpid()] * 2
    assert [f["dynamo"] for f in facts] == [False, False]


@_clean_pools
def test_a_failing_server_makes_ranks_spawn_and_says_so(monkeypatch):
    from multiprocessing import forkserver

    def refuse(fds):
        raise ConnectionRefusedError("the fork server is gone")

    monkeypatch.setitem(zygote._STATE, "broken", None)
    monkeypatch.setattr(forkserver, "connect_to_new_process", refuse)
    facts = dist.run_ranks(rank_fns.process_facts, 2, timeout_s=TIMEOUT_S, reuse=False,
                           accelerator="cpu")
    assert [f["ppid"] for f in facts] == [os.getpid()] * 2
    assert "the fork server is gone" in (zygote.broken() or "")
    assert zygote.method() == "spawn"


def test_forked_ranks_die_with_a_killed_pytest(tmp_path):
    """SIGKILL leaves no atexit handler to run: the server sees its parent go, exits, and the
    kernel kills its ranks (PR_SET_PDEATHSIG)."""
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from dsconform.harness import api as dist
        from tests import rank_fns
        if __name__ == "__main__":
            pids = dist.run_ranks(rank_fns.pid, 2, timeout_s=60, accelerator="cpu")
            print(*pids, flush=True)
            time.sleep(600)
    """))
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    try:
        line = holder.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        assert all(psutil.Process(p).ppid() != holder.pid for p in pids), "ranks were spawned"
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
            time.sleep(0.2)
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert alive == [], f"ranks {alive} outlived the killed parent"
    finally:
        if holder.poll() is None:
            holder.kill()


@_clean_pools
def test_the_start_up_line_has_the_fork_server_and_the_first_rank(monkeypatch):
    """A forked rank says when its server started and ended its imports and when it was ready:
    the summary's start-up line orders them after the steps pytest's process marked."""
    from dsconform.harness import timeline

    timeline.reset()
    timeline.mark("before the ranks")
    t0 = time.time()
    dist.run_ranks(rank_fns.noop, 1, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
    steps = timeline.marks()
    for step in ("fork server imported torch", "first rank ready"):
        assert step in steps, steps
    assert list(steps).index("before the ranks") < list(steps).index("first rank ready")
    assert timeline.process_started_at(_forkserver_pid()) <= time.time()
    if "fork server started" in steps:  # the server of this test process may predate the mark
        assert steps["fork server started"] <= steps["fork server imported torch"]
    assert steps["fork server imported torch"] <= steps["first rank ready"]
    assert steps["first rank ready"] - steps["before the ranks"] <= time.time() - t0
    assert timeline.line().startswith("start-up (seconds after pytest's process started): ")
    timeline.reset()


SERVER_WRITES = textwrap.dedent("""
    import sys
    from dsconform.ops.cache import enable_bytecode_cache
    where = enable_bytecode_cache()
    assert where is not None, "the bytecode cache was not enabled"
    from dsconform.harness import api as dist
    from tests import rank_fns
    dist.run_ranks(rank_fns.noop, 1, timeout_s=120, reuse=False, accelerator="cpu")
    print(where)
""")


def test_a_server_started_under_pythondontwritebytecode_fills_the_bytecode_cache(tmp_path):
    """A pytest started under PYTHONDONTWRITEBYTECODE (as in container images) keeps compiled
    files in the suite's cache; the fork server, which multiprocessing starts with -B, writes
    there what it imports too (here dsconform.harness.preload, which only the server imports)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", DSCONFORM_CACHE=str(tmp_path / "cache"),
               DSCONFORM_FORKSERVER="1")
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", SERVER_WRITES], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    where = out.stdout.strip().splitlines()[-1]
    compiled = [p.name for p in Path(where).rglob("__init__*.pyc") if p.parent.name == "_dynamo"
                and p.parent.parent.name == "torch"]
    assert compiled, f"the fork server wrote no compiled torch._dynamo under {where}"
