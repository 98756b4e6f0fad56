"""Functions the harness tests run inside ranks (module level, so spawn can import them)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as tdist

from dsconform.harness import api as dist


def rank_and_sum() -> dict:
    """Each rank contributes rank+1; the all_reduce sum proves the process group works."""
    value = torch.tensor([float(dist.rank() + 1)], device=dist.device())
    tdist.all_reduce(value)
    return {"rank": dist.rank(), "world": dist.world(), "sum": value.item(), "pid": os.getpid()}


def noop() -> None:
    return None


def pid() -> int:
    return os.getpid()


def raise_on(bad_rank: int) -> int:
    """bad_rank raises at once; the others block in a collective that can never complete."""
    if dist.rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    tdist.barrier()
    return dist.rank()


def raise_alone(bad_rank: int) -> int:
    """bad_rank raises; the others return normally (no collective left waiting)."""
    if dist.rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return dist.rank()


def exit_on(bad_rank: int, code: int) -> int:
    if dist.rank() == bad_rank:
        os._exit(code)
    tdist.barrier()
    return dist.rank()


def sigkill_on(bad_rank: int) -> int:
    if dist.rank() == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    tdist.barrier()
    return dist.rank()


def segfault_on(bad_rank: int) -> int:
    if dist.rank() == bad_rank:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    tdist.barrier()
    return dist.rank()


def hang_forever_in_sleep() -> None:
    """A hang the stack dump must name: a pure-Python loop, no collective involved."""
    while True:
        time.sleep(0.1)


def hang_on(bad_rank: int) -> int:
    """bad_rank hangs in a named function; the others wait for it in a barrier."""
    if dist.rank() == bad_rank:
        hang_forever_in_sleep()
    tdist.barrier()
    return dist.rank()


def skip_all(reason: str) -> None:
    import pytest

    pytest.skip(reason)


def skip_on(skip_rank: int, reason: str) -> int:
    """skip_rank skips; the others return without waiting for it."""
    if dist.rank() == skip_rank:
        import pytest

        pytest.skip(reason)
    return dist.rank()


def skip_on_then_barrier(skip_rank: int, reason: str) -> int:
    """skip_rank skips; the others wait for it in a barrier (they would hang forever)."""
    if dist.rank() == skip_rank:
        import pytest

        pytest.skip(reason)
    tdist.barrier()
    return dist.rank()


def skip_with_rank_reason() -> None:
    import pytest

    pytest.skip(f"reason of rank {dist.rank()}")


def agree_or_report(bad_rank: int) -> str:
    """Every rank must raise from all_agree when one rank is not ok; report what each saw."""
    try:
        dist.all_agree(dist.rank() != bad_rank, f"value on rank {dist.rank()} is off")
    except AssertionError as exc:
        # A collective after all_agree proves no rank was left behind in it.
        tdist.barrier()
        return f"raised: {exc}"
    return "passed"


def agree_all_ok() -> str:
    dist.all_agree(True, "unused")
    return "passed"


def gather_ranks() -> list:
    return dist.gather(dist.rank() * 10)


def seeded_draw(seed: int, per_rank: bool) -> list:
    dist.seed_everything(seed, per_rank=per_rank)
    return torch.rand(3).tolist()


def unpicklable_result():
    return lambda: None


def set_env_var(name: str, value: str) -> str | None:
    """Sets a variable; the harness must undo it before the next call in a pooled rank."""
    before = os.environ.get(name)
    os.environ[name] = value
    return before


def read_env_var(name: str) -> str | None:
    return os.environ.get(name)


def env_of_rank() -> dict:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES")
    from deepspeed.accelerator import get_accelerator

    return {"env": {k: os.environ.get(k) for k in keys},
            "backend": tdist.get_backend(),
            "ds_accelerator": get_accelerator()._name}


_calls = 0


def pid_and_calls() -> tuple[int, int]:
    """This process's pid and how many harness calls it has run, this one included: a rank
    that ran nothing before answers 1."""
    global _calls
    _calls += 1
    return os.getpid(), _calls


def pid_calls_warmed() -> tuple[int, int, bool]:
    """pid_and_calls, and warmed_up."""
    return (*pid_and_calls(), warmed_up())


def warmed_up() -> bool:
    """Whether this rank built dsconform's warm-up engine before its first call."""
    from dsconform.harness import rank as rank_module

    return rank_module._warmed_up


