"""dsconform's pytest entry point (``pytest11``): the options, registered before pytest parses
the command line, which a conftest is too late for (docs/findings.md#running-the-suite).

Every pytest run of an environment where dsconform is installed loads it, so it MUST stay inert
outside the suite: no import of torch or DeepSpeed, no header, no summary, no results directory,
no hypothesis profile. The suite itself is ``fixtures/plugin.py``, loaded by the checkout's
conftest.py.
"""

from __future__ import annotations

import pytest

from dsconform import settings


def add_options(parser: pytest.Parser) -> None:
    """Register the options once, whoever comes first: this entry point, or the suite's plugin
    loaded with ``-p`` before entry points (pytester, PYTEST_DISABLE_PLUGIN_AUTOLOAD)."""
    g = parser.getgroup("dsconform", "DeepSpeed conformance (active in the dsconform suite only)")
    if any("--profile" in opt.names() for opt in g.options):
        return
    g.addoption("--profile", default=settings.get("DSCONFORM_PROFILE"),
                help="hardware profile: a shipped NAME, a PATH to a .toml, or auto (count the "
                     "node's GPUs without torch and pick the shipped profile of that model and "
                     "count, else a detected profile with no floors). Env: DSCONFORM_PROFILE. "
                     "Default: auto")
    g.addoption("--scratch", default=settings.get("DSCONFORM_SCRATCH") or None,
                help="existing writable directory where DeepNVMe and checkpoint tests may write "
                     "(nowhere else). Env: DSCONFORM_SCRATCH. Default: a temporary directory "
                     "removed at the end")
    g.addoption("--results", default=settings.get("DSCONFORM_RESULTS"),
                help="directory for benchmarks.json (pytest-benchmark format), junit.xml, "
                     "summary.json/.txt and records.jsonl; created if missing. Env: "
                     "DSCONFORM_RESULTS. Default: ./dsconform-results")
    g.addoption("--prometheus-textfile", metavar="DIR", default=None,
                help="also write the run's verdict, tests per capability, rates and floors and "
                     "the hardware gate's counters as DIR/dsconform.prom, atomically: the "
                     "folder node_exporter's textfile collector reads (--collector.textfile."
                     "directory). --results always holds a dsconform.prom too")
    g.addoption("--nightly", action="store_true",
                default=settings.get("DSCONFORM_NIGHTLY"),
                help="the nightly tier: also run the tests marked `slow` (the full matrices) "
                     "that -m selects. Without it `slow` tests run only when -m names them "
                     "(-m slow, -m 'gpu and slow'). Env: DSCONFORM_NIGHTLY=1")
    g.addoption("--soak", metavar="MINUTES", type=float, default=None,
                help="burn-in: after the selected tests (pytest suites -m gpu --soak 60), loop "
                     "the known-answer checks, ZeRO training cells, sustained matmul and HBM "
                     "patterns on every GPU at once for MINUTES while the hardware gate is "
                     "sampled (SOAK-1, docs/burn-in.md). Needs GPUs: refused on a node "
                     "without. Without it the soak test is not collected")


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)
