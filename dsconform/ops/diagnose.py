"""Why an op did not build or load, and the fix for each cause recognised in the error, the
compiler/ninja output and the environment. Pure text (no torch, no DeepSpeed): it also works on
logs copied from another node."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_MIN_SHM_BYTES = 512 * 1024**2  # DeepSpeed's env_report warns below this


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    fix: str


LIBAIO_FIX = ("install libaio-dev (Debian/Ubuntu) or libaio-devel, or, for a libaio outside "
              "system paths, set CPATH and LIBRARY_PATH (the async_io JIT build ignores "
              "CFLAGS/LDFLAGS) and LD_LIBRARY_PATH at run time")


def _libaio(text: str, env: Mapping[str, str]) -> Diagnosis | None:
    if re.search(r"libaio\.h: No such file or directory", text):
        cause = "the compiler cannot find libaio.h (async_io includes it)"
    elif re.search(r"cannot find -laio|unable to find library -laio", text):
        cause = "the linker cannot find libaio.so (-laio)"
    elif re.search(r"libaio\.so[.\d]*: cannot open shared object file", text):
        cause = "libaio.so cannot be found when the op is loaded"
    elif re.search(r"async_io requires the dev libaio|"
                   r"Unable to JIT load the async_io op due to it not being compatible",
                   text):
        cause = "DeepSpeed's probe could not compile and link a test program against libaio"
    else:
        return None
    flags = {k: env[k] for k in ("CFLAGS", "LDFLAGS") if env.get(k)}
    if flags and "probe" not in cause:
        shown = ", ".join(f"{k}={v!r}" for k, v in flags.items())
        cause += f"; {shown} is set, which satisfies DeepSpeed's probe but not the JIT build"
    return Diagnosis(cause, LIBAIO_FIX)


def _arch_suffix(text: str, env: Mapping[str, str]) -> Diagnosis | None:
    value = env.get("TORCH_CUDA_ARCH_LIST", "")
    entries = re.split(r"[;\s]+", value.strip())
    if bad := [cc for cc in entries if re.fullmatch(r"\d+\.\d+[A-Za-z]+(\+PTX)?", cc)]:
        fixed = ";".join(re.sub(r"^(\d+\.\d+)[A-Za-z]+", r"\1", cc) for cc in entries if cc)
        cause = (f"TORCH_CUDA_ARCH_LIST={value} has an arch suffix ({', '.join(bad)}) that "
                 "DeepSpeed's JIT builder cannot parse (op_builder/builder.py "
                 "compute_capability_args reads int('0a'))")
        return Diagnosis(cause, f"export TORCH_CUDA_ARCH_LIST={fixed}")
    literal = re.search(r"invalid literal for int\(\) with base 10: '(\d*[A-Za-z]+)'", text)
    if not literal:
        return None
    shown = f"TORCH_CUDA_ARCH_LIST={value}" if value else "the CUDA arch list"
    cause = (f"DeepSpeed could not parse a compute capability ({literal[1]!r}) from {shown}; "
             "entries must read MAJOR.MINOR[+PTX]")
    return Diagnosis(cause, "export TORCH_CUDA_ARCH_LIST=9.0 "
                            "(or your GPUs' MAJOR.MINOR list, without suffixes)")


def _cuda_mismatch(text: str, env: Mapping[str, str]) -> Diagnosis | None:
    # torch raises RuntimeError(CUDA_MISMATCH_MESSAGE, nvcc, torch) unformatted, so str() of it
    # is a tuple:
    # "('The detected CUDA version (%s) mismatches ... compilePyTorch (%s). ...', '13.0', '12.8')".
    if m := re.search(r"detected CUDA version \(([^)]*)\) mismatches the version that was used "
                      r"to compile\s*PyTorch \(([^)]*)\)", text):
        nvcc, torch_cuda = m[1], m[2]
        if nvcc == "%s" and (args := re.search(r"', '([^']*)', '([^']*)'\)", text[m.end():])):
            nvcc, torch_cuda = args[1], args[2]
    elif (m := re.search(r"Installed CUDA version ([\d.]+) does not match the version torch "
                         r"was compiled with ([\d.]+), unable to compile", text)):
        nvcc, torch_cuda = m[1], m[2]
    else:
        return None
    cause = (f"nvcc is CUDA {nvcc} (CUDA_HOME={env.get('CUDA_HOME', 'unset')}) but torch was "
             f"built with CUDA {torch_cuda}; ops cannot be compiled with a different CUDA major "
             "version")
    fix = (f"install the CUDA {torch_cuda} toolkit and export CUDA_HOME to it, or install a torch "
           f"build for CUDA {nvcc}; DS_SKIP_CUDA_CHECK=1 only silences DeepSpeed's own check, "
           "not torch's")
    return Diagnosis(cause, fix)


def _ninja(text: str, env: Mapping[str, str]) -> Diagnosis | None:
    if re.search(r"Ninja is required to load C\+\+ extensions|due to ninja not being installed",
                 text):
        return Diagnosis("ninja is not on PATH; DeepSpeed's JIT loader needs it even for an op "
                         "built before", "pip install ninja in the environment that runs the "
                         "suite (or apt-get install ninja-build) and make sure `ninja --version` "
                         "works on PATH")
    return None


def _compiler(text: str, env: Mapping[str, str]) -> Diagnosis | None:
    cc = r"[\w./+-]*(?:gcc|g\+\+|c\+\+|clang\+\+|clang|\bcc)"
    m = (re.search(rf"(?P<cc>{cc}): (?:command )?not found", text)
         or re.search(rf"No such file or directory: '(?P<cc>{cc})'", text)
         or re.search(rf"error: command '(?P<cc>{cc})' failed: No such file or directory", text))
    if not m:
        return None
    configured = f" (CXX={env['CXX']})" if env.get("CXX") else ""
    return Diagnosis(f"the C/C++ compiler {m['cc']!r} was not found{configured}",
                     "install a compiler (Debian/Ubuntu: apt-get install build-essential; "
                     "RHEL: dnf install gcc-c++) or set CXX to one that exists")


def _cuda_home(text: str, env: Mapping[str, str]) -> Diagnosis | None:
    patterns = (r"CUDA_HOME does not exist", r"CUDA_HOME environment variable is not set",
                r"cannot find CUDA_HOME", r"nvcc missing", r"Unable to run \S*nvcc",
                r"\bnvcc: (?:command )?not found", r"No such file or directory: '\S*nvcc'")
    if not any(re.search(p, text) for p in patterns):
        return None
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    cause = f"no usable nvcc: CUDA_HOME={home}" if home else "no usable nvcc: CUDA_HOME is not set"
    return Diagnosis(cause, "install the CUDA toolkit (with nvcc) matching torch.version.cuda and "
                            "export CUDA_HOME=/usr/local/cuda-X.Y "
                            "so that $CUDA_HOME/bin/nvcc exists")


def _shm_text(text: str, env: Mapping[str, str]) -> Diagnosis | None:
    if re.search(r"/dev/shm[^\n]*No space left on device|No space left on device[^\n]*/dev/shm|"
                 r"Error while creating shared memory segment|/dev/shm size might be too small",
                 text):
        return Diagnosis("/dev/shm ran out of space", SHM_FIX)
    return None


SHM_FIX = ("give the container more shared memory (docker run --shm-size=16g, or a Kubernetes "
           "emptyDir with medium: Memory at /dev/shm), "
           "or remount: mount -o remount,size=16G /dev/shm")

RULES = (_arch_suffix, _cuda_mismatch, _cuda_home, _ninja, _compiler, _libaio, _shm_text)


def diagnose(error_text: str, log_tail: str, env: Mapping[str, str], *,
             shm_bytes: int | None = None,
             min_shm_bytes: int = DEFAULT_MIN_SHM_BYTES) -> list[Diagnosis]:
    """Known causes of a failed op build/load, each with a fix; [] when none is recognised. `env`
    is the process environment (TORCH_CUDA_ARCH_LIST is checked even when the error says
    something else); `shm_bytes`, when given, is compared with `min_shm_bytes`."""
    text = f"{error_text or ''}\n{log_tail or ''}"
    found = [d for d in (rule(text, env) for rule in RULES) if d is not None]
    if (shm_bytes is not None and shm_bytes < min_shm_bytes
            and not any(d.fix == SHM_FIX for d in found)):
        found.append(Diagnosis(f"/dev/shm is {shm_bytes} bytes, below {min_shm_bytes}", SHM_FIX))
    return found


def first_compiler_error(log: str) -> str | None:
    """The first line a compiler or linker flagged as an error, if any."""
    m = re.search(r"^.*(?:\berror\b:|fatal error|undefined reference|cannot find -l"
                  r"|: (?:command )?not found$).*$", log or "", re.M)
    return m.group(0).strip() if m else None


def format_failure(load: Any) -> str:
    """What the suite prints for an op (a dsconform.ops.load.OpLoad) that did not load: op,
    error, causes and fixes, output tail."""
    error_lines = (load.error or "no error recorded").strip().splitlines()
    lines = [f"op {load.name} did not load (DeepSpeed's probe said compatible: {load.compatible}; "
             f"{load.seconds:.1f} s)",
             f"error: {error_lines[-1] if error_lines else ''}"]
    if (first := first_compiler_error(load.log_tail)):
        lines.append(f"first compiler error: {first}")
    for d in load.diagnosis:
        lines += [f"cause: {d.cause}", f"  fix: {d.fix}"]
    if not load.diagnosis:
        lines.append("cause: not recognised; read the output below")
    if load.log_tail.strip():
        lines.append("compiler/ninja output (tail):")
        lines += [f"    {ln}" for ln in load.log_tail.splitlines()]
    return "\n".join(lines)