def fresh_state() -> tuple[bool, bool]:
    """(warmed_up, whether torch._dynamo was imported before this call)."""
    import sys

    return warmed_up(), "torch._dynamo" in sys.modules


def sleep_then_pid(seconds: float) -> int:
    """Sleep, then answer this rank's pid (calls that overlap in time show it)."""
    time.sleep(seconds)
    return os.getpid()


def sleep_window(seconds: float) -> tuple[float, float]:
    """Sleep; return when the sleep began and ended (wall clock), to show calls overlapping."""
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def tensors(n: int) -> list:
    """n small CPU tensors (what a cell returns: states, traces)."""
    import torch

    return [torch.full((16,), float(i)) for i in range(n)]


def wire_count() -> dict:
    """suites/onebit_ranks.WireCount on gloo: a direct torch.distributed call and one through
    deepspeed.comm are both counted (once each), an object collective is named as uncounted,
    and torch.distributed's functions are restored afterwards."""
    import deepspeed.comm as dscomm

    from suites.onebit_ranks import WireCount

    n = tdist.get_world_size()
    original = tdist.all_reduce, tdist.distributed_c10d.all_gather
    with WireCount(n) as counted:
        tdist.all_reduce(torch.ones(1000))                     # 2 (n-1)/n x 4000 bytes
        dscomm.all_gather([torch.empty(250) for _ in range(n)], torch.ones(250))  # (n-1) x 1000
    with WireCount(n) as objects:
        tdist.all_gather_object([None] * n, {"rank": dist.rank()})
    return {"bytes": counted.bytes, "calls": counted.calls,
            "uncounted": sorted(counted.uncounted), "object_calls": objects.calls,
            "object_uncounted": sorted(objects.uncounted),
            "restored": (tdist.all_reduce, tdist.distributed_c10d.all_gather) == original}


def zero_layout(asked: dict, built: dict) -> list[str]:
    """dsconform.checks.zero_vs_ddp.layout_problems of an engine built from ``built`` (ZeroCase
    fields) judged against the case ``asked``: an engine that is not what the case asked for."""
    import deepspeed

    from dsconform.checks.zero_vs_ddp import MLP, ZeroCase, layout_problems

    base = dict(dtype="fp32", optimizer="sgd", grad_accum=1, world_size=dist.world())
    case, engine_case = ZeroCase(**base, **asked), ZeroCase(**base, **built)
    model = MLP(case.d_in, case.width, case.d_out)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=engine_case.config())
    try:
        return layout_problems(engine, case)
    finally:
        engine.destroy()


def process_facts() -> dict:
    """What a rank process inherited: its parent, whether torch's lazy imports were there
    before this call, its CPU threads and a few variables."""
    import sys

    import torch

    return {"ppid": os.getppid(), "dynamo": "torch._dynamo" in sys.modules,
            "threads": torch.get_num_threads(),
            "late": os.environ.get("DSCONFORM_TEST_LATE"),
            "server_env": os.environ.get("DSC_FORK_SERVER_PID"),
            "cuda_initialized": torch.cuda.is_initialized()}


def cpu_questions() -> dict:
    """How a rank answers DeepSpeed's CPU questions: whether py-cpuinfo's function is the
    shared answer (dsconform.base.cpu_info), whether the rank already holds an answer (a
    fork of the server that asked), and what two of DeepSpeed's builders read from it."""
    import cpuinfo
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    from dsconform.base import cpu_info

    held = cpu_info._STATE["answer"] is not None or bool(os.environ.get(cpu_info.ENV))
    return {"shared": cpuinfo.get_cpu_info is cpu_info.remembered, "held": held,
            "flags": [CPUAdamBuilder().cpu_arch(), AsyncIOBuilder().simd_width()]}
