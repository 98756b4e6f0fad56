"""Air-gapped nodes: ``dsconform bundle`` MUST carry what the node lacks for the target Python and
platform (and nothing the node has, and never torch), and the offline install (install.sh =
examples/offline-node.sh) MUST work from the folder alone: pick a DeepSpeed version, unpack
libaio, export the environment, and name any requirement that is not met.

The resolver runs on a fake index (tiny wheels made here: the library's logic, not pip's); the
install script runs for real (bash, pip --no-index --target, dpkg -x) on a crafted bundle in a
temporary folder, in a subprocess, so this machine's environment is never touched. Building a
real bundle needs the package index and takes minutes: the report of issue 14 says how it was
built and installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from dsconform.tools import bundle

REPO = Path(__file__).resolve().parents[2]
ENV_312 = bundle.target_environment("3.12", "manylinux_2_28_x86_64")


def make_wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A minimal pure-Python wheel: a package whose __version__ is ``version``."""
    folder.mkdir(parents=True, exist_ok=True)
    module = name.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    path = folder / f"{module}-{version}-py3-none-any.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *[f"Requires-Dist: {r}" for r in requires]]) + "\n"
    files = {f"{module}/__init__.py": f"__version__ = {version!r}\n",
             f"{dist}/METADATA": meta,
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
    return path


# ------------------------------------------------------------------ the target and the node

def test_platform_tags_take_older_manylinux_wheels():
    tags = bundle.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64"
    # pydantic-core and numpy publish manylinux_2_17 (manylinux2014) wheels: pip must see them.
    for older in ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"):
        assert older in tags
    assert bundle.platform_tags("manylinux2014_aarch64")[0] == "manylinux_2_17_aarch64"
    with pytest.raises(bundle.BundleError, match="--platform 'many linux'"):
        bundle.platform_tags("many linux")
    with pytest.raises(bundle.BundleError, match="--python '3'"):
        bundle.target_environment("3", "manylinux_2_28_x86_64")


def test_markers_are_evaluated_for_the_target_not_this_machine():
    assert bundle.applies(Requirement('tomli; python_version < "3.13"'), ENV_312)
    assert not bundle.applies(Requirement('tomli; python_version < "3.12"'), ENV_312)
    assert not bundle.applies(Requirement('pywin32; sys_platform == "win32"'), ENV_312)
    assert not bundle.applies(Requirement('sphinx; extra == "docs"'), ENV_312)
    assert bundle.applies(Requirement('sphinx; extra == "docs"'), ENV_312, extras=("docs",))


def test_have_list_formats():
    have = bundle.parse_have("# comment\nPackage Version\n------- -------\nnumpy==2.5.2\n"
                             "pytest 9.0.1\nTyping_Extensions\n")
    assert have == {"numpy": "2.5.2", "pytest": "9.0.1", "typing-extensions": None}
    with pytest.raises(bundle.BundleError, match=r"--have:2: cannot read 'a b c'"):
        bundle.parse_have("ok\na b c\n")
    shipped = bundle.parse_have((REPO / "examples" / "h200-image-packages.txt").read_text())
    assert shipped["torch"] == "2.11.0" and "pydantic" not in shipped and "hjson" not in shipped


# ------------------------------------------------------------------ resolving

@pytest.fixture
def fake_index(tmp_path):
    """name -> {version: requires}; ``download`` serves the newest version in the specifier."""
    index = {
        "pydantic": {"2.13.4": ["annotated-types>=0.6.0", "pydantic-core==2.46.4",
                                "typing-extensions>=4.14.1", "typing-inspection>=0.4.2",
                                'email-validator>=2.0.0; extra == "email"']},
        "pydantic-core": {"2.46.4": ["typing-extensions>=4.14.1"]},
        "annotated-types": {"0.7.0": []},
        "typing-inspection": {"0.4.2": ["typing-extensions>=4.12.0"]},
        "hjson": {"3.1.0": []},
        "packaging": {"23.2": [], "25.0": []},
        "tomli": {"2.0.1": []},
    }
    calls = []

    def download(name: str, spec: SpecifierSet) -> Path:
        calls.append((name, str(spec)))
        versions = [v for v in index[name] if spec.contains(v)]
        assert versions, f"the fake index has no {name}{spec}"
        best = max(versions, key=lambda v: tuple(map(int, v.split("."))))
        return make_wheel(tmp_path / "dl", name, best, index[name][best])
    return download, calls


def test_resolve_carries_what_the_node_lacks_and_nothing_else(tmp_path, fake_index):
    download, calls = fake_index
    ds = make_wheel(tmp_path / "roots", "deepspeed", "0.19.8",
                    ["einops", "hjson", "numpy", "packaging>=20.0", "pydantic>=2.0.0",
                     "torch>=2.0.0", "nvidia-ml-py", 'autodoc_pydantic; extra == "readthedocs"'])
    suite = make_wheel(tmp_path / "roots", "dsconform", "0.1.0",
                       ["torch<2.14,>=2.11", "deepspeed<0.20,>=0.19.6", "packaging>=23",
                        'tomli; python_version < "3.11"', 'matplotlib>=3.7; extra == "plot"'])
    have = {"einops": None, "numpy": "2.5.2", "typing-extensions": "4.15.0",
            "nvidia-ml-py": None, "packaging": "21.0"}
    got = bundle.resolve([ds, suite], env=ENV_312, have=have, download=download)
    assert sorted(got.wheels) == ["annotated-types", "hjson", "packaging", "pydantic",
                                  "pydantic-core", "typing-inspection"]
    # packaging 21 on the node satisfies deepspeed's >=20 but not the suite's >=23: carried,
    # once, under both requirements.
    assert got.wheels["packaging"].name == "packaging-25.0-py3-none-any.whl"
    assert [c for c in calls if c[0] == "packaging"] == [("packaging", ">=20.0,>=23")]
    assert "deepspeed 0.19.8 (>=20.0)" in "; ".join(got.why["packaging"])
    assert got.present["torch"] == "the node's own torch/CUDA build"
    assert got.present["numpy"] == "on the node (2.5.2)"
    assert got.present["einops"] == "on the node (version not listed)"
    assert "deepspeed" not in got.wheels and "tomli" not in got.wheels  # a root; marker false
    assert "email-validator" not in got.wheels and "autodoc-pydantic" not in got.wheels


def test_resolve_redownloads_when_a_later_requirement_rules_a_wheel_out(tmp_path, fake_index):
    download, calls = fake_index
    a = make_wheel(tmp_path / "roots", "a", "1.0", ["packaging"])
    b = make_wheel(tmp_path / "roots", "b", "1.0", ["packaging<24"])
    got = bundle.resolve([a, b], env=ENV_312, have={}, download=download)
    assert got.wheels["packaging"].name == "packaging-23.2-py3-none-any.whl"
    assert calls == [("packaging", ""), ("packaging", "<24")]
    forced = bundle.resolve([], env=ENV_312, have={"hjson": None}, download=download,
                            include=[Requirement("hjson")])
    assert list(forced.wheels) == ["hjson"]


def test_build_refuses_a_used_folder_and_bad_versions(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    kw = dict(python="3.12", platform="manylinux_2_28_x86_64", have={}, checkout=REPO)
    with pytest.raises(bundle.BundleError, match="exists and is not empty"):
        bundle.build(tmp_path / "out", deepspeed=["0.19.8"], **kw)
    with pytest.raises(bundle.BundleError, match="--deepspeed 'latest': not a version"):
        bundle.build(tmp_path / "new", deepspeed=["latest"], **kw)


@pytest.mark.parametrize("existed", [False, True])
def test_a_failed_build_leaves_no_half_bundle(tmp_path, monkeypatch, existed):
    """The suite's wheel is built, then DeepSpeed's sdist cannot be fetched: the folder is left
    as it was (absent, or empty), so the same command can simply be run again."""
    def suite_wheel(checkout, dest):
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "dsconform-0.1.0-py3-none-any.whl").write_bytes(b"wheel")
        return dest / "dsconform-0.1.0-py3-none-any.whl"

    def no_sdist(version, dest, work):
        raise bundle.BundleError(f"pip download deepspeed=={version} (sdist) failed")

    monkeypatch.setattr(bundle, "build_suite", suite_wheel)
    monkeypatch.setattr(bundle, "build_deepspeed", no_sdist)
    out = tmp_path / "bundle"
    if existed:
        out.mkdir()
    with pytest.raises(bundle.BundleError, match="sdist"):
        bundle.build(out, python="3.12", platform="manylinux_2_28_x86_64", deepspeed=["0.19.8"],
                     have={}, checkout=REPO, debs=(), log=lambda line: None)
    assert (list(out.iterdir()) == []) if existed else not out.exists()


def test_suite_wheel_carries_the_hardware_profiles(tmp_path):
    """A wheel install (no checkout) finds the shipped profiles inside the package."""
    wheel = bundle.build_suite(REPO, tmp_path / "wheels")
    with zipfile.ZipFile(wheel) as z:
        inside = {Path(n).name for n in z.namelist() if "/hardware_profiles/" in n}
    shipped = {p.name for p in (REPO / "hardware_profiles").glob("*.toml")}
    assert inside == shipped
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, timeout=300)
    probe = ("import dsconform.profile.schema as p; "
             "print(p.PROFILES_DIR); print(sorted(p.shipped()))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(site)},
                         check=True).stdout.splitlines()
    assert out[0] == str(site / "dsconform" / "hardware_profiles")
    assert out[1] == str(sorted(Path(n).stem for n in shipped))


