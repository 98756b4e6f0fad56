"""The Kubernetes recipes (examples/k8s/*.yaml) MUST be valid objects of the Kubernetes API and
keep the suite's promises:

- strictly valid: every YAML document deserializes into the kubernetes client's model of its
  kind (V1Job, V1CronJob, V1Service, ...), which refuses a missing required field; and every
  key it holds is a field of that model, of the model's type, all the way down (the client
  drops unknown keys silently, as kubectl apply without server-side validation does: a
  misspelled ``tolerationz`` would never tolerate anything);
- one pod per GPU node: an Indexed Job (completions = parallelism) with a required pod
  anti-affinity on kubernetes.io/hostname, the nvidia.com/gpu toleration, a node selector and
  the same nvidia.com/gpu limit on every container;
- the hardware error gate (`dsconform health`) as an init container, /dev/shm from a memory
  emptyDir, the results on a volume mounted at /results, in a folder named after the node
  (NODE_NAME from spec.nodeName);
- the multi-node tier: a headless Service (clusterIP: None) named as the Job's pod subdomain,
  and torchrun's c10d rendezvous at ``<job>-0.<service>:<port>``; its command line is run for
  real (two torchrun agents on this host, gloo) and its results aggregated;
- the nightly report: the aggregate CronJob's script takes the newest run and fails a node that
  started and wrote nothing.

Needs the kubernetes client (``pip install -e '.[k8s]'``); CI installs it.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dsconform.harness.api import free_port

if os.environ.get("CI"):  # CI installs the [k8s] extra: never skip there
    import kubernetes
    import yaml
else:
    kubernetes = pytest.importorskip("kubernetes", reason="pip install -e '.[k8s]'")
    yaml = pytest.importorskip("yaml", reason="pip install -e '.[k8s]'")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "examples" / "k8s"
GPU = "nvidia.com/gpu"
HOSTNAME = "kubernetes.io/hostname"
#: The recipes whose pods run the suite on GPU nodes (the promises below hold for each);
#: aggregate-cronjob.yaml's pod only reads the results.
GPU_PODS = ("acceptance-job.yaml", "burn-in-job.yaml", "multinode-job.yaml",
            "nightly-cronjob.yaml")

_LIST = re.compile(r"^(?:List\[|list\[)(.+)\]$")
_DICT = re.compile(r"^(?:Dict\[str, |dict\(str, )(.+)[\])]$")
_OPTIONAL = re.compile(r"^Optional\[(.+)\]$")
_PRIMITIVE: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
    "datetime": (str,), "date": (str,), "bytes": (str,)}


# ------------------------------------------------------------------ strict schema

def documents() -> list[tuple[str, dict[str, Any]]]:
    """(FILE#N, document) for every YAML document of examples/k8s/."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.name}#{i}", doc))
    return out


def model_name(doc: dict[str, Any]) -> str:
    """batch/v1 Job -> V1Job."""
    return doc["apiVersion"].split("/")[-1].capitalize() + doc["kind"]


def schema_problems(data: Any, type_name: str, path: str) -> list[str]:
    """Every key of ``data`` that is not a field of the model ``type_name``, and every value
    not of its field's type, recursively (the models' attribute_map and openapi_types)."""
    if m := _OPTIONAL.match(type_name):
        type_name = m.group(1)
    if m := _LIST.match(type_name):
        if not isinstance(data, list):
            return [f"{path}: expected a list ({type_name}), got {type(data).__name__}"]
        return [p for i, item in enumerate(data)
                for p in schema_problems(item, m.group(1), f"{path}[{i}]")]
    if m := _DICT.match(type_name):
        if not isinstance(data, dict):
            return [f"{path}: expected a map ({type_name}), got {type(data).__name__}"]
        return [p for k, v in data.items() for p in schema_problems(v, m.group(1), f"{path}.{k}")]
    if type_name == "object":
        return []
    if type_name in _PRIMITIVE:
        ok = isinstance(data, _PRIMITIVE[type_name]) and not (
            type_name in ("int", "float") and isinstance(data, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {type(data).__name__} "
                              f"{data!r}"]
    model = getattr(kubernetes.client.models, type_name, None)
    if model is None:
        return [f"{path}: the client has no type {type_name!r}"]
    if not isinstance(data, dict):
        return [f"{path}: expected an object ({type_name}), got {type(data).__name__}"]
    fields = {json_key: attr for attr, json_key in model.attribute_map.items()}
    out = []
    for key, value in data.items():
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=1)
            out.append(f"{path}.{key}: not a field of {type_name}"
                       + (f" (did you mean {near[0]!r}?)" if near else ""))
        else:
            out += schema_problems(value, model.openapi_types[fields[key]], f"{path}.{key}")
    return out


def to_model(doc: dict[str, Any]) -> Any:
    """The client's model of ``doc``; raises on a missing required field or a bad value."""
    name = model_name(doc)
    model = getattr(kubernetes.client, name)
    if hasattr(model, "from_dict"):  # pydantic models (newer clients)
        return model.from_dict(doc)
    api = kubernetes.client.ApiClient()  # client_side_validation: required fields raise
    return api.deserialize(SimpleNamespace(data=json.dumps(doc)), name)


def strict_problems(where: str, doc: dict[str, Any]) -> list[str]:
    if not isinstance(doc, dict) or not {"apiVersion", "kind"} <= set(doc):
        return [f"{where}: not a Kubernetes object (no apiVersion and kind)"]
    name = model_name(doc)
    if getattr(kubernetes.client.models, name, None) is None:
        return [f"{where}: {doc['apiVersion']} {doc['kind']}: the client has no model {name}"]
    out = [f"{where}: {p}" for p in schema_problems(doc, name, doc["kind"])]
    try:
        to_model(doc)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        detail = " ".join(line.strip() for line in str(e).splitlines()[:3])
        out.append(f"{where}: {name} refuses it: {detail}")
    return out


# ------------------------------------------------------------------ the suite's promises

def pod_templates(doc: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(job spec, pod template) of a Job, or of a CronJob's job template."""
    if doc["kind"] == "Job":
        return [(doc["spec"], doc["spec"]["template"])]
    if doc["kind"] == "CronJob":
        spec = doc["spec"]["jobTemplate"]["spec"]
        return [(spec, spec["template"])]
    return []


def command_text(container: dict[str, Any]) -> str:
    return " ".join([*container.get("command", []), *container.get("args", [])])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def pod_problems(where: str, job: dict[str, Any], template: dict[str, Any]) -> list[str]:
    out = []
    pod = template["spec"]
    labels = template.get("metadata", {}).get("labels", {})
    if job.get("completionMode") != "Indexed" or job.get("completions") != job.get("parallelism"):
        out.append(f"{where}: not an Indexed Job with completions = parallelism (one pod per "
                   "node, all at once)")
    terms = (pod.get("affinity", {}).get("podAntiAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", []))
    if not any(t.get("topologyKey") == HOSTNAME and t.get("labelSelector", {}).get("matchLabels")
               and t["labelSelector"]["matchLabels"].items() <= labels.items() for t in terms):
        out.append(f"{where}: no required pod anti-affinity on {HOSTNAME} selecting its own pods "
                   "(two pods could share a node)")
    if not any(t.get("key") == GPU and t.get("effect") in (None, "NoSchedule")
               and t.get("operator") == "Exists" for t in pod.get("tolerations", [])):
        out.append(f"{where}: no toleration of the {GPU} NoSchedule taint")
    if not pod.get("nodeSelector"):
        out.append(f"{where}: no nodeSelector for the GPU nodes")
    containers = pod.get("initContainers", []) + pod.get("containers", [])
    gpus = {c["name"]: c.get("resources", {}).get("limits", {}).get(GPU) for c in containers}
    if None in gpus.values() or len(set(gpus.values())) != 1:
        out.append(f"{where}: every container must have the same {GPU} limit (all the node's "
                   f"GPUs): {gpus}")
    if not any(re.search(r"(^|\s)dsconform health(\s|$)", command_text(c))
               for c in pod.get("initContainers", [])):
        out.append(f"{where}: no init container runs `dsconform health`")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    main = pod["containers"][0]
    mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in main.get("volumeMounts", [])}
    if mounts.get("/dev/shm", {}).get("emptyDir", {}).get("medium") != "Memory":
        out.append(f"{where}: /dev/shm is not a memory emptyDir (NCCL needs it)")
    results = mounts.get("/results", {})
    if not ("hostPath" in results or "persistentVolumeClaim" in results):
        out.append(f"{where}: no hostPath or PVC volume mounted at /results")
    text = command_text(main)
    if not re.search(r"--results \"?/results/\S*(\$\(NODE_NAME\)|\$NODE_NAME)", text):
        out.append(f"{where}: the results folder is not /results/...<NODE_NAME>: {text!r}")
    if env_of(main).get("NODE_NAME") != {"fieldRef": {"fieldPath": "spec.nodeName"}}:
        out.append(f"{where}: NODE_NAME does not come from spec.nodeName (downward API)")
    if "--profile auto" not in text or not re.search(r"pytest suites(/\S+)? -m (gpu|multinode)",
                                                     text):
        out.append(f"{where}: the pod does not run `pytest suites -m gpu|multinode --profile "
                   f"auto`: {text!r}")
    return out


def multinode_problems(where: str, docs: list[dict[str, Any]]) -> list[str]:
    """The Job whose pods name a subdomain: its headless Service and torchrun's rendezvous."""
    out = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for job in (d for d in docs if d["kind"] == "Job"):
        pod = job["spec"]["template"]["spec"]
        subdomain = pod.get("subdomain")
        if subdomain is None:
            continue
        service = services.get(subdomain)
        if service is None:
            out.append(f"{where}: no Service named as the pod subdomain {subdomain!r}")
            continue
        if service["spec"].get("clusterIP") != "None":
            out.append(f"{where}: Service {subdomain} is not headless (clusterIP: None): its "
                       "pods get no DNS names")
        labels = job["spec"]["template"]["metadata"]["labels"]
        if not service["spec"].get("selector") or not (
                service["spec"]["selector"].items() <= labels.items()):
            out.append(f"{where}: Service {subdomain} does not select the Job's pods")
        ports = [p["port"] for p in service["spec"].get("ports", [])]
        main = pod["containers"][0]
        text = command_text(main)
        endpoint = re.search(r"--rdzv-endpoint=(\S+):(\d+)", text)
        expected = f"{job['metadata']['name']}-0.{subdomain}"
        if "--rdzv-backend=c10d" not in text or endpoint is None or (
                endpoint.group(1) != expected or int(endpoint.group(2)) not in ports):
            out.append(f"{where}: torchrun's rendezvous is not c10d at {expected}:{ports}: "
                       f"{endpoint and endpoint.group(0)}")
        env = env_of(main)
        if env.get("NNODES") != str(job["spec"].get("completions")):
            out.append(f"{where}: NNODES {env.get('NNODES')} != completions "
                       f"{job['spec'].get('completions')}")
        if env.get("GPUS_PER_NODE") != main["resources"]["limits"].get(GPU):
            out.append(f"{where}: GPUS_PER_NODE != the {GPU} limit")
        index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        if env.get("NODE_RANK") != {"fieldRef": {"fieldPath": index}}:
            out.append(f"{where}: NODE_RANK is not the completion index")
    return out


def all_problems(docs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    out = [p for where, doc in docs for p in strict_problems(where, doc)]
    if out:
        return out
    for where, doc in docs:
        if where.split("#")[0] in GPU_PODS:
            for job, template in pod_templates(doc):
                out += pod_problems(where, job, template)
    by_file: dict[str, list[dict[str, Any]]] = {}
    for where, doc in docs:
        by_file.setdefault(where.split("#")[0], []).append(doc)
    for name, file_docs in by_file.items():
        out += multinode_problems(name, file_docs)
    return out


def edited(name: str, change) -> list[tuple[str, dict[str, Any]]]:
    """Every document, with ``change(doc)`` applied to a copy of those of file ``name``."""
    docs = copy.deepcopy(documents())
    for where, doc in docs:
        if where.startswith(name + "#"):
            change(doc)
    return docs


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return pod_templates(doc)[0][1]["spec"]


# ------------------------------------------------------------------ tests

def test_every_manifest_is_strictly_valid_and_keeps_the_promises():
    docs = documents()
    kinds = sorted({(w.split("#")[0], d["kind"]) for w, d in docs})
    assert kinds == [("acceptance-job.yaml", "Job"), ("aggregate-cronjob.yaml", "CronJob"),
                     ("burn-in-job.yaml", "Job"), ("multinode-job.yaml", "Job"),
                     ("multinode-job.yaml", "Service"), ("nightly-cronjob.yaml", "CronJob"),
                     ("results-pvc.yaml", "PersistentVolumeClaim")]
    pods = [w for w, d in docs if pod_templates(d)]
    assert pods == ["acceptance-job.yaml#0", "aggregate-cronjob.yaml#0", "burn-in-job.yaml#0",
                    "multinode-job.yaml#1", "nightly-cronjob.yaml#0"]
    assert all_problems(docs) == []


def test_a_misspelled_key_is_refused():
    docs = edited("acceptance-job.yaml",
                  lambda d: d["spec"]["template"]["spec"].update(
                      tolerationz=d["spec"]["template"]["spec"].pop("tolerations")))
    problems = all_problems(docs)
    assert problems == ["acceptance-job.yaml#0: Job.spec.template.spec.tolerationz: not a field "
                        "of V1PodSpec (did you mean 'tolerations'?)"]
    # Deep inside too: a container's key.
    docs = edited("multinode-job.yaml", lambda d: d["kind"] == "Job" and pod_spec(d)[
        "containers"][0]["resources"].update(limitz={GPU: "8"}))
    assert ["not a field of V1ResourceRequirements" in p for p in all_problems(docs)] == [True]


def test_a_wrong_type_is_refused():
    docs = edited("acceptance-job.yaml", lambda d: d["spec"].update(completions="four"))
    problems = all_problems(docs)
    assert "acceptance-job.yaml#0: Job.spec.completions: expected int, got str 'four'" in problems
    # An unquoted number where the API wants a string (an env value, a quantity).
    docs = edited("nightly-cronjob.yaml", lambda d: pod_spec(d)["containers"][0][
        "resources"]["limits"].update({GPU: 8}))
    assert any(p.endswith(f"limits.{GPU}: expected str, got int 8") for p in all_problems(docs))
    docs = edited("multinode-job.yaml", lambda d: d["kind"] == "Service" and d["spec"].update(
        ports={"port": 29500}))
    assert any("Service.spec.ports: expected a list" in p for p in all_problems(docs))


def test_a_missing_required_field_is_refused():
    docs = edited("acceptance-job.yaml", lambda d: pod_spec(d)["containers"][0].pop("name"))
    problems = all_problems(docs)
    assert len(problems) == 1 and "V1Job refuses it" in problems[0], problems
    assert "name" in problems[0], problems


def test_a_service_that_is_not_headless_is_refused():
    docs = edited("multinode-job.yaml",
                  lambda d: d["kind"] == "Service" and d["spec"].pop("clusterIP"))
    assert all_problems(docs) == [
        "multinode-job.yaml: Service dsconform-multinode is not headless (clusterIP: None): its "
        "pods get no DNS names"]


@pytest.mark.parametrize("change, message", [
    (lambda d: d["kind"] == "Job" and pod_spec(d).update(subdomain="other"),
     "no Service named as the pod subdomain 'other'"),
    (lambda d: d["kind"] == "Service" and d["metadata"].update(name="other"),
     "no Service named as the pod subdomain 'dsconform-multinode'"),
    (lambda d: d["kind"] == "Job" and pod_spec(d)["containers"][0].update(args=[
        pod_spec(d)["containers"][0]["args"][0].replace(
            "=dsconform-multinode-0.dsconform-multinode:", "=dsconform-multinode-0.other:")]),
     "torchrun's rendezvous is not c10d at dsconform-multinode-0.dsconform-multinode"),
    (lambda d: d["kind"] == "Job" and d["spec"].update(completions=3),
     "not an Indexed Job with completions = parallelism"),
    (lambda d: d["kind"] == "Job" and d["spec"].update(completions=3, parallelism=3),
     "NNODES 2 != completions 3"),
])
def test_multinode_promises_are_checked(change, message):
    problems = all_problems(edited("multinode-job.yaml", change))
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("affinity"), "no required pod anti-affinity on kubernetes.io/hostname"),
    (lambda s: s["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"][0].update(topologyKey="zone"),
     "no required pod anti-affinity"),
    (lambda s: s.update(tolerations=[]), "no toleration of the nvidia.com/gpu NoSchedule taint"),
    (lambda s: s.pop("initContainers"), "no init container runs `dsconform health`"),
    (lambda s: s["initContainers"][0]["resources"]["limits"].update({GPU: "4"}),
     "the same nvidia.com/gpu limit"),
    (lambda s: s["containers"][0]["volumeMounts"].pop(), "/dev/shm is not a memory emptyDir"),
    (lambda s: s["volumes"][0].pop("hostPath") and s["volumes"][0].update(emptyDir={}),
     "no hostPath or PVC volume mounted at /results"),
    (lambda s: s["containers"][0]["env"].pop(0), "NODE_NAME does not come from spec.nodeName"),
    (lambda s: s["containers"][0].update(command=[
        c.replace("$(NODE_NAME)", "node") for c in s["containers"][0]["command"]]),
     "the results folder is not /results/...<NODE_NAME>"),
    (lambda s: s["containers"][0].update(command=[
        c.replace("gpu", "not gpu") for c in s["containers"][0]["command"]]),
     "does not run `pytest suites -m gpu"),
])
def test_acceptance_promises_are_checked(change, message):
    problems = all_problems(edited("acceptance-job.yaml", lambda d: change(pod_spec(d))))
    assert any(message in p for p in problems), problems


