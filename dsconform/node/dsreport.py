"""ds_report as data: its coloured op table and environment block (deepspeed/env_report.py),
parsed into plain data for the results and `dsconform report --json`. Its "compatible" only means
a probe passed; whether an op builds and loads is `dsconform.ops.load.load_op`'s to say."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# The logging format of DeepSpeed's loggers:
# "[2026-11-30 05:37:17,985] [WARNING] [file.py:213:fn] msg".
LOG_RE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+\] "
                    r"\[(?P<level>[A-Z]+)\] \[(?P<origin>[^\]]*)\] (?P<msg>.*)$")
SEPARATOR_RE = re.compile(r"^-{10,}$")
TABLE_HEADER_RE = re.compile(r"^op name \.* installed \.* compatible$")
# env_report pads the op name with dots to 23 characters; a longer name gets no dots at all
# ("deepspeed_not_implemented  [NO] ....... [OKAY]"), hence `\.*`.
OP_ROW_RE = re.compile(r"^(?P<name>[A-Za-z0-9_]+) \.* ?\[(?P<installed>YES|NO)\] "
                       r"\.* ?\[(?P<compatible>OKAY|NO)\]$")
NINJA_RE = re.compile(r"^ninja \.* \[(?P<status>OKAY|FAIL)\]$")
# env_report prints `name + " " + "." * (33 - len(name)) + " " + value`.
ENV_ROW_RE = re.compile(r"^(?P<key>[^.\[].*?) \.{2,} ?(?P<value>.*)$")
WARNING_PREFIX_RE = re.compile(r"^\[WARNING\]\s*")
ACCEL_RE = re.compile(r"Setting ds_accelerator to (?P<name>\w+)")
ACCEL_CPU_FALLBACK = "Setting accelerator to CPU"
ENV_HEADER = "DeepSpeed general environment info:"

# Lines of the fixed preamble that carry no data.
PREAMBLE_TEXT = {
    "DeepSpeed C++/CUDA extension op report",
    "NOTE: Ops not installed will be just-in-time (JIT) compiled at",
    "runtime if needed. Op compatibility means that your system",
    "meet the required dependencies to JIT install the op.",
    "JIT compiled ops requires ninja",
}

# ds_report's labels -> our keys where the label snake_cased is not the key.
ENV_KEYS = {"deepspeed wheel compiled w.": "deepspeed_wheel_compiled",
            "shared memory (/dev/shm) size": "shm_size_text"}
# Always present in the result (None when ds_report did not print them, e.g. the CUDA lines on the
# CPU accelerator), so callers can index without guessing which accelerator produced the text.
STANDARD_ENV_KEYS = (
    "torch_install_path", "torch_version", "torch_cuda_version", "torch_hip_version",
    "nvcc_version",
    "deepspeed_install_path", "deepspeed_version", "deepspeed_git_hash", "deepspeed_git_branch",
    "deepspeed_wheel_compiled", "shm_size_text", "shm_size_bytes",
)

# env_report.human_readable_size divides by 1024 per step but labels the result "KB/MB/GB/TB":
# "23.54 GB" means 23.54 GiB = 23.54 * 1024**3 bytes.
SHM_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}


class DsReportError(RuntimeError):
    """ds_report could not be run, or exited non-zero."""


def run_ds_report(timeout_s: float = 120) -> str:
    """Run the `ds_report` script that DeepSpeed installed with this interpreter and return
    stdout+stderr, colours kept. The script only calls into the deepspeed package, so run by
    this interpreter it reports the DeepSpeed the suite imports, whatever the `ds_report` on
    PATH belongs to (pyenv shims, a second venv). Where it is: the path DeepSpeed's installed
    files list, ``bin/`` beside the package (``pip install --target``), this environment's
    scripts folder."""
    try:
        dist = metadata.distribution("deepspeed")
    except metadata.PackageNotFoundError as exc:
        raise DsReportError("DeepSpeed is not installed: no ds_report to run") from exc
    places = [dist.locate_file(f) for f in dist.files or () if f.name == "ds_report"]
    places += [dist.locate_file("bin/ds_report"),
               os.path.join(sysconfig.get_path("scripts"), "ds_report")]
    script = next((os.fspath(p) for p in places if os.path.isfile(p)), None)
    if script is None:
        raise DsReportError(f"DeepSpeed {dist.version}'s ds_report script is not installed "
                            f"(looked in {', '.join(map(os.fspath, places))})")
    # Unbuffered so that logger lines (stderr) and the report (stdout) keep their printed order.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, script]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DsReportError(f"{' '.join(cmd)} did not finish within {timeout_s} s") from exc
    out = proc.stdout.decode(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(out.splitlines()[-20:])
        raise DsReportError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return out


def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


def parse_ds_report(text: str) -> dict[str, Any]:
    """Parse ds_report output (coloured or not) into ops, ninja, env, warnings and accelerator;
    ValueError when the text holds no op table (not ds_report output, or --hide_operator_status)."""
    lines = [line.strip() for line in strip_ansi(text).replace("\r", "").splitlines()]
    rows = {i: m for i, m in ((i, OP_ROW_RE.match(line)) for i, line in enumerate(lines)) if m}
    if not any(TABLE_HEADER_RE.match(line) for line in lines) or not rows:
        first = next((line for line in lines if line), "<empty>")
        raise ValueError("no DeepSpeed op table in this text (expected the header "
                         "'op name ... installed .. compatible' followed by op rows); "
                         f"first line: {first[:120]!r}")
    result: dict[str, Any] = {
        "ops": {}, "ninja": None, "env": dict.fromkeys(STANDARD_ENV_KEYS), "warnings": [],
        "accelerator": None, "log": [], "unparsed": [],
    }
    op_names = [m["name"] for m in rows.values()]
    pending: list[str] = []  # probe output waiting for the op row it belongs to
    section = "preamble"
    for i, line in enumerate(lines):
        if not line or SEPARATOR_RE.match(line):
            continue
        if (log := LOG_RE.match(line)):
            _take_log_line(result, log)
        elif i in rows:
            _add_op(result, rows[i], pending, op_names)
            pending = []
        elif TABLE_HEADER_RE.match(line):
            section = "ops"
        elif line == ENV_HEADER:
            result["warnings"].extend(pending)  # probe output after the last row belongs to no op
            pending = []
            section = "env"
        elif section == "ops":
            # env_report runs each op's compatibility probe right before printing its row, so
            # whatever appears between two rows is that probe's output.
            pending.append(_warning_text(line))
        elif (ninja := NINJA_RE.match(line)):
            result["ninja"] = ninja["status"] == "OKAY"
        elif WARNING_PREFIX_RE.match(line):
            result["warnings"].append(_warning_text(line))
        elif section == "env" and (row := ENV_ROW_RE.match(line)):
            _add_env(result["env"], row["key"], row["value"].strip())
        elif section == "preamble" and line in PREAMBLE_TEXT:
            continue
        else:
            result["unparsed"].append(line)
    result["warnings"].extend(pending)
    if result["accelerator"] is None:
        result["accelerator"] = _infer_accelerator(result["env"])
    return result


def _take_log_line(result: dict[str, Any], log: re.Match[str]) -> None:
    msg = log["msg"]
    if (accel := ACCEL_RE.search(msg)):
        result["accelerator"] = accel["name"]
    elif ACCEL_CPU_FALLBACK in msg:
        result["accelerator"] = "cpu"
    if log["level"] in ("WARNING", "ERROR", "CRITICAL"):
        result["warnings"].append(msg)
    else:
        result["log"].append(log.group(0))


def _add_op(result: dict[str, Any], row: re.Match[str], pending: Sequence[str],
            op_names: Sequence[str]) -> None:
    name = row["name"]
    result["ops"][name] = {"installed": row["installed"] == "YES",
                           "compatible": row["compatible"] == "OKAY",
                           "warnings": []}
    for warning in pending:
        # A warning that names another op of the table (and not this one) is about that op.
        named = [op for op in op_names if re.search(rf"\b{re.escape(op)}\b", warning)]
        target = (named[0] if len(named) == 1 and named[0] != name and named[0] in result["ops"]
                  else name)
        result["ops"][target]["warnings"].append(warning)


def _warning_text(line: str) -> str:
    return WARNING_PREFIX_RE.sub("", line).strip()


def _add_env(env: dict[str, Any], label: str, value: str) -> None:
    key = ENV_KEYS.get(label) or re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
    parsed = _env_value(value)
    env[key] = parsed
    if key == "deepspeed_info":
        # "0.19.8, unknown, unknown": version, git hash, git branch
        parts = [p.strip() for p in value.split(",")]
        (env["deepspeed_version"], env["deepspeed_git_hash"],
         env["deepspeed_git_branch"]) = (parts + [None] * 3)[:3]
    elif key == "shm_size_text":
        env["shm_size_bytes"] = shm_bytes(value)


def _env_value(value: str) -> Any:
    """`None` for "None", the first entry of a printed path list, else the text."""
    if value == "None":
        return None
    if value.startswith("[") and value.endswith("]"):
        try:
            items = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
        return items[0] if len(items) == 1 else items
    return value


def shm_bytes(text: str) -> int | None:
    """Bytes from env_report's "23.54 GB" (binary units despite the label); None for "UNKNOWN"."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(B|KB|MB|GB|TB)\s*", text)
    if not m:
        return None
    return round(float(m[1]) * SHM_UNITS[m[2]])


def _infer_accelerator(env: Mapping[str, Any]) -> str | None:
    # env_report prints the CUDA lines only when get_accelerator().device_name() == 'cuda', and
    # the torch_npu lines only for 'npu'.
    if "torch_npu_version" in env:
        return "npu"
    if env.get("torch_cuda_version") is not None or env.get("nvcc_version") is not None:
        return "cuda"
    return None
