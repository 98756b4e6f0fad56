"""The monitor suite's checks MUST go red when a monitor writes a value one step late.

The suite's own rank code (suites/monitor_ranks.py) trains real engines with csv_monitor (and
tensorboard where installed) on 2 ranks of the CPU accelerator, first as they are (the control:
no problem) and then with ``late=True``: the engine's own ``monitor.write_events`` is wrapped so
that every write carries the previous write's values at the current step index. MON-CSV-1 (and
MON-TB-1) MUST then fail at optimizer step 1, naming the value written, the step index and the
engine's value. Nothing is mocked: DeepSpeed's engine and monitors write the files.
"""

from __future__ import annotations

import re

from suites.test_monitor import run_cell, value_problems


def test_lr_one_step_late_fails(tmp_path):
    control = run_cell("cpu", "fp32", tmp_path / "control")
    assert value_problems(control, control["csv"], "csv_monitor") == []
    if control["tensorboard"] is not None:
        assert value_problems(control, control["tensorboard"], "tensorboard") == []
    late = run_cell("cpu", "fp32", tmp_path / "late", late=True)
    steps = late["steps"]
    for writer, written in (("csv_monitor", late["csv"]), ("tensorboard", late["tensorboard"])):
        if written is None:
            continue
        text = "\n".join(value_problems(late, written, writer))
        found = re.search(rf"{writer} Train/Samples/lr: optimizer step 1 wrote (\S+) at step "
                          rf"index {steps[1]['samples']}; the engine held (\S+) with "
                          rf"{steps[1]['samples']} samples", text)
        assert found, text
        # what was written is the step before's lr
        assert float(found.group(1)) == _as_written(steps[0]["lr"], writer)
        assert float(found.group(2)) == _as_written(steps[1]["lr"], writer)


def _as_written(x: float, writer: str) -> float:
    import struct

    return struct.unpack("f", struct.pack("f", x))[0] if writer == "tensorboard" else x
