"""Known answers: the hashes of the SDC suite's deterministic kernels (suites/test_sdc.py), as
a healthy GPU of each catalogue model computed them, in known_answers.toml beside this module.

A hash holds only for the exact software that computed it: the same GPU model (a key of
gpu_models.toml), torch, CUDA and cuBLAS (another release may pick another GEMM algorithm, and
so other rounding), and the same inputs (``inputs``: the suite's INPUTS_VERSION). A one-GPU node
has no peers to compare with; it compares with the entry of its exact key, and where there is
none the check skips saying so, while the run records what it observed (fact
``sdc.observed``) so that it can be added:

    dsconform known-answers RESULTS_DIR [--source TEXT] [--write]

prints the ``[[answers]]`` entries a run observed (``--write`` appends them to the shipped
file). Record only from a node whose SDC checks passed everywhere else (repetitions, peers,
the CPU reference), and say in ``source`` which node and results folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from dsconform.profile import catalogue

ANSWERS_FILE = Path(__file__).with_name("known_answers.toml")
#: The fact a run records its observed hashes under (one value per GPU).
FACT = "sdc.observed"
KEY_FIELDS = ("model", "torch", "cuda", "cublas", "inputs")
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")


class KnownAnswersError(catalogue.CatalogueError):
    """Problems of a known-answers file, one line each: FILE: answers[i].FIELD: reason."""


@dataclass(frozen=True)
class Key:
    model: str      # gpu_models.toml key ("h200")
    torch: str      # torch.__version__
    cuda: str       # torch.version.cuda
    cublas: str     # cuBLAS's MAJOR.MINOR.PATCH as the library reports it
    inputs: int     # the suite's INPUTS_VERSION

    def describe(self) -> str:
        return (f"model {self.model}, torch {self.torch}, CUDA {self.cuda}, cuBLAS "
                f"{self.cublas}, inputs v{self.inputs}")


def parse(data: Mapping[str, Any], src: str = "<known answers>",
          models: Mapping[str, Any] | None = None) -> dict[Key, dict[str, str]]:
    """The recorded hashes by key; KnownAnswersError naming every problem. ``models``: the GPU
    catalogue's entries (an entry's model must be one of them)."""
    problems: list[str] = []
    extra = set(data) - {"answers"}
    problems += [f"{src}: {e}: unknown table (only [[answers]])" for e in sorted(extra)]
    entries = data.get("answers", [])
    if not isinstance(entries, list):
        return _raise([f"{src}: answers: expected an array of tables ([[answers]])"])
    out: dict[Key, dict[str, str]] = {}
    for n, e in enumerate(entries):
        at = f"{src}: answers[{n}]"
        if not isinstance(e, dict):
            problems.append(f"{at}: expected a table")
            continue
        for name in sorted(set(e) - {*KEY_FIELDS, "source", "hashes"}):
            problems.append(f"{at}.{name}: unknown field")
        for name in (*KEY_FIELDS[:4], "source"):
            if not isinstance(e.get(name), str) or not e[name].strip():
                problems.append(f"{at}.{name}: required, a non-empty string")
        if isinstance(e.get("inputs"), bool) or not isinstance(e.get("inputs"), int):
            problems.append(f"{at}.inputs: required, the suite's INPUTS_VERSION (an integer)")
        if models is not None and isinstance(e.get("model"), str) and e["model"] not in models:
            problems.append(f"{at}.model: {e['model']!r} is no entry of gpu_models.toml")
        hashes = e.get("hashes")
        if not isinstance(hashes, dict) or not hashes:
            problems.append(f"{at}.hashes: required, a table kernel = sha256 hex digest")
            continue
        for kernel, h in hashes.items():
            if not isinstance(h, str) or not _HASH_RE.match(h):
                problems.append(f"{at}.hashes.{kernel}: expected 64 hex digits, found {h!r}")
        if not problems:
            key = Key(*(e[f] for f in KEY_FIELDS))
            if key in out:
                problems.append(f"{at}: a second entry for {key.describe()}")
            out[key] = dict(hashes)
    return _raise(problems) if problems else out


def _raise(problems: list[str]) -> Any:
    raise KnownAnswersError(problems)


def load(path: str | Path = ANSWERS_FILE) -> dict[Key, dict[str, str]]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise KnownAnswersError([f"{path}: cannot read: {e.strerror or e}"]) from None
    except tomllib.TOMLDecodeError as e:
        raise KnownAnswersError([f"{path}: not valid TOML: {e}"]) from None
    return parse(data, str(path), catalogue.shipped())


def digest(path: str | Path = ANSWERS_FILE) -> str:
    """The sha256 of the known-answers file: which recorded answers a run compared against."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@cache
