"""A suite run leaves no process of its own behind: every child pytest's process started (the
fork server, ranks, op builds) is gone once pytest has exited."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil

from tests.harness.test_dist import REPO


def _watch(pid: int, seen: set[int], done: threading.Event) -> None:
    """Every descendant of pid, as often as psutil can list them, until done."""
    while not done.is_set():
        try:
            seen.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            return
        time.sleep(0.05)


def test_no_child_outlives_pytest(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["DSCONFORM_FORKSERVER"] = "1"
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "suites/test_collectives.py::test_all_reduce_is_exact", "-m", "not gpu",
         "--results", str(tmp_path / "results")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(run.pid, seen, done), daemon=True)
    watcher.start()
    out = run.communicate(timeout=600)[0]
    done.set()
    watcher.join()
    assert run.returncode == 0, out[-3000:]
    assert len(seen) >= 2, f"no ranks were seen starting: {sorted(seen)}"
    alive = []
    for pid in seen:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            pass
    assert not alive, "still running after pytest exited:\n" + "\n".join(alive)
