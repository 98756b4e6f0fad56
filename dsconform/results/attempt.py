"""The newest run attempt of a results folder, as its ``dsconform.prom`` tells it.

Every run writes ``dsconform.prom`` first, before anything can refuse it ("not finished"), and
last (its verdict, "refused" for a run that never started). So the .prom names the newest
attempt, and a ``summary.json`` or ``benchmarks.json`` of an earlier run beside it (a folder
whose old files could not be set aside, a partial copy) is stale: it must never be read as that
attempt's verdict. ``stale_against`` decides it by the runs' start times, and by the files'
modification times where a file does not carry its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dsconform.results import format as results_format


@dataclass(frozen=True)
class Mark:
    """What the newest attempt's dsconform.prom says."""
    path: Path
    started: float | None  # dsconform_run_start_timestamp_seconds
    finished: bool         # dsconform_run_finished
    refused: bool          # dsconform_run_refused
    mtime: float

    @property
    def unsettled(self) -> bool:
        """The attempt has no verdict of its own to read (running, killed) or was refused: any
        older pass beside it is not this attempt's."""
        return self.refused or not self.finished


def read_mark(folder: Path) -> Mark | None:
    """The folder's dsconform.prom, read; None where there is none or it cannot be parsed."""
    path = folder / results_format.PROM_FILE
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
        values = {s.name: s.value for fam in text_string_to_metric_families(text)
                  for s in fam.samples if not s.labels}
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if "dsconform_run_finished" not in values:
        return None
    return Mark(path=path, started=values.get("dsconform_run_start_timestamp_seconds"),
                finished=values["dsconform_run_finished"] == 1,
                refused=values.get("dsconform_run_refused", 0) == 1, mtime=mtime)


def timestamp(text: Any) -> float | None:
    """Seconds since the epoch of an ISO 8601 time (a run's ``started``: ``...+0000``)."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def stale_against(mark: Mark | None, path: Path, started: Any) -> bool:
    """Whether the document at ``path`` (which says its run ``started`` then, or nothing) is
    from an attempt older than the unsettled one ``mark`` names. Where both carry a start the
    starts decide (a copy keeps them, not the files' times); a tie is the same attempt."""
    if mark is None or not mark.unsettled:
        return False
    begun = timestamp(started)
    if begun is not None and mark.started is not None:
        return begun < mark.started
    try:
        return path.stat().st_mtime <= mark.mtime
    except OSError:
        return False
