"""Profile schema: shipped profiles validate; every defect is named with file, field and reason."""

from __future__ import annotations

import tomllib

import pytest

from dsconform.cli import main
from dsconform.profile import schema as profile

MINIMAL = """
[profile]
name = "t"
[gpus]
count = 2
"""


def write(tmp_path, text, name="p.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(profile.shipped()))
def test_shipped_profiles_validate(name):
    p = profile.load(profile.shipped()[name])
    assert p.name == name


def test_shipped_profiles_state_units():
    for path in profile.shipped().values():
        assert "1e9" in path.read_text(), f"{path.name} must say GB/s means 1e9 bytes/s"


def test_minimal_profile_loads(tmp_path):
    p = profile.load(write(tmp_path, MINIMAL))
    assert (p.name, p.gpu_count, p.ops, p.nccl_floors) == ("t", 2, (), ())


@pytest.mark.parametrize("extra, field, reason", [
    ("[gpus]\ncount = 2\nmodle = 'x'", "gpus.modle", "unknown key"),
    ("[gpus]\ncount = '2'", "gpus.count", "expected integer"),
    ("[gpus]\ncount = true", "gpus.count", "expected integer"),
    ("[gpus]\ncount = -1", "gpus.count", "must be >= 0"),
    ("[gpus]\ncount = 2\ncompute_capability = '9.0a'", "gpus.compute_capability", "major.minor"),
    ("[gpus]\ncount = 0\nmodel = 'NVIDIA H200'", "gpus.model", "count = 0"),
    ("[gpus]\ncount = 2\n[nccl]\nmin_version = 'new'", "nccl.min_version", "2.21"),
    ("[gpus]\ncount = 2\n[[nccl.floors]]\ncollective = 'allreduce'\nbytes = 1\nbusbw_gbps = 1",
     "nccl.floors[0].collective", "must be one of"),
    ("[gpus]\ncount = 2\n[[nccl.floors]]\ncollective = 'all_reduce'\nbusbw_gbps = 1",
     "nccl.floors[0].bytes", "required"),
    ("[gpus]\ncount = 2\n[[nccl.floors]]\ncollective = 'all_reduce'\nbytes = 1\nbusbw_gbps = 0",
     "nccl.floors[0].busbw_gbps", "must be > 0"),
    ("[gpus]\ncount = 1\n[[nccl.floors]]\ncollective = 'all_reduce'\nbytes = 1\nbusbw_gbps = 1",
     "nccl.floors[0]", "at least 2 ranks"),
    ("[gpus]\ncount = 2\n[[nvme.paths]]\npath = 'rel/dir'\nread_gbps = 1\nwrite_gbps = 1",
     "nvme.paths[0].path", "absolute path"),
    ("[gpus]\ncount = 2\n[[nvme.paths]]\npath = '/nvme'\nread_gbps = 1\nwrite_gbps = 1\n"
     "bytes = 1000000", "nvme.paths[0].bytes", "multiple of 1 MiB"),
    ("[gpus]\ncount = 2\n[deepspeed]\nops = ['fused_adma']", "deepspeed.ops", "unknown op"),
    ("[gpus]\ncount = 2\n[system]\nmin_shm_gib = 0", "system.min_shm_gib", "must be > 0"),
    ("[gpus]\ncount = 2\n[gpu]\ncount = 1", "gpu", "unknown table"),
])
def test_defects_are_named(tmp_path, extra, field, reason):
    path = write(tmp_path, "[profile]\nname = 't'\n" + extra)
    with pytest.raises(profile.ProfileError) as e:
        profile.load(path)
    matching = [p for p in e.value.problems if f": {field}" in p and reason in p]
    assert matching, f"no problem naming {field!r} with {reason!r} in {e.value.problems}"
    assert all(p.startswith(str(path)) for p in e.value.problems)


def test_all_problems_reported_at_once(tmp_path):
    path = write(tmp_path, "[profile]\nname = 't'\n[gpus]\ncount = 'x'\nbf16 = 1\nfoo = 2\n")
    with pytest.raises(profile.ProfileError) as e:
        profile.load(path)
    assert len(e.value.problems) == 3, e.value.problems


def test_missing_tables_and_bad_toml(tmp_path):
    with pytest.raises(profile.ProfileError, match=r"\[gpus\]: required table is missing"):
        profile.load(write(tmp_path, "[profile]\nname = 't'\n"))
    with pytest.raises(profile.ProfileError, match="not valid TOML"):
        profile.load(write(tmp_path, "[profile\nname = "))
    with pytest.raises(profile.ProfileError, match="cannot read"):
        profile.load(tmp_path / "absent.toml")


def test_scratch_token_resolves(tmp_path):
    p = profile.load(write(tmp_path, MINIMAL + "[[nvme.paths]]\npath = '@scratch'\n"
                           "read_gbps = 1\nwrite_gbps = 2\n"))
    assert p.nvme_paths[0].resolve(tmp_path) == tmp_path
    with pytest.raises(profile.ProfileError, match="--scratch"):
        p.nvme_paths[0].resolve(None)


def test_validate_cli_exit_codes(tmp_path, capsys):
    good = write(tmp_path, MINIMAL, "good.toml")
    bad = write(tmp_path, MINIMAL + "modle = 'H200'\n", "bad.toml")
    assert main(["validate", str(good)]) == 0
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: gpus.modle: unknown key" in err
    assert main(["validate", "h300-x9"]) == 2  # an argument here, not --profile; no auto
    assert capsys.readouterr().err.startswith("h300-x9: no such shipped profile (shipped: ")


def test_resolve_names_and_unknown():
    assert profile.resolve("h200-x2").name == "h200-x2.toml"
    with pytest.raises(profile.ProfileError, match="no such shipped profile"):
        profile.resolve("h300-x9")


def test_tolerance_overrides_need_a_reason(tmp_path):
    try:
        from dsconform.checks.tolerances import known_tolerance_keys
    except ImportError:
        pytest.skip("dsconform.checks.tolerances not present")
    key = sorted(known_tolerance_keys())[0]
    ok = MINIMAL + f'[tolerances."{key}"]\nrtol = 0.1\nwhy = "measured"\n'
    assert profile.load(write(tmp_path, ok)).tolerances[key]["rtol"] == 0.1
    with pytest.raises(profile.ProfileError, match="why: required"):
        profile.load(write(tmp_path, MINIMAL + f'[tolerances."{key}"]\nrtol = 0.1\n'))
    with pytest.raises(profile.ProfileError, match="unknown tolerance"):
        profile.load(write(tmp_path, MINIMAL + '[tolerances."x.y.z"]\nrtol = 1\nwhy = "w"\n'))


def test_shipped_floors_state_their_size():
    for name, path in profile.shipped().items():
        data = tomllib.loads(path.read_text())
        for fl in data.get("nccl", {}).get("floors", []):
            assert fl["bytes"] >= 1 << 20, f"{name}: a floor must state a realistic size"
            assert fl.get("source"), f"{name}: every floor cites where it came from"