def test_the_aggregate_cronjob_reads_the_nightly_runs_and_prints_kubectl_commands():
    (cron,) = [d for w, d in documents() if w.startswith("aggregate-cronjob.yaml")]
    (nightly,) = [d for w, d in documents() if w.startswith("nightly-cronjob.yaml")]
    pod = pod_spec(cron)
    main = pod["containers"][0]
    assert "--scheduler k8s" in command_text(main)
    claims = {v["persistentVolumeClaim"]["claimName"] for d in (cron, nightly)
              for v in pod_spec(d)["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"dsconform-results"}
    assert "nvidia.com/gpu" not in json.dumps(pod)  # it needs no GPU


# ------------------------------------------------------------------ the commands, for real

def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args ($$ is a literal $)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def test_the_multinode_command_runs_two_ranks_that_join_one_job(tmp_path):
    """The Job's own command line (torchrun, c10d, is_host from NODE_RANK, one pytest per rank,
    the rank folders) as two pods would run it, on this host: the service name is localhost,
    one rank per "node" (gloo), and only MN-NODES-1 runs. Then aggregate reads the folders."""
    (job,) = [d for w, d in documents() if w.startswith("multinode-job.yaml")
              and d["kind"] == "Job"]
    main = pod_spec(job)["containers"][0]
    port = free_port()
    script = (main["args"][0]
              .replace("dsconform-multinode-0.dsconform-multinode", "localhost")
              .replace(":29500", f":{port}")
              .replace("/results/", f"{tmp_path}/results/")
              .replace("suites -m multinode",
                       "suites/test_multinode.py -m multinode -k test_ranks_span_the_nodes"))
    assert script.count("localhost") == 2 and script.count(str(tmp_path)) == 1, script
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PYTEST_", "RANK", "LOCAL_", "WORLD_", "MASTER_", "GROUP_",
                                 "TORCHELASTIC_", "SLURM_"))}
    manifest_env = {k: v for k, v in env_of(main).items() if isinstance(v, str)}
    agents = []
    for index in (0, 1):
        env = {**base, **manifest_env, **dict(
            GPUS_PER_NODE="1", DSCONFORM_TIME_S="400", NODE_RANK=str(index),
            NODE_NAME=f"gpu-k0{index}", JOB_NAME="dsconform-mn", PYTHONUNBUFFERED="1",
            DSCONFORM_HYPOTHESIS_DIR=str(tmp_path / "hypothesis"),
            # two pods have two hostnames; on one host the ranks are told theirs
            SLURMD_NODENAME=f"pod{index}")}
        argv = [expand(a, env) for a in main["command"]] + [expand(script, env)]
        log = open(tmp_path / f"agent{index}.log", "w")  # closed below
        agents.append((subprocess.Popen(argv, cwd=REPO, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True), log))
    try:
        codes = [agent.wait(timeout=480) for agent, _ in agents]
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
                agent.wait()
            log.close()
    logs = "\n".join((tmp_path / f"agent{i}.log").read_text()[-3000:] for i in (0, 1))
    assert codes == [0, 0], logs
    results = tmp_path / "results" / "dsconform-mn" / "multinode"
    folders = sorted(p.name for p in results.iterdir())
    assert sorted(f.split("-rank")[0] for f in folders) == ["gpu-k00", "gpu-k01"], folders
    assert sorted(f.split("-rank")[1] for f in folders) == ["0", "1"], folders
    for folder in folders:
        summ = json.loads((results / folder / "summary.json").read_text())
        assert summ["capabilities"]["multinode"] == {"passed": 1}, (summ, logs)
        assert summ["rendezvous"]["job"] == "dsconform-mn" and summ["rendezvous"]["nodes"] == 2
    proc = subprocess.run([sys.executable, "-m", "dsconform.cli", "aggregate", str(results),
                           "--scheduler", "k8s", "--no-plot", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "multi-node job dsconform-mn: 2 nodes, world size 2, 2 rank folder(s): passed" \
        in proc.stdout and "kubectl" not in proc.stdout


def test_the_acceptance_command_writes_the_node_folder(tmp_path):
    """The acceptance pod's command, $(VAR)s expanded as Kubernetes does, on this CPU machine:
    every GPU test skips with its reason, the run fails (exit 1: no GPU found, and -m gpu asks
    for the GPU tier) and the results land in /results/<node>."""
    (job,) = [d for w, d in documents() if w.startswith("acceptance-job.yaml")]
    main = pod_spec(job)["containers"][0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MASTER_"))}
    env.update({k: v for k, v in env_of(main).items() if isinstance(v, str)},
               NODE_NAME="gpu-k01", DSCONFORM_TIME_S="300")
    argv = [expand(a, env).replace("/results/", f"{tmp_path}/results/") for a in main["command"]]
    argv = [a if a != "/scratch" else str(tmp_path) for a in argv]
    assert argv[:6] == ["timeout", "-s", "INT", "-k", "120", "300"], argv
    # suites/test_profile.py alone: the collection of every suite is not what is tested here
    argv[argv.index("suites")] = "suites/test_profile.py"
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summ = json.loads((tmp_path / "results" / "gpu-k01" / "summary.json").read_text())
    assert summ["exitstatus"] == 1 and summ["capabilities"], summ
    assert summ["reason"].startswith("no GPU found on this node"), summ["reason"]
    assert shlex.join(argv).count("--results") == 1


def test_the_aggregate_command_fails_a_node_that_started_and_wrote_nothing(tmp_path):
    """aggregate-cronjob.yaml's script over a nightly run folder: the newest run is taken, a
    node whose pod started (expected/) without a results folder fails, and its kubectl
    commands are printed."""
    from tests.results.test_aggregate import good

    (cron,) = [d for w, d in documents() if w.startswith("aggregate-cronjob.yaml")]
    main = pod_spec(cron)["containers"][0]
    script = main["args"][0].replace("/results/", f"{tmp_path}/results/")
    for run in ("dsconform-nightly-900", "dsconform-nightly-29000000"):  # the newest: last
        good(tmp_path / "results" / run / "single" / "gpu-a01")
        (tmp_path / "results" / run / "expected").mkdir()
        for node in ("gpu-a01", "gpu-a02"):
            (tmp_path / "results" / run / "expected" / node).touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update({k: v for k, v in env_of(main).items() if isinstance(v, str)},
               EXPECT="gpu-a03")
    proc = subprocess.run([*main["command"], script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    newest = tmp_path / "results" / "dsconform-nightly-29000000"
    assert f"dsconform-aggregate: {newest} (expected: gpu-a03,gpu-a01,gpu-a02)" in proc.stdout
    lines = proc.stdout.splitlines()
    for node in ("gpu-a02", "gpu-a03"):
        assert f"kubectl cordon {node}" in lines
        assert (f"kubectl label nodes {node} dsconform/verdict=failed dsconform/reason=no-results"
                " --overwrite") in lines
    assert "kubectl cordon gpu-a01" not in lines
    assert (newest / "cluster" / "cluster.json").is_file()
