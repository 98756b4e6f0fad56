"""Air-gapped nodes: ``dsconform bundle OUTDIR`` collects, on a machine with a package index,
everything a GPU node without one needs to run the suite, into one folder.

The folder (its MANIFEST.json lists every file with its size, sha256 and why it is there)::

    install.sh            the offline install (a copy of examples/offline-node.sh): it uses
                          only this folder, and first checks every file against MANIFEST.json
    MANIFEST.json
    requirements.txt      the suite's and the carried wheels' ``name==version --hash=sha256:``
    requirements-deepspeed-<version>.txt    the same for each DeepSpeed wheel (pip installs
                          them with --require-hashes)
    wheels/               the suite itself (dsconform, hardware profiles inside) and every
                          dependency of the suite and of DeepSpeed that the node lacks, for the
                          target Python and platform
    deepspeed/<version>/  one DeepSpeed wheel per requested version, built from PyPI's sdist
                          with DS_BUILD_OPS=0 (pure Python; ops JIT-build on the node)
    debs/                 Debian's libaio packages (async_io needs the header and library)
    suite.tar.gz          the suite's tests (suites/, fixtures/, conftest.py, tox.ini, docs/,
                          ...) for a node that has no checkout

What the node lacks: every requirement (with its environment markers evaluated for the target
Python and platform) that the node's package list (``--have FILE``: ``pip list --format=freeze``
on the node, or one name per line) does not satisfy, followed through the dependencies of what is
downloaded. torch and its CUDA stack (nvidia-*, triton) always come from the node: an index
resolve would pull gigabytes of another CUDA build.

Downloads go through pip (``pip download --only-binary=:all: --python-version ...``), the
DeepSpeed builds through ``pip wheel --no-deps --no-build-isolation`` (the sdist's setup.py
imports torch: the machine building the bundle needs torch installed), the .debs through
``apt-get download``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path
from typing import Any

from packaging.markers import UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

#: 2: MANIFEST.json's "files" lists every file of the folder (install.sh checks them all) and
#: the requirements files pin every wheel to its sha256.
FORMAT = "dsconform-bundle/2"
MANIFEST = "MANIFEST.json"
REQUIREMENTS = "requirements.txt"
#: What the node always brings: its own torch build and the CUDA stack that came with it.
NODE_PROVIDES = ("torch",)
NODE_PROVIDES_PREFIXES = ("nvidia-", "triton", "cuda-")
#: Debian packages: the runtime library and the header async_io compiles against. Debian 13 and
#: Ubuntu 24.04 renamed the library package libaio1t64; the first name the index has is taken.
DEFAULT_DEBS = ("libaio1|libaio1t64", "libaio-dev")
#: The suite's files a node needs besides the wheel (pytest runs from this tree).
SUITE_FILES = ("conftest.py", "tox.ini", "pyproject.toml", "README.md", "docs", "suites",
               "fixtures", "hardware_profiles", "examples", "dsconform")
INSTALL_SCRIPT = Path("examples") / "offline-node.sh"
_PLATFORM = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
_PYTHON = re.compile(r"^3\.\d{1,2}$")
PIP_TIMEOUT_S = 900


class BundleError(RuntimeError):
    """The bundle cannot be built; the message says what failed and what to do."""


# ------------------------------------------------------------------ target

def platform_tags(platform: str) -> list[str]:
    """Every platform tag a wheel may carry to install on ``platform``: manylinux_2_28_x86_64
    also takes manylinux_2_17 (manylinux2014) ... manylinux1 wheels (pip download takes only the
    tags it is given)."""
    for legacy, (major, minor) in _LEGACY.items():
        if platform.startswith(legacy + "_"):
            platform = f"manylinux_{major}_{minor}_{platform[len(legacy) + 1:]}"
    m = _PLATFORM.match(platform)
    if not m:
        if re.match(r"^[a-z0-9_]+$", platform):
            return [platform]  # linux_x86_64, macosx_...: taken as given
        raise BundleError(f"--platform {platform!r}: expected e.g. manylinux_2_28_x86_64")
    major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
    if major != 2:
        return [platform]
    tags = []
    for glibc in range(minor, 4, -1):
        tags.append(f"manylinux_2_{glibc}_{arch}")
        tags += [f"{name}_{arch}" for name, v in _LEGACY.items() if v == (2, glibc)]
    return tags


def target_environment(python: str, platform: str) -> dict[str, str]:
    """PEP 508 marker values of the target node (Linux, CPython)."""
    if not _PYTHON.match(python):
        raise BundleError(f"--python {python!r}: expected MAJOR.MINOR, e.g. 3.12")
    arch = platform_tags(platform)[0]
    machine = "x86_64" if arch.endswith("x86_64") else arch.split("_")[-1]
    return {"python_version": python, "python_full_version": f"{python}.0",
            "implementation_name": "cpython", "implementation_version": f"{python}.0",
            "platform_python_implementation": "CPython", "sys_platform": "linux",
            "platform_system": "Linux", "os_name": "posix", "platform_machine": machine,
            "platform_release": "", "platform_version": "", "extra": ""}


def parse_have(text: str, source: str = "--have") -> dict[str, str | None]:
    """The node's packages: ``name==version`` (pip freeze), ``name version`` (pip list), or a
    bare name (present, version unknown: trusted). ``#`` starts a comment."""
    have: dict[str, str | None] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(("Package ", "---")):
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\s*==\s*|\s+)?(\S+)?$", line)
        if not m:
            raise BundleError(f"{source}:{n}: cannot read {raw!r} (one package a line: NAME, "
                              "NAME==VERSION or NAME VERSION)")
        have[canonicalize_name(m.group(1))] = m.group(2)
    return have


