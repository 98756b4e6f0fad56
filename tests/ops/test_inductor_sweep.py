"""A truncated inductor kernel left by a killed compile is removed before a run; a whole one, and
one still being linked, stay (dsconform.ops.cache.sweep_inductor_cache)."""

from __future__ import annotations

import os
import time

from dsconform.ops.cache import inductor_cache_dir, sweep_inductor_cache


def _lib(path, data: bytes, age_s: float):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_killed_compile_is_removed_and_the_rest_stay(tmp_path):
    killed = _lib(tmp_path / "qo" / "c1.main.so", b"", 600)
    cut = _lib(tmp_path / "ab" / "c2.main.so", b"\x7fE", 600)
    whole = _lib(tmp_path / "qo" / "c3.main.so", b"\x7fELF" + b"\0" * 60, 600)
    linking = _lib(tmp_path / "zz" / "c4.main.so", b"", 5)
    source = _lib(tmp_path / "qo" / "c1.main.cpp", b"", 600)
    notices = sweep_inductor_cache(tmp_path)
    assert not killed.exists() and not cut.exists()
    assert whole.exists() and linking.exists() and source.exists()
    assert len(notices) == 2 and all("truncated inductor kernel" in n for n in notices)


def test_no_cache_no_notice(tmp_path):
    assert sweep_inductor_cache(tmp_path / "none") == []


def test_the_cache_is_torchs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert inductor_cache_dir() == tmp_path
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert str(inductor_cache_dir()) == default_cache_dir()
