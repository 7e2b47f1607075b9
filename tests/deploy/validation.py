"""Offline validation of Kubernetes manifests, as strict as the API server where it can be.

- ray.io/v1 kinds (RayCluster, RayJob, RayService): the KubeRay CRDs' `openAPIV3Schema` from
  ../shared/kuberay-crds/, after dropping nulls and filling schema defaults (as the API server
  does), with unknown fields refused (additionalProperties: false wherever the schema lists
  properties and does not keep unknown fields), like `kubectl apply --validate=strict`. Every
  embedded pod template is also checked against Kubernetes' own strict PodTemplateSpec schema.
- Everything else (Service, Ingress, Secret, Deployment, StatefulSet, ConfigMap, PVC): Kubernetes'
  own JSON schemas from the `kubernetes-validate` package, strict mode.

The CRDs' CEL rules and the operator's own checks are not in these schemas: `kuberay_rules`
checks the ones these manifests rely on.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO.parent / "shared" / "kuberay-crds"
K8S_VERSION = "1.32.0"  # a widely deployed Kubernetes; the schemas of the newest <= this are used
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}


class ManifestError(AssertionError):
    """A manifest that the API server (or KubeRay) would refuse; the message names the object and field."""


def load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def load_file(path: Path) -> list[dict[str, Any]]:
    return load_docs(path.read_text(encoding="utf-8"))


def crd_dir() -> Path:
    if not CRD_DIR.is_dir():
        raise FileNotFoundError(f"the KubeRay CRDs are expected in {CRD_DIR} (shared/kuberay-crds)")
    return CRD_DIR


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The v1 openAPIV3Schema of a KubeRay kind, as served by the API server."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 1-1.4 MB each
    doc = yaml.load((crd_dir() / CRD_FILES[kind]).read_text(encoding="utf-8"), Loader=loader)
    for v in doc["spec"]["versions"]:
        if v["name"] == "v1":
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{kind} CRD has no v1 version")


def _strict(schema: Any) -> Any:
    """Refuse unknown fields wherever the schema lists properties and does not preserve unknowns."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def strict_crd_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = _strict(crd_schema(kind))
    # The CRD's top-level metadata is only {type: object}; the API server checks it as ObjectMeta.
    return jsonschema.Draft7Validator(schema)


