# The project's own tests. pytester runs small pytest sessions against the plugin in-process.
import distutils.ccompiler

import pytest

pytest_plugins = ["pytester"]

# pytester restores sys.modules after each in-process run, so a module first imported inside one
# is dropped afterwards. setuptools' distutils finds its compilers as subclasses of one base class:
# imported inside a run, then re-imported, the base class has no 'unix' compiler any more, and
# DeepSpeed's op probe (OpBuilder.has_function) reports every op incompatible for the rest of the
# session. Importing the compilers here, before any run, keeps them in place.
distutils.ccompiler.new_compiler()


@pytest.fixture
def outside_xdist(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's pytester runs and fake nodes see a process without pytest-xdist, also when the
    project's tests themselves run under it (a worker's environment names it, and the plugin
    then gives the worker a share of the GPUs and runs no cell batch)."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
