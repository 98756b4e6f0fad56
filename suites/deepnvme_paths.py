"""Where the DeepNVMe suites (suites/test_deepnvme.py, suites/test_zero_infinity.py) write: the
profile's ``[[nvme.paths]]`` entries (``@scratch``: the run's --scratch), each checked before
anything is written, and the ``nvme_entry`` parameter that names them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsconform.suite import (
    nvme,
    run_state,
)

CAPABILITY = "deepnvme"
KiB, MiB = 1 << 10, 1 << 20


def accelerator_of(node) -> str:
    # On a GPU node everything runs in CUDA-accelerator processes: DeepSpeed's CPU accelerator
    # builds its own async_io into the same extensions cache and would replace the CUDA build.
    return node.accelerator


def entry_label(profile, index: int | None, entry) -> str:
    if index is None:
        return "--scratch"
    return f"{profile.source} nvme.paths[{index}] (path = {entry.path!r})"


@contextlib.contextmanager
def target(profile, index: int | None, entry, run, scratch: Path,
            need_bytes: int) -> Iterator[tuple[Path, nvme.PathFacts]]:
    """(directory to write in, facts of its filesystem) for a profile entry (``index`` None:
    the run's --scratch). Fails naming the entry before anything is written when the path is
    missing, read-only, too small, on tmpfs/overlay, or refuses O_DIRECT. ``@scratch`` and
    --scratch resolve to the test's own ``scratch`` directory (removed by the fixture); a fixed
    path gets a fresh directory of its own, removed on exit."""
    where = entry_label(profile, index, entry)
    path = scratch if index is None else entry.resolve(scratch)
    try:
        facts = nvme.check_path(path, need_bytes, where=where)
        nvme.probe_o_direct(path, facts)
    except nvme.NvmePathError as e:
        pytest.fail(str(e), pytrace=False)
    if path == scratch:
        yield scratch, facts
    else:
        with nvme.owned_dir(path) as d:
            yield d, facts


@contextlib.contextmanager
def scratch_dir(run) -> Iterator[tuple[Path, nvme.PathFacts]]:
    """A fresh directory under --scratch for one hypothesis example (function-scoped fixtures
    do not reset between examples), after the same checks as _target."""
    try:
        facts = nvme.check_path(run.scratch, 32 * MiB, where="--scratch")
    except nvme.NvmePathError as e:
        pytest.fail(str(e), pytrace=False)
    with nvme.owned_dir(run.scratch) as d:
        yield d, facts


def entries(config) -> list:
    prof = run_state(config).profile
    if not prof.nvme_paths:
        return [pytest.param((None, None), id="no-path", marks=pytest.mark.skip(
            reason=f"Requires: [NVMe path in profile (profile {prof.name} lists no "
                   f"[[nvme.paths]])]"))]
    return [pytest.param((i, e), id=f"path{i}") for i, e in enumerate(prof.nvme_paths)]


def generate_nvme_entries(metafunc: pytest.Metafunc) -> None:
    """The suites' pytest_generate_tests: one ``nvme_entry`` per profile path."""
    if "nvme_entry" in metafunc.fixturenames:
        metafunc.parametrize("nvme_entry", entries(metafunc.config))
