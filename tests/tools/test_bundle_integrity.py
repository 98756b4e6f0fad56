"""The air-gapped bundle MUST install only what was built: install.sh checks every file against
MANIFEST.json (size and sha256) before it installs anything, and refuses, naming the file, a
changed byte, a missing file or a file the manifest does not list; pip then installs with
--require-hashes from the bundle's requirements files, so a wheel swapped together with its
manifest entry is refused too. Sourced, a refusal returns 1 and leaves the user's shell open.

The bundle is crafted (tiny real wheels, a real .deb) and sealed by the library
(``bundle.seal``, what ``dsconform bundle`` ends with); install.sh runs for real in a
subprocess, installing into a temporary folder, with ``python3`` seen through a shim that logs
each command line, so what pip was asked to do is seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from dsconform.tools import bundle
from tests.tools.test_bundle import REPO, craft_bundle, make_wheel, source

FAKEDEP = "wheels/fakedep-1.0-py3-none-any.whl"


@pytest.fixture
def sealed(tmp_path) -> Path:
    return craft_bundle(tmp_path)


def run_install(tmp_path: Path, script: str) -> tuple[int, str, list[str]]:
    """(exit status, stdout + stderr, python3 command lines) of ``script`` in bash."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    log = tmp_path / "python3.log"
    log.write_text("")
    (shim / "python3").write_text(
        f'#!/bin/bash\nprintf "%s\\n" "$*" >> {log}\nexec {sys.executable} "$@"\n')
    (shim / "python3").chmod(stat.S_IRWXU)
    proc = source(f'export PATH={shim}:"$PATH"; {script}', tmp_path, cwd=tmp_path)
    return proc.returncode, proc.stdout + proc.stderr, log.read_text().splitlines()


def pip_runs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip install")]


def test_an_intact_bundle_verifies_and_pip_installs_with_hashes(tmp_path, sealed):
    code, out, calls = run_install(tmp_path, f"source {sealed}/install.sh 0.19.8")
    assert code == 0, out
    manifest = json.loads((sealed / bundle.MANIFEST).read_text())
    assert f"offline-node: {len(manifest['files'])} files match MANIFEST.json" in out
    (pip,) = pip_runs(calls)
    assert "--require-hashes" in pip.split()
    assert f"-r {sealed}/requirements.txt -r {sealed}/requirements-deepspeed-0.19.8.txt" in pip
    assert f"--find-links {sealed}/wheels --find-links {sealed}/deepspeed/0.19.8" in pip
    assert "--no-index" in pip.split() and f"--target {tmp_path}/site" in pip
    assert (tmp_path / "site" / "deepspeed" / "__init__.py").is_file()


def test_one_changed_byte_is_refused_before_pip_runs(tmp_path, sealed):
    wheel = sealed / FAKEDEP
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0x01
    wheel.write_bytes(bytes(data))
    code, out, calls = run_install(tmp_path, f"source {sealed}/install.sh 0.19.8")
    assert code == 1, out
    assert f"offline-node: {sealed} is not the bundle that was built; nothing installed" in out
    digest = hashlib.sha256(bytes(data)).hexdigest()
    assert f"{FAKEDEP}: sha256 {digest}, MANIFEST.json says " in out
    assert pip_runs(calls) == [] and not (tmp_path / "site").exists()
    # A shorter file is named by its size.
    wheel.write_bytes(bytes(data[:-10]))
    code, out, _ = run_install(tmp_path, f"source {sealed}/install.sh")
    assert code == 1 and f"{FAKEDEP}: {len(data) - 10} bytes, MANIFEST.json says" in out, out


def test_a_missing_file_is_refused(tmp_path, sealed):
    deb = next((sealed / "debs").glob("*.deb"))
    deb.unlink()
    code, out, calls = run_install(tmp_path, f"source {sealed}/install.sh")
    assert code == 1 and f"debs/{deb.name}: missing" in out, out
    assert pip_runs(calls) == []


def test_a_stray_file_is_refused(tmp_path, sealed):
    make_wheel(sealed / "wheels", "evil", "1.0")
    code, out, calls = run_install(tmp_path, f"source {REPO}/examples/offline-node.sh {sealed}")
    assert code == 1, out
    assert "wheels/evil-1.0-py3-none-any.whl: not in MANIFEST.json" in out
    assert pip_runs(calls) == []


def test_sourced_a_refusal_returns_and_the_shell_goes_on(tmp_path, sealed):
    (sealed / "suite.tar.gz").write_bytes(b"not the suite")
    code, out, _ = run_install(tmp_path, f'source {sealed}/install.sh; echo "shell alive: $?"')
    assert code == 0 and "shell alive: 1" in out and "suite.tar.gz: 13 bytes" in out, out
    code, out, _ = run_install(tmp_path, f"bash {sealed}/install.sh")  # run, not sourced
    assert code == 1, out


def test_a_wheel_swapped_with_its_manifest_entry_is_refused_by_pip(tmp_path, sealed):
    """Someone rewrites MANIFEST.json to match a changed wheel: the requirements files still
    pin the built wheel's sha256, and pip's --require-hashes refuses it."""
    make_wheel(tmp_path / "other", "fakedep", "1.0", ["packaging"])
    shutil.copy(tmp_path / "other" / Path(FAKEDEP).name, sealed / FAKEDEP)
    manifest = json.loads((sealed / bundle.MANIFEST).read_text())
    for entry in manifest["files"]:
        if entry["path"] == FAKEDEP:
            entry.update(bundle._entry(sealed / FAKEDEP, sealed))
    (sealed / bundle.MANIFEST).write_text(json.dumps(manifest))
    code, out, calls = run_install(tmp_path, f"source {sealed}/install.sh 0.19.8")
    assert code == 1, out
    assert "files match MANIFEST.json" in out and len(pip_runs(calls)) == 1
    assert "DO NOT MATCH THE HASHES" in out and "fakedep" in out, out


