"""The harness's errors, the checks of a call's arguments, and how the ranks' outcomes become
the call's result (their values, one RankError, or a unanimous skip)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class RankError(AssertionError):
    """A rank raised, died, or the ranks disagreed about skipping. AssertionError so that
    pytest reports a test failure, not an error in the harness."""

    def __init__(self, message: str, *, rank: int | None = None, world_size: int | None = None,
                 exc_type: str | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


class RankTimeout(AssertionError):
    """Ranks were still running after timeout_s; the message holds each rank's Python stacks."""

    def __init__(self, message: str, *, stacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.stacks = stacks or {}


class WorldSizeMismatch(RuntimeError):
    """Under torchrun/Slurm the job's world size is fixed; the call asked for another one."""


def check_accelerator(accelerator: str | None) -> str:
    if accelerator is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator not in ("cuda", "cpu"):
        raise ValueError(f"accelerator must be 'cuda', 'cpu' or None, got {accelerator!r}")
    return accelerator


def fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def describe(outcome: tuple | None) -> str:
    if outcome is None:
        return "did not finish"
    if outcome[0] == "ok":
        return "returned"
    if outcome[0] == "skip":
        return f"skipped ({outcome[1]})"
    return f"raised {outcome[1]}: {outcome[2]}"


def rank_error(outcomes: list, note: str = "") -> RankError:
    """The first rank that raised, the others that did after it (note: a line between)."""
    errors = [i for i, o in enumerate(outcomes) if o is not None and o[0] == "error"]
    index, world_size = errors[0], len(outcomes)
    _, exc_type, message, remote_tb = outcomes[index]
    lines = [f"rank {index} of {world_size} raised {exc_type}: {message}", note]
    lines += [f"also rank {i}: {describe(outcomes[i])}" for i in errors[1:]]
    text = "\n".join(line for line in lines if line)
    if remote_tb:
        text += f"\n\nRemote traceback (rank {index}):\n{remote_tb.rstrip()}"
    return RankError(text, rank=index, world_size=world_size, exc_type=exc_type,
                     remote_traceback=remote_tb)


def resolve(outcomes: list[tuple]) -> list:
    """All ranks reported: return their values, or raise one RankError / skip for the call."""
    if any(o[0] == "error" for o in outcomes):
        raise rank_error(outcomes)
    if skips := {o[1] for o in outcomes if o[0] == "skip"}:
        if len(skips) == 1 and all(o[0] == "skip" for o in outcomes):
            import pytest  # only a skip needs pytest, and then the caller is a pytest test

            raise pytest.skip.Exception(skips.pop())
        listing = "\n".join(f"  rank {i}: {describe(o)}" for i, o in enumerate(outcomes))
        raise RankError(f"the {len(outcomes)} ranks disagree about skipping; a skip must be "
                        f"decided identically on every rank (gate in the parent):\n{listing}",
                        world_size=len(outcomes))
    return [o[1] for o in outcomes]


def check_timeout(timeout_s: Any) -> None:
    if timeout_s is None or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def check_world_size(world_size: Any) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be an int >= 1 outside torchrun/Slurm, got {world_size!r}")