def node_provides(name: str) -> bool:
    return name in NODE_PROVIDES or name.startswith(NODE_PROVIDES_PREFIXES)


def satisfied(req: Requirement, have: Mapping[str, str | None]) -> bool:
    """The node's package satisfies ``req`` (a bare name in the list is trusted)."""
    name = canonicalize_name(req.name)
    if name not in have:
        return False
    version = have[name]
    if version is None or not req.specifier:
        return True
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True


def applies(req: Requirement, env: Mapping[str, str], extras: Iterable[str] = ()) -> bool:
    if req.marker is None:
        return True
    try:
        return any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras))
    except UndefinedEnvironmentName:
        return False


# ------------------------------------------------------------------ wheels

def wheel_metadata(wheel: Path) -> tuple[str, str, list[Requirement]]:
    """(name, version, Requires-Dist) of a wheel file."""
    try:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist()
                        if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            msg = Parser().parsestr(z.read(meta).decode("utf-8", "replace"))
    except (zipfile.BadZipFile, StopIteration, OSError) as e:
        raise BundleError(f"{wheel}: not a readable wheel ({e or 'no METADATA'})") from None
    reqs = []
    for text in msg.get_all("Requires-Dist") or []:
        try:
            reqs.append(Requirement(text))
        except InvalidRequirement as e:
            raise BundleError(f"{wheel}: Requires-Dist {text!r}: {e}") from None
    return canonicalize_name(msg["Name"]), msg["Version"], reqs


@dataclass
class Resolved:
    wheels: dict[str, Path] = field(default_factory=dict)      # name -> wheel file
    why: dict[str, list[str]] = field(default_factory=dict)    # name -> "X 1.0 (>=2)", each
    present: dict[str, str] = field(default_factory=dict)      # name -> why it was left out


