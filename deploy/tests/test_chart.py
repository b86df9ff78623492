"""The Helm chart, rendered without a cluster: lint, API schemas, and what
the objects say (probes, resources, secrets, the launcher's flags).

The pod's contract with a running launcher (probes, traffic, SIGTERM while a
stream is in flight) is integration-tests/test_pod_contract.py.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from chart import (CHART, KUBE_VERSION, NAMESPACE, PROFILES, RELEASE, find, helm, render, sluice_container,
                   template, value_args)
from conftest import launcher_exe

SCHEMAS = Path(__file__).parent / "schemas"
# The newest Kubernetes API kubernetes-validate knows, and the oldest the
# chart supports (Chart.yaml's kubeVersion: the preStop sleep action is 1.30).
KUBERNETES_VERSIONS = [KUBE_VERSION, "1.30.0"]
# Flags the chart sets from its own values rather than from `launcher`.
CHART_OWNED_FLAGS = {"hostname", "port", "api-key", "prefix-caching", "web-ui"}
# Environment variables the container gets that are not launcher flags:
# who reads them.
CHILD_ENV = {
    "HF_HOME": "huggingface_hub in the shard (the Hub cache is $HF_HOME/hub)",
    "HF_TOKEN": "huggingface_hub in the shard (gated models)",
    "TORCH_EXTENSIONS_DIR": "torch, for the shard's CPU kernels",
    "HF_HUB_OFFLINE": "the shard's downloader",
}


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def objects(profile) -> list[dict]:
    return render(profile)


def values(profile: str) -> dict:
    """The merged values of a profile (defaults, then its files in order)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in PROFILES[profile]:
        merge(merged, yaml.safe_load((CHART / f).read_text()))
    return merged


def merge(into: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v


def flags_of(container: dict) -> dict[str, list[str | None]]:
    """--name=value / --name args as {name: [value or None, ...]}."""
    flags: dict[str, list] = {}
    for arg in container["args"]:
        assert arg.startswith("--"), f"not a flag: {arg}"
        name, _, value = arg[2:].partition("=")
        flags.setdefault(name, []).append(value if "=" in arg else None)
    return flags


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# --- helm lint ---------------------------------------------------------------------------------


def test_lint(profile):
    out = subprocess.run([helm(), "lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART),
                          *value_args(profile)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- schemas -----------------------------------------------------------------------------------


def crd_schema(kind: str) -> tuple[str, dict]:
    """(apiVersion, openAPIV3Schema) of a vendored custom resource."""
    if kind == "InferencePool":
        crd = yaml.safe_load((SCHEMAS / "inference.networking.k8s.io_inferencepools.yaml").read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
        return f"{crd['spec']['group']}/{version['name']}", version["schema"]["openAPIV3Schema"]
    files = {
        "HTTPRoute": ("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io_v1_httproute.json"),
        "ServiceMonitor": ("monitoring.coreos.com/v1", "monitoring.coreos.com_v1_servicemonitor.json"),
    }
    api_version, name = files[kind]
    return api_version, json.loads((SCHEMAS / name).read_text())


CUSTOM_KINDS = {"InferencePool", "HTTPRoute", "ServiceMonitor"}


def inference_pool_cel_rules(pool: dict) -> None:
    """The InferencePool CRD's x-kubernetes-validations, which JSON Schema
    does not evaluate (CEL): checked by hand, and the CRD must carry no
    others."""
    _, schema = crd_schema("InferencePool")
    rules = []

    def walk(node):
        if isinstance(node, dict):
            rules.extend(r["rule"] for r in node.get("x-kubernetes-validations", []))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    known = {
        "self.kind != 'Service' || has(self.port)",
        "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
    }
    assert set(rules) == known, f"the vendored CRD has CEL rules this test does not check: {set(rules) - known}"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))


def test_objects_match_the_api_schemas(objects):
    kinds = set()
    for obj in objects:
        kinds.add(obj["kind"])
        if obj["kind"] in CUSTOM_KINDS:
            api_version, schema = crd_schema(obj["kind"])
            assert obj["apiVersion"] == api_version
            jsonschema.validate(obj, schema)
            if obj["kind"] == "InferencePool":
                inference_pool_cel_rules(obj)
            continue
        for version in KUBERNETES_VERSIONS:
            # strict: unknown fields are errors too.
            kubernetes_validate.validate(obj, version, strict=True)
    assert {"Deployment", "Service"} <= kinds


def test_a_broken_object_fails_validation():
    """The validators do reject: the same checks on corrupted copies."""
    deployment = find(render("default"), "Deployment", RELEASE)
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecond"] = 10
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)
    pool = find(render("inferencepool"), "InferencePool")
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    _, schema = crd_schema("InferencePool")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, schema)


