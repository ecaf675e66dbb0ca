"""deploy/k8s/components/inference-gateway: rendered with the cpu-dev overlay by the real ``kubectl kustomize``
and validated offline against the Gateway API Inference Extension's InferencePool CRD schema (vendored in
``data/``), and wired the way the extension documents: the pool selects the orchestrator pods at their HTTP
port, its endpoint picker is the EPP Service, and the EPP scrapes gauge names the orchestrator exports.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from prometheus_client.core import GaugeMetricFamily

from kakeya.runtime.metrics import ServerMetrics

from .manifests import K8S, container, deployment, of_kind, render_over
from .test_k8s import _admits

COMPONENT = K8S / "components" / "inference-gateway"
SCHEMA = json.loads((K8S.parents[1] / "tests" / "deploy" / "data" / "inferencepool-v1.schema.json").read_text())


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """cpu-dev with the component, as a user's overlay would add it."""
    tmp = tmp_path_factory.mktemp("gateway")
    return render_over(tmp, "cpu-dev", components=[os.path.relpath(COMPONENT, tmp)])


def _pool(docs) -> dict:
    (pool,) = of_kind(docs, "InferencePool").values()
    return pool


def test_the_inference_pool_validates_against_the_extensions_crd_schema(docs):
    pool = _pool(docs)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.Draft7Validator(SCHEMA).validate(pool)
    # the schema bites: what the CRD refuses is refused here too
    for broken in (
        {"targetPorts": [{"number": 0}]},
        {"targetPorts": []},
        {"selector": {}},
        {"endpointPickerRef": None},
    ):
        bad = json.loads(json.dumps(pool))
        bad["spec"].update(broken)
        bad["spec"] = {k: v for k, v in bad["spec"].items() if v is not None}
        assert not jsonschema.Draft7Validator(SCHEMA).is_valid(bad), broken


def test_the_pool_is_the_orchestrators_http_port(docs):
    spec = _pool(docs)["spec"]
    orch = deployment(docs, "orchestrator")
    assert spec["selector"]["matchLabels"].items() <= orch["spec"]["template"]["metadata"]["labels"].items()
    for role in ("verifier", "drafter"):  # the backends stay behind the orchestrators
        labels = deployment(docs, role)["spec"]["template"]["metadata"]["labels"]
        assert not spec["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(docs, "orchestrator")["ports"]}
    assert [p["number"] for p in spec["targetPorts"]] == [ports["http"]]
    assert f"--http-port={ports['http']}" in container(docs, "orchestrator")["args"]


def test_the_endpoint_picker_is_wired_to_the_pool_and_to_kakeyas_gauges(docs):
    ref = _pool(docs)["spec"]["endpointPickerRef"]
    service = of_kind(docs, "Service")[ref["name"]]
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    epp = of_kind(docs, "Deployment")[ref["name"]]
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in c["args"])
    assert args["pool-name"] == _pool(docs)["metadata"]["name"]
    assert f"/config/{next(iter(of_kind(docs, 'ConfigMap')['kakeya-epp']['data']))}" == args["config-file"]
    orch_ports = {p["name"]: p["containerPort"] for p in container(docs, "orchestrator")["ports"]}
    assert int(args["model-server-metrics-port"]) == orch_ports["metrics"]
    # the names it scrapes are gauges an orchestrator exports
    m = ServerMetrics("orchestrator")
    m.track_kv_usage(lambda: 0.25)
    gauges = {f.name for f in m.registry.collect() if f.type == GaugeMetricFamily("x", "").type}
    for flag in ("total-queued-requests-metric", "kv-cache-usage-percentage-metric"):
        assert args[flag] in gauges, (flag, args[flag])
    role = of_kind(docs, "Role")["kakeya-epp"]
    assert {"pods", "inferencepools"} <= {r for rule in role["rules"] for r in rule["resources"]}
    assert (
        of_kind(docs, "RoleBinding")["kakeya-epp"]["subjects"][0]["name"]
        == epp["spec"]["template"]["spec"]["serviceAccountName"]
    )


def test_the_endpoint_picker_may_scrape_the_orchestrators_and_only_them(docs):
    epp = of_kind(docs, "Deployment")["kakeya-epp"]["spec"]["template"]["metadata"]["labels"]
    policies = of_kind(docs, "NetworkPolicy")
    assert _admits(policies["kakeya-orchestrator"], "metrics", epp)
    assert not _admits(policies["kakeya-verifier"], "metrics", epp)
    assert not _admits(policies["kakeya-drafter"], "metrics", epp)


def test_every_pod_passes_the_restricted_pod_security_standard(docs):
    """A namespace that enforces Pod Security "restricted" (`pod-security.kubernetes.io/enforce: restricted`, the
    usual one for serving workloads) admits the Kakeya pods, which set what it asks; the endpoint picker's set nothing,
    so its ReplicaSet was refused every pod ("violates PodSecurity restricted") and the pool had no picker."""
    for name, d in of_kind(docs, "Deployment").items():
        pod = d["spec"]["template"]["spec"]
        psc = pod.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 1) != 0, name
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
            assert seccomp in ("RuntimeDefault", "Localhost"), f"{name}/{c['name']}: seccompProfile"
            assert sc.get("allowPrivilegeEscalation") is False, f"{name}/{c['name']}: allowPrivilegeEscalation"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}/{c['name']}: capabilities"
            assert sc.get("runAsNonRoot", True) is True and sc.get("runAsUser", 1) != 0, f"{name}/{c['name']}"