def resolve(roots: Iterable[Path], *, env: Mapping[str, str], have: Mapping[str, str | None],
            download: Callable[[str, SpecifierSet], Path],
            include: Iterable[Requirement] = ()) -> Resolved:
    """Follow the requirements of the root wheels (and of everything downloaded for them) that
    apply to the target and that the node does not satisfy; ``download(name, specifier)``
    fetches one wheel. Requirements on one name are intersected; a wheel downloaded earlier that
    a later requirement rules out is downloaded again under both."""
    out = Resolved()
    specs: dict[str, SpecifierSet] = {}
    root_names = set()
    queue: list[tuple[Requirement, str]] = [(r, "--include") for r in include]
    for wheel in roots:
        name, version, reqs = wheel_metadata(wheel)
        root_names.add(name)
        queue += [(r, f"{name} {version}") for r in reqs if applies(r, env)]
    while queue:
        req, by = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in root_names:
            continue
        if node_provides(name):
            out.present[name] = "the node's own torch/CUDA build"
            continue
        # Every requirement on a name counts once it is carried: the carried wheel shadows the
        # node's copy, so it must satisfy the requirements the node's copy satisfied too.
        spec = specs.get(name, SpecifierSet()) & req.specifier
        specs[name] = spec
        out.why.setdefault(name, []).append(f"{by} ({req.specifier or 'any'})")
        current = out.wheels.get(name)
        if current is None and by != "--include" and satisfied(req, have):
            out.present[name] = f"on the node ({have[name] or 'version not listed'})"
            continue
        out.present.pop(name, None)
        if current is not None and spec.contains(wheel_metadata(current)[1], prereleases=True):
            continue
        wheel = download(name, spec)
        got, version, reqs = wheel_metadata(wheel)
        if got != name or not spec.contains(version, prereleases=True):
            raise BundleError(f"downloaded {wheel.name} for {name}{spec}: does not match")
        out.wheels[name] = wheel
        queue += [(r, f"{name} {version}") for r in reqs if applies(r, env, req.extras)]
    return out


def _run(command: list[str], what: str, *, cwd: Path | None = None,
         env: Mapping[str, str] | None = None) -> str:
    try:
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BundleError(f"{what}: {e}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise BundleError(f"{what} failed (exit {proc.returncode}): {' '.join(command)}\n{tail}")
    return proc.stdout


def pip_downloader(dest: Path, python: str, platform: str) -> Callable[[str, SpecifierSet], Path]:
    """``download(name, spec)`` through pip: binary wheels for the target only."""
    abi = "cp" + python.replace(".", "")
    target = ["--python-version", python, "--implementation", "cp", "--abi", abi,
              "--abi", "abi3", "--abi", "none"]
    for tag in platform_tags(platform):
        target += ["--platform", tag]

    def download(name: str, spec: SpecifierSet) -> Path:
        with tempfile.TemporaryDirectory(prefix="dsconform-dl-") as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                  "--disable-pip-version-check", "-q", *target, "-d", tmp, f"{name}{spec}"],
                 f"pip download {name}{spec} for Python {python} {platform}")
            found = sorted(Path(tmp).glob("*.whl"))
            if len(found) != 1:
                raise BundleError(f"pip download {name}{spec}: expected one wheel, got "
                                  f"{[p.name for p in found]}")
            dest.mkdir(parents=True, exist_ok=True)
            return Path(shutil.move(str(found[0]), dest / found[0].name))
    return download


def build_deepspeed(version: str, dest: Path, work: Path) -> Path:
    """DeepSpeed ``version`` as a pure-Python wheel from PyPI's sdist (no op compiled)."""
    sdist_dir = work / f"deepspeed-{version}-sdist"
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
          "--disable-pip-version-check", "-q", "-d", str(sdist_dir), f"deepspeed=={version}"],
         f"pip download deepspeed=={version} (sdist)")
    sdists = sorted(sdist_dir.glob("deepspeed-*.tar.gz"))
    if not sdists:
        raise BundleError(f"deepspeed=={version}: the index has no sdist")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")}
    env["DS_BUILD_OPS"] = "0"  # ops JIT-build on the node, for its own GPUs
    dest.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-q", "-w", str(dest), str(sdists[0])],
         f"building the deepspeed {version} wheel (needs torch, setuptools and wheel here)",
         env=env)
    wheels = sorted(dest.glob(f"deepspeed-{version}-*.whl"))
    if not wheels:
        raise BundleError(f"building deepspeed {version}: no wheel in {dest}")
    return wheels[0]


