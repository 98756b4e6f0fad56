"""Error-compensated 1-bit compression, the way DeepSpeed's 1-bit optimizers communicate, in
plain torch: the reference the onebit suite holds DeepSpeed's compressed allreduce to.

One compressed allreduce over ``n`` ranks (1-bit Adam, https://arxiv.org/abs/2102.02888,
Algorithm 1; DeepSpeed 0.19.6 ``deepspeed/runtime/comm/nccl.py``
``NcclBackend.compressed_allreduce``; DeepSpeed 0.19.7 removed it, PR #8490):

1. Worker ``r`` flattens its buffer and pads it with zeros to ``padded_numel(numel, n)``, adds
   its worker error ``e_r`` (``c_r = x_r + e_r``), and sends ``C(c_r)`` where ``C`` is the sign
   with a scale: ``C(v) = rms(v) * sign(v)``, ``rms(v) = ||v||_2 / sqrt(numel(v))`` and
   ``sign(0) = +1`` (DeepSpeed packs ``sign(v) + 1 > 0`` into bits). One scale and one bit per
   element travel. The worker keeps what was not sent: ``e_r <- c_r - C(c_r)``.
2. Rank ``j`` is the server of chunk ``j`` (``padded / n`` elements): it averages the chunks it
   received, ``a_j = sum_r C(c_r)[j] / n``, adds its server error ``E_j``
   (``m_j = a_j + E_j``), keeps ``E_j <- m_j - C(m_j)`` and sends ``C(m_j)`` back to everyone.
3. Every rank ends with the same tensor, the concatenation of the ``C(m_j)``, cut back to the
   input's size and shape.

Nothing is lost, only delayed (the error feedback): over any number of rounds, the sum of the
outputs plus the current errors equals the sum of the true averages plus the initial errors.
``round_violations`` and ``rounds_violations`` state these properties independently of the
implementation above them, so a broken reference (or DeepSpeed) cannot vouch for itself.

Everything here runs on the CPU in float32, the dtype DeepSpeed compresses in (the fp32 master
momentum, or fp32 gradients).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def padded_numel(numel: int, world: int) -> int:
    """DeepSpeed's padded size: a multiple of ``world * lcm(world, 8)``, so every server chunk
    packs into whole bytes on every rank (``divider = world * 8 / gcd(world, 8)`` upstream)."""
    if world < 1 or numel < 0:
        raise ValueError(f"padded_numel(numel={numel}, world={world}): need numel >= 0, "
                         f"world >= 1")
    unit = world * (world * 8 // math.gcd(world, 8))
    return -(-numel // unit) * unit


def sign_pm1(x: torch.Tensor) -> torch.Tensor:
    """+1 where x >= 0, -1 elsewhere: 1-bit compression has no zero (DeepSpeed maps 0 to +1)."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def rms(x: torch.Tensor) -> torch.Tensor:
    """||x||_2 / sqrt(numel): the scale that gives C(x) the L2 norm of x."""
    return torch.linalg.norm(x) / math.sqrt(x.numel())


def scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """C(x) = rms(x) * sign(x): what one compressed tensor decompresses to."""
    return rms(x) * sign_pm1(x)


