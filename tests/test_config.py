"""The typed configuration refuses bad input with the field's name and the fix."""

from __future__ import annotations

import pytest

from parallel.config import ModelConfig
from service.spec import JobSpec, SpecError, parse_spec


def test_defaults_are_valid() -> None:
    spec = parse_spec({})
    assert isinstance(spec, JobSpec)
    assert spec.model.n_layers >= 1


def test_preset_then_override() -> None:
    m = ModelConfig(preset="llama3-8b", n_layers=2)
    assert m.dim == 4096 and m.n_layers == 2 and m.ffn_dim == 14336


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"model": {"n_heads": 3, "dim": 64}}, "model: n_heads=3 does not divide dim=64"),
        ({"model": {"dimm": 64}}, "model.dimm: Extra inputs are not permitted"),
        ({"model": {"preset": {}}}, "model: unknown preset {}"),  # found by the API fuzzer (was a 500)
        ({"training": {"steps": 0}}, "training.steps: Input should be greater than or equal to 1"),
        ({"data": {"kind": "text"}}, "needs data.path"),
        ({"parallelism": {"pp": 4, "pp_microbatches": 2}}, "pp_microbatches=2 must be >= pp=4"),
        ({"checkpoint": {"uri": "ftp://x"}}, "must start with file:// or s3://"),
        ({"checkpoint": {"s3": {"access_key_id": "AKIA1"}}},
         "checkpoint.s3: access_key_id is set without secret_access_key: set both, or neither"),
        ({"checkpoint": {"s3": {"secret_access_key": "s3cr3t-only"}}},
         "checkpoint.s3: secret_access_key is set without access_key_id"),
        ({"checkpoint": {"s3": {"endpoint_url": "127.0.0.1:8333"}}},
         "checkpoint.s3.endpoint_url: endpoint_url '127.0.0.1:8333' must start with http:// or https://"),
        ({"resources": {"dp": {"min": 4, "max": 2}}}, "dp.max=2 is below dp.min=4"),
        ({"chaos": [{"kind": "explode", "step": 3}]}, "chaos.0.kind"),
        ("- a\n- b\n", "a job is a mapping of sections"),
        ("model: {dim: [", "not valid YAML"),
    ],
)
def test_bad_specs_name_the_field(body: object, expected: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(body)  # type: ignore[arg-type]
    assert expected in str(info.value)


def test_parallelism_auto_string() -> None:
    assert parse_spec({"parallelism": "auto"}).parallelism.auto


def test_a_lone_s3_secret_is_refused_without_being_echoed() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"checkpoint": {"uri": "s3://b/p", "s3": {"secret_access_key": "s3cr3t-only"}}})
    assert "s3cr3t-only" not in str(info.value)


def test_secrets_are_masked() -> None:
    spec = parse_spec({"runtime_env": {"secret_env_vars": {"HF_TOKEN": "hunter2"}}})
    assert "hunter2" not in str(spec.public_dict())
