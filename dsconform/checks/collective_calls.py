"""The collectives as ranks run them: exact results on known data through deepspeed.comm, the
API training uses, and torch.distributed beside it (``check_exact``), and timed back-to-back
calls through torch.distributed whose output is then checked through both (``measure``).

Shared by suites/test_collectives.py (one node) and suites/test_multinode.py (across nodes); every
function runs inside the ranks (module-level: picklable by reference), on real collectives (gloo
on the CPU accelerator, NCCL on GPUs), and returns plain data for the parent to check and record
(the reference: dsconform/checks/collectives.py). Fault injection for the project's own red
tests, off by default:
- ``check_exact(..., perturb={"rank": r, "numel": m, "index": i})``: on rank r, the
  deepspeed.comm call for size m returns its output with element i off by one unit of the
  data (a wrapper around the real call); ``{"rank": r, "numel": m, "narrow": "bf16"}`` rounds
  it through bf16 instead;
  ``{"numel": m, "carry": "fp16"}``: every rank carries the collective in fp16 (its tensors
  cast down, the real collective run in fp16, the result cast back).
- ``measure(..., delay_rank=r, delay_s=d)``: rank r sleeps d seconds before every call it starts
  (it arrives late); ``partial_rank=r``: the output of rank r's checked calls has its last
  quarter zeroed (a collective that did only part of the work).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsconform.checks import collectives
from dsconform.harness.api import device, gather, rank, world

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def synchronize(dev: torch.device) -> None:
    """Wait for the device's queued work (timing on GPUs needs it; nothing to wait for on CPUs)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def identity() -> dict[str, Any]:
    """What this rank computes on. On GPUs the PCI address comes from the device itself, so it
    is right whatever CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER did to torch's numbering; the
    parent maps it to nvidia-smi's index (dsconform/node/gpu_health.py)."""
    dev = device()
    info: dict[str, Any] = {"rank": rank(), "device": "cpu", "bus_id": None, "visible": None}
    if dev.type != "cuda":
        return info
    props = torch.cuda.get_device_properties(dev)
    bus = getattr(props, "pci_bus_id", None)  # torch >= 2.2
    if bus is not None:
        info["bus_id"] = (f"{getattr(props, 'pci_domain_id', 0) or 0:04x}:{bus:02x}:"
                          f"{getattr(props, 'pci_device_id', 0) or 0:02x}.0")
    listed = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    index = dev.index or 0
    info["device"] = f"cuda:{index}"
    info["visible"] = listed[index] if index < len(listed) and listed[index] else str(index)
    return info


# ------------------------------------------------------------------ exactness

