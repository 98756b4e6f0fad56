"""Which profile a run is held to, and what kind of run this is (single node or a rendezvous)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dsconform import detect
from dsconform import profile as profiles
from dsconform.detect import NodeFacts
from dsconform.profile import Profile, ProfileError


@dataclass(frozen=True)
class Selection:
    profile: Profile
    node: NodeFacts
    how: str  # how the profile was chosen, for the report header


def matches(p: Profile, node: NodeFacts) -> bool:
    """A shipped profile describes this node type: the GPU count and model the *hardware* has
    (counted without torch), so a node whose torch lost GPUs still picks its real profile and
    then fails its promises."""
    if (p.gpu_count or 0) != node.gpus_present:
        return False
    if p.gpu_model:
        names = node.hardware.models or [g.name for g in node.gpus]
        if not names or not all(p.gpu_model.lower() in n.lower() for n in names):
            return False
    return True


#: Printed in the header and the summary whenever auto falls back to a detected profile.
DETECTED_WARNING = (
    "only 'what is here works' was checked: the detected profile promises what this node has "
    "now and sets no floors, so a slow or partly broken node can pass. Pass the profile of this "
    "node type: --profile NAME (shipped: {shipped}) or --profile PATH.toml "
    "(start from `dsconform detect > my-node.toml`, add measured floors)")


def auto_select(node: NodeFacts) -> tuple[Profile, str]:
    candidates = []
    for _name, path in profiles.shipped().items():
        p = profiles.load(path)  # a broken shipped profile is a bug: let it raise
        if matches(p, node):
            candidates.append(p)
    what = (f"{node.gpus_present}x {node.present_model or 'NVIDIA GPU'} present "
            f"({node.hardware.source if node.hardware.count else 'torch'}), "
            f"{node.gpu_count} usable" if node.is_gpu_node else "no GPUs")
    if len(candidates) == 1:
        p = candidates[0]
        return p, f"auto: node matches shipped {p.source} ({what})"
    data = detect.profile_data(node)
    p = profiles.from_data(data, "detected")
    why = ("several shipped profiles match: " + ", ".join(c.name for c in candidates)
           if candidates else f"no shipped profile matches ({what})")
    return p, f"auto: {why}; using the detected profile, which has no floors"


def is_detected(p: Profile) -> bool:
    return p.source == "detected"


def detected_warning() -> str:
    return DETECTED_WARNING.format(shipped=", ".join(profiles.shipped()) or "none")


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