# --- the launcher's flags ------------------------------------------------------------------------


def test_values_name_every_launcher_flag(launcher_help):
    """values.yaml's `launcher` holds exactly the launcher's flags, less the
    ones the chart sets itself: a new flag, or a renamed one, fails here."""
    # --dry-run is a mode of the command, not a setting of the server.
    flags = set(launcher_help) - {"help", "version", "dry-run"}
    in_values = set(values("default")["launcher"])
    assert in_values - flags == set(), "values.yaml names flags the launcher does not have"
    assert flags - in_values - CHART_OWNED_FLAGS == set(), "launcher flags missing from values.yaml"
    assert CHART_OWNED_FLAGS <= flags


def test_args_are_flags_the_launcher_accepts(objects, profile, launcher_help):
    flags = flags_of(sluice_container(objects))
    for name, given in flags.items():
        assert name in launcher_help, f"--{name} is not a sluice-launcher flag"
        spec = launcher_help[name]
        for value in given:
            assert (value is not None) == spec["takes_value"], f"--{name}: {value!r}"
            if spec["possible"]:
                assert value in spec["possible"], f"--{name}={value} not in {spec['possible']}"
    merged = values(profile)["launcher"]
    for name, value in merged.items():
        if value is None or value is False or value == []:
            assert name not in flags
        elif value is True:
            assert flags[name] == [None]
        elif isinstance(value, list):
            assert flags[name] == [str(v) for v in value]
        else:
            # Numbers as the command line writes them: no 1e+09.
            assert flags[name] == [str(value)], name


def container_env_for_launcher(objects: list[dict], container: dict) -> dict[str, str]:
    """The container's environment as the kubelet would set it; a Secret
    the chart does not render (existingSecret) gives a placeholder."""
    secrets = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "Secret"}
    env = {}
    for name, spec in env_of(container).items():
        if "value" in spec:
            env[name] = spec["value"]
        else:
            ref = spec["valueFrom"]["secretKeyRef"]
            data = secrets.get(ref["name"], {ref["key"]: base64.b64encode(b"placeholder").decode()})
            env[name] = base64.b64decode(data[ref["key"]]).decode()
    return env


def test_the_launcher_accepts_the_container_spec(objects, launcher_help):
    """The real launcher parses the rendered args and environment
    (--dry-run: checks them and exits without starting anything)."""
    container = sluice_container(objects)
    env = container_env_for_launcher(objects, container)
    for name in env:
        flag_env = {spec["env"] for spec in launcher_help.values()}
        assert name in flag_env or name in CHILD_ENV, f"nothing reads {name}"
    out = subprocess.run([launcher_exe(), *container["args"], "--dry-run"], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **env})
    assert out.returncode == 0, out.stdout + out.stderr


# --- probes, termination ---------------------------------------------------------------------------