def drop_nulls(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [drop_nulls(v) for v in x]
    return x


def fill_defaults(schema: dict[str, Any], x: Any) -> Any:
    """Apply the schema's `default`s to absent fields, recursively, as the API server does."""
    if isinstance(x, dict):
        props = schema.get("properties") or {}
        out = dict(x)
        for name, sub in props.items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
        for name, value in list(out.items()):
            if name in props:
                out[name] = fill_defaults(props[name], value)
            elif isinstance(schema.get("additionalProperties"), dict):
                out[name] = fill_defaults(schema["additionalProperties"], value)
        return out
    if isinstance(x, list) and isinstance(schema.get("items"), dict):
        return [fill_defaults(schema["items"], v) for v in x]
    return x


def _where(err: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top level)"


def name_of(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, template) of every pod template inside a KubeRay object."""
    spec = doc.get("spec") or {}
    clusters: list[tuple[str, dict[str, Any]]] = []
    if doc["kind"] == "RayCluster":
        clusters.append(("spec", spec))
    elif doc["kind"] == "RayJob":
        if "rayClusterSpec" in spec:
            clusters.append(("spec.rayClusterSpec", spec["rayClusterSpec"]))
        if "submitterPodTemplate" in spec:
            yield "spec.submitterPodTemplate", spec["submitterPodTemplate"]
    elif doc["kind"] == "RayService" and "rayClusterConfig" in spec:
        clusters.append(("spec.rayClusterConfig", spec["rayClusterConfig"]))
    for path, c in clusters:
        if "template" in (c.get("headGroupSpec") or {}):
            yield f"{path}.headGroupSpec.template", c["headGroupSpec"]["template"]
        for i, g in enumerate(c.get("workerGroupSpecs") or []):
            if "template" in g:
                yield f"{path}.workerGroupSpecs.{i}.template", g["template"]


def validate_k8s(doc: dict[str, Any]) -> None:
    """Kubernetes' own strict schema for a built-in kind."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise ManifestError(f"{name_of(doc)}: {_where(e)}: {e.message[:300]}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        raise ManifestError(f"{name_of(doc)}: no Kubernetes {K8S_VERSION} schema for this kind ({e})") from None


def validate_crd(doc: dict[str, Any]) -> dict[str, Any]:
    """A KubeRay object against its CRD (defaults filled, nulls dropped, unknown fields refused);
    returns the object as the API server would store it."""
    kind = doc["kind"]
    stored = fill_defaults(crd_schema(kind), drop_nulls(doc))
    errors = sorted(strict_crd_validator(kind).iter_errors(stored), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{_where(e)}: {e.message[:300]}" for e in errors[:10]]
        raise ManifestError(f"{name_of(doc)} does not match the KubeRay {kind} CRD:\n  " + "\n  ".join(lines))
    meta = doc.get("metadata") or {}
    validate_k8s({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta})  # ObjectMeta, strictly
    for path, tpl in pod_templates(doc):
        try:
            validate_k8s({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl})
        except ManifestError as e:
            raise ManifestError(f"{name_of(doc)}: {path}: {str(e).split(': ', 1)[1]}") from None
    return stored


def validate_doc(doc: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        raise ManifestError(f"not a Kubernetes object (needs apiVersion and kind): {json.dumps(doc)[:120]}")
    if doc["apiVersion"] == "ray.io/v1":
        if doc["kind"] not in CRD_FILES:
            raise ManifestError(f"{name_of(doc)}: ray.io/v1 has no kind {doc['kind']!r}")
        return validate_crd(doc)
    if doc["apiVersion"].startswith("ray.io/"):
        raise ManifestError(f"{name_of(doc)}: use apiVersion ray.io/v1 (the CRDs serve v1), not {doc['apiVersion']}")
    validate_k8s(doc)
    return doc


# ---- KubeRay's own rules (CEL rules and operator checks) that these manifests rely on ----

def _containers(tpl: dict[str, Any]) -> list[dict[str, Any]]:
    return list(((tpl.get("spec") or {}).get("containers")) or [])


def _gpu_limit(c: dict[str, Any]) -> int:
    return int(str(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0)))


def _cluster_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = doc.get("spec") or {}
    if doc["kind"] == "RayCluster":
        return [("spec", spec)]
    if doc["kind"] == "RayJob" and "rayClusterSpec" in spec:
        return [("spec.rayClusterSpec", spec["rayClusterSpec"])]
    if doc["kind"] == "RayService" and "rayClusterConfig" in spec:
        return [("spec.rayClusterConfig", spec["rayClusterConfig"])]
    return []


def kuberay_rules(doc: dict[str, Any]) -> None:
    """Rules outside the CRD schema: replica bounds, unique group names, GPUs declared through
    container limits (never --num-gpus) with a toleration for the nvidia.com/gpu taint, extended
    resources with requests == limits, and a Ray start command wherever the generated one is replaced."""
    if doc.get("apiVersion") != "ray.io/v1":
        return
    overwrite = ((doc.get("metadata") or {}).get("annotations") or {}).get("ray.io/overwrite-container-cmd") == "true"
    for path, c in _cluster_specs(doc):
        groups = [("headGroupSpec", c.get("headGroupSpec") or {})]
        groups += [(f"workerGroupSpecs.{i}", g) for i, g in enumerate(c.get("workerGroupSpecs") or [])]
        names = [g.get("groupName") for _, g in groups[1:]]
        if len(set(names)) != len(names):
            raise ManifestError(f"{name_of(doc)}: {path}.workerGroupSpecs: groupName must be unique, got {names}")
        for gpath, g in groups:
            where = f"{name_of(doc)}: {path}.{gpath}"
            params = g.get("rayStartParams") or {}
            if "num-gpus" in params or "num_gpus" in params:
                raise ManifestError(f"{where}.rayStartParams: do not set num-gpus; Ray reads the GPUs from the "
                                    "container's nvidia.com/gpu limit")
            for k, v in params.items():
                if not isinstance(v, str):
                    raise ManifestError(f"{where}.rayStartParams.{k}: values must be strings (quote {v!r})")
            if "resources" in params:
                try:  # KubeRay passes it to `ray start --resources=...` as a quoted JSON object
                    res = json.loads(json.loads(params["resources"]))
                    assert isinstance(res, dict) and all(isinstance(x, int | float) for x in res.values())
                except (ValueError, TypeError, AssertionError):
                    raise ManifestError(f"{where}.rayStartParams.resources: write it as a JSON object inside "
                                        "double quotes, e.g. '\"{\\\"name\\\": 1}\"' in YAML") from None
            if gpath != "headGroupSpec":
                lo, hi, n = g.get("minReplicas", 0), g.get("maxReplicas"), g.get("replicas", g.get("minReplicas", 0))
                if hi is not None and not lo <= n <= hi:
                    raise ManifestError(f"{where}: need minReplicas <= replicas <= maxReplicas, got {lo}, {n}, {hi}")
            tpl = g.get("template") or {}
            containers = _containers(tpl)
            if not containers:
                raise ManifestError(f"{where}.template.spec.containers: the Ray container must be the first")
            for i, ctr in enumerate(containers):
                res = ctr.get("resources") or {}
                for k, v in (res.get("requests") or {}).items():
                    if "/" in k and "kubernetes.io" not in k and str(v) != str((res.get("limits") or {}).get(k)):
                        raise ManifestError(f"{where}.template.spec.containers.{i}.resources: extended resource "
                                            f"{k} needs requests == limits")
            ray_ctr = containers[0]
            if _gpu_limit(ray_ctr) > 0:
                tols = (tpl.get("spec") or {}).get("tolerations") or []
                if not any(t.get("key") == "nvidia.com/gpu" and t.get("effect") in ("NoSchedule", None)
                           and t.get("operator", "Equal") in ("Exists", "Equal") for t in tols):
                    raise ManifestError(f"{where}.template.spec.tolerations: a GPU group needs a toleration for "
                                        "the nvidia.com/gpu taint (key nvidia.com/gpu, operator Exists, effect NoSchedule)")
            if overwrite:
                cmd = " ".join((ray_ctr.get("command") or []) + (ray_ctr.get("args") or []))
                if "$KUBERAY_GEN_RAY_START_CMD" not in cmd and "ray start" not in cmd:
                    raise ManifestError(f"{where}: with ray.io/overwrite-container-cmd the container must run "
                                        "$KUBERAY_GEN_RAY_START_CMD (or its own ray start)")
        autoscale = [g for _, g in groups[1:] if g.get("minReplicas", 0) != g.get("maxReplicas", 0)]
        if autoscale and not c.get("enableInTreeAutoscaling"):
            raise ManifestError(f"{name_of(doc)}: {path}: worker groups have minReplicas < maxReplicas but "
                                "enableInTreeAutoscaling is off: nothing would scale them")


def validate_all(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Schema-validate and rule-check every object; returns them as stored."""
    out = []
    for d in docs:
        out.append(validate_doc(d))
        kuberay_rules(d)
    return out


# ---- references between objects (a Secret key, a ConfigMap, a Service) ----

def _walk(x: Any) -> Iterator[dict[str, Any]]:
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v)


def check_references(docs: list[dict[str, Any]]) -> None:
    """Every Secret/ConfigMap key, envFrom source, volume and Service backend named exists in `docs`."""
    secrets = {d["metadata"]["name"]: set((d.get("stringData") or {}) | (d.get("data") or {}))
               for d in docs if d["kind"] == "Secret"}
    configmaps = {d["metadata"]["name"]: set(d.get("data") or {}) for d in docs if d["kind"] == "ConfigMap"}
    services = {d["metadata"]["name"]: {p["port"] for p in d["spec"]["ports"]} for d in docs if d["kind"] == "Service"}
    pvcs = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for d in docs:
        who = name_of(d)
        for node in _walk(d):
            if "secretKeyRef" in node:
                ref = node["secretKeyRef"]
                if ref["key"] not in secrets.get(ref.get("name", ""), set()):
                    raise ManifestError(f"{who}: secret {ref.get('name')!r} key {ref['key']!r} is not defined")
            if "configMapKeyRef" in node:
                ref = node["configMapKeyRef"]
                if ref["key"] not in configmaps.get(ref.get("name", ""), set()):
                    raise ManifestError(f"{who}: configmap {ref.get('name')!r} key {ref['key']!r} is not defined")
            if "secretRef" in node and "name" in node["secretRef"] and node["secretRef"]["name"] not in secrets:
                raise ManifestError(f"{who}: envFrom secret {node['secretRef']['name']!r} is not defined")
            if isinstance(node.get("configMap"), dict) and node["configMap"].get("name") not in configmaps:
                raise ManifestError(f"{who}: volume configmap {node['configMap'].get('name')!r} is not defined")
            if isinstance(node.get("persistentVolumeClaim"), dict) and node["persistentVolumeClaim"]["claimName"] not in pvcs:
                raise ManifestError(f"{who}: PVC {node['persistentVolumeClaim']['claimName']!r} is not defined")
            if isinstance(node.get("service"), dict) and "port" in node["service"] and d["kind"] == "Ingress":
                svc = node["service"]
                if svc["port"].get("number") not in services.get(svc["name"], set()):
                    raise ManifestError(f"{who}: backend service {svc['name']}:{svc['port']} is not defined")