def error_feedback_step(value: torch.Tensor,
                        error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One error-compensated compression: (sent, new error) = (C(value + error),
    value + error - sent)."""
    compensated = value + error
    sent = scaled_sign(compensated)
    return sent, compensated - sent


# The two places error feedback happens, by name, so each can be checked and broken on its own.
def worker_step(value: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A worker compresses its (padded) buffer with its worker error."""
    return error_feedback_step(value, error)


def server_step(value: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A server compresses the average of its chunk with its server error."""
    return error_feedback_step(value, error)


@dataclass
class RoundResult:
    """One compressed allreduce over all ranks, as the reference computes it."""
    output: torch.Tensor               # what every rank holds afterwards (input's shape)
    padded_output: torch.Tensor        # the same before cutting the padding off
    worker_errors: list[torch.Tensor]  # per rank, padded numel
    server_errors: list[torch.Tensor]  # per rank, padded numel / world
    worker_sent: list[torch.Tensor]    # C(x_r + e_r), per rank, padded numel
    server_averages: list[torch.Tensor]  # a_j: the average each server received, per rank
    server_compensated: list[torch.Tensor]  # m_j = a_j + E_j before its sign: ties live near 0


def zero_errors(numel: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fresh (worker, server) error buffers for ``world`` ranks, as DeepSpeed allocates them."""
    padded = padded_numel(numel, world)
    return ([torch.zeros(padded) for _ in range(world)],
            [torch.zeros(padded // world) for _ in range(world)])


def _check_inputs(buffers: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                  server_errors: Sequence[torch.Tensor]) -> int:
    world = len(buffers)
    if world < 1 or len(worker_errors) != world or len(server_errors) != world:
        raise ValueError(f"need one buffer, worker error and server error per rank: "
                         f"{len(buffers)}, {len(worker_errors)}, {len(server_errors)}")
    shapes = {tuple(b.shape) for b in buffers}
    if len(shapes) != 1:
        raise ValueError(f"every rank's buffer must have the same shape, found {sorted(shapes)}")
    padded = padded_numel(buffers[0].numel(), world)
    for r in range(world):
        if worker_errors[r].numel() != padded or server_errors[r].numel() != padded // world:
            raise ValueError(f"rank {r}: worker error has {worker_errors[r].numel()} elements "
                             f"and server error {server_errors[r].numel()}; expected {padded} "
                             f"and {padded // world} (padded_numel)")
    return padded


def compressed_allreduce(buffers: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                         server_errors: Sequence[torch.Tensor]) -> RoundResult:
    """One round over all ranks at once; the inputs are left untouched (a pure function).

    ``buffers[r]`` is rank r's tensor (any shape, the same on every rank), ``worker_errors[r]``
    and ``server_errors[r]`` its error buffers (padded sizes, see ``zero_errors``).
    """
    padded = _check_inputs(buffers, worker_errors, server_errors)
    world = len(buffers)
    shape = buffers[0].shape
    numel = buffers[0].numel()
    if numel == 0:  # DeepSpeed returns the empty buffer and zeroes both errors
        return RoundResult(buffers[0].clone(), buffers[0].new_zeros(0),
                           [torch.zeros_like(e) for e in worker_errors],
                           [torch.zeros_like(e) for e in server_errors], [], [], [])
    sent, new_worker = [], []
    for r in range(world):
        flat = torch.zeros(padded)
        flat[:numel] = buffers[r].detach().reshape(-1).to("cpu", torch.float32)
        s, e = worker_step(flat, worker_errors[r].detach().to("cpu", torch.float32))
        sent.append(s)
        new_worker.append(e)
    chunk = padded // world
    outs, new_server, averages, compensated = [], [], [], []
    for j in range(world):
        part = torch.stack([s[j * chunk:(j + 1) * chunk] for s in sent])
        # DeepSpeed's order: each received chunk times (scale / n), then summed over ranks.
        average = (part * (1.0 / world)).sum(0)
        error = server_errors[j].detach().to("cpu", torch.float32)
        out, e = server_step(average, error)
        outs.append(out)
        new_server.append(e)
        averages.append(average)
        compensated.append(average + error)
    padded_output = torch.cat(outs)
    return RoundResult(padded_output[:numel].reshape(shape).clone(), padded_output, new_worker,
                       new_server, sent, averages, compensated)


# ------------------------------------------------------------------------- properties
# Stated from first principles (norms and sums), never by calling the implementation above:
# each returns one line per violated property, empty when all hold.

def _close(a: torch.Tensor, b: torch.Tensor, scale: float, rtol: float) -> tuple[bool, float]:
    """Equal up to float32 rounding of quantities of size ``scale``: (ok, worst abs diff)."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    worst = float((a64 - b64).abs().max()) if a.numel() else 0.0
    return worst <= rtol * max(scale, 1e-30), worst


def _is_scaled_sign(v: torch.Tensor, rtol: float) -> str | None:
    """v has exactly two values +s and -s with s = rms of what it stands for (checked by the
    caller); here: one magnitude for every element."""
    mags = v.abs().to(torch.float64)
    if v.numel() == 0:
        return None
    spread = float(mags.max() - mags.min())
    if spread > rtol * float(mags.max()):
        return f"takes {len(torch.unique(mags))} magnitudes (spread {spread:.3g}), not one"
    return None


def _compression_violations(sent: torch.Tensor, compensated: torch.Tensor,
                            new_error: torch.Tensor, rtol: float, *, who: str, what: str,
                            of: str, feedback: str, sent_name: str) -> list[str]:
    """One compression step (a worker's message or a server's chunk): ``sent`` is one scale
    and signs, keeps the norm of what was compressed (``compensated``: the input plus the old
    error), and ``sent + new_error == compensated`` (the error feedback loses nothing)."""
    problems = []
    size = float(compensated.abs().max()) + float(sent.abs().max())
    why = _is_scaled_sign(sent, rtol)
    if why:
        problems.append(f"{who}: {what} is not one scale and signs: {why}")
    # The bit sent is the compensated value's sign (0 -> +1). Elements within float32 rounding
    # of zero may land on either side; no other may differ (flipped or constant signs keep
    # the magnitude, the norm and the feedback sum, so only this sees them).
    decided = compensated.to(torch.float64).abs() > rtol * max(size, 1e-30)
    wrong = decided & ((sent >= 0) != (compensated >= 0))
    if bool(wrong.any()):
        first = int(wrong.nonzero()[0])
        problems.append(f"{who}: {what} has the wrong sign at {int(wrong.sum())} of "
                        f"{int(decided.sum())} elements (first: element {first}, sent "
                        f"{float(sent[first]):.3g} for {float(compensated[first]):.3g}): one "
                        f"bit must carry the sign of {of} + error")
    norm = float(torch.linalg.norm(compensated))
    energy_ok, _ = _close(torch.linalg.norm(sent.to(torch.float64)).reshape(1),
                          torch.linalg.norm(compensated).reshape(1), norm, rtol)
    if not energy_ok:
        problems.append(f"{who}: {what} has norm {float(torch.linalg.norm(sent)):.6g}, "
                        f"compensated {of} {norm:.6g}: the scale must keep the norm")
    ok, worst = _close(sent.to(torch.float64) + new_error, compensated, size, rtol)
    if not ok:
        problems.append(f"{who}: {feedback} error feedback loses {worst:.3g}: {sent_name} + new "
                        f"error != {of} + old error")
    return problems


def round_violations(buffers: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                     server_errors: Sequence[torch.Tensor], result: RoundResult, *,
                     rtol: float = 1e-5) -> list[str]:
    """What one round must satisfy, given its inputs and what the round produced.

    - 1 bit and 1 scale: every worker's message and every server chunk has one magnitude,
      and each element's sign is the sign of what was compressed (0 counts as +);
    - the scale keeps the energy: ||C(v)|| == ||v|| for what each worker and server compressed;
    - worker error feedback loses nothing: sent_r + e_r' == x_r + e_r;
    - server error feedback loses nothing: out_j + E_j' == a_j + E_j, with a_j the average
      of the workers' messages for chunk j;
    - the output is the servers' chunks, cut to the input's shape.
    ``rtol`` is relative to the size of the quantities involved (float32 rounding).
    """
    world = len(buffers)
    numel = buffers[0].numel()
    if numel == 0:
        return []
    padded = padded_numel(numel, world)
    chunk = padded // world
    problems = []
    for r in range(world):
        x = torch.zeros(padded, dtype=torch.float64)
        x[:numel] = buffers[r].reshape(-1).to(torch.float64)
        c = x + worker_errors[r].to(torch.float64)
        problems += _compression_violations(
            result.worker_sent[r], c, result.worker_errors[r], rtol,
            who=f"rank {r}", what="worker message", of="buffer", feedback="worker",
            sent_name="sent")
    for j in range(world):
        a = sum(result.worker_sent[r][j * chunk:(j + 1) * chunk].to(torch.float64)
                for r in range(world)) / world
        m = a + server_errors[j].to(torch.float64)
        problems += _compression_violations(
            result.padded_output[j * chunk:(j + 1) * chunk], m, result.server_errors[j], rtol,
            who=f"server {j}", what="output chunk", of="average", feedback="server",
            sent_name="output")
    if not torch.equal(result.output.reshape(-1), result.padded_output[:numel]) or \
            tuple(result.output.shape) != tuple(buffers[0].shape):
        problems.append("output is not the servers' chunks cut to the input's shape")
    return problems


def rounds_violations(inputs: Sequence[Sequence[torch.Tensor]],
                      initial: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
                      results: Sequence[RoundResult], *, rtol: float = 1e-5) -> list[str]:
    """Nothing is lost over rounds: sum_t out_t + mean_r e_r,T + E_T ==
    sum_t mean_r x_r,t + mean_r e_r,0 + E_0 (padded, E the servers' chunks side by side).

    ``inputs[t][r]`` is rank r's buffer in round t, ``initial`` the (worker, server) errors
    before round 0, ``results[t]`` round t's result.
    """
    if not results:
        return ["no rounds to check"]
    world = len(inputs[0])
    numel = inputs[0][0].numel()
    if numel == 0:
        return []
    padded = padded_numel(numel, world)

    def held(workers: Sequence[torch.Tensor], servers: Sequence[torch.Tensor]) -> torch.Tensor:
        return (sum(w.to(torch.float64) for w in workers) / world
                + torch.cat([s.to(torch.float64) for s in servers]))

    produced = sum(r.padded_output.to(torch.float64) for r in results)
    truth = torch.zeros(padded, dtype=torch.float64)
    for round_inputs in inputs:
        for x in round_inputs:
            truth[:numel] += x.reshape(-1).to(torch.float64) / world
    left = produced + held(results[-1].worker_errors, results[-1].server_errors)
    right = truth + held(*initial)
    size = sum(float(r.padded_output.abs().max()) for r in results) + float(right.abs().max())
    ok, worst = _close(left, right, size, rtol)
    if ok:
        return []
    return [f"over {len(results)} rounds the outputs and errors lose {worst:.3g} of the true "
            f"average sum: error feedback must only delay, never drop"]


SCALE_BYTES = 4  # every scale travels as one float32


def bus_bytes(numel: int, world: int, dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes each rank puts on the wire (nccl-tests' bus factors) for one allreduce of ``numel``
    elements of ``dtype_bytes`` each: ``plain`` (all_reduce: 2(n-1)/n of the buffer) and
    ``compressed`` (DeepSpeed's compressed allreduce: all_to_all of the packed worker signs and
    all_gather of the worker scales, then all_gather of the server signs and scales; an
    all_to_all or all_gather puts (n-1)/n of its output on the wire)."""
    padded = padded_numel(numel, world)
    frac = (world - 1) / world
    compressed = (frac * padded / 8                 # all_to_all of the worker signs
                  + frac * world * SCALE_BYTES      # all_gather of the worker scales
                  + frac * padded / 8               # all_gather of the server signs
                  + frac * world * SCALE_BYTES)     # all_gather of the server scales
    return {"plain": 2 * frac * numel * dtype_bytes, "compressed": compressed}
