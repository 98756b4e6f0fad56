"""Which profile a run is held to, and what kind of run this is (a GPU or a CPU run; single
node or a rendezvous)."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dsconform.node import detect
from dsconform.node.detect import NodeFacts
from dsconform.profile import catalogue
from dsconform.profile import schema as profiles
from dsconform.profile.schema import Profile, ProfileError


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
    why = ("several shipped profiles match: " + ", ".join(c.name for c in candidates)
           if candidates else f"no shipped profile matches ({what})")
    data = detect.profile_data(node)
    ops = training_ops(node)
    if ops:
        data["deepspeed"] = {"ops": ops}
    promised = f"; it promises the ops training needs here: {', '.join(ops)}" if ops else ""
    model = catalogue.find(node.hardware.models or [g.name for g in node.gpus])
    if model is not None:
        data["gpus"]["catalogue"] = model.key
        data["profile"]["name"] = f"auto-{model.key}-x{node.gpus_present}"
        p = profiles.from_data(data, f"catalogue:{model.key}")
        return p, (f"auto: {why}; composed from the detected hardware and the GPU catalogue's "
                   f"entry {model.describe()}: its floors for matmul, HBM and host transfers"
                   f"{promised}")
    p = profiles.from_data(data, "detected")
    return p, f"auto: {why}; using the detected profile, which has no floors{promised}"


def training_ops(node: NodeFacts) -> list[str]:
    """The DeepSpeed ops training on this node needs, promised under auto: FusedAdam and CPU
    Adam (ZeRO-Offload) on a GPU node, async_io where libaio is there to build it (ZeRO-Infinity,
    DeepNVMe), gds where the nvidia-fs module is loaded. A CPU machine promises none: its
    profile (cpu-ci) names what CI builds."""
    if not node.is_gpu_node:
        return []
    ops = ["fused_adam", "cpu_adam"]
    if node.libaio:
        ops.append("async_io")
    if node.nvidia_fs:
        ops.append("gds")
    return ops


def is_detected(p: Profile) -> bool:
    return p.source == "detected"


def detected_warning() -> str:
    return DETECTED_WARNING.format(shipped=", ".join(profiles.shipped()) or "none")


def select_profile(spec: str, node: NodeFacts | None = None, *,
                   named: str | None = None) -> Selection:
    """Resolve --profile NAME|PATH|auto against a probe of this node. Raises ProfileError, naming
    the spec as ``named`` (default ``--profile SPEC``; DSCONFORM_PROFILE=SPEC from there)."""
    node = node or detect.probe()
    if spec == "auto":
        p, how = auto_select(node)
        return Selection(p, node, how)
    named = named or f"--profile {spec}"
    path = profiles.resolve(spec, named=named)
    if not path.exists():
        raise ProfileError([f"{named}: no such file"])
    return Selection(profiles.load(path), node, f"--profile {spec}")


def selects_gpu_tests(markexpr: str | None) -> bool:
    """Whether ``-m`` names the gpu mark other than as ``not gpu``: the GPU tiers (acceptance,
    nightly), which a node passes only on its GPUs."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None


def gpu_search(node: NodeFacts) -> str:
    """Where this node's GPUs were looked for and what each place said, in one line."""
    seen = node.hardware.seen
    nvml = seen.get("nvml", "not asked")
    return (f"NVML: {nvml if isinstance(nvml, str) else f'{nvml} GPUs'}; "
            f"/proc/driver/nvidia: {seen.get('/proc/driver/nvidia') or 'no GPU'}; "
            f"PCI: {seen.get('pci') or 'no NVIDIA GPU'}; torch: {node.gpu_count} CUDA devices")


@dataclass(frozen=True)
class RunKind:
    """What a run can say about the node: its GPUs (a GPU run) or only its CPU stack."""
    gpu: bool
    description: str            # one line, for the report header and the summary
    failure: str | None = None  # why the run cannot pass, known before any test runs


def run_kind(markexpr: str | None, node: NodeFacts) -> RunKind:
    """A GPU run where the node has GPUs and ``-m`` does not leave the GPU tests out; a CPU run
    otherwise. ``-m gpu`` (the acceptance tier) where no GPU is found fails: every GPU test would
    skip, and a node whose GPUs fell off the bus would pass it."""
    m = f"-m {shlex.quote(markexpr or '')}"
    if selects_gpu_tests(markexpr) and not node.is_gpu_node:
        return RunKind(False, f"GPU tier ({m}) on a node where no GPU is found: it fails",
                       f"no GPU found on this node ({gpu_search(node)}) but {m} asks for the "
                       "GPU acceptance tier")
    if not node.is_gpu_node:
        return RunKind(False, f"a CPU run: no GPU found on this node ({gpu_search(node)}); GPU "
                              "tests skip, so it says nothing about GPUs")
    if not selects_gpu_tests(markexpr) and re.search(r"\bnot gpu\b", markexpr or ""):
        return RunKind(False, f"a CPU run: {m} leaves the GPU tests out; the run says nothing "
                              f"about this node's {node.gpus_present} GPUs")
    return RunKind(True, f"a GPU run on this node's {node.gpus_present} GPUs"
                         + (f" ({m})" if markexpr else ""))


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


@dataclass(frozen=True)
class Rendezvous:
    """The job a launcher (torchrun, the DeepSpeed launcher, Slurm) made this process a rank of.
    ``job`` names the job the same way on every rank, so per-rank results can be grouped."""
    launcher: str         # "torchrun" or "slurm"
    job: str              # TORCHELASTIC_RUN_ID, SLURM_JOB_ID.SLURM_STEP_ID, else MASTER_ADDR:PORT
    world_size: int
    rank: int
    local_rank: int
    nodes: int
    node_rank: int | None  # torchrun's GROUP_RANK, Slurm's SLURM_NODEID

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rendezvous_info(env: Mapping[str, str] | None = None) -> Rendezvous | None:
    """This process's place in an already-provided rendezvous, or None outside one. Detected the
    way dsconform.harness.api.run_ranks detects it (torchrun or Slurm variables)."""
    from dsconform.harness.launcher import _SLURM_VARS, _TORCHRUN_VARS

    env = os.environ if env is None else env
    torchrun = all(v in env for v in _TORCHRUN_VARS)
    if not torchrun and not all(v in env for v in _SLURM_VARS):
        return None

    def number(*names: str) -> int | None:
        for name in names:
            value = env.get(name, "")
            if value.strip().isdigit():
                return int(value)
        return None

    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if env.get("SLURM_JOB_ID"):
        job = env["SLURM_JOB_ID"] + (f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID")
                                     else "")
    elif run_id and run_id != "none":  # torchrun's default when --rdzv-id is not given
        job = run_id
    else:
        job = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return Rendezvous(
        launcher="torchrun" if torchrun else "slurm", job=job,
        world_size=number("WORLD_SIZE", "SLURM_NTASKS") or 1,
        rank=number("RANK", "SLURM_PROCID") or 0,
        local_rank=number("LOCAL_RANK", "SLURM_LOCALID") or 0,
        nodes=rendezvous_nodes(env), node_rank=number("GROUP_RANK", "SLURM_NODEID"))
