"""The suite keeps compiled Python in its cache where the environment forbids writing it
beside the sources (PYTHONDONTWRITEBYTECODE, as container images set it)."""

from __future__ import annotations

import os
import subprocess
import sys

from dsconform.ops.cache import bytecode_dir, enable_bytecode_cache


def test_forbidden_bytecode_goes_to_the_cache(tmp_path):
    env = {"PYTHONDONTWRITEBYTECODE": "1", "DSCONFORM_CACHE": str(tmp_path)}
    os.environ["DSCONFORM_CACHE"], old = str(tmp_path), os.environ.get("DSCONFORM_CACHE")
    try:
        where = enable_bytecode_cache(env)
        assert where == bytecode_dir() == tmp_path / "pycache" and where.is_dir()
    finally:
        if old is None:
            os.environ.pop("DSCONFORM_CACHE")
        else:
            os.environ["DSCONFORM_CACHE"] = old
    assert env == {"DSCONFORM_CACHE": str(tmp_path), "PYTHONPYCACHEPREFIX": str(where)}


def test_the_environment_is_left_alone_otherwise(tmp_path):
    for env in ({}, {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/theirs"},
                {"PYTHONDONTWRITEBYTECODE": "1", "DSCONFORM_PYCACHE": "0"}):
        before = dict(env)
        assert enable_bytecode_cache(env) is None
        assert env == before


def test_a_process_started_after_it_writes_its_bytecode_there(tmp_path):
    """A child of the process (a rank) compiles a module once into the cache; a module file
    beside the sources gets no __pycache__."""
    mod = tmp_path / "src" / "dsc_probe_mod.py"
    mod.parent.mkdir()
    mod.write_text("X = 1\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "DSCONFORM_CACHE": str(tmp_path / "c")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    code = ("import os, subprocess, sys\n"
            "from dsconform.ops.cache import enable_bytecode_cache\n"
            "enable_bytecode_cache()\n"
            f"subprocess.run([sys.executable, '-c', 'import dsc_probe_mod'], check=True, "
            f"env={{**os.environ, 'PYTHONPATH': {str(mod.parent)!r}}})\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert not (mod.parent / "__pycache__").exists()
    assert list((tmp_path / "c" / "pycache").rglob("dsc_probe_mod*.pyc"))


def test_a_run_keeps_the_bytecode_of_what_its_plugin_imports(tmp_path):
    """The plugin turns the cache on as it is imported, before it imports hypothesis: a pytest
    run keeps hypothesis' compiled files there too, not only those of the processes it
    starts."""
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "DSCONFORM_CACHE": str(tmp_path / "c")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    subprocess.run([sys.executable, "-m", "pytest", "-p", "fixtures.plugin", "--collect-only",
                    "-q", "-p", "no:cacheprovider", str(tmp_path / "test_nothing.py")],
                   check=True, env=env, capture_output=True, cwd=os.getcwd())
    kept = [p for p in (tmp_path / "c" / "pycache").rglob("*.pyc") if "hypothesis" in p.parts]
    assert kept, "hypothesis was imported before the bytecode cache was on"
