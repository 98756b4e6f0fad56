"""A run refused at its start: the checks of its options (each refusal a usage error naming the
option, the value and what to fix), and the verdict files around them: before any check the last
run's verdict is set aside and dsconform.prom says "not finished" (dsconform.results.run_files),
so a refused or killed run never leaves an older pass; a refused run writes "refused" and why.
"""

from __future__ import annotations

import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsconform.profile.select import rendezvous_info
from dsconform.results import run_files
from dsconform.storage.nvme import mount_of

#: The run's attempt, from the start of pytest_configure to the verdict.
ATTEMPT = pytest.StashKey["Attempt"]()

#: File systems that are kernel interfaces, not storage: a scratch directory there can take no
#: file (/proc answers "No such file or directory" to a create), so the refusal names the kind.
KERNEL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs", "bpf",
    "configfs", "pstore", "efivarfs", "mqueue", "binfmt_misc", "fusectl", "nsfs", "autofs",
    "rpc_pipefs", "selinuxfs"})


def usage(msg: str) -> pytest.UsageError:
    return pytest.UsageError(f"dsconform: {msg}")


@dataclass
class Attempt:
    """This run's attempt: where its verdict goes, from before any check to its end."""
    results: Path | None    # --results as given: it may not exist, or be unusable
    textfile: Path | None   # --prometheus-textfile DIR
    started: str
    textfile_error: str = ""  # why the "not finished" copy could not be written there
    concluded: bool = False  # a verdict of this run is written (its own, or "refused")


def runs_tests(config: pytest.Config) -> bool:
    """Whether this pytest invocation runs tests: --collect-only, --help, --markers, --fixtures,
    --setup-plan and --setup-only run none, so they write no results and keep the last run's."""
    o = config.option
    return not any(getattr(o, name, False) for name in (
        "collectonly", "help", "markers", "showfixtures", "show_fixtures_per_test", "setupplan",
        "setuponly"))


def _given(value: object) -> Path | None:
    return Path(str(value)).expanduser() if value else None


def begin(config: pytest.Config, *, started: str, is_worker: bool) -> Attempt | None:
    """Set the previous run's verdict aside and say "not finished", before any check. Nothing
    where no test runs (runs_tests) or in an xdist worker (the controller owns the files)."""
    if not runs_tests(config) or is_worker:
        return None
    attempt = Attempt(_given(config.getoption("--results")),
                      _given(config.getoption("prometheus_textfile", None)), started)
    config.stash[ATTEMPT] = attempt
    try:
        folder = attempt.results if attempt.results and attempt.results.is_dir() else None
    except OSError:  # a folder this user may not look into: check_results names it
        folder = None
    if folder is not None:
        run_files.set_aside(folder)
        run_files.write_running([folder], started)
    if attempt.textfile is not None:
        errors = run_files.write_running([attempt.textfile], started)
        attempt.textfile_error = errors[0] if errors else ""
    return attempt


def results_ready(config: pytest.Config, results: Path | None) -> None:
    """Once --results is known to be a writable folder: "not finished" there too (a folder
    this run created had none), and refuse a --prometheus-textfile folder that took no file."""
    if (attempt := config.stash.get(ATTEMPT, None)) is None:
        return
    if results is not None:
        run_files.write_running([results], attempt.started)
    if attempt.textfile_error:
        raise usage(f"--prometheus-textfile: {attempt.textfile_error}; give a folder this user "
                    "can write (node_exporter's --collector.textfile.directory)")


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config):
    """Around the whole run: a usage error before the session began (the suite's own checks,
    another plugin's) refuses the run in the error's words; a run that ended with no verdict of
    its own (an internal error, or an interruption before its session began) is refused with
    pytest's exit status, never left saying "not finished"."""
    try:
        code = yield
    except pytest.UsageError as e:
        refuse(config, str(e))
        raise
    refuse(config, f"pytest stopped the run before its first test: exit status {int(code)} "
                   "(its console output says why)", exitstatus=int(code))
    return code


def refuse(config: pytest.Config, reason: str, *,
           exitstatus: int | None = run_files.REFUSED_EXIT_STATUS) -> None:
    """Write this run's "refused" verdict with ``reason``, once."""
    if (attempt := config.stash.get(ATTEMPT, None)) is None or attempt.concluded:
        return
    attempt.concluded = True
    rdzv = rendezvous_info()  # a refused rank of a job is still that job's
    summ = run_files.refused_summary(reason, started=attempt.started, exitstatus=exitstatus,
                                   hostname=socket.gethostname(),
                                   rendezvous=rdzv.to_dict() if rdzv else None)
    run_files.write_refused(attempt.results, attempt.textfile, summ)


def conclude(config: pytest.Config) -> Attempt | None:
    """The run writes its own verdict now (the recorder, at the session's end): its attempt,
    None where no test runs (nothing is written then)."""
    if (attempt := config.stash.get(ATTEMPT, None)) is not None:
        attempt.concluded = True
    return attempt


def check_results(opt: str | None) -> Path | None:
    """The --results folder, made where missing; refused, naming the option and why, where it
    cannot be made or written."""
    if not opt:
        return None
    path = Path(opt).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dsconform-probe-"):
            pass
    except OSError as e:
        existing = next((p for p in (path, *path.absolute().parents) if p.exists()), path)
        fstype = _filesystem(existing)
        why = (f"{existing} is on the kernel's {fstype} file system, where no file can be "
               "created" if fstype in KERNEL_FILESYSTEMS else e.strerror or str(e))
        raise usage(f"--results {opt}: cannot create or write it ({why})") from None
    return path.resolve()


def check_scratch(opt: str | None) -> tuple[Path, bool]:
    """The --scratch directory (made when not given: a temporary one, removed at the end) and
    whether it is temporary. Refused, naming the option and why: missing, not a directory, a
    kernel interface rather than a disk, or not writable."""
    if not opt:
        return Path(tempfile.mkdtemp(prefix="dsconform-scratch-")), True
    path = Path(opt).expanduser()
    fix = "point --scratch at an existing writable directory on the disk under test"
    if not path.exists():
        raise usage(f"--scratch {opt}: no such directory (create it, or {fix})")
    if not path.is_dir():
        raise usage(f"--scratch {opt}: not a directory ({fix})")
    fstype = _filesystem(path)
    if fstype in KERNEL_FILESYSTEMS:
        raise usage(f"--scratch {opt}: not a directory on a disk: it is on the kernel's {fstype} "
                    f"file system, where no file can be created; {fix}")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dsconform-probe-"):
            pass
    except OSError as e:
        raise usage(f"--scratch {opt}: not writable: creating a file there failed "
                    f"({e.strerror or e}); {fix}") from None
    return path.resolve(), False


def _filesystem(path: Path) -> str:
    """The type of the file system ``path`` is on ("" where /proc/self/mountinfo is unread)."""
    try:
        mount = mount_of(path)
    except OSError:
        return ""
    return mount.fstype if mount is not None else ""
