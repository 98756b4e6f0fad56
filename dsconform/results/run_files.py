"""A run's verdict files as runs follow each other in one results folder: what the previous run
wrote is set aside before anything can refuse the next one (``set_aside``), the verdict then
says "not finished" until the run writes its own (``write_running``), and a run refused before
its first test writes a "refused" verdict with the reason (``write_refused``). So no reader (a
person, ``dsconform aggregate``, node_exporter) ever takes an older run's pass for the newest
run's. The reading side: dsconform.results.attempt and dsconform.results.node_folder.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsconform.results import format as results_format
from dsconform.results import node_folder, prometheus

#: pytest's exit status for a run refused at its start (a usage error).
REFUSED_EXIT_STATUS = 4


def write_atomically(path: Path, text: str) -> None:
    """A temporary file beside ``path``, then a rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def set_aside(folder: Path) -> list[str]:
    """Rename the previous run's verdict files in ``folder`` to their ``.previous`` names (one
    previous run is kept); a file that cannot be renamed is removed. Returns the names of those
    that stay (a folder this process cannot write: the run is then refused naming it)."""
    left = []
    for name in results_format.VERDICT_FILES:
        old = folder / name
        if not (old.exists() or old.is_symlink()):
            continue
        try:
            old.replace(folder / results_format.previous_name(name))
        except OSError:
            try:
                old.unlink()
            except OSError:
                left.append(name)
    return left


def now() -> str:
    """The time as runs record it (``started``): local time with its UTC offset."""
    return _dt.datetime.now().astimezone().strftime("%Y-%m-%dT%H:%M:%S%z")


def write_running(folders: Iterable[Path], started: str) -> list[str]:
    """dsconform.prom saying "not finished" into each folder. Returns what could not be
    written, one line each naming the folder (prometheus.TextfileError's words)."""
    node = node_folder.NodeResult.missing(results_format.PROM_FILE)
    node.absent = False
    families = prometheus.result_families(node, started=started)
    errors = []
    for folder in folders:
        try:
            prometheus.write(families, folder / results_format.PROM_FILE)
        except prometheus.TextfileError as e:
            errors.append(str(e))
    return errors


def refused_summary(reason: str, *, started: str, hostname: str,
                    rendezvous: dict[str, Any] | None = None,
                    exitstatus: int | None = REFUSED_EXIT_STATUS) -> dict[str, Any]:
    """summary.json of a run refused before its first test: no test ran, nothing was measured;
    ``status`` "refused" and ``reason`` say why, in the words the console showed.
    ``exitstatus``: pytest's, None where it is not known here."""
    reason = reason.removeprefix("dsconform: ")
    return {"status": "refused", "reason": reason, "started": started, "ended": now(),
            "run": None, "capabilities": {}, "failures": [], "skips": [], "known_issues": [],
            "profile": None, "node": {"hostname": hostname}, "exitstatus": exitstatus,
            "notices": [reason], "rendezvous": rendezvous, "ops": None,
            "collection_errors": []}


def refused_lines(summ: dict[str, Any]) -> list[str]:
    """summary.txt of a refused run."""
    host = (summ.get("node") or {}).get("hostname", "?")
    code = summ.get("exitstatus")
    status = (f"pytest exit status {code} ({node_folder.EXIT_STATUS.get(code, 'unknown')})"
              if code is not None else "pytest's exit status is on its console")
    return [f"REFUSED on {host}: the run stopped before its first test, so it does not accept "
            "the node",
            f"reason: {summ['reason']}",
            f"started {summ['started']}; {status}"]


def write_refused(folder: Path | None, textfile: Path | None, summ: dict[str, Any]) -> list[str]:
    """The refused verdict ``summ`` (refused_summary) wherever a reader looks: summary.json,
    summary.txt and dsconform.prom in the results ``folder`` where it is a folder this process
    can write, and the --prometheus-textfile copy. Returns what could not be written."""
    target = folder if folder is not None and folder.is_dir() else None
    node = node_folder.node_from_summary(target or Path(summ["node"]["hostname"]), summ)
    families = prometheus.result_families(node, started=summ["started"], ended=summ["ended"])
    failed = []
    if target is not None:
        try:
            write_atomically(target / results_format.SUMMARY_JSON, json.dumps(summ, indent=2))
            write_atomically(target / results_format.SUMMARY_TXT,
                             "\n".join(refused_lines(summ)) + "\n")
            prometheus.write(families, target / results_format.PROM_FILE)
        except OSError as e:
            failed.append(f"{target}: {e.strerror or e}")
    if textfile is not None:
        try:
            prometheus.write(families, textfile / results_format.PROM_FILE)
        except prometheus.TextfileError as e:
            failed.append(str(e))
    return failed