def build_suite(checkout: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("dsconform-*.whl"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
               "-q", "-w", str(dest), str(checkout)]
    try:  # with this Python's setuptools: seconds, and no index needed
        _run([*command, "--no-build-isolation"], "building the dsconform wheel")
    except BundleError:  # no (or too old a) setuptools here: pip fetches its own
        _run(command, "building the dsconform wheel")
    new = sorted(set(dest.glob("dsconform-*.whl")) - before) or sorted(dest.glob("dsconform-*"))
    if not new:
        raise BundleError(f"building the dsconform wheel: nothing in {dest}")
    return new[0]


def suite_tarball(checkout: Path, dest: Path) -> Path:
    """The suite's files (SUITE_FILES), without caches, as suite.tar.gz."""
    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(p in ("__pycache__", ".pytest_cache", ".hypothesis") for p in parts):
            return None
        if info.name.endswith((".pyc", ".egg-info")):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info
    path = dest / "suite.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in SUITE_FILES:
            if (checkout / name).exists():
                tar.add(checkout / name, arcname=f"dsconform-suite/{name}", filter=keep)
    return path


def download_debs(names: Iterable[str], dest: Path) -> list[Path]:
    """``apt-get download`` each package; ``a|b`` takes the first name the index knows."""
    dest.mkdir(parents=True, exist_ok=True)
    got = []
    for alternatives in names:
        errors = []
        for name in alternatives.split("|"):
            before = set(dest.glob("*.deb"))
            try:
                _run(["apt-get", "download", "-q", name], f"apt-get download {name}", cwd=dest)
            except BundleError as e:
                errors.append(str(e).splitlines()[-1])
                continue
            got += sorted(set(dest.glob("*.deb")) - before)
            break
        else:
            raise BundleError(f"apt-get download {alternatives}: {'; '.join(errors)} (run "
                              "`apt-get update` first, or pass --no-debs)")
    return got


# ------------------------------------------------------------------ the bundle

def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _entry(path: Path, root: Path, why: str = "") -> dict[str, Any]:
    entry = {"path": path.relative_to(root).as_posix(), "bytes": path.stat().st_size,
             "sha256": _sha256(path)}
    if why:
        entry["why"] = why
    return entry


def deepspeed_requirements(version: str) -> str:
    """The requirements file of one DeepSpeed version's wheel, at the bundle's top."""
    return f"requirements-deepspeed-{version}.txt"


def requirements_text(wheels: Iterable[Path]) -> str:
    """``name==version --hash=sha256:...`` for each wheel: what ``pip install --no-index
    --require-hashes -r`` installs, and only if every file is the one the bundle was built with."""
    lines = ["# Written by `dsconform bundle`: install.sh runs pip install --no-index "
             "--require-hashes -r on it."]
    for wheel in sorted(wheels, key=lambda w: w.name):
        name, version, _ = wheel_metadata(wheel)
        lines.append(f"{name}=={version} --hash=sha256:{_sha256(wheel)}")
    return "\n".join(lines) + "\n"


def seal(out: Path, fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Finish the bundle in ``out`` as its files lie: the hash-pinned requirements files (the
    wheels of wheels/, and of each deepspeed/<version>/), then MANIFEST.json with ``fields``
    and every file's path, size and sha256 (``files``: what install.sh checks)."""
    (out / REQUIREMENTS).write_text(requirements_text((out / "wheels").glob("*.whl")))
    for folder in sorted(p for p in (out / "deepspeed").glob("*") if p.is_dir()):
        (out / deepspeed_requirements(folder.name)).write_text(
            requirements_text(folder.glob("*.whl")))
    files = sorted(p for p in out.rglob("*") if p.is_file() and p != out / MANIFEST)
    manifest = {"format": FORMAT, **(fields or {}),
                "files": [_entry(p, out) for p in files],
                "total_bytes": sum(p.stat().st_size for p in files)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def find_checkout(start: Path | None = None) -> Path:
    """The checkout this dsconform runs from (the suite and its install script live there)."""
    here = (start or Path(__file__).resolve().parents[2])
    if (here / "pyproject.toml").is_file() and (here / INSTALL_SCRIPT).is_file():
        return here
    raise BundleError(f"{here}: not a dsconform checkout (no pyproject.toml and {INSTALL_SCRIPT}"
                      "); run `dsconform bundle` from a checkout's install (pip install -e .) "
                      "or pass --suite CHECKOUT")


def build(out: Path, *, python: str, platform: str, deepspeed: list[str],
          have: Mapping[str, str | None], checkout: Path, debs: Iterable[str] = DEFAULT_DEBS,
          include: Iterable[str] = (), log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the bundle into ``out`` (which must not exist or be empty); returns the manifest."""
    if out.exists() and any(out.iterdir()):
        raise BundleError(f"{out}: exists and is not empty; give a new folder")
    if not deepspeed:
        raise BundleError("no --deepspeed VERSION given")
    for v in deepspeed:
        try:
            Version(v)
        except InvalidVersion:
            raise BundleError(f"--deepspeed {v!r}: not a version (e.g. 0.19.8)") from None
    env = target_environment(python, platform)
    extra = []
    for text in include:
        try:
            extra.append(Requirement(text))
        except InvalidRequirement as e:
            raise BundleError(f"--include {text!r}: {e}") from None
    started = time.monotonic()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _fill(out, python=python, platform=platform, deepspeed=deepspeed, have=have,
                     checkout=checkout, debs=debs, env=env, extra=extra, log=log,
                     started=started)
    except BaseException:
        # A half-built bundle is no bundle, and would make the retry refuse the folder.
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for p in list(out.iterdir()):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        raise


def _fill(out: Path, *, python: str, platform: str, deepspeed: list[str],
          have: Mapping[str, str | None], checkout: Path, debs: Iterable[str], env: Any,
          extra: list, log: Callable[[str], None], started: float) -> dict[str, Any]:
    wheels_dir = out / "wheels"
    log(f"bundle: building the suite's wheel from {checkout}")
    suite_wheel = build_suite(checkout, wheels_dir)
    ds_wheels = {}
    with tempfile.TemporaryDirectory(prefix="dsconform-bundle-") as tmp:
        for v in deepspeed:
            log(f"bundle: building deepspeed {v} from its sdist (DS_BUILD_OPS=0)")
            ds_wheels[v] = build_deepspeed(v, out / "deepspeed" / v, Path(tmp))
    log(f"bundle: resolving what a Python {python} {platform} node lacks")
    resolved = resolve([suite_wheel, *ds_wheels.values()], env=env, have=have,
                       download=pip_downloader(wheels_dir, python, platform), include=extra)
    deb_files = download_debs(debs, out / "debs") if debs else []
    suite_tar = suite_tarball(checkout, out)
    shutil.copy2(checkout / INSTALL_SCRIPT, out / "install.sh")
    manifest = seal(out, {
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": python, "platform": platform, "platform_tags": platform_tags(platform),
        "deepspeed": {v: _entry(w, out) for v, w in ds_wheels.items()},
        "suite": _entry(suite_wheel, out, "the suite (dsconform) and its hardware profiles"),
        "wheels": [_entry(w, out, "; ".join(resolved.why[n]))
                   for n, w in sorted(resolved.wheels.items())],
        "left_out": dict(sorted(resolved.present.items())),
        "debs": [_entry(d, out) for d in deb_files],
        "suite_tarball": _entry(suite_tar, out),
        "install": "source install.sh [DEEPSPEED_VERSION]  (see the comments at its top)",
    })
    log(f"bundle: {out}: {manifest['total_bytes'] / 2**20:.1f} MiB in "
        f"{time.monotonic() - started:.0f} s")
    # install.sh checks every file against MANIFEST.json; this checks MANIFEST.json itself.
    log(f"bundle: on the node, `sha256sum {out / MANIFEST}` must print "
        f"{_sha256(out / MANIFEST)}")
    return manifest


def describe(manifest: Mapping[str, Any]) -> list[str]:
    """The bundle's contents, one file a line."""
    rows = [("suite", manifest["suite"])]
    rows += [(f"deepspeed {v}", e) for v, e in manifest["deepspeed"].items()]
    rows += [(e.get("why", ""), e) for e in manifest["wheels"]]
    rows += [("libaio", e) for e in manifest["debs"]]
    rows += [("the suite's tests", manifest["suite_tarball"])]
    lines = [f"{e['bytes'] / 1024:>9.0f} KiB  {e['path']}  ({what})" for what, e in rows]
    lines.append(f"left out (the node has them): {', '.join(manifest['left_out']) or 'none'}")
    lines.append(f"total {manifest['total_bytes'] / 2**20:.1f} MiB")
    return lines


def main(out: str, *, python: str, platform: str, deepspeed: list[str], have_file: str | None,
         suite: str | None, debs: bool, include: list[str]) -> int:
    """``dsconform bundle``: exit 0 built, 2 it could not be built (the reason on stderr)."""
    try:
        have: dict[str, str | None] = {}
        if have_file:
            try:
                have = parse_have(Path(have_file).read_text(), have_file)
            except OSError as e:
                raise BundleError(f"--have {have_file}: {e.strerror or e}") from None
        checkout = find_checkout(Path(suite).resolve() if suite else None)
        manifest = build(Path(out), python=python, platform=platform, deepspeed=deepspeed,
                         have=have, checkout=checkout, debs=DEFAULT_DEBS if debs else (),
                         include=include, log=lambda m: print(m, file=sys.stderr))
    except BundleError as e:
        print(f"dsconform bundle: {e}", file=sys.stderr)
        return 2
    print("\n".join(describe(manifest)))
    return 0


def add_cli(sub: Any) -> None:
    """``dsconform bundle``'s arguments (sub: the CLI's subparsers)."""
    b = sub.add_parser("bundle", help="collect, where a package index is, what an air-gapped "
                                      "node needs into one folder (install: OUTDIR/install.sh)")
    b.add_argument("out", metavar="OUTDIR", help="new (or empty) folder for the bundle")
    b.add_argument("--python", required=True, metavar="X.Y", help="the node's Python, e.g. 3.12")
    b.add_argument("--platform", default="manylinux_2_28_x86_64",
                   help="the node's newest wheel platform tag (default manylinux_2_28_x86_64; "
                        "older manylinux tags are taken too)")
    b.add_argument("--deepspeed", action="append", required=True, metavar="VERSION",
                   help="a DeepSpeed version to build a wheel of (repeat for several)")
    b.add_argument("--have", metavar="FILE",
                   help="the node's packages (`pip list --format=freeze` there): what it has "
                        "is not carried (torch and its CUDA stack never are)")
    b.add_argument("--include", action="append", default=[], metavar="REQ",
                   help="carry this requirement even if the node has it (repeatable)")
    b.add_argument("--suite", metavar="CHECKOUT", help="the suite's checkout (default: the one "
                                                       "this dsconform runs from)")
    b.add_argument("--no-debs", action="store_true", help="do not download the libaio .debs")
    b.set_defaults(func=lambda a: main(a.out, python=a.python, platform=a.platform,
                                       deepspeed=a.deepspeed, have_file=a.have, suite=a.suite,
                                       debs=not a.no_debs, include=a.include))
