"""The Dockerfiles' build steps, checked as far as a machine without a Docker engine allows.

- Every COPY source exists and is let through by the Dockerfile's own .dockerignore.
- The Ray and torch pins agree with what this project is tested with and with pyproject.
- The image's `pip install` lines resolve together in a fresh virtualenv (no system packages) with
  `pip install --dry-run`: installing torch and ray[train,default] for real takes minutes and
  ~2 GB, too slow for CI on 2 cores, while the resolution finds the same conflicts or missing
  packages. Index options (download.pytorch.org) are dropped: there is no network here and pip's
  configured local wheel cache (/opt/wheels) holds the same CPU torch.
- Our package builds as a wheel with the files the image needs at run time (migrations, CLI).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import ray
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.deploy.validation import REPO

DEPLOY = REPO / "deploy"
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path.name}: a continued line never ends"
    return out


def build_args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    args: dict[str, str] = {}
    for word, rest in instrs:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v.strip('"')
    return args


def expand(s: str, args: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in args:
            raise AssertionError(f"${name} is not a build ARG with a default")
        return args[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, s)


def pip_installs(path: Path) -> list[list[str]]:
    """The argument lists of every `pip install` in the RUN lines, ARGs expanded."""
    instrs = instructions(path)
    args = build_args(instrs)
    out = []
    for word, rest in instrs:
        if word != "RUN":
            continue
        commands: list[list[str]] = [[]]
        for t in shlex.split(expand(rest, args)):
            if t in ("&&", ";", "||"):
                commands.append([])
            else:
                commands[-1].append(t)
        out += [c[2:] for c in commands if c[:2] == ["pip", "install"]]
    return out


def requirements_of(path: Path) -> list[str]:
    """What the image's pip lines ask for, as pip arguments here: `.` is the repository root."""
    reqs: list[str] = []
    for toks in pip_installs(path):
        skip = False
        for t in toks:
            if skip:
                skip = False
                continue
            if t in ("--index-url", "--extra-index-url", "-i"):
                skip = True  # no network here; the local wheel cache serves the same packages
                continue
            if t.startswith("-"):
                raise AssertionError(f"{path.name}: unexpected pip option {t}")
            reqs.append(str(REPO) + t[1:] if t.startswith(".") else t)
    return reqs


def dockerignore_allows(ignore: Path, src: str) -> bool:
    allowed = False
    for line in ignore.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line[1:] if neg else line
        if fnmatch.fnmatch(src, pat) or fnmatch.fnmatch(src + "/x", pat):
            allowed = neg
    return allowed


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copy_sources_exist_and_are_in_the_context(name: str) -> None:
    instrs = instructions(DEPLOY / name)
    copies = [shlex.split(rest) for word, rest in instrs if word == "COPY"]
    assert copies
    for toks in copies:
        for src in toks[:-1]:
            assert (REPO / src).exists(), f"{name}: COPY {src} does not exist"
            assert dockerignore_allows(DEPLOY / f"{name}.dockerignore", src), f"{name}: {src} is .dockerignored"
    # every top-level package of pyproject is copied, or `pip install .` would miss it
    copied = {toks[0] for toks in copies}
    for pkg in ("unbroken", "parallel", "checkpointing", "workers", "service", "api"):
        assert pkg in copied, f"{name}: package {pkg} is not copied into the image"
    assert instrs[-2:] == [("USER", "ray"), ("WORKDIR", "/home/ray")]


def test_pins_match_what_we_test_with() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    ray_req = Requirement(re.search(r'"(ray\[[^"]+)"', pyproject).group(1))  # type: ignore[union-attr]
    for name in DOCKERFILES:
        args = build_args(instructions(DEPLOY / name))
        assert args["RAY_VERSION"] == ray.__version__, f"{name}: Ray {args['RAY_VERSION']} != tested {ray.__version__}"
        assert ray_req.specifier.contains(args["RAY_VERSION"])
        assert "ray[train,default]==" + ray.__version__ in requirements_of(DEPLOY / name)
    cpu = build_args(instructions(DEPLOY / "Dockerfile.cpu"))
    assert cpu["TORCH_VERSION"] == torch.__version__.split("+")[0]
    base = build_args(instructions(DEPLOY / "Dockerfile"))["BASE_IMAGE"]
    m = re.match(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda", base)
    assert m and Version(m.group(1)) >= Version("2.11"), f"the CUDA base {base} must carry torch >= 2.11"
    # the same Ray version in the KubeRay manifests
    for f in list((DEPLOY / "kuberay").glob("*.yaml")) + [DEPLOY / "helm" / "unbroken" / "values.yaml"]:
        for v in re.findall(r'rayVersion: "([^"]+)"', f.read_text(encoding="utf-8")):
            assert v == ray.__version__, f"{f.name}: rayVersion {v}"


# ~230 s on a 2-core machine: pip evaluates every link of ~150 index pages (CPU-bound, measured
# with --log). That is a sixth of CI's test budget for one resolution, so it runs on request:
# UNBROKEN_IMAGE_CHECKS=1 make test (and before any change to the Dockerfiles' pip lines).
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("UNBROKEN_IMAGE_CHECKS") != "1",
                    reason="resolving the image's pip lines takes ~4 min; set UNBROKEN_IMAGE_CHECKS=1")
@pytest.mark.timeout(540)
def test_pip_lines_resolve_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # Both images end with the same package set (the CUDA base brings torch itself: ask for its range).
    reqs = requirements_of(DEPLOY / "Dockerfile.cpu")
    assert any(r.startswith("torch==") for r in reqs)
    cuda = requirements_of(DEPLOY / "Dockerfile")
    assert set(cuda) <= set(reqs)
    report = tmp_path / "report.json"
    r = subprocess.run([str(py), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), *reqs],
                       capture_output=True, text=True, timeout=520)
    assert r.returncode == 0, r.stderr[-3000:]
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert chosen["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert chosen["ray"] == ray.__version__
    assert chosen["unbroken"] and "tensorboard" in chosen and "fastapi" in chosen
    assert "aiohttp" in chosen  # ray[default]: the dashboard and metrics agent KubeRay relies on


def test_package_wheel_has_runtime_files(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = tmp_path.glob("unbroken-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("service/migrations/env.py", "service/migrations/versions/0001_initial.py", "api/cli/__init__.py",
                   "workers/telemetry.py", "unbroken/__init__.py"):
        assert needed in names, f"{needed} is not in the wheel the image installs"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "unbroken = api.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
