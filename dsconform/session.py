"""Which profile a run is held to, and what kind of run this is (single node or a rendezvous)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dsconform import detect, profile as profiles
from dsconform.detect import NodeFacts
from dsconform.profile import Profile, ProfileError


@dataclass(frozen=True)
class Selection:
    profile: Profile
    node: NodeFacts
    how: str  # how the profile was chosen, for the report header


def matches(p: Profile, node: NodeFacts) -> bool:
    """A shipped profile describes this node type: same GPU count and model (substring)."""
    if (p.gpu_count or 0) != node.gpu_count:
        return False
    if p.gpu_model and not all(p.gpu_model.lower() in g.name.lower() for g in node.gpus):
        return False
    return True


def auto_select(node: NodeFacts) -> tuple[Profile, str]:
    candidates = []
    for name, path in profiles.shipped().items():
        p = profiles.load(path)  # a broken shipped profile is a bug: let it raise
        if matches(p, node):
            candidates.append(p)
    if len(candidates) == 1:
        p = candidates[0]
        what = f"{node.gpu_count}x {node.gpu_model}" if node.gpus else "no GPUs"
        return p, f"auto: node matches shipped {p.source} ({what})"
    data = detect.profile_data(node)
    p = profiles.from_data(data, "detected")
    why = ("several shipped profiles match: " + ", ".join(c.name for c in candidates)
           if candidates else "no shipped profile matches")
    return p, f"auto: {why}; using the detected profile, which has no floors"


def select_profile(spec: str, node: NodeFacts | None = None) -> Selection:
    """Resolve --profile NAME|PATH|auto against a probe of this node. Raises ProfileError."""
    node = node or detect.probe()
    if spec == "auto":
        p, how = auto_select(node)
        return Selection(p, node, how)
    path = profiles.resolve(spec)
    if not path.exists():
        raise ProfileError([f"--profile {spec}: no such file"])
    return Selection(profiles.load(path), node, f"--profile {spec}")


def rendezvous_nodes(env: dict[str, str] | None = None) -> int:
    """How many nodes an already-provided rendezvous spans (1 when there is none).
    torchrun exports WORLD_SIZE and LOCAL_WORLD_SIZE; Slurm exports SLURM_NNODES."""
    env = os.environ if env is None else env
    try:
        if "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:
            return max(1, int(env["WORLD_SIZE"]) // max(1, int(env["LOCAL_WORLD_SIZE"])))
        if "SLURM_NNODES" in env and "MASTER_ADDR" in env:
            return max(1, int(env["SLURM_NNODES"]))
    except ValueError:
        pass
    return 1
