"""Rendering the Helm chart (deploy/helm/sluice) for tests, without a cluster.

`helm()` finds the binary: $SLUICE_HELM, else scripts/install_helm.sh, which
prints the cached one (building it from the Go module proxy the first time).
`render(profile, set=...)` runs `helm template` and returns the objects.

Also imported by integration-tests/test_pod_contract.py.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "sluice"
RELEASE = "sluice"
NAMESPACE = "llm"
# The Kubernetes release the objects are rendered for (and validated
# against, with kubernetes-validate's schemas of it).
KUBE_VERSION = "1.37.0"

# Values files per profile, in the order `helm -f` takes them (later wins).
PROFILES: dict[str, list[str]] = {
    "default": [],
    "gpu": ["ci/gpu-values.yaml"],
    "cpu": ["values-cpu.yaml", "ci/cpu-values.yaml"],
    "secrets": ["ci/secrets-values.yaml"],
    "inferencepool": ["ci/inferencepool-values.yaml"],
    "inferencepool-cpu": ["values-cpu.yaml", "ci/cpu-values.yaml", "ci/inferencepool-values.yaml"],
    "everything": ["ci/everything-values.yaml"],
}


@functools.cache
def helm() -> str:
    if os.environ.get("SLUICE_HELM"):
        return os.environ["SLUICE_HELM"]
    out = subprocess.run(["bash", str(ROOT / "scripts" / "install_helm.sh")], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def value_args(profile: str, set: dict[str, object] | None = None) -> list[str]:
    args = []
    for f in PROFILES[profile]:
        args += ["-f", str(CHART / f)]
    for key, value in (set or {}).items():
        # --set-json keeps types (numbers, booleans, null) as given.
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def template(profile: str, set: dict[str, object] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
         *value_args(profile, set)],
        capture_output=True, text=True,
    )


def render(profile: str, set: dict[str, object] | None = None) -> list[dict]:
    out = template(profile, set)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def sluice_container(objects: list[dict]) -> dict:
    deployment = find(objects, "Deployment", f"{RELEASE}")
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "sluice"]
    return container
