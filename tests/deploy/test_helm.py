"""The Helm chart: its values files satisfy values.schema.json (as `helm install` checks), and every
rendering (default values, the example values) validates like the plain manifests. Rendered with
tests/deploy/helm_render.py (no helm binary here); where `helm` is on PATH its output must match."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from service.spec import parse_spec
from tests.deploy.helm_render import TemplateError, chart_values, parse, render_chart
from tests.deploy.validation import REPO, ManifestError, check_references, load_docs, validate_all

CHART = REPO / "deploy" / "helm" / "unbroken"
EXAMPLE = CHART / "values-example.yaml"
SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))

# What docs/deploy.md tells users to create when secrets.create is false (names for release "unbroken").
USER_SECRETS: list[dict[str, Any]] = [
    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "unbroken-secrets"},
     "stringData": {"redis-password": "x", "postgres-password": "x", "db-url": "x"}},
    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "unbroken-s3"},
     "stringData": {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}},
    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "unbroken-api-token"},
     "stringData": {"UNBROKEN_URL": "x", "UNBROKEN_TOKEN": "x"}},
]


def rendered_docs(values_files: list[Path], overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = render_chart(CHART, values_files, overrides=overrides)
    return [d for text in out.values() for d in load_docs(text)]


def check_values(values_files: list[Path], overrides: dict[str, Any] | None = None) -> None:
    jsonschema.validate(chart_values(CHART, values_files, overrides), SCHEMA)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", [[], [EXAMPLE]], ids=["default", "example"])
def test_values_match_schema(values: list[Path]) -> None:
    check_values(values)


@pytest.mark.parametrize("values", [[], [EXAMPLE]], ids=["default", "example"])
def test_rendering_validates(values: list[Path]) -> None:
    docs = rendered_docs(values)
    validate_all(docs)
    created = chart_values(CHART, values)["secrets"]["create"]
    check_references(docs + ([] if created else USER_SECRETS))
    rc = by_kind(docs, "RayCluster")
    assert len(rc) == 1 and rc[0]["spec"]["gcsFaultToleranceOptions"]["redisAddress"] == "unbroken-redis:6379"


def test_default_rendering_is_a_small_complete_install() -> None:
    docs = rendered_docs([])
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert kinds == sorted([
        "RayCluster/unbroken", "Service/unbroken-api", "Secret/unbroken-secrets", "Secret/unbroken-s3",
        "PersistentVolumeClaim/unbroken-redis-data", "Deployment/unbroken-redis", "Service/unbroken-redis",
        "StatefulSet/unbroken-postgres", "Service/unbroken-postgres",
    ])
    gpu = by_kind(docs, "RayCluster")[0]["spec"]["workerGroupSpecs"][1]
    assert gpu["replicas"] == 0 and gpu["minReplicas"] == 0  # no GPU bill until a job needs one
    secret = next(d for d in docs if d["metadata"]["name"] == "unbroken-secrets")
    assert secret["stringData"]["db-url"] == "postgresql+psycopg://unbroken:change-me-postgres@unbroken-postgres:5432/unbroken"


def test_example_values_reach_the_manifests() -> None:
    docs = rendered_docs([EXAMPLE])
    rc = by_kind(docs, "RayCluster")[0]
    gpu = rc["spec"]["workerGroupSpecs"][1]
    ctr = gpu["template"]["spec"]["containers"][0]
    assert ctr["image"] == "123456789012.dkr.ecr.us-east-1.amazonaws.com/unbroken:0.1.0"
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == "8" and ctr["resources"]["limits"]["memory"] == "1800Gi"
    assert (gpu["minReplicas"], gpu["replicas"], gpu["maxReplicas"]) == (2, 2, 8)
    assert gpu["template"]["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    tols = gpu["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tols
    assert {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"} in tols
    ing = by_kind(docs, "Ingress")[0]
    assert ing["spec"]["tls"][0] == {"hosts": ["unbroken.ml.example.com"], "secretName": "unbroken-tls"}
    assert not by_kind(docs, "Secret")  # secrets.create: false
    smoke = by_kind(docs, "Pod")[0]
    assert smoke["metadata"]["annotations"]["helm.sh/hook"] == "test"
    job_file = by_kind(docs, "ConfigMap")[0]["data"]["job.yaml"]
    spec = parse_spec(job_file)
    assert spec.checkpoint.uri == "s3://acme-ml-checkpoints/unbroken/stdlib-small"
    assert spec.training.steps == 5000 and spec.resources.gpus_per_worker == 8


# ---- wrong values are refused: by the values schema, and by manifest validation behind it ----

@pytest.mark.parametrize("override,words", [
    ({"gpuWorkers": {"gpus": 4}}, "gpus"),  # a typo: Helm would silently ignore it
    ({"gpuWorkers": {"replicas": "two"}}, "two"),
    ({"gpuWorkers": {"memory": "lots"}}, "lots"),
    ({"image": {"pullPolicy": "Sometimes"}}, "Sometimes"),
    ({"storage": {"uri": "gs://bucket"}}, "gs://bucket"),
    ({"secrets": {"create": "yes"}}, "yes"),
], ids=["typo", "replicas-type", "quantity", "enum", "uri-scheme", "bool-type"])
def test_schema_refuses_bad_values(override: dict[str, Any], words: str) -> None:
    with pytest.raises(jsonschema.ValidationError) as e:
        check_values([], override)
    assert words in str(e.value.message) or words in json.dumps(list(e.value.absolute_path))


@pytest.mark.parametrize("override,words", [
    ({"gpuWorkers": {"replicas": "two"}}, "replicas"),
    ({"gpuWorkers": {"replicas": 20, "maxReplicas": 8}}, "maxReplicas"),
    ({"api": {"port": "http"}}, "port"),
    ({"cpuWorkers": {"nodeSelector": {"zone": 3}}}, "nodeSelector"),
], ids=["replicas-type", "replica-bounds", "port-type", "selector-value-type"])
def test_bad_values_give_invalid_manifests(override: dict[str, Any], words: str) -> None:
    """Even past the schema (helm --skip-schema-validation), the manifests would be refused."""
    with pytest.raises(ManifestError) as e:
        validate_all(rendered_docs([], override))
    assert words in str(e.value)


# ---- the renderer itself: exact on its subset, loud outside it ----

def test_renderer_semantics() -> None:
    ctx_tpl = "a:{{- if .Values.x }} yes{{ else }} no{{ end -}}\n  b: {{ .Values.n | quote }} {{ .Values.f }}"
    from tests.deploy import helm_render as h

    ctx = {"Values": {"x": [], "n": 8, "f": 0.5}, "Release": {}, "Chart": {}}
    assert h._render(parse(ctx_tpl), ctx) == 'a: nob: "8" 0.5'  # end -}} ate the newline
    ctx["Values"]["x"] = {"k": 1}
    assert h._render(parse(ctx_tpl), ctx) == 'a: yesb: "8" 0.5'
    assert h._render(parse("s:{{- toYaml .Values.m | nindent 2 }}"), {"Values": {"m": {"b": 1, "a": [1]}}}) == \
        "s:\n  a:\n  - 1\n  b: 1"
    for bad in ["{{ range .Values.x }}{{ end }}", "{{ include \"x\" . }}", "{{ .Values.x | upper }}",
                "{{ if .Values.x }}", "{{ end }}", "{{/* c */}}"]:
        with pytest.raises(TemplateError):
            h._render(parse(bad), ctx)
    for value in [1_000_000, None, {"a": 1}]:  # Helm prints 1e+06, "" and map[a:1]: refused here
        with pytest.raises(TemplateError):
            h._render(parse("{{ .Values.v }}"), {"Values": {"v": value}})


@pytest.mark.skipif(shutil.which("helm") is None, reason="no helm binary on this machine")
@pytest.mark.parametrize("values", [[], [EXAMPLE]], ids=["default", "example"])
def test_matches_helm_template(values: list[Path]) -> None:
    args = ["helm", "template", "unbroken", str(CHART)] + [a for v in values for a in ("-f", str(v))]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(load_docs(out), key=key) == sorted(rendered_docs(values), key=key)