def test_probes(objects, profile):
    container = sluice_container(objects)
    port = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert flags_of(container)["port"] == [str(port["http"])]
    startup, liveness, readiness = (container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe"))
    for probe in (startup, liveness, readiness):
        assert probe["httpGet"]["port"] == "http"
        assert probe["timeoutSeconds"] >= 1
    # Startup: /health answers only once the router runs, after download,
    # load and warmup; it gets half an hour before the kubelet restarts it.
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    # Liveness: the process answers (also while draining); a few misses.
    assert liveness["httpGet"]["path"] == "/health"
    assert liveness["failureThreshold"] >= 3
    # Readiness: warmed up, not draining, making progress; reacts within seconds.
    assert readiness["httpGet"]["path"] == "/ready"
    assert readiness["periodSeconds"] * readiness["failureThreshold"] <= 15
    assert "initialDelaySeconds" not in liveness and "initialDelaySeconds" not in readiness


def test_termination_outlasts_the_drain(objects, profile):
    spec = find(objects, "Deployment", RELEASE)["spec"]["template"]["spec"]
    container = sluice_container(objects)
    merged = values(profile)
    pre_stop = merged["termination"]["preStopSleepSeconds"]
    hook = container["lifecycle"]["preStop"]
    if merged["termination"]["preStopAction"] == "sleep":
        assert hook == {"sleep": {"seconds": pre_stop}}
    else:
        assert hook == {"exec": {"command": ["sleep", str(pre_stop)]}}
    drain = int(flags_of(container)["shutdown-timeout"][0])
    # The launcher: the router gets the drain + 5 s, then the shards 10 s.
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 5 + 10
    assert spec["enableServiceLinks"] is False


def test_a_grace_period_shorter_than_the_drain_is_refused():
    out = template("default", {"termination.gracePeriodSeconds": 20})
    assert out.returncode != 0
    assert "shorter than preStopSleepSeconds + launcher.shutdown-timeout" in out.stderr
    assert render("default", {"termination.gracePeriodSeconds": 600})[0] is not None


# --- resources, secrets, volumes --------------------------------------------------------------------


def test_gpus_follow_num_shard(objects, profile):
    container = sluice_container(objects)
    limits = container["resources"].get("limits", {})
    merged = values(profile)
    if merged["gpu"]["enabled"]:
        assert limits["nvidia.com/gpu"] == merged["launcher"]["num-shard"]
        tolerations = find(objects, "Deployment", RELEASE)["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    else:
        assert "nvidia.com/gpu" not in limits
        assert flags_of(container)["device"] == ["cpu"]
    assert container["resources"]["requests"]["memory"]


def test_gpu_profile():
    objects = render("gpu")
    container = sluice_container(objects)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    flags = flags_of(container)
    assert flags["num-shard"] == ["2"] and flags["hourly-cost"] == ["4.5"] and flags["dtype"] == ["bfloat16"]
    pod = find(objects, "Deployment", RELEASE)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    shm = [v for v in pod["volumes"] if v["name"] == "shm"][0]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_secrets():
    objects = render("secrets")
    container = sluice_container(objects)
    env = env_of(container)
    assert env["API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-secrets", "key": "api-key"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-hf-token", "key": "token"}
    secret = find(objects, "Secret", f"{RELEASE}-secrets")
    assert secret["data"] == {"api-key": base64.b64encode(b"test-api-key").decode()}
    # The key never appears in the args or a plain env value.
    assert not any("test-api-key" in a for a in container["args"])
    assert "test-api-key" not in json.dumps(find(objects, "Deployment", RELEASE))
    # No secrets configured: no Secret, no variables.
    plain = render("default")
    assert not [o for o in plain if o["kind"] == "Secret"]
    assert {"API_KEY", "HF_TOKEN"}.isdisjoint(env_of(sluice_container(plain)))


def test_changing_the_key_restarts_the_pods():
    def checksum(key):
        deployment = find(render("secrets", {"apiKey.value": key}), "Deployment", RELEASE)
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/secrets"]

    assert checksum("a") != checksum("b")


def test_cache_volume(objects, profile):
    deployment = find(objects, "Deployment", RELEASE)
    container = sluice_container(objects)
    merged = values(profile)["cache"]
    assert env_of(container)["HF_HOME"]["value"] == merged["mountPath"]
    assert {"name": "cache", "mountPath": merged["mountPath"]} in container["volumeMounts"]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
    claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    if merged["type"] == "emptyDir":
        assert volume == {"name": "cache", "emptyDir": {}} and not claims
    elif merged["type"] == "existingClaim":
        assert volume["persistentVolumeClaim"]["claimName"] == merged["existingClaim"] and not claims
    else:
        (claim,) = claims
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert claim["spec"]["accessModes"] == merged["accessModes"]
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    single_node = merged["type"] != "emptyDir" and "ReadWriteMany" not in merged["accessModes"]
    assert (deployment["spec"].get("strategy") == {"type": "Recreate"}) == single_node


@pytest.mark.parametrize("settings, message", [
    ({"replicaCount": 2}, "ReadWriteOnce claim attaches to one node"),
    ({"autoscaling.enabled": True}, "ReadWriteOnce claim attaches to one node"),
    ({"launcher.port": 9000}, "the chart sets --port itself"),
    ({"launcher.api-key": "k"}, "the chart sets --api-key itself"),
    ({"launcher.device": "cpu"}, "launcher.device=cpu with gpu.enabled=true"),
    ({"cache.type": "hostPath"}, "cache.type must be"),
    ({"apiKey.value": "a", "apiKey.existingSecret": "b"}, "not both"),
    ({"inferencePool.enabled": True, "inferencePool.endpointPicker.create": False}, "endpointPicker.serviceName"),
])
def test_inconsistent_values_are_refused(settings, message):
    out = template("default", settings)
    assert out.returncode != 0 and message in out.stderr, out.stderr


# --- InferencePool and its endpoint picker -----------------------------------------------------------


def test_inference_pool_selects_the_sluice_pods():
    objects = render("inferencepool")
    pool = find(objects, "InferencePool")
    deployment = find(objects, "Deployment", RELEASE)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels["llm-d.ai/engine-type"] == "sluice"
    assert pool["spec"]["targetPorts"] == [{"number": sluice_container(objects)["ports"][0]["containerPort"]}]
    assert deployment["spec"]["replicas"] == 3
    # The picker: its Service is the pool's endpointPickerRef.
    ref = pool["spec"]["endpointPickerRef"]
    service = find(objects, "Service", ref["name"])
    assert [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc"] == [ref["port"]["number"]]
    picker = find(objects, "Deployment", ref["name"])
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    (epp,) = picker["spec"]["template"]["spec"]["containers"]
    assert f"--pool-name={pool['metadata']['name']}" in epp["args"]
    assert f"--pool-namespace={NAMESPACE}" in epp["args"]
    # It reads pods and the pool.
    role = find(objects, "Role", ref["name"])
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"]} in role["rules"]
    # The HTTPRoute sends the Gateway's traffic to the pool.
    route = find(objects, "HTTPRoute")
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}]


def test_endpoint_picker_config_reads_sluice_metrics():
    """The picker's EndpointPickerConfig (llm-d-router v0.10): the metric
    names it scrapes for engine `sluice` are gauges the router exports."""
    objects = render("inferencepool")
    config_map = find(objects, "ConfigMap")
    config = yaml.safe_load(config_map["data"]["sluice-epp.yaml"])
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p.get("parameters") for p in config["plugins"]}
    assert plugins["metrics-data-source"] == {"scheme": "http", "path": "/metrics"}
    extractor = plugins["core-metrics-extractor"]
    assert extractor["defaultEngine"] == "sluice"
    (engine,) = extractor["engineConfigs"]
    assert engine == {
        "name": "sluice",
        "queuedRequestsSpec": "sluice_queue_size",
        "runningRequestsSpec": "sluice_batch_current_size",
        "kvUsageSpec": "sluice_kv_cache_usage_ratio",
    }
    # Every scorer the profile uses is declared.
    (profile,) = config["schedulingProfiles"]
    assert {p["pluginRef"] for p in profile["plugins"]} == {"queue-scorer", "kv-cache-utilization-scorer",
                                                           "prefix-cache-scorer"}
    assert {p["pluginRef"] for p in profile["plugins"]} <= set(plugins)
    # The README documents the gauges the picker reads.
    readme = (CHART.parents[2] / "README.md").read_text()
    for name in ("sluice_queue_size", "sluice_batch_current_size", "sluice_kv_cache_usage_ratio"):
        assert f"`{name}`" in readme


def test_everything_profile():
    objects = render("everything")
    container = sluice_container(objects)
    flags = flags_of(container)
    assert flags["cors-allow-origin"] == ["https://a.example", "https://b.example"]
    assert flags["kv-cache-bytes"] == ["3000000000"]
    assert flags["otlp-endpoint"] == ["http://otel-collector.observability:4317"]
    assert flags["no-prefix-caching"] == [None]
    deployment = find(objects, "Deployment", RELEASE)
    assert "replicas" not in deployment["spec"]  # the autoscaler owns it
    hpa = find(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "sluice_queue_size"
    monitor = find(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    service = find(objects, "Service", RELEASE)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # An external picker: the chart renders none of its own.
    pool = find(objects, "InferencePool")
    assert pool["spec"]["endpointPickerRef"]["name"] == "shared-epp"
    assert not [o for o in objects if o["kind"] == "ConfigMap"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == find(objects, "ServiceAccount")[
        "metadata"]["name"]
    # Grace: 15 s preStop + 90 s drain + 20.
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 125
