"""Imported by the fork server only (dsconform.harness.zygote): torch and what a first engine
imports lazily, before any rank is forked. No CUDA context or thread pool may start here (a
forked child cannot use either); an import that fails is left to the rank to report."""

import contextlib
import os
import sys
import time

# The server inherits -B from a parent started under PYTHONDONTWRITEBYTECODE but writes compiled
# files when the parent does (dsconform.ops.cache.enable_bytecode_cache; docs/performance.md:
# "the fork server keeps its compiled Python").
sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))

from dsconform.base import cpu_info  # noqa: E402

# torch.cuda.is_available() initialises the CUDA driver unless PyTorch's NVML check is on.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
#: Marks the server's environment; a rank takes its parent's instead (rank._take_environment).
os.environ["DSC_FORK_SERVER_PID"] = str(os.getpid())

# py-cpuinfo's query (a second, dsconform.base.cpu_info) runs beside the imports; every
# rank forked from here then has its answer.
cpu_info.install()
cpu_info.start_asking()

#: Heaviest first; DeepSpeed is not among them (it picks its accelerator when imported).
MODULES = ("torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
           "numpy")

for _name in MODULES:
    with contextlib.suppress(Exception):  # the rank reports it
        __import__(_name)

cpu_info.remembered()

#: When the server's imports ended (time.time()): its ranks report it (dsconform.harness.timeline).
READY_AT = time.time()