def test_what_install_writes_inside_the_bundle_is_not_stray(tmp_path, sealed):
    env = (f"export DSCONFORM_SITE={sealed}/site DSCONFORM_LIBAIO={sealed}/libaio "
           f"DSCONFORM_SUITE={sealed}/suite; ")
    for _ in range(2):  # the second run finds the first one's folders in the bundle
        code, out, _ = run_install(tmp_path, env + f"source {sealed}/install.sh 0.19.8")
        assert code == 0, out
    (sealed / "notes.txt").write_text("mine")
    code, out, _ = run_install(tmp_path, env + f"source {sealed}/install.sh 0.19.8")
    assert code == 1 and "notes.txt: not in MANIFEST.json" in out, out


def test_a_bundle_without_a_file_list_is_refused(tmp_path, sealed):
    (sealed / bundle.MANIFEST).write_text(json.dumps({"format": "dsconform-bundle/1"}))
    code, out, calls = run_install(tmp_path, f"source {sealed}/install.sh")
    assert code == 1 and "MANIFEST.json: no list of files to check" in out, out
    assert "rebuild the bundle" in out and pip_runs(calls) == []


def test_seal_lists_every_file_and_pins_every_wheel(tmp_path, sealed):
    manifest = json.loads((sealed / bundle.MANIFEST).read_text())
    assert manifest["format"] == bundle.FORMAT
    on_disk = sorted(p.relative_to(sealed).as_posix() for p in sealed.rglob("*")
                     if p.is_file() and p.name != bundle.MANIFEST)
    assert [e["path"] for e in manifest["files"]] == on_disk
    assert {"install.sh", "requirements.txt", "requirements-deepspeed-0.19.6.txt",
            "suite.tar.gz"} <= set(on_disk)
    for entry in manifest["files"]:
        data = (sealed / entry["path"]).read_bytes()
        assert (entry["bytes"], entry["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    sha = {e["path"]: e["sha256"] for e in manifest["files"]}
    lines = (sealed / "requirements.txt").read_text().splitlines()[1:]
    suite = "wheels/dsconform-0.1.0-py3-none-any.whl"
    assert lines == [f"dsconform==0.1.0 --hash=sha256:{sha[suite]}",
                     f"fakedep==1.0 --hash=sha256:{sha[FAKEDEP]}"]
    (line,) = (sealed / "requirements-deepspeed-0.19.6.txt").read_text().splitlines()[1:]
    assert line == ("deepspeed==0.19.6 --hash=sha256:"
                    f"{sha['deepspeed/0.19.6/deepspeed-0.19.6-py3-none-any.whl']}")


def test_the_suite_tarball_carries_the_docs(tmp_path):
    """The README's links point into docs/: a node without a checkout has them too."""
    path = bundle.suite_tarball(REPO, tmp_path)
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
    shipped = {f"dsconform-suite/docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert shipped and shipped <= names
    assert "dsconform-suite/README.md" in names and "dsconform-suite/examples/k8s" in names
    assert not any("__pycache__" in n for n in names)
    assert os.path.getsize(path) < 20 * 2**20


def test_a_built_bundle_is_sealed_and_installs(tmp_path, monkeypatch, capsys):
    """``bundle.build`` end to end, its downloads and builds faked (no index here): the folder
    it writes verifies, installs with hashes, and names its manifest's own sha256."""
    from tests.tools.test_bundle import make_deb

    def suite_wheel(checkout, dest):
        return make_wheel(dest, "dsconform", "0.1.0", ["deepspeed>=0.19.6", "fakedep>=1"])

    def deepspeed_wheel(version, dest, work):
        return make_wheel(dest, "deepspeed", version, ["fakedep"])

    def downloader(dest, python, platform):
        return lambda name, spec: make_wheel(dest, name, "1.0")

    def debs(names, dest):
        dest.mkdir(parents=True)
        return [make_deb(dest)]

    monkeypatch.setattr(bundle, "build_suite", suite_wheel)
    monkeypatch.setattr(bundle, "build_deepspeed", deepspeed_wheel)
    monkeypatch.setattr(bundle, "pip_downloader", downloader)
    monkeypatch.setattr(bundle, "download_debs", debs)
    out = tmp_path / "built"
    logged: list[str] = []
    manifest = bundle.build(out, python="3.12", platform="manylinux_2_28_x86_64",
                            deepspeed=["0.19.8"], have={}, checkout=REPO, log=logged.append)
    assert [w["path"] for w in manifest["wheels"]] == [FAKEDEP]
    digest = hashlib.sha256((out / bundle.MANIFEST).read_bytes()).hexdigest()
    assert logged[-1] == f"bundle: on the node, `sha256sum {out}/MANIFEST.json` must print {digest}"
    assert "requirements-deepspeed-0.19.8.txt" in {e["path"] for e in manifest["files"]}
    code, text, calls = run_install(tmp_path, f"source {out}/install.sh")
    assert code == 0, text
    assert "--require-hashes" in pip_runs(calls)[0] and "deepspeed 0.19.8" in text