# ------------------------------------------------------------------ the offline install

def make_deb(folder: Path) -> Path:
    """A .deb laid out like Debian's libaio packages (library and header)."""
    root = folder / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        "Package: libaio-fake\nVersion: 1.0\nArchitecture: amd64\nMaintainer: t <t@t>\n"
        "Description: test\n")
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu/libaio.so.1").write_text("")
    (root / "usr/include").mkdir(parents=True)
    (root / "usr/include/libaio.h").write_text("")
    deb = folder / "libaio-fake_1.0_amd64.deb"
    subprocess.run(["dpkg-deb", "--build", str(root), str(deb)], check=True,
                   capture_output=True, timeout=60)
    return deb


def craft_bundle(tmp_path: Path) -> Path:
    """A bundle laid out as `dsconform bundle` lays it out, of tiny wheels, sealed by the
    library (hash-pinned requirements files, MANIFEST.json with every file)."""
    b = tmp_path / "bundle"
    make_wheel(b / "wheels", "dsconform", "0.1.0", ["deepspeed>=0.19.6", "fakedep>=1"])
    make_wheel(b / "wheels", "fakedep", "1.0", ["packaging<1"])  # the node's is newer
    make_wheel(b / "deepspeed" / "0.19.8", "deepspeed", "0.19.8", ["fakedep"])
    make_wheel(b / "deepspeed" / "0.19.6", "deepspeed", "0.19.6", ["fakedep", "notthere>=1"])
    (b / "debs").mkdir()
    make_deb(b / "debs")
    suite = tmp_path / "suite-src" / "dsconform-suite"
    (suite / "suites").mkdir(parents=True)
    (suite / "conftest.py").write_text("")
    subprocess.run(["tar", "-czf", str(b / "suite.tar.gz"), "-C", str(suite.parent),
                    "dsconform-suite"], check=True, timeout=60)
    (b / "install.sh").write_text((REPO / bundle.INSTALL_SCRIPT).read_text())
    bundle.seal(b)
    return b


