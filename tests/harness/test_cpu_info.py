"""py-cpuinfo asked once per process tree (dsconform.base.cpu_info): DeepSpeed's builders and
CPU Adam read the first answer, a copy each time; processes started later take it from the
environment; a failed query is answered as py-cpuinfo answers it ({}), once."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dsconform.base import cpu_info
from dsconform.harness import api as dist

try:
    from tests import rank_fns
except ImportError:
    import rank_fns

from tests.harness.test_dist import REPO
from tests.harness.test_dist_lanes import clean  # noqa: F401 - the fixture: no pool before or after

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


def test_a_failed_query_is_not_remembered_and_the_next_call_asks_again(fake_cpuinfo):
    """A query that fails is answered as py-cpuinfo answers it ({}), to that caller only: the
    next question asks py-cpuinfo again, and its usable answer is the one shared."""
    mod, calls = fake_cpuinfo
    query = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                             stdout=subprocess.PIPE)
    cpu_info.install()
    cpu_info._STATE["asking"] = query
    cpu_info._STATE["original"] = lambda: {}
    assert mod.get_cpu_info() == {}
    assert cpu_info.ENV not in __import__("os").environ
    cpu_info._STATE["original"] = lambda: calls.append(1) or dict(ANSWER)
    assert mod.get_cpu_info() == ANSWER and mod.get_cpu_info() == ANSWER
    assert calls == [1]


@pytest.mark.parametrize("printed", [b"", b"{}", b'{"count": 2}', b"[1]", b"not json"],
                         ids=["nothing", "empty", "no-arch", "a-list", "garbage"])
def test_a_query_that_names_no_architecture_is_a_failed_answer(fake_cpuinfo, printed):
    """A query that exits 0 but prints nothing usable (py-cpuinfo2 10.1 run as a script prints
    nothing) is not shared: py-cpuinfo in-process answers instead."""
    mod, calls = fake_cpuinfo
    query = subprocess.Popen([sys.executable, "-c",
                              f"import sys; sys.stdout.buffer.write({printed!r})"],
                             stdout=subprocess.PIPE)
    cpu_info.install()
    cpu_info._STATE["asking"] = query
    assert mod.get_cpu_info() == ANSWER
    assert calls == [1]


def test_an_environment_answer_without_architecture_is_ignored(fake_cpuinfo, monkeypatch):
    mod, calls = fake_cpuinfo
    monkeypatch.setenv(cpu_info.ENV, "{}")
    cpu_info.install()
    assert mod.get_cpu_info() == ANSWER and calls == [1]


WHEELS = sorted(Path(REPO, "tests", "data", "cpuinfo").glob("*.whl"))


@pytest.mark.parametrize("wheel", WHEELS, ids=[w.name.split("-py3")[0] for w in WHEELS])
def test_the_query_works_with_every_py_cpuinfo(wheel, tmp_path):
    """py-cpuinfo 9.0.0 and its fork py-cpuinfo2 (10.0, 10.1: the command line moved to
    cpuinfo/__main__.py) install the same module; the started query answers with each, and
    DeepSpeed's builders read an architecture from it."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path)
    version = wheel.name.split("-")[1]
    code = ("import cpuinfo, json\n"
            "from dsconform.base import cpu_info\n"
            "cpu_info.install(); cpu_info.start_asking()\n"
            "cpu_info._STATE['original'] = None\n"  # only the started query may answer
            "a = cpuinfo.get_cpu_info()\n"
            "print(json.dumps([cpuinfo.__file__, a.get('cpuinfo_version_string'),"
            " a.get('arch')]))\n")
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path}:{REPO}")
    env.pop(cpu_info.ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=60, check=True).stdout
    where, answered_version, arch = json.loads(out.splitlines()[-1])
    assert where.startswith(str(tmp_path)), where
    assert answered_version == version and arch, out


def test_a_started_query_gives_the_first_answer():
    """start_asking runs py-cpuinfo's own query command; its answer is the real one."""
    code = ("import cpuinfo, time\n"
            "from dsconform.base import cpu_info\n"
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
