"""Every manifest under deploy/kuberay validates (KubeRay CRDs, Kubernetes' strict schemas, KubeRay's
own rules, references between objects), and the validation refuses broken copies of them."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.spec import parse_spec
from tests.deploy.validation import (
    REPO,
    ManifestError,
    check_references,
    load_file,
    validate_all,
)

KUBERAY = REPO / "deploy" / "kuberay"
SHARED = ["secrets.yaml", "redis.yaml", "postgres.yaml"]  # what every deployment applies
FILES = sorted(p.name for p in KUBERAY.glob("*.yaml"))


def docs_of(*names: str) -> list[dict[str, Any]]:
    return [d for n in names for d in load_file(KUBERAY / n)]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    for d in docs:
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name):
            return d
    raise KeyError(f"{kind}/{name}")


def test_the_expected_manifests_exist() -> None:
    assert {"raycluster.yaml", "rayjob.yaml", "api.yaml", "api-deployment.yaml", *SHARED} <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_manifest_validates(name: str) -> None:
    docs = load_file(KUBERAY / name)
    assert docs, f"{name} is empty"
    validate_all(docs)


@pytest.mark.parametrize("main", [["raycluster.yaml", "api.yaml"], ["api-deployment.yaml"], ["rayjob.yaml"]])
def test_each_deployment_is_complete(main: list[str]) -> None:
    """Every Secret key, ConfigMap, PVC and Service a deployment names is defined by its files."""
    check_references(docs_of(*SHARED, *main))


def test_cluster_shape() -> None:
    rc = find(docs_of("raycluster.yaml"), "RayCluster")
    stored = validate_all([rc])[0]
    spec = stored["spec"]
    # GCS fault tolerance through the Redis Service of redis.yaml, password from the Secret
    redis_svc = find(docs_of("redis.yaml"), "Service")
    host, port = spec["gcsFaultToleranceOptions"]["redisAddress"].split(":")
    assert host == redis_svc["metadata"]["name"] and int(port) == redis_svc["spec"]["ports"][0]["port"]
    assert spec["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    # the head runs the control plane next to `ray start`, and no Ray work
    head = spec["headGroupSpec"]
    script = " ".join(head["template"]["spec"]["containers"][0]["args"])
    assert "unbroken serve --address auto" in script and "$KUBERAY_GEN_RAY_START_CMD" in script
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in str(head["template"]["spec"]["containers"][0]["resources"])
    # supervisors go to the CPU group: it carries the resource service/supervisor.py asks for
    from checkpointing.keeper import CONTROL_RESOURCE

    cpu = spec["workerGroupSpecs"][0]
    assert cpu["groupName"] == "cpu" and cpu["minReplicas"] >= 1
    assert json.loads(json.loads(cpu["rayStartParams"]["resources"])) == {CONTROL_RESOURCE: 1}
    # an autoscaled GPU group
    gpu = [g for g in spec["workerGroupSpecs"] if "nvidia.com/gpu" in str(g["template"]["spec"]["containers"][0])]
    assert gpu and spec["enableInTreeAutoscaling"] is True
    assert all(g["minReplicas"] < g["maxReplicas"] for g in gpu)
    # the API Service reaches the head pod (KubeRay's labels) on the port `unbroken serve` binds
    svc = find(docs_of("api.yaml"), "Service")
    assert svc["spec"]["selector"] == {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
    assert f"--port {svc['spec']['ports'][0]['targetPort']}" in script


def test_rayjob_runs_its_job_file_and_the_job_file_is_a_valid_spec() -> None:
    docs = docs_of("rayjob.yaml")
    job = find(docs, "RayJob")
    cm = find(docs, "ConfigMap")
    entry = job["spec"]["entrypoint"].split()
    assert entry[:2] == ["unbroken", "run"]
    mount = next(m for m in job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
                 ["volumeMounts"] if m["name"] == "job")
    path = Path(entry[2])
    assert str(path.parent) == mount["mountPath"] and path.name in cm["data"]
    spec = parse_spec(cm["data"][path.name])  # the service's own validation of a job file
    assert spec.checkpoint.uri.startswith("s3://") and spec.resources.gpus_per_worker == 1
    assert job["spec"]["shutdownAfterJobFinishes"] is True


# ---- the validation must refuse broken manifests ----

def _keys(path: str) -> list[str | int]:
    """a.0.b -> ["a", 0, "b"]; a key with dots is written in brackets: limits.[nvidia.com/gpu]."""
    out: list[str | int] = []
    for part in path.replace("[", "\0").replace("]", "\0").split("\0"):
        if not part:
            continue
        if "/" in part:
            out.append(part)
        else:
            out += [int(k) if k.isdigit() else k for k in part.strip(".").split(".")]
    return out


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        node: Any = doc
        keys = _keys(path)
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return mutate


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        node: Any = doc
        keys = _keys(path)
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]
    return mutate


GPU = "spec.workerGroupSpecs.1"
HEAD_CTR = "spec.headGroupSpec.template.spec.containers.0"
BROKEN: list[tuple[str, str, str, Callable[[dict[str, Any]], None], str]] = [
    # (file, kind, case, mutation, expected words in the error)
    ("raycluster.yaml", "RayCluster", "replicas not an integer", _set(f"{GPU}.replicas", "two"), "replicas"),
    ("raycluster.yaml", "RayCluster", "missing worker groupName", _delete(f"{GPU}.groupName"), "groupName"),
    ("raycluster.yaml", "RayCluster", "missing head template", _delete("spec.headGroupSpec.template"), "template"),
    ("raycluster.yaml", "RayCluster", "unknown spec field", _set("spec.workerGroupSpec", []), "workerGroupSpec"),
    ("raycluster.yaml", "RayCluster", "redisAddress not a string", _set("spec.gcsFaultToleranceOptions.redisAddress",
                                                                         6379), "redisAddress"),
    ("raycluster.yaml", "RayCluster", "bad enum", _set("spec.autoscalerOptions.upscalingMode", "Fast"), "Fast"),
    ("raycluster.yaml", "RayCluster", "container without a name", _delete(f"{HEAD_CTR}.name"), "name"),
    ("raycluster.yaml", "RayCluster", "unknown container field", _set(f"{HEAD_CTR}.cmd", ["x"]), "cmd"),
    ("raycluster.yaml", "RayCluster", "port not an integer", _set(f"{HEAD_CTR}.ports.0.containerPort", "6379"),
     "containerPort"),
    ("raycluster.yaml", "RayCluster", "num-gpus in rayStartParams", _set(f"{GPU}.rayStartParams", {"num-gpus": "8"}),
     "num-gpus"),
    ("raycluster.yaml", "RayCluster", "GPU group without toleration", _delete(f"{GPU}.template.spec.tolerations"),
     "toleration"),
    ("raycluster.yaml", "RayCluster", "GPU requests != limits",
     _set(f"{GPU}.template.spec.containers.0.resources.requests.[nvidia.com/gpu]", "4"), "requests == limits"),
    ("raycluster.yaml", "RayCluster", "replicas above max", _set(f"{GPU}.replicas", 99), "maxReplicas"),
    ("raycluster.yaml", "RayCluster", "rayStartParams value not a string",
     _set("spec.headGroupSpec.rayStartParams.num-cpus", 0), "num-cpus"),
    ("raycluster.yaml", "RayCluster", "overwritten command without ray start",
     _set(f"{GPU}.template.spec.containers.0.args", ["sleep infinity"]), "KUBERAY_GEN_RAY_START_CMD"),
    ("raycluster.yaml", "RayCluster", "resources not quoted JSON",
     _set("spec.workerGroupSpecs.0.rayStartParams.resources", '{"unbroken_control": 1}'), "resources"),
    ("raycluster.yaml", "RayCluster", "old apiVersion", _set("apiVersion", "ray.io/v1alpha1"), "ray.io/v1"),
    ("rayjob.yaml", "RayJob", "entrypoint not a string", _set("spec.entrypoint", ["unbroken", "run"]), "entrypoint"),
    ("rayjob.yaml", "RayJob", "shutdown flag not a boolean", _set("spec.shutdownAfterJobFinishes", "yes"),
     "shutdownAfterJobFinishes"),
    ("rayjob.yaml", "RayJob", "worker group of the job's cluster without groupName",
     _delete("spec.rayClusterSpec.workerGroupSpecs.0.groupName"), "groupName"),
    ("rayjob.yaml", "RayJob", "job cluster's GPU container with an unknown field",
     _set("spec.rayClusterSpec.workerGroupSpecs.0.template.spec.containers.0.gpus", 1), "gpus"),
    ("api.yaml", "Service", "service port as a name", _set("spec.ports.0.port", "http"), "port"),
    ("api.yaml", "Ingress", "ingress path without pathType", _delete("spec.rules.0.http.paths.0.pathType"),
     "pathType"),
    ("api.yaml", "Ingress", "unknown ingress field", _set("spec.rules.0.hosts", ["x"]), "hosts"),
    ("secrets.yaml", "Secret", "secret value not a string", _set("stringData.redis-password", 12345), "redis-password"),
    ("redis.yaml", "Deployment", "deployment without selector", _delete("spec.selector"), "selector"),
    ("redis.yaml", "Deployment", "replicas not an integer", _set("spec.replicas", "1"), "replicas"),
    ("postgres.yaml", "StatefulSet", "env entry without name", _delete("spec.template.spec.containers.0.env.0.name"),
     "name"),
    ("api-deployment.yaml", "Deployment", "probe port of wrong type",
     _set("spec.template.spec.containers.0.readinessProbe.httpGet.port", ["http"]), "port"),
]


@pytest.mark.parametrize("file,kind,case,mutate,words", BROKEN, ids=[b[2] for b in BROKEN])
def test_validation_refuses(file: str, kind: str, case: str, mutate: Callable[[dict[str, Any]], None],
                            words: str) -> None:
    doc = copy.deepcopy(find(docs_of(file), kind))
    validate_all([doc])  # the original is fine
    mutate(doc)
    with pytest.raises(ManifestError) as e:
        validate_all([doc])
    assert words in str(e.value), str(e.value)


def test_references_are_checked() -> None:
    docs = copy.deepcopy(docs_of(*SHARED, "raycluster.yaml", "api.yaml"))
    secret = find(docs, "Secret", "unbroken-secrets")
    del secret["stringData"]["db-url"]
    with pytest.raises(ManifestError, match="db-url"):
        check_references(docs)
    docs = copy.deepcopy(docs_of(*SHARED, "raycluster.yaml", "api.yaml"))
    find(docs, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"]["number"] = 80
    with pytest.raises(ManifestError, match="backend service"):
        check_references(docs)