def shipped() -> dict[Key, dict[str, str]]:
    """The shipped known answers (a broken file is a bug of the suite: it raises)."""
    return load(ANSWERS_FILE)


def model_key(device_name: str) -> str | None:
    """The GPU catalogue's key for a device name, None where the catalogue has no such model."""
    model = catalogue.find([device_name])
    return None if model is None else model.key


def observed(device_name: str, versions: Mapping[str, str], inputs: int,
             hashes: Mapping[str, str]) -> dict[str, Any]:
    """What a GPU computed, in the form of an entry (without ``source``): the value of the
    ``sdc.observed`` fact, one per GPU."""
    return {"model": model_key(device_name) or device_name, "torch": versions["torch"],
            "cuda": versions["cuda"], "cublas": versions["cublas"], "inputs": inputs,
            "hashes": dict(sorted(hashes.items()))}


def lookup(entry: Mapping[str, Any], answers: Mapping[Key, dict[str, str]] | None = None
           ) -> tuple[dict[str, str] | None, str]:
    """(the recorded hashes for an observed entry's key, "") or (None, why there are none)."""
    answers = shipped() if answers is None else answers
    if model_key_known(entry["model"]) is False:
        return None, (f"the GPU model {entry['model']!r} is not in the GPU catalogue "
                      f"(dsconform/profile/gpu_models.toml)")
    if "unknown" in (entry["cuda"], entry["cublas"]):
        return None, (f"the CUDA or cuBLAS version could not be read (CUDA {entry['cuda']}, "
                      f"cuBLAS {entry['cublas']}): no recorded hash can be matched")
    key = Key(*(entry[f] for f in KEY_FIELDS))
    if key not in answers:
        near = sorted(k.describe() for k in answers if k.model == key.model)
        return None, (f"no known answer recorded for {key.describe()} in "
                      f"{ANSWERS_FILE.name} (recorded for this model: "
                      f"{'; '.join(near) or 'none'}); this run's hashes are in its results "
                      f"(fact {FACT}): dsconform known-answers RESULTS_DIR")
    return answers[key], ""


def model_key_known(model: str) -> bool:
    return model in catalogue.shipped()


def entries_from_results(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The distinct observed entries of a run's results document (its ``sdc.observed``
    facts); GPUs of one key that disagree are not recordable and raise."""
    seen: dict[Key, dict[str, Any]] = {}
    for fact in (doc.get("dsconform") or {}).get("facts") or []:
        if not fact.get("name", "").startswith(FACT):
            continue
        for value in fact["value"] if isinstance(fact["value"], list) else [fact["value"]]:
            key = Key(*(value[f] for f in KEY_FIELDS))
            merged = seen.setdefault(key, {**value, "hashes": {}})
            for kernel, h in value["hashes"].items():
                if merged["hashes"].setdefault(kernel, h) != h:
                    raise KnownAnswersError([f"{key.describe()}: {kernel}: the run's GPUs "
                                             f"disagree; record from a node that passed"])
    return list(seen.values())


def render(entry: Mapping[str, Any], source: str) -> str:
    """One ``[[answers]]`` entry as TOML."""
    lines = ["[[answers]]"]
    lines += [f"{f} = {json.dumps(entry[f])}" for f in KEY_FIELDS]
    lines += [f"source = {json.dumps(source)}", "[answers.hashes]"]
    lines += [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in sorted(entry["hashes"].items())]
    return "\n".join(lines) + "\n"


def add_cli(sub: Any) -> None:
    """``dsconform known-answers``: print (or add) the entries a run observed."""
    ap = sub.add_parser("known-answers", help="print (or add to the catalogue) the SDC "
                                              "known answers a GPU run observed")
    ap.add_argument("results", help="a run's --results directory or its benchmarks.json")
    ap.add_argument("--source", default="", help="which node and results folder (required "
                                                 "with --write)")
    ap.add_argument("--write", action="store_true", help=f"append to {ANSWERS_FILE}")
    ap.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from dsconform.results.format import ResultsFormatError, load_benchmarks

    try:
        entries = entries_from_results(load_benchmarks(args.results))
    except (ResultsFormatError, KnownAnswersError) as e:
        print(e, file=sys.stderr)
        return 2
    if not entries:
        print(f"{args.results}: no {FACT} fact (did the SDC suite run on a GPU?)",
              file=sys.stderr)
        return 2
    if args.write and not args.source.strip():
        print("--write needs --source: which node and results folder", file=sys.stderr)
        return 2
    text = "\n".join(render(e, args.source or "FILL IN: node and results folder")
                     for e in entries)
    if args.write:
        with ANSWERS_FILE.open("a") as f:
            f.write("\n" + text)
        load(ANSWERS_FILE)  # what was appended must load
    sys.stdout.write(text)
    return 0