@pytest.fixture
def crafted_bundle(tmp_path) -> Path:
    return craft_bundle(tmp_path)


def source(script: str, tmp_path: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSCONFORM_SITE": str(tmp_path / "site"),
           "DSCONFORM_LIBAIO": str(tmp_path / "libaio"), "DSCONFORM_SUITE": str(tmp_path / "s")}
    # No compiled files read or written: the fake versions' sources differ only in their text,
    # so a .pyc kept elsewhere (this process's PYTHONPYCACHEPREFIX, shared between runs) could
    # stand for a file that has since been replaced within the same second and size.
    env.pop("PYTHONPYCACHEPREFIX", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # The node's python3 is the one running these tests (a virtualenv not activated included).
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return subprocess.run(["bash", "-c", f"set -u; {script}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_install_from_the_bundle_alone_picks_the_deepspeed_version(tmp_path, crafted_bundle):
    b = crafted_bundle
    show = ('python3 -c "import deepspeed, dsconform; print(deepspeed.__version__, '
            'deepspeed.__file__)"; echo "CPATH=$CPATH"; echo "LD=$LD_LIBRARY_PATH"')
    proc = source(f"source {b}/install.sh 0.19.8 && {show}", tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    site = tmp_path / "site"
    assert f"0.19.8 {site}/deepspeed/__init__.py" in lines, proc.stdout
    assert f"CPATH={tmp_path}/libaio/usr/include" in lines
    assert f"LD={tmp_path}/libaio/usr/lib/x86_64-linux-gnu" in lines
    assert f"offline-node: the suite is in {tmp_path}/s" in proc.stdout
    # A version outside a requirement is importable: a warning naming it, not a failure.
    assert "WARNING: versions outside the requirements" in proc.stderr
    assert "packaging<1 (for fakedep): found" in proc.stderr
    assert (tmp_path / "s" / "conftest.py").is_file()
    assert (site / "env.sh").is_file()
    # Another version replaces the first; a new shell gets the environment from env.sh.
    proc = source(f"bash {b}/install.sh 0.19.6; source {site}/env.sh; {show}",
                  tmp_path, cwd=tmp_path)
    assert "notthere>=1 (for deepspeed): not installed on the node nor carried" in proc.stderr
    assert f"0.19.6 {site}/deepspeed/__init__.py" in proc.stdout.splitlines(), proc.stdout
    proc = source(f"source {REPO}/examples/offline-node.sh --deepspeed 0.19.6 {b}; {show}",
                  tmp_path, cwd=tmp_path)
    assert f"0.19.6 {site}/deepspeed/__init__.py" in proc.stdout.splitlines(), proc.stdout
    # The default is the newest version; from a checkout the suite is not unpacked.
    proc = source(f"source {REPO}/examples/offline-node.sh {b}", tmp_path, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deepspeed 0.19.8" in proc.stdout and f"run the suite from here ({REPO})" in proc.stdout


def test_install_failures_say_what_is_wrong(tmp_path, crafted_bundle):
    b = crafted_bundle
    proc = source(f"source {b}/install.sh 0.20.0", tmp_path, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no DeepSpeed '0.20.0' in" in proc.stderr and "0.19.6 0.19.8" in proc.stderr
    proc = source(f"source {b}/install.sh 0.19.6", tmp_path, cwd=tmp_path)
    assert proc.returncode == 1
    assert "requirements not met" in proc.stderr and "notthere>=1" in proc.stderr
    proc = source(f"source {REPO}/examples/offline-node.sh {b}/debs", tmp_path, cwd=tmp_path)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_manual_way_with_loose_folders_still_works(tmp_path, crafted_bundle):
    b = crafted_bundle
    proc = source(f"source {REPO}/examples/offline-node.sh {b}/debs {b}/wheels "
                  f"{b}/deepspeed/0.19.8 && python3 -c 'import deepspeed; "
                  "print(deepspeed.__version__)'", tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "0.19.8"
