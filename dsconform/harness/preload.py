"""Imported by the fork server only (dsconform.harness.zygote), never by a rank or pytest:
torch and what a first engine imports lazily, before any rank is forked from it.

Nothing here may create a CUDA context or start a thread pool: a forked child cannot use
either. torch.cuda.is_available() initialises the CUDA driver unless PyTorch's NVML check is
on, so the server turns it on for itself (each rank sets its own environment). An import that
fails is left to the rank, which imports it again and reports the error there.
"""

import os
import sys
import time

# multiprocessing starts the server with the parent's interpreter flags: -B where the parent
# started under PYTHONDONTWRITEBYTECODE (container images set it). Where the parent then kept
# compiled files in the suite's cache instead (dsconform.ops.cache.enable_bytecode_cache: the
# variable is gone from the environment), the server writes them too: what only it imports
# (torch._dynamo, inductor, sympy) would otherwise be compiled from source by every run's
# server (docs/performance.md#what-dominates-cold-and-warm-1xh200-pytest-suites--m-gpu-auto).
sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))

from dsconform.base import cpu_info  # noqa: E402

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
    try:
        __import__(_name)
    except Exception:  # noqa: BLE001 - the rank reports it
        pass

cpu_info.remembered()

#: When the server's imports ended (time.time()): its ranks report it (dsconform.harness.timeline).
READY_AT = time.time()
