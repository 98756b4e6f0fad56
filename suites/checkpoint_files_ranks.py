"""Code that runs inside the ranks of suites/test_checkpoint_files.py: damaged and flipped
checkpoints, the save and load timings, client state and the ``latest`` file. The model, the
engines and the snapshots are suites/checkpoint_ranks.py's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from dsconform.suite import checkpoint_storage
from suites.checkpoint_ranks import (
    CheckpointRefused,
    CkptCase,
    _batches,
    _destroy,
    build,
    final_params,
    snapshot,
    train,
)

CAPABILITY = "checkpoint"


def save_good_then_bad(case: CkptCase, ckpt_dir: str) -> dict[str, Any]:
    """Save tag "good" after ``steps``, train one step more, save tag "bad" (which the parent
    then damages). Returns the state saved under "good"."""
    from dsconform.suite import rank

    before, after = _batches(case)
    a = build(case, case.seed)
    try:
        train(a, before, case.dtype)
        a.save_checkpoint(ckpt_dir, tag="good")
        good = snapshot(a)
        train(a, after[:1], case.dtype)
        a.save_checkpoint(ckpt_dir, tag="bad")
        return {"rank": rank(), "good": good}
    finally:
        _destroy(a)


def load_tag(case: CkptCase, ckpt_dir: str, tag: str) -> dict[str, Any]:
    """Load ``tag`` into a fresh engine. A refusal (an exception, or DeepSpeed's "no path"
    return) raises CheckpointRefused on this rank, so the call fails at once and the harness
    stops the other ranks, which may wait in a collective for this one."""
    from dsconform.suite import rank

    b = build(case, case.seed + 1)
    try:
        try:
            load_path, _ = b.load_checkpoint(ckpt_dir, tag=tag)
        except Exception as e:
            raise CheckpointRefused(f"load_checkpoint(tag={tag!r}) raised "
                                    f"{type(e).__name__}: {e}") from e
        if load_path is None:
            raise CheckpointRefused(f"load_checkpoint(tag={tag!r}) returned no path")
        return {"rank": rank(), "load_path": load_path, "loaded": snapshot(b)}
    finally:
        _destroy(b)


DAMAGE = ("truncated", "missing_rank_file", "wrong_tag")


def damage(ckpt: Path, kind: str) -> tuple[str, str]:
    """Damage the checkpoint saved under tag "bad"; returns (the tag to load, what was done)."""
    if kind == "wrong_tag":
        return "no-such-tag", "load_checkpoint(tag='no-such-tag')"
    shards = sorted((ckpt / "bad").glob("*zero_pp_rank_1_*optim_states.pt"))
    if not shards:
        raise AssertionError(f"no rank-1 optimizer shard under {ckpt / 'bad'} to damage")
    if kind == "truncated":
        size = shards[0].stat().st_size
        new = checkpoint_storage.truncate(shards[0])
        return "bad", f"{shards[0].name} truncated from {size} to {new} bytes"
    if kind == "missing_rank_file":
        shards[0].unlink()
        return "bad", f"{shards[0].name} deleted"
    raise ValueError(f"unknown damage {kind!r}; known: {', '.join(DAMAGE)}")


def damaged_round_at_one_rank(case: CkptCase, ckpt_dir: str, kind: str) -> dict[str, Any]:
    """CKPT-CORRUPT-1 on a single rank, in one call: save "good" and "bad", damage "bad"
    (``damage``), load the damaged tag, then "good". On one rank no peer waits for a rank that
    refuses, so the refusal comes back as a value (``refused``: its error, None when the load
    went through) and the rank serves the next call (a raised error stops the ranks, and new
    ones cost a CUDA context and DeepSpeed's warm-up). Returns
    {"rank", "good", "what", "refused", "load_path", "loaded"}."""
    if case.world_size != 1:
        raise ValueError(f"damaged_round_at_one_rank runs on one rank, not {case.world_size}: "
                         "on more, a refusing rank's peers may wait in a collective")
    saved = save_good_then_bad(case, ckpt_dir)
    tag, what = damage(Path(ckpt_dir), kind)
    try:
        wrong = load_tag(case, ckpt_dir, tag)
        refused, load_path = None, wrong["load_path"]
    except CheckpointRefused as e:
        refused, load_path = str(e), None
    again = load_tag(case, ckpt_dir, "good")
    return {"rank": saved["rank"], "good": saved["good"], "what": what, "refused": refused,
            "load_path": load_path, "loaded": again["loaded"]}


def flipped_round_at_one_rank(case: CkptCase, ckpt_dir: str) -> dict[str, Any]:
    """CKPT-CORRUPT-2 on a single rank, in one call: save "good" (and "bad"), flip one bit of
    the tensor data of "good"'s optimizer shard (checkpoint_storage.flip_tensor_byte), then load
    "good". As in damaged_round_at_one_rank, a refusal comes back as a value (``refused``: its
    error, None when the load went through) and the rank serves the next call. Returns
    {"rank", "good", "shard", "entry", "offset", "refused", "loaded"} ("loaded": None when
    refused)."""
    if case.world_size != 1:
        raise ValueError(f"flipped_round_at_one_rank runs on one rank, not {case.world_size}: "
                         "on more, a refusing rank's peers may wait in a collective")
    saved = save_good_then_bad(case, ckpt_dir)
    shard = sorted((Path(ckpt_dir) / "good").glob("*zero_pp_rank_0_*optim_states.pt"))[0]
    flip = checkpoint_storage.flip_tensor_byte(shard)
    try:
        loaded, refused = load_tag(case, ckpt_dir, "good")["loaded"], None
    except CheckpointRefused as e:
        loaded, refused = None, str(e)
    return {"rank": saved["rank"], "good": saved["good"], "shard": shard.name,
            "entry": flip.entry, "offset": flip.offset, "refused": refused, "loaded": loaded}


def measure_saves(case: CkptCase, ckpt_dir: str, rounds: int) -> dict[str, Any]:
    """Save ``rounds`` checkpoints (tags r0, r1, ...) of one trained engine. A round's time runs
    from the call to save_checkpoint until every file of the tag is fsynced on every rank (the
    bytes are durable, not only in the page cache), as seen by rank 0."""
    import torch.distributed as dist

    from dsconform.suite import rank

    before, _ = _batches(case)
    a = build(case, case.seed)
    try:
        train(a, before[:1], case.dtype)
        engine_class = type(a.checkpoint_engine).__name__
        seconds, sizes = [], []
        for r in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            a.save_checkpoint(ckpt_dir, tag=f"r{r}")
            for path in checkpoint_storage.checkpoint_files(Path(ckpt_dir) / f"r{r}"):
                checkpoint_storage.fsync_file(path)
            dist.barrier()
            seconds.append(time.perf_counter() - t0)
            sizes.append(checkpoint_storage.total_bytes(Path(ckpt_dir) / f"r{r}"))
        return {"rank": rank(), "seconds": seconds, "bytes": sizes, "engine": engine_class}
    finally:
        _destroy(a)


def measure_loads(case: CkptCase, ckpt_dir: str, rounds: int) -> dict[str, Any]:
    """Load tags r0, r1, ... (from measure_saves) into one fresh engine. Before each round every
    file's cached pages are dropped, so the load reads the device; a round's time runs from the
    call to load_checkpoint until every rank returned, as seen by rank 0."""
    import torch.distributed as dist

    from dsconform.suite import rank

    b = build(case, case.seed + 1)
    try:
        engine_class = type(b.checkpoint_engine).__name__
        seconds, sizes = [], []
        for r in range(rounds):
            tag_dir = Path(ckpt_dir) / f"r{r}"
            checkpoint_storage.drop_cached_pages(checkpoint_storage.checkpoint_files(tag_dir))
            dist.barrier()
            t0 = time.perf_counter()
            load_path, _ = b.load_checkpoint(ckpt_dir, tag=f"r{r}")
            dist.barrier()
            seconds.append(time.perf_counter() - t0)
            if load_path is None:
                raise CheckpointRefused(f"load_checkpoint(tag='r{r}') returned no path")
            sizes.append(checkpoint_storage.total_bytes(tag_dir))
        return {"rank": rank(), "seconds": seconds, "bytes": sizes, "engine": engine_class}
    finally:
        _destroy(b)


# ---------------------------------------------------------------------------- besides tensors

def client_state() -> dict[str, Any]:
    """What a user hands save_checkpoint besides tensors: nested ints, floats, a tensor, a list.
    The same on every rank: DeepSpeed keeps one client_state per checkpoint (rank 0's, in the
    model states file) and gives it back to every rank."""
    return {"epoch": 3, "samples_seen": 12_345, "best_loss": 0.1234567891234,
            "history": [1, 2.5, {"lr": 1e-3}], "rng": torch.arange(5, dtype=torch.float64) / 7,
            "nested": {"data_loader": {"position": 42, "shuffled": [3, 1, 2]}}}


def _equal_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def client_state_round_trip(case: CkptCase, ckpt_dir: str) -> dict[str, Any]:
    """Save with ``client_state``, load into a fresh engine: whether every value came back equal,
    and what came back (as text, for the message)."""
    from dsconform.suite import rank

    before, _ = _batches(case)
    given = client_state()
    a = build(case, case.seed)
    try:
        train(a, before, case.dtype)
        a.save_checkpoint(ckpt_dir, tag="client", client_state=given)
    finally:
        _destroy(a)
    b = build(case, case.seed + 1)
    try:
        _, back = b.load_checkpoint(ckpt_dir, tag="client")
    finally:
        _destroy(b)
    back = back or {}
    missing = sorted(set(given) - set(back))
    wrong = sorted(k for k in given if k in back and not _equal_state(given[k], back[k]))
    return {"rank": rank(), "missing": missing, "wrong": wrong,
            "given": {k: repr(v) for k, v in given.items()},
            "back": {k: repr(back.get(k)) for k in given}}


def load_latest(case: CkptCase, ckpt_dir: str, saves: int, tag: str | None = None,
                load_optimizer_states: bool = True) -> dict[str, Any]:
    """Save ``saves`` checkpoints into one directory, one step apart (tags s1, s2, ...), then
    load_checkpoint(dir) into a fresh engine, with no tag (the newest) or the given one, the
    optimizer state or not: its step counter and weights, against those of every save."""
    from dsconform.suite import rank

    before, after = _batches(case)
    a = build(case, case.seed)
    saved = []
    try:
        train(a, before, case.dtype)
        for i in range(1, saves + 1):
            if i > 1:
                train(a, after[i - 2:i - 1], case.dtype)
            a.save_checkpoint(ckpt_dir, tag=f"s{i}")
            saved.append({"tag": f"s{i}", "steps": a.global_steps, "params": final_params(a)})
    finally:
        _destroy(a)
    b = build(case, case.seed + 1)
    try:
        load_path, _ = b.load_checkpoint(ckpt_dir, tag=tag,
                                         load_optimizer_states=load_optimizer_states)
        loaded = {"steps": b.global_steps, "params": final_params(b)}
    finally:
        _destroy(b)
    return {"rank": rank(), "load_path": load_path, "saved": saved, "loaded": loaded}


def load_missing_latest(case: CkptCase, ckpt_dir: str, missing: str) -> dict[str, Any]:
    """Save one checkpoint, then point ``latest`` at the tag ``missing`` (a preempted save that
    wrote ``latest`` but not its tag, or a deleted tag): what load_checkpoint(dir) with no tag
    does with it, what DeepSpeed said about it (its exception or its log), and whether the fresh
    engine's weights stayed its own."""
    import logging

    from dsconform.suite import rank

    before, _ = _batches(case)
    a = build(case, case.seed)
    try:
        train(a, before, case.dtype)
        a.save_checkpoint(ckpt_dir, tag="s1")
    finally:
        _destroy(a)
    if rank() == 0:
        Path(ckpt_dir, "latest").write_text(missing)
    import torch.distributed as dist
    dist.barrier()
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    from deepspeed.utils import logger
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    b = build(case, case.seed + 1)
    try:
        fresh = final_params(b)
        raised, load_path = None, None
        try:
            load_path, _ = b.load_checkpoint(ckpt_dir)
        except Exception as e:
            raised = f"{type(e).__name__}: {e}"
        untouched = all(torch.equal(fresh[k], v) for k, v in final_params(b).items())
    finally:
        logger.removeHandler(handler)
        _destroy(b)
    return {"rank": rank(), "load_path": load_path, "raised": raised, "said": said,
            "untouched": untouched}