def _with_fault(call: Callable, index: int, by: float) -> Callable:
    """The real deepspeed.comm call, then element ``index`` of its output (the first argument,
    as in every call used here) off by ``by`` (one unit of the dtype's data, which the dtype
    holds at every value of it): a rank whose collective returns one wrong value."""
    def faulty(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = call(out, *args, **kwargs)
        out.view(-1)[index] += by
        return result
    return faulty


def _narrowed(call: Callable, narrow: torch.dtype) -> Callable:
    """The real deepspeed.comm call, then its output rounded through ``narrow`` (bf16, fp16):
    a rank whose collective carries the data in a narrower type (a compression hook)."""
    def faulty(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = call(out, *args, **kwargs)
        out.copy_(out.to(narrow).to(out.dtype))
        return result
    return faulty


def _carried(call: Callable, carrier: torch.dtype) -> Callable:
    """The real deepspeed.comm call run on copies of its tensors cast to ``carrier``, the
    result cast back into the output: a collective carried in another dtype."""
    def carried(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        low = out.to(carrier)
        args = tuple(a.to(carrier) if isinstance(a, torch.Tensor) else a for a in args)
        result = call(low, *args, **kwargs)
        out.copy_(low.to(out.dtype))
        return result
    return carried


def _ds_calls() -> dict[str, Callable]:
    """The deepspeed.comm entry points ZeRO uses for each collective."""
    import deepspeed.comm as dc

    return {"all_reduce": dc.all_reduce, "all_gather": dc.allgather_fn,
            "reduce_scatter": dc.reduce_scatter_fn, "broadcast": dc.broadcast,
            "all_to_all": dc.all_to_all_single}


def _torch_calls() -> dict[str, Callable]:
    """The torch.distributed calls beneath them, with the same arguments."""
    return {"all_reduce": dist.all_reduce, "all_gather": dist.all_gather_into_tensor,
            "reduce_scatter": dist.reduce_scatter_tensor, "broadcast": dist.broadcast,
            "all_to_all": dist.all_to_all_single}


#: The APIs an exactness check can go through, by the name its messages give them.
APIS = {"deepspeed.comm": _ds_calls, "torch.distributed": _torch_calls}


def _run_exact(collective: str, case: Any, dtype: torch.dtype, call: Callable,
               dev: torch.device) -> torch.Tensor:
    inp = case.as_float(case.input, dtype)
    if collective == "all_reduce":
        out = inp.clone()
        call(out)
    elif collective == "broadcast":
        out = inp.clone()
        call(out, src=case.src)
    elif collective == "all_to_all":
        out = torch.empty(sum(case.output_splits), dtype=dtype, device=dev)
        call(out, inp, output_split_sizes=case.output_splits,
             input_split_sizes=case.input_splits)
    else:  # all_gather, reduce_scatter: (output, input)
        out = torch.empty(case.expected.numel(), dtype=dtype, device=dev)
        call(out, inp)
    return out


def check_exact(collective: str, dtype: str, sizes: Sequence[int],
                perturb: dict[str, int] | None = None,
                apis: Sequence[str] = ("deepspeed.comm",)) -> dict[str, Any]:
    """Run ``collective`` on known data at every size through each of ``apis`` (``APIS``: the
    fault injection acts on the deepspeed.comm call only); this rank's identity and the
    mismatches it saw (every size runs on every rank, so no rank is left waiting in a
    collective when another one found a wrong value)."""
    dev, n, me = device(), world(), rank()
    mismatches = []
    for numel in sizes:
        for api in apis:
            call = APIS[api]()[collective]
            if api == "deepspeed.comm" and perturb and perturb["numel"] == numel:
                if "carry" in perturb:  # every rank, or the collective would not match
                    call = _carried(call, DTYPES[perturb["carry"]])
                elif perturb["rank"] == me:
                    call = (_narrowed(call, DTYPES[perturb["narrow"]]) if "narrow" in perturb
                            else _with_fault(call, perturb["index"],
                                             collectives.unit(dtype)))
            case = collectives.exact_case(collective, me, n, numel, dev, dtype)
            out = _run_exact(collective, case, DTYPES[dtype], call, dev)
            found = collectives.find_mismatch(out, case.as_float(case.expected, DTYPES[dtype]))
            if found is not None:
                index, expected, value, wrong = found
                mismatches.append(dict(collective=collective, dtype=dtype, numel=numel, rank=me,
                                       index=index, expected=expected, found=value, wrong=wrong,
                                       total=out.numel(), layout=case.layout, api=api))
            del out, case
    return {"identity": identity(), "mismatches": mismatches}


# ------------------------------------------------------------------ bandwidth

def _op(collective: str, nbytes: int,
        dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """Input, output (the same tensor where the call works in place) and a callable for one
    collective moving ``nbytes`` (nccl-tests' "size": the total buffer, i.e. the output of
    all_gather and the input of reduce_scatter), fp32, through torch.distributed (the way the
    profile's floors were measured)."""
    n = world()
    count = nbytes // 4
    per_rank = count // n
    if collective == "all_reduce":
        buf = torch.empty(count, dtype=torch.float32, device=dev)
        return buf, buf, lambda: dist.all_reduce(buf)
    if collective == "all_gather":
        inp = torch.empty(per_rank, dtype=torch.float32, device=dev)
        out = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        return inp, out, lambda: dist.all_gather_into_tensor(out, inp)
    if collective == "reduce_scatter":
        inp = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        out = torch.empty(per_rank, dtype=torch.float32, device=dev)
        return inp, out, lambda: dist.reduce_scatter_tensor(out, inp)
    if collective == "all_to_all":
        inp = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        out = torch.empty_like(inp)
        return inp, out, lambda: dist.all_to_all_single(out, inp)
    if collective == "broadcast":
        buf = torch.empty(count, dtype=torch.float32, device=dev)
        return buf, buf, lambda: dist.broadcast(buf, src=0)
    raise ValueError(f"unknown collective {collective!r}")


def _ds_op(collective: str, inp: torch.Tensor, out: torch.Tensor) -> Callable:
    """The same call as ``_op``'s on the same buffers, through deepspeed.comm (``_ds_calls``)."""
    call = _ds_calls()[collective]
    if collective == "all_reduce":
        return lambda: call(inp)
    if collective == "broadcast":
        return lambda: call(inp, src=0)
    return lambda: call(out, inp)


def _wrong_after_one_call(collective: str, inp: torch.Tensor, out: torch.Tensor,
                          op: Callable, partial: bool = False) -> int:
    """Elements of one call's output that are not what the timed collective, at the timed size,
    must return when every rank's input is rank + 1: a collective that does only part of the
    work at large sizes is fast, and would pass a floor, but is wrong."""
    n, me = world(), rank()
    inp.fill_(float(me + 1))
    op()
    if partial:  # fault injection (the project's red test): the last quarter left as it was
        out.view(-1)[out.numel() * 3 // 4:] = 0.0
    if collective in ("all_reduce", "reduce_scatter"):
        return int(out.ne(n * (n + 1) / 2).sum())
    if collective == "broadcast":
        return int(out.ne(1.0).sum())  # from rank 0
    # all_gather, all_to_all: the part from rank s holds s + 1
    want = torch.arange(1, n + 1, dtype=out.dtype, device=out.device).unsqueeze(1)
    return int(out.view(n, -1).ne(want).sum())


class _CallTimer:
    """Time this rank spends inside each call: CUDA events around the call on the GPU (no host
    synchronisation per call, so back-to-back timing is unchanged), the host clock on the CPU.
    A rank its peers wait for spends the least time inside (dsconform/node/gpu_health.py)."""

    def __init__(self, dev: torch.device, iters: int) -> None:
        self.cuda = dev.type == "cuda"
        self.events = ([(torch.cuda.Event(enable_timing=True),
                         torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
                       if self.cuda else [])
        self.spent = 0.0
        self._t = 0.0

    def reset(self) -> None:
        self.spent = 0.0

    def begin(self, i: int) -> None:
        if self.cuda:
            self.events[i][0].record()
        else:
            self._t = time.perf_counter()

    def end(self, i: int) -> None:
        if self.cuda:
            self.events[i][1].record()
        else:
            self.spent += time.perf_counter() - self._t

    def total(self) -> float:
        """Seconds inside the calls of this round (after the device was synchronised)."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        return self.spent


def measure(collective: str, points: Sequence[tuple[int, int]], rounds: int = 3,
            warmup: int = 5, delay_rank: int | None = None,
            delay_s: float = 0.0, partial_rank: int | None = None) -> dict[str, Any]:
    """For each (bytes, iters) point: ``rounds`` rounds of ``iters`` back-to-back calls, then
    one call on known data whose output is checked (``wrong[r]``: rank r's wrong elements), and
    the same call through deepspeed.comm, checked the same way (``wrong_ds[r]``).

    ``seconds[k]``: round k's time per call, the slowest rank's (as in nccl-tests, the job is
    as fast as its slowest rank), the same on every rank. ``inside[r][k]``: the time per call
    rank r spent inside the calls in round k. Every rank returns the same dict."""
    dev = device()
    late = delay_s if rank() == delay_rank else 0.0
    out = []
    for nbytes, iters in points:
        buf, result, op = _op(collective, nbytes, dev)
        buf.fill_(1.0)
        for _ in range(warmup):
            op()
        synchronize(dev)
        timer = _CallTimer(dev, iters)
        seconds, inside = [], []
        for _ in range(rounds):
            timer.reset()
            dist.barrier()
            start = time.perf_counter()
            for i in range(iters):
                if late:
                    time.sleep(late)
                timer.begin(i)
                op()
                timer.end(i)
            synchronize(dev)
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                                   device=dev)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds.append(float(elapsed.item()))
            inside.append(timer.total() / iters)
        wrong = _wrong_after_one_call(collective, buf, result, op, rank() == partial_rank)
        wrong_ds = _wrong_after_one_call(collective, buf, result,
                                         _ds_op(collective, buf, result), rank() == partial_rank)
        del buf, result, op, timer
        out.append({"bytes": nbytes, "iters": iters, "seconds": seconds,
                    "inside": gather(inside), "wrong": gather(wrong),
                    "wrong_ds": gather(wrong_ds)})
    return {"identities": gather(identity()), "points": out, "world_size": world()}
