"""dsconform.ops (cache, load, checks) and dsconform.ops.diagnose: the extensions cache, real op
builds and loads on this machine, check_op's dispatch, and the diagnosis of real build failures
(the functional checks themselves: tests/checks/test_op_checks.py).

Ops build once into the stable cache (`extensions_dir()`); the first run on a machine pays the cold
builds (on 2 cores: cpu_adam about 40 s, async_io about 150 s, more on a busy machine).
Failures are provoked for real where this machine allows it; where it cannot (a CUDA torch is
needed), the text comes from the library's own message constants and the test says so.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from dsconform.ops import checks as ops
from dsconform.ops import load
from dsconform.ops.cache import ensure_extensions_dir, environment_key, extensions_dir
from dsconform.ops.checks import check_op
from dsconform.ops.diagnose import (
    LIBAIO_FIX,
    Diagnosis,
    diagnose,
    first_compiler_error,
    format_failure,
)
from dsconform.ops.load import OpLoad, OpUnavailable, load_op

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parents[1] / "data" / "ds_report"
WITHOUT_LIBAIO_DEV = DATA / "without_libaio_dev.sh"
PY = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}"


# --------------------------------------------------------------------------------------------
# The extensions cache


def test_extensions_dir_is_keyed_by_environment(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("DSCONFORM_CACHE", str(tmp_path))
    torch_v = importlib.metadata.version("torch")
    ds_v = importlib.metadata.version("deepspeed")
    variant = torch_v.split("+")[1] if "+" in torch_v else None
    key = extensions_dir().name
    assert extensions_dir() == tmp_path / "torch_extensions" / key
    assert key.startswith(f"{PY}-torch{torch_v.split('+')[0]}-ds{ds_v}-")
    if variant:
        assert f"-{variant}-" in key
    # ... and the place DeepSpeed is installed: two installs of one version keep apart
    assert re.fullmatch(r".*-[0-9a-f]{8}", key)
    # another DeepSpeed, torch or Python gets another directory
    assert len({key, environment_key(deepspeed_version="0.19.6"),
                environment_key(torch_version="2.11.0+cu130"),
                environment_key(python=(3, 12))}) == 4
    assert environment_key(torch_version="2.11.0+cu130", deepspeed_version="0.19.6",
                           python=(3, 12)) == \
        f"py312{sys.abiflags}-torch2.11.0-ds0.19.6-cu130"


def test_extensions_dir_does_not_import_torch() -> None:
    code = ("import sys; from dsconform.ops.cache import extensions_dir; extensions_dir(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_extensions_dir_default_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DSCONFORM_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert extensions_dir() == (tmp_path / ".cache" / "dsconform" / "torch_extensions"
                                / environment_key())


def test_ensure_extensions_dir_sets_and_creates(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("DSCONFORM_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    path = ensure_extensions_dir()
    assert path == extensions_dir() and path.is_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(path)


def test_ensure_extensions_dir_respects_the_user(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    mine = tmp_path / "my_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(mine))
    assert ensure_extensions_dir() == mine and mine.is_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(mine)


# --------------------------------------------------------------------------------------------
# Diagnosis on real failure texts


def test_arch_suffix_real_deepspeed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Real: DeepSpeed's CUDA FusedAdamBuilder parses TORCH_CUDA_ARCH_LIST without needing a GPU.
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError) as exc:
        FusedAdamBuilder().compute_capability_args()
    text = "".join(traceback.format_exception(exc.value))
    assert "invalid literal for int() with base 10: '0a'" in text
    found = diagnose(text, "", {"TORCH_CUDA_ARCH_LIST": "9.0a"})
    assert len(found) == 1
    assert "TORCH_CUDA_ARCH_LIST=9.0a" in found[0].cause
    assert found[0].fix == "export TORCH_CUDA_ARCH_LIST=9.0"


def test_arch_suffix_findings_line_and_proactive() -> None:
    # docs/findings.md#op-builds: the line the H200 nodes' JIT builds fail with
    findings_line = "ValueError: invalid literal for int() with base 10: '0a'"
    assert diagnose(findings_line, "", {})[0].fix.startswith("export TORCH_CUDA_ARCH_LIST=9.0")
    # The variable alone is enough, whatever the error says.
    found = diagnose("RuntimeError: Error building extension 'fused_adam'", "",
                     {"TORCH_CUDA_ARCH_LIST": "8.0;9.0a+PTX"})
    assert [d.fix for d in found] == ["export TORCH_CUDA_ARCH_LIST=8.0;9.0+PTX"]
    assert diagnose("RuntimeError: x", "", {"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}) == []


def test_cuda_home_real_deepspeed_error() -> None:
    # Real: DeepSpeed's installed_cuda_version() with CUDA_HOME pointing nowhere.
    code = ("from deepspeed.ops.op_builder.builder import installed_cuda_version\n"
            "try:\n    installed_cuda_version()\nexcept Exception as e:\n"
            "    print(type(e).__name__ + ': ' + str(e))")
    env = {**os.environ, "CUDA_HOME": "/nonexistent/cuda"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120).stdout
    assert "MissingCUDAException" in out, out
    found = diagnose(out, "", {"CUDA_HOME": "/nonexistent/cuda"})
    assert [d.cause for d in found] == ["no usable nvcc: CUDA_HOME=/nonexistent/cuda"]
    assert "export CUDA_HOME=" in found[0].fix


def test_cuda_mismatch_torch_message() -> None:
    # Text fixture: a CUDA torch is needed to provoke it. The text is what torch raises:
    # RuntimeError(CUDA_MISMATCH_MESSAGE, nvcc_version, torch.version.cuda), left unformatted.
    from torch.utils.cpp_extension import CUDA_MISMATCH_MESSAGE
    text = f"RuntimeError: {RuntimeError(CUDA_MISMATCH_MESSAGE, '13.0', '12.8')}"
    (found,) = diagnose(text, "", {"CUDA_HOME": "/usr/local/cuda-13.0"})
    assert "nvcc is CUDA 13.0" in found.cause and "torch was built with CUDA 12.8" in found.cause
    # and DeepSpeed's own check (text fixture from op_builder/builder.py's CUDAMismatchException)
    ds_text = (">- DeepSpeed Op Builder: Installed CUDA version 12.4 does not match the version "
               "torch was compiled with 13.0, unable to compile cuda/cpp extensions without a "
               "matching cuda version.")
    (found,) = diagnose(ds_text, "", {})
    assert "nvcc is CUDA 12.4" in found.cause and "CUDA 13.0" in found.cause


def test_shm_threshold_and_text() -> None:
    assert diagnose("RuntimeError: x", "", {}, shm_bytes=64 * 1024**2)[0].cause.startswith(
        "/dev/shm is 67108864 bytes")
    assert diagnose("RuntimeError: x", "", {}, shm_bytes=64 * 1024**2,
                    min_shm_bytes=32 * 1024**2) == []
    # Text: env_report's warning and NCCL's shared-memory failure.
    assert diagnose("[WARNING] /dev/shm size might be too small, if running in docker increase",
                    "", {})
    assert diagnose("", "NCCL WARN Error while creating shared memory segment /dev/shm/nccl-x "
                        "(size 9637888)", {})


def test_unrecognised_failure_gives_no_diagnosis() -> None:
    assert diagnose("RuntimeError: something nobody has seen", "", {}) == []


def test_format_failure_names_op_error_causes_and_tail() -> None:
    load = OpLoad(name="async_io", compatible=True, loaded=False, seconds=12.5, built_now=False,
                  error="CalledProcessError: Command '['ninja', '-v']' returned non-zero exit "
                        "status 1.\n"
                        "RuntimeError: Error building extension 'async_io'",
                  log_tail="[1/12] c++ -c a.cpp\n"
                           "x.cpp:1:10: fatal error: libaio.h: No such file or directory\n"
                           "ninja: build stopped: subcommand failed.",
                  diagnosis=[Diagnosis("the compiler cannot find libaio.h", LIBAIO_FIX)])
    text = format_failure(load)
    lines = text.splitlines()
    assert lines[0].startswith("op async_io did not load")
    assert lines[1] == "error: RuntimeError: Error building extension 'async_io'"
    assert ("first compiler error: x.cpp:1:10: fatal error: libaio.h: No such file or directory"
            in lines)
    assert "cause: the compiler cannot find libaio.h" in lines and f"  fix: {LIBAIO_FIX}" in lines
    assert lines[-1] == "    ninja: build stopped: subcommand failed."


def test_first_compiler_error() -> None:
    assert first_compiler_error("ok\n"
                                "/usr/bin/ld: cannot find -laio: No such file or directory\n") == \
        "/usr/bin/ld: cannot find -laio: No such file or directory"
    assert first_compiler_error("all good") is None


BUILD_LOGS = DATA / "build_logs"
# Real failed loads captured on the CPU machine (build_logs/README.md):
# file -> (cause contains, fix starts with)
CAPTURED_FAILURES = {
    "async_io-libaio-prefix-cflags.json": ("cannot find libaio.h", "install libaio-dev"),
    "async_io-libaio-prefix-link.json": ("cannot find libaio.so (-laio)", "install libaio-dev"),
    "async_io-no-libaio-dev.json": ("probe could not compile and link", "install libaio-dev"),
    "cpu_adam-no-ninja.json": ("ninja is not on PATH", "pip install ninja"),
    "cpu_adam-no-compiler.json": ("'/nonexistent/bin/c++' was not found", "install a compiler"),
}


@pytest.mark.parametrize("path", sorted(BUILD_LOGS.glob("*.json")), ids=lambda p: p.name)
def test_captured_failures_are_diagnosed(path: Path) -> None:
    failure = json.loads(path.read_text())
    assert not failure["loaded"]
    found = diagnose(failure["error"], failure["log_tail"], failure["env"])
    assert found, f"{path.name}: no cause recognised for {failure['error'].splitlines()[-1]!r}"
    if path.name in CAPTURED_FAILURES:
        cause, fix = CAPTURED_FAILURES[path.name]
        assert len(found) == 1, found
        assert cause in found[0].cause and found[0].fix.startswith(fix), found


def test_captured_failures_exist() -> None:
    missing = [name for name in CAPTURED_FAILURES if not (BUILD_LOGS / name).is_file()]
    assert not missing, f"captured build failures missing from {BUILD_LOGS}: {missing}"


# --------------------------------------------------------------------------------------------
# Real loads in this process (stable cache)


@pytest.mark.parametrize("name", ["cpu_adam", "async_io"])
def test_load_op_builds_and_loads(name: str) -> None:
    load = load_op(name)
    print(f"{name}: {'cold build' if load.built_now else 'warm load'} {load.seconds:.1f} s")
    assert load.loaded, format_failure(load)
    assert load.compatible and load.error is None and load.diagnosis == []
    assert load.module is not None and load.seconds > 0
    assert Path(ensure_extensions_dir(), name, f"{name}.so").is_file()
    if load.built_now:  # the compiler's lines were captured (the tail ends with the link step)
        assert f"-o {name}.so" in load.log_tail, load.log_tail


def test_second_process_loads_warm() -> None:
    """Another process in the same environment finds the op built: the cache is shared by key."""
    assert load_op("cpu_adam").loaded
    result = _load_in_subprocess("cpu_adam", dict(os.environ))
    assert result["loaded"] and not result["built_now"], result


def test_unknown_op_is_a_result_not_an_exception() -> None:
    load = load_op("no_such_op")
    assert not load.loaded and "not provided by DeepSpeed's" in load.error
    with pytest.raises(OpUnavailable, match="op no_such_op did not load"):
        check_op("no_such_op", device="cpu")


def test_op_builders_follow_the_accelerator() -> None:
    from deepspeed.accelerator import get_accelerator
    builders = load.op_builders()
    assert builders["cpu_adam"] == "CPUAdamBuilder" and builders["async_io"] == "AsyncIOBuilder"
    assert builders["fused_adam"] == "FusedAdamBuilder"
    if get_accelerator()._name == "cpu":  # the CPU accelerator's fused_adam is a CPU implementation
        assert type(load._create_builder("fused_adam")).__module__.endswith(
            "op_builder.cpu.fused_adam")
        assert "gds" not in builders
        with pytest.raises(OpUnavailable, match="not provided by DeepSpeed's cpu accelerator"):
            check_op("gds", device="cpu", scratch_dir="/nonexistent")


def test_check_op_dispatch(tmp_path: Path) -> None:
    only_load = check_op("pin_memory", device="cpu")
    assert only_load["checked"] == "load only" and only_load["loaded"]
    aio = check_op("async_io", device="cpu", scratch_dir=tmp_path)
    assert aio["checked"] == "functional" and aio["equal"] and "build_seconds" in aio
    with pytest.raises(ValueError, match="scratch_dir"):
        check_op("async_io", device="cpu")


# --------------------------------------------------------------------------------------------
# Real failures, provoked in a child process


def _load_in_subprocess(name: str, env: dict[str, str], prefix: list[str] | None = None,
                        timeout: int = 900) -> dict:
    code = ("import json, sys\nfrom dsconform.ops.load import load_op\nr = load_op(sys.argv[1])\n"
            "print('DSCONFORM-RESULT ' + json.dumps({**r.summary(), 'log_tail': r.log_tail}))")
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
    proc = subprocess.run([*(prefix or []), sys.executable, "-c", code, name], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("DSCONFORM-RESULT ")]
    assert lines, f"child exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("DSCONFORM-RESULT "))


def test_ninja_missing_real(tmp_path: Path) -> None:
    assert load_op("cpu_adam").loaded  # built: DeepSpeed still insists on ninja
    bin_dir = tmp_path / "bin"  # PATH with the tools the load needs, and no ninja
    bin_dir.mkdir()
    for tool in ("sh", "bash", "c++", "gcc", "cc", "lscpu", "uname"):
        if (found := shutil.which(tool)):
            (bin_dir / tool).symlink_to(found)
    result = _load_in_subprocess("cpu_adam", {**os.environ, "PATH": str(bin_dir)})
    assert not result["loaded"]
    assert "ninja" in result["error"]
    assert any("ninja" in d["cause"] and "pip install ninja" in d["fix"]
               for d in result["diagnosis"]), result


def test_compiler_missing_real(tmp_path: Path) -> None:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "CXX": "/nonexistent/bin/c++"}
    result = _load_in_subprocess("cpu_adam", env)
    assert not result["loaded"], result
    assert any("was not found" in d["cause"] and "build-essential" in d["fix"]
               for d in result["diagnosis"]), result


def _can_hide_libaio_dev() -> str | None:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "needs root and unshare to hide libaio-dev in a mount namespace"
    probe = subprocess.run([str(WITHOUT_LIBAIO_DEV), "true"], capture_output=True, text=True)
    return (None if probe.returncode == 0
            else f"cannot hide libaio-dev here: {probe.stderr.strip()[-200:]}")


@pytest.mark.slow
@pytest.mark.skipif(bool(_can_hide_libaio_dev()), reason=str(_can_hide_libaio_dev()))
def test_libaio_outside_system_paths_real(tmp_path: Path) -> None:
    """libaio in a private prefix with CFLAGS/LDFLAGS: DeepSpeed's probe passes,
    the JIT build fails."""
    prefix = tmp_path / "libaio"
    env = {**os.environ, "LIBAIO_PREFIX": str(prefix),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "CFLAGS": f"-I{prefix}/include", "LDFLAGS": f"-L{prefix}/lib"}
    result = _load_in_subprocess("async_io", env, prefix=[str(WITHOUT_LIBAIO_DEV)])
    assert result["compatible"] and not result["loaded"], result
    assert "libaio.h: No such file or directory" in result["log_tail"]
    (libaio,) = [d for d in result["diagnosis"] if d["fix"] == LIBAIO_FIX]
    assert "cannot find libaio.h" in libaio["cause"] and "CFLAGS=" in libaio["cause"]


@pytest.mark.skipif(bool(_can_hide_libaio_dev()), reason=str(_can_hide_libaio_dev()))
def test_libaio_missing_probe_real() -> None:
    """Without libaio-dev, DeepSpeed refuses to build async_io; the refusal is diagnosed.

    The stable cache is fine here: the refusal comes before the cached async_io binary is looked at,
    and pin_memory (loaded first) is already built there.
    """
    assert load_op("pin_memory").loaded
    result = _load_in_subprocess("async_io", dict(os.environ), prefix=[str(WITHOUT_LIBAIO_DEV)])
    assert not result["compatible"] and not result["loaded"], result
    assert "not being compatible" in result["error"]
    assert [d["fix"] for d in result["diagnosis"]] == [LIBAIO_FIX]


def test_isolated_check_survives_a_native_crash(monkeypatch, tmp_path):
    """A check that aborts its process (as GDS I/O did on the 2xH200 virtio disk) fails with
    OpCrashed naming the signal; the calling process carries on."""
    monkeypatch.setattr(ops, "_CHILD", "import os, sys; print('about to crash'); "
                                       "sys.stdout.flush(); os.abort()")
    with pytest.raises(ops.OpCrashed, match=r"killed by SIGABRT[\s\S]*about to crash"):
        ops.IsolatedOpCheck.start("cpu_adam", scratch_dir=tmp_path).result()


def test_isolated_check_returns_the_result(tmp_path):
    result = ops.IsolatedOpCheck.start("cpu_adam", scratch_dir=tmp_path).result()
    assert result["op"] == "cpu_adam" and result["checked"] == "functional"
    assert result["max_abs_diff"] <= result["atol"] + result["rtol"]


class _FakeProc:
    def __init__(self, log, name):
        self.log, self.name, self.finished = log, name, False

    def wait(self):
        self.finished = True
        self.log.append(("finished", self.name))

    def poll(self):
        return 0 if self.finished else None


class _FakeCheck:
    def __init__(self, log, name):
        self.proc = _FakeProc(log, name)
        self.killed = False

    def wait(self):
        self.proc.wait()

    def kill(self):
        self.killed = True


def test_op_checks_start_compute_ops_together_and_io_ops_one_at_a_time(tmp_path):
    from dsconform.ops.checks import OpChecks

    log = []

    def starter(op, *, device, scratch_dir):
        assert scratch_dir.is_dir() and scratch_dir.name == op and device == "cuda"
        log.append(("started", op))
        return _FakeCheck(log, op)

    builds = {"fused_adam": {"loaded": True}, "cpu_adam": {"loaded": False}}
    checks = OpChecks(["fused_adam", "async_io", "cpu_adam", "gds"], device="cuda",
                      scratch_root=tmp_path, build_result=builds.get, starter=starter)
    # Compute ops and the first I/O op at once; a failed build gets no check.
    assert log == [("started", "fused_adam"), ("started", "async_io")]
    assert checks.get("cpu_adam") is None
    assert checks.get("fused_adam").proc.name == "fused_adam"
    gds = checks.get("gds")
    assert log[-2:] == [("finished", "async_io"), ("started", "gds")]
    checks.close()
    assert gds.killed


def test_op_checks_never_wait_for_a_build_before_their_op_is_asked_for(tmp_path):
    from dsconform.ops.checks import OpChecks

    log, done = [], {"fused_adam": False, "cpu_adam": True}

    def starter(op, *, device, scratch_dir):
        log.append(op)
        return _FakeCheck(log, op)

    def build_result(op):
        done[op] = True  # wait(op): returns once the build has ended
        return {"loaded": True}

    checks = OpChecks(["fused_adam", "cpu_adam"], device="cuda", scratch_root=tmp_path,
                      build_result=build_result, build_done=done.get, starter=starter)
    assert log == ["cpu_adam"]  # fused_adam's build still runs: not waited for
    assert checks.get("fused_adam").proc.name == "fused_adam"
    assert log == ["cpu_adam", "fused_adam"]


def test_a_disk_op_check_waiting_for_the_one_before_reads_its_output(tmp_path, monkeypatch):
    """The second I/O op's check waits for the first; a first check that prints more than a
    pipe holds must not hang that wait."""
    import threading

    from dsconform.ops import checks as ops

    monkeypatch.setattr(ops, "_CHILD", "import sys; sys.stdout.write('x' * 1_000_000)\n")
    checks = ops.OpChecks(["async_io", "gds"], device="cpu", scratch_root=tmp_path)
    waiter = threading.Thread(target=checks.get, args=("gds",), daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    hung = waiter.is_alive()
    checks.close()
    assert not hung, "waiting for the first I/O op's check hung on its full output pipe"
    with pytest.raises(ops.OpCrashed, match="exited 0 before reporting"):
        checks.get("async_io").result()
