"""The Kubernetes manifests in ``deploy/k8s/``: lint-clean, and consistent with each other and with
the server they deploy (its flags, ports, health service names and exported metric names).

Nothing here needs a cluster; ``kubectl kustomize`` is run only where kubectl is installed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from batchgate.batcher.telemetry import FAMILIES as GPU_FAMILIES
from batchgate.server import cli
from batchgate.server.frontend.app import SERVICE_NAME
from batchgate.server.metrics import ServerMetrics
from batchgate.server.supervisor.multiproc_metrics import _RestartCollector
from batchgate.server.supervisor.supervisor import EXECUTOR_MIN_GRACE_S, LAST_LINES_S

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
YAML_FILES = sorted(K8S.glob("*.yaml")) + sorted(K8S.glob("*.yml"))

# Stricter than yamllint's `relaxed`: everything of `default` is an error, lines up to 100.
YAMLLINT_CONFIG = YamlLintConfig("""
extends: default
rules:
  line-length: {max: 100}
  document-start: {present: true}
  truthy: {allowed-values: ["true", "false"], check-keys: true}
  comments: {min-spaces-from-content: 1}
""")

# Health services the server registers for the whole server (server/frontend/app.py); one more per model.
SERVER_HEALTH_SERVICES = {"", SERVICE_NAME}

# Metric names the dashboard may use before the server exports them: the GPU figures come from
# NVML once the server has a GPU, the pool figure with the GPU memory pool. Each panel that uses
# them says so in its description. Remove a name from here once the server exports it.
FUTURE_METRICS: set[str] = set()  # queried by the dashboard before the server exports them

METRIC_NAME = re.compile(r"\bbatchgate_[a-zA-Z0-9_]+\b")


# -- loading -----------------------------------------------------------------------------------

def load_docs() -> list[tuple[Path, dict]]:
    docs = []
    for path in YAML_FILES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path, doc))
    return docs


DOCS = load_docs()


def objects(kind: str) -> list[dict]:
    return [doc for _, doc in DOCS if doc.get("kind") == kind]


def one(kind: str) -> dict:
    found = objects(kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def deployment() -> dict:
    return one("Deployment")


def pod_labels() -> dict:
    return deployment()["spec"]["template"]["metadata"]["labels"]


def container() -> dict:
    containers = deployment()["spec"]["template"]["spec"]["containers"]
    (c,) = [c for c in containers if c["name"] == "batchgate"]
    return c


def container_ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container()["ports"]}


def serve_args() -> argparse.Namespace:
    """The container's args, parsed by the server's own CLI parser."""
    args = list(container()["args"])
    assert args[0] == "serve"
    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    return parser.parse_args(args[1:])


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def exported_series() -> set[str]:
    """Every series name a real registry can expose: gauges plain, counters as _total,
    histograms as _bucket/_sum/_count (and the samples of the children that exist)."""
    suffixes = {"gauge": [""], "counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    metrics = ServerMetrics()
    families = list(metrics.registry.collect())
    families += list(_RestartCollector(lambda: {"executor": 0}).collect())
    names = {family.name + suffix for family in families
             for suffix in suffixes.get(family.type, [""])}
    names |= {sample.name for family in families for sample in family.samples}
    names |= {name for _, name, _ in GPU_FAMILIES}  # NVML's gauges: absent on a CPU machine
    assert {"batchgate_queue_depth", "batchgate_requests_total",
            "batchgate_request_seconds_bucket", "batchgate_child_restarts_total"} <= names
    return names


EXPORTED = exported_series()


# -- lint and inventory --------------------------------------------------------------------------

def test_the_folder_has_the_manifests():
    names = {p.name for p in YAML_FILES}
    assert {"deployment.yaml", "service.yaml", "hpa.yaml", "prometheus-adapter-rules.yaml",
            "vpa.yaml", "pdb.yaml", "servicemonitor.yaml", "kustomization.yaml"} <= names
    assert (K8S / "grafana-dashboard.json").is_file()
    assert (K8S / "README.md").is_file()


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_yamllint_clean(path):
    problems = list(linter.run(path.read_text(), YAMLLINT_CONFIG, str(path)))
    assert not problems, "\n".join(f"{path.name}:{p.line}:{p.column} {p.desc} ({p.rule})"
                                   for p in problems)


def test_kustomization_lists_every_yaml_file():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    others = {p.name for p in YAML_FILES} - {"kustomization.yaml"}
    assert listed == others
    generated = [f for g in kustomization.get("configMapGenerator", []) for f in g["files"]]
    assert "grafana-dashboard.json" in generated


def test_kustomization_wraps_the_dashboard_in_a_labelled_configmap():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (gen,) = [g for g in kustomization["configMapGenerator"]
              if "grafana-dashboard.json" in g["files"]]
    assert gen["options"]["labels"]["grafana_dashboard"] == "1"
    assert gen["options"]["disableNameSuffixHash"] is True


def test_every_object_is_namespaced_explicitly():
    for path, doc in DOCS:
        if doc["kind"] in ("Namespace", "Kustomization"):
            continue
        assert doc["metadata"].get("namespace"), f"{path.name}: {doc['kind']} has no namespace"
    batchgate = [d for _, d in DOCS if d["kind"] not in ("Namespace", "Kustomization", "ConfigMap")]
    assert {d["metadata"]["namespace"] for d in batchgate} == {"batchgate"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    dashboards = [d for d in built if d["kind"] == "ConfigMap"
                  and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(dashboards) == 1
    json.loads(dashboards[0]["data"]["grafana-dashboard.json"])


# -- the Deployment ------------------------------------------------------------------------------

def test_args_parse_with_the_servers_cli():
    args = serve_args()
    ports = container_ports()
    assert args.grpc_port == ports["grpc"] == 8001
    assert args.metrics_port == ports["metrics"] == 8002
    assert args.host == "0.0.0.0"
    assert str(args.model_repository) == "/models"
    env = {e["name"]: e.get("value") for e in container().get("env", [])}
    assert env.get("BATCHGATE_MODEL_REPOSITORY") == "/models"
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    assert mounts["/models"].get("readOnly") is True


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probes_use_grpc_health_on_the_grpc_port(probe):
    spec = container()[probe]
    assert set(spec) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}
    # A gRPC probe's port is a number (no named ports): it must be the container's gRPC port.
    assert spec["grpc"]["port"] in (container_ports()["grpc"], "grpc")
    assert spec["grpc"].get("service", "") in SERVER_HEALTH_SERVICES


def test_liveness_tolerates_what_readiness_reports():
    c = container()
    live, ready = c["livenessProbe"], c["readinessProbe"]
    # Liveness must be the slower to fail: a brief NOT_SERVING (executor restart) takes the pod
    # out of rotation but does not restart it.
    live_s = live["periodSeconds"] * live["failureThreshold"]
    ready_s = ready["periodSeconds"] * ready["failureThreshold"]
    assert live_s > ready_s
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model loading


def test_grace_period_covers_prestop_and_drain():
    spec = deployment()["spec"]["template"]["spec"]
    args = serve_args()
    pre_stop = container()["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        pre_stop_s = pre_stop["sleep"]["seconds"]
    else:
        command = pre_stop["exec"]["command"]
        assert command[0] == "sleep"
        pre_stop_s = int(command[1])
    assert pre_stop_s > 0
    needed = pre_stop_s + args.drain_timeout_s
    if getattr(args, "frontend", "auto") != "single":
        # The supervisor drains the front end, then gives the executor its minimum grace.
        needed += EXECUTOR_MIN_GRACE_S + LAST_LINES_S
    assert spec["terminationGracePeriodSeconds"] > needed


def test_one_gpu_in_limits():
    resources = container()["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[kind])


def test_pods_spread_over_nodes():
    anti = deployment()["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    terms = [t["podAffinityTerm"] for t in
             anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
    terms += anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    assert any(t["topologyKey"] == "kubernetes.io/hostname"
               and selects(t["labelSelector"]["matchLabels"], pod_labels()) for t in terms)


def test_security_context():
    pod = deployment()["spec"]["template"]["spec"]
    sc = container()["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    models = volumes[mounts["/models"]]["persistentVolumeClaim"]
    assert models == {"claimName": "batchgate-models", "readOnly": True}


def test_deployment_selector_matches_its_pods():
    assert selects(deployment()["spec"]["selector"]["matchLabels"], pod_labels())


# -- Services, PDB, ServiceMonitor ---------------------------------------------------------------

def test_services_select_the_pods_and_expose_both_ports():
    services = objects("Service")
    assert sorted(s["spec"].get("clusterIP", "") for s in services) == ["", "None"]
    names = container_ports()
    for svc in services:
        assert selects(svc["spec"]["selector"], pod_labels()), svc["metadata"]["name"]
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert {"grpc", "metrics"} <= set(ports)
        for port in ports.values():
            assert port["targetPort"] in names or port["targetPort"] in names.values()
        assert ports["grpc"]["port"] == 8001 and ports["metrics"]["port"] == 8002
        assert ports["grpc"].get("appProtocol") == "grpc"


def test_pdb_selects_the_pods():
    pdb = one("PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels())
    assert ("maxUnavailable" in pdb["spec"]) != ("minAvailable" in pdb["spec"])


def test_servicemonitor_scrapes_one_service_on_its_metrics_port():
    monitor = one("ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in objects("Service") if selects(selector, s["metadata"]["labels"])]
    assert len(scraped) == 1, "each pod must be scraped through exactly one Service"
    port_names = {p["name"] for p in scraped[0]["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
    assert scraped[0]["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]


def test_autoscalers_target_the_deployment():
    name = deployment()["metadata"]["name"]
    hpa, vpa = one("HorizontalPodAutoscaler"), one("VerticalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": name}
    assert vpa["spec"]["targetRef"]["name"] == name
    assert vpa["spec"]["updatePolicy"]["updateMode"] == "Off"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > 0


# -- the HPA metric chain ------------------------------------------------------------------------

def adapter_rules() -> list[dict]:
    (cm,) = [c for c in objects("ConfigMap") if "config.yaml" in c.get("data", {})]
    return yaml.safe_load(cm["data"]["config.yaml"])["rules"]


def exposed_name(rule: dict) -> tuple[str, str]:
    """(series metric, custom-metric name) of a prometheus-adapter rule."""
    series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
    naming = rule.get("name", {})
    pattern = naming.get("matches", "^(.*)$")
    replacement = naming.get("as", "${1}" if "(" in pattern else "$0")
    match = re.search(pattern, series)
    assert match, f"{pattern!r} does not match {series!r}"
    groups = [match.group(0), *match.groups()]
    name = re.sub(r"\$\{?(\d+)\}?", lambda m: groups[int(m.group(1))], replacement)
    return series, name


def test_hpa_metric_is_exposed_by_the_adapter_from_an_exported_series():
    hpa = one("HorizontalPodAutoscaler")
    rules = {exposed_name(r)[1]: r for r in adapter_rules()}
    pod_metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]
                   if m["type"] == "Pods"]
    assert pod_metrics
    for name in pod_metrics:
        assert name in rules, f"HPA metric {name} is not exposed by any adapter rule"
        rule = rules[name]
        series, _ = exposed_name(rule)
        assert series in EXPORTED, f"{series} is not a series the server exports"
        assert '{namespace!="",pod!=""}' in rule["seriesQuery"].replace(" ", "")
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"]["resource"] == "pod"
        assert overrides["namespace"]["resource"] == "namespace"
        query = rule["metricsQuery"]
        assert "<<.Series>>" in query and "<<.LabelMatchers>>" in query
        assert re.search(r"\bsum\b", query) and "<<.GroupBy>>" in query


# -- the Grafana dashboard -----------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads((K8S / "grafana-dashboard.json").read_text())


def all_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def test_dashboard_is_well_formed():
    dash = dashboard()
    assert isinstance(dash["schemaVersion"], int) and dash["uid"] and dash["title"]
    panels = list(all_panels(dash["panels"]))
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert all(t["expr"] and t["refId"] for t in panel["targets"])


def test_dashboard_covers_the_server():
    exprs = " ".join(t["expr"] for p in all_panels(dashboard()["panels"])
                     for t in p.get("targets", []))
    for needed in ("batchgate_requests_total", "batchgate_request_seconds_bucket",
                   "batchgate_batch_size", "batchgate_queue_depth",
                   "batchgate_queue_seconds_bucket", "batchgate_gpu_utilization_ratio",
                   "batchgate_gpu_memory_used_bytes", "batchgate_pool_bytes_in_use",
                   *FUTURE_METRICS):
        assert needed in exprs, needed


def test_dashboard_queries_only_real_or_documented_future_metrics():
    dash = dashboard()
    queries = [(p["title"], t["expr"]) for p in all_panels(dash["panels"])
               for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and query:
            queries.append((f"${var['name']}", query))
    for title, expr in queries:
        unknown = set(METRIC_NAME.findall(expr)) - EXPORTED - FUTURE_METRICS
        assert not unknown, f"panel {title!r} queries {unknown}, which the server does not export"
    for panel in all_panels(dash["panels"]):
        used = {n for t in panel.get("targets", []) for n in METRIC_NAME.findall(t["expr"])}
        if used & FUTURE_METRICS:
            assert "not exported yet" in panel["description"].lower(), panel["title"]
    assert not FUTURE_METRICS & EXPORTED, "now exported: drop it from FUTURE_METRICS"
