"""py-cpuinfo asked once per process tree (dsconform.harness.cpu_info): DeepSpeed's builders and
CPU Adam read the first answer, a copy each time; processes started later take it from the
environment; a failed query is answered as py-cpuinfo answers it ({}), once."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from dsconform.harness import api as dist
from dsconform.harness import cpu_info

try:
    from tests import rank_fns
except ImportError:
    import rank_fns

from tests.test_dist import REPO
from tests.test_dist_lanes import clean  # noqa: F401 - the fixture: no pool before or after

ANSWER = {"arch": "X86_64", "flags": ["avx2", "avx512f"], "vendor_id_raw": "GenuineIntel"}


@pytest.fixture
def fake_cpuinfo(monkeypatch):
    """A py-cpuinfo whose get_cpu_info counts its calls; a fresh cpu_info state."""
    calls = []

    def get_cpu_info():
        calls.append(1)
        return json.loads(json.dumps(ANSWER))

    inner = types.SimpleNamespace(get_cpu_info=get_cpu_info, __file__="/nonexistent/cpuinfo.py")
    mod = types.SimpleNamespace(get_cpu_info=get_cpu_info, cpuinfo=inner)
    monkeypatch.setitem(sys.modules, "cpuinfo", mod)
    monkeypatch.setattr(cpu_info, "_STATE", {"answer": None, "asking": None, "original": None})
    monkeypatch.delenv(cpu_info.ENV, raising=False)
    return mod, calls


def test_the_first_answer_is_remembered_and_handed_out_as_copies(fake_cpuinfo):
    mod, calls = fake_cpuinfo
    assert cpu_info.install()
    first = mod.get_cpu_info()
    first["flags"].append("changed by a caller")
    again = mod.cpuinfo.get_cpu_info()
    assert calls == [1], "py-cpuinfo was asked again"
    assert again == ANSWER
    assert json.loads(__import__("os").environ[cpu_info.ENV]) == ANSWER


def test_an_answer_in_the_environment_is_taken_without_asking(fake_cpuinfo, monkeypatch):
    mod, calls = fake_cpuinfo
    monkeypatch.setenv(cpu_info.ENV, json.dumps({"arch": "ARM_8", "flags": "sve"}))
    cpu_info.install()
    assert mod.get_cpu_info() == {"arch": "ARM_8", "flags": "sve"}
    assert calls == []


def test_a_failed_query_is_answered_empty_once(fake_cpuinfo, monkeypatch):
    """py-cpuinfo answers {} when its query process fails; that answer is not asked for again
    (it would fail again, a second later)."""
    mod, _ = fake_cpuinfo
    query = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                             stdout=subprocess.PIPE)
    cpu_info.install()
    cpu_info._STATE["asking"] = query
    cpu_info._STATE["original"] = lambda: pytest.fail("asked again after the query")
    assert mod.get_cpu_info() == {} and mod.get_cpu_info() == {}


def test_a_started_query_gives_the_first_answer():
    """start_asking runs py-cpuinfo's own query command; its answer is the real one."""
    code = ("import cpuinfo, time\n"
            "from dsconform.harness import cpu_info\n"
            "cpu_info.install(); cpu_info.start_asking()\n"
            "cpu_info._STATE['original'] = None\n"  # only the started query may answer
            "a = cpuinfo.get_cpu_info(); t = time.monotonic(); b = cpuinfo.get_cpu_info()\n"
            "print(a == b and bool(a.get('arch')), time.monotonic() - t < 0.1)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60, check=True).stdout.split()
    assert out == ["True", "True"], out


def test_deepspeeds_builders_read_the_remembered_answer(fake_cpuinfo):
    """OpBuilder.cpu_arch and simd_width (every load of cpu_adam, async_io, gds) ask
    cpuinfo.get_cpu_info at call time: after install(), one question for all of them."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    _, calls = fake_cpuinfo
    cpu_info.install()
    flags = [CPUAdamBuilder().cpu_arch(), CPUAdamBuilder().simd_width(),
             AsyncIOBuilder().cpu_arch(), AsyncIOBuilder().simd_width()]
    assert flags == ["-march=native", "-D__AVX512__", "-march=native", "-D__AVX512__"]
    assert calls == [1]


@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize("forkserver", ["1", "0"], ids=["forked", "spawned"])
def test_ranks_answer_from_the_shared_answer(forkserver, monkeypatch):
    """A rank (forked from the server, or spawned after the parent shared its answer) holds the
    answer before its first question, and DeepSpeed's builders read it."""
    monkeypatch.setenv("DSCONFORM_FORKSERVER", forkserver)
    monkeypatch.setitem(cpu_info._STATE, "answer", None)
    monkeypatch.delenv(cpu_info.ENV, raising=False)
    cpu_info.share()
    facts = dist.run_ranks(rank_fns.cpu_questions, 2, timeout_s=120, reuse=False,
                           accelerator="cpu")
    for fact in facts:
        assert fact["shared"] and fact["held"], facts
        assert fact["flags"][0].startswith("-m"), facts
