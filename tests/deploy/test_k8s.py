"""Every overlay renders with `kubectl kustomize`, validates against the Kubernetes schemas offline,
and says what the servers and the Dockerfile actually accept."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kakeya.app.main import build_parser
from kakeya.app.serve import DEFAULT_PORTS

from .manifests import K8S, OVERLAYS, ROLES, argv, config_env, container, deployment, flag, of_kind, render
from .test_dockerfile import STAGES, TARGETS, inherited

K8S_VERSION = "1.30.0"  # the oldest version we promise (native gRPC probes GA in 1.27, preStop sleep in 1.30)
CRDS = {  # no schema in kubernetes-validate: checked below
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}
TOKEN_FILE = "/etc/kakeya/internal/token"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", [K8S_VERSION, "1.37.0"])
def test_renders_and_validates_against_the_schemas(overlay, version):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for d in docs:
        if (d["apiVersion"], d["kind"]) in CRDS:
            continue
        kubernetes_validate.validate(d, version, strict=True)  # raises on an unknown or mistyped field


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_args_parse_with_the_real_cli(overlay):
    docs = render(overlay)
    parser = build_parser()
    for role in ROLES:
        cmd = argv(docs, role)
        assert cmd[:2] == ["kakeya", "serve"], cmd
        args = parser.parse_args(cmd[1:])
        assert args.role == role
        assert args.port == DEFAULT_PORTS[role] and args.host == "0.0.0.0"
        if role != "orchestrator":
            assert args.max_sessions > 0, "a model server must bound its sessions (memory)"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_native_grpc_on_the_served_port(overlay):
    """On the served port, or where it speaks TLS (which the kubelet's gRPC probes cannot) on --health-port."""
    docs = render(overlay)
    for role in ROLES:
        c = container(docs, role)
        args = argv(docs, role)
        port = int(flag(args, "--port"))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == port
        assert flag(args, "--health-port") or not flag(args, "--tls-cert"), (
            f"{role} serves TLS: probes need a --health-port"
        )
        probed = int(flag(args, "--health-port") or port)
        assert ports["health" if probed != port else "grpc"] == probed
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{role} {probe}"
            assert c[probe]["grpc"]["port"] == probed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_liveness_asks_a_health_no_backend_outage_turns(overlay):
    """An orchestrator's health ("") is NOT_SERVING while no verifier answers: readiness takes it out of the Service,
    as it should; a liveness probe on it restarted every orchestrator a minute into a verifier outage (a restart, an
    OOM kill), each then waiting out --backend-wait and the kubelet's back-off after the verifiers were back."""
    from kakeya.runtime.lifecycle import LIVENESS

    docs = render(overlay)
    for role in ROLES:
        c = container(docs, role)
        assert c["livenessProbe"]["grpc"].get("service") == LIVENESS, role
        assert c["readinessProbe"]["grpc"].get("service", "") == c["startupProbe"]["grpc"].get("service", "") == ""


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_non_root_and_locked_down(overlay):
    docs = render(overlay)
    image_uid = int(inherited(STAGES, "runtime", "USER").split(":")[0])
    for role in ROLES:
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        c = container(docs, role)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == image_uid != 0
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts, "read-only root: torch/triton/MLX need a writable /tmp (HOME=/tmp)"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_outlasts_the_drain(overlay):
    docs = render(overlay)
    for role in ROLES:
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        grace = float(flag(argv(docs, role), "--grace") or build_parser().parse_args(argv(docs, role)[1:]).grace)
        pre = container(docs, role).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod["terminationGracePeriodSeconds"] > grace + pre + 5, role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_dockerfile_targets_and_fit_the_backend(overlay):
    docs = render(overlay)
    for role in ROLES:
        image = container(docs, role)["image"]
        name, _, tag = image.rpartition(":")
        target = tag.rsplit("-", 1)[-1]
        assert name.endswith("kakeya") and target in TARGETS, f"{role}: {image} is not a Dockerfile target"
        args = build_parser().parse_args(argv(docs, role)[1:])
        backend = getattr(args, "backend", None)
        if role != "orchestrator":
            # the cuda image has no MLX, the cpu image no torch
            assert backend == ("torch" if target == "cuda" else "mlx"), f"{role} on {image}: --backend {backend}"
        if target == "cuda":
            assert args.device == "cuda"


def test_cuda_overlay_gpus_nodes_and_separation():
    docs = render("cuda")
    for role, other in (("verifier", "drafter"), ("drafter", "verifier")):
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        res = container(docs, role)["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert any(
            t["topologyKey"] == "kubernetes.io/hostname"
            and t["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == other
            for t in terms
        ), f"{role} may share a node with a {other}"
    orch = container(docs, "orchestrator")
    assert "nvidia.com/gpu" not in orch["resources"].get("requests", {}), "the orchestrator holds no model"


def test_the_cpu_dev_recipe_builds_and_loads_the_image_it_runs():
    """cpu-dev's recipe (its kustomization's header) is for kind or minikube, whose nodes do not see the host's
    images: applied as written, every pod asked Docker Hub for `kakeya:0.1.0-cpu` (ImagePullBackOff). The recipe
    builds each image the overlay names and loads it into the cluster before applying."""
    text = (K8S / "overlays" / "cpu-dev" / "kustomization.yaml").read_text()
    recipe = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#   ")]
    overlay = yaml.safe_load(text)
    apply = next(i for i, c in enumerate(recipe) if c.startswith("kubectl apply -k"))
    for image in {f"{i['newName']}:{i['newTag']}" for i in overlay["images"]}:
        built = [i for i, c in enumerate(recipe) if c.startswith("docker build") and f"-t {image} " in c + " "]
        loaded = [
            i for i, c in enumerate(recipe) if re.match(rf"(kind load docker-image|minikube image load) {image}\b", c)
        ]
        assert built and loaded and built[0] < loaded[0] < apply, f"{image}: built, loaded, then applied"


def test_cpu_dev_is_small_and_needs_no_volume_or_gpu():
    docs = render("cpu-dev")
    assert not of_kind(docs, "PersistentVolumeClaim")
    for role in ROLES:
        d = deployment(docs, role)
        assert d["spec"]["replicas"] == 1
        c = container(docs, role)
        assert "nvidia.com/gpu" not in str(c["resources"])
        assert all("/models" not in a for a in argv(docs, role)), "cpu-dev uses the image's embedded pair"
        assert not [v for v in d["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]


def test_gpu_verifiers_admit_sessions_against_a_kv_budget():
    """A GPU verifier holds its sessions' K/V beside the weights. Without --max-kv-bytes it admits by --max-sessions
    alone, whatever each session's context (no --max-context either: up to the model's max_position_embeddings; one
    128K-position gemma-4-31b session holds 10.8 GiB under `native`), so a few long prompts run the GPU out of memory
    mid-generation instead of being queued or refused at admission; and
    kakeya_kv_cache_usage_perc, the gauge an inference gateway's picker routes by besides the queue, stays 0."""
    docs = render("cuda")
    verifier = build_parser().parse_args(argv(docs, "verifier")[1:])
    assert verifier.max_kv_bytes > 0
    assert config_env(docs)["KAKEYA_VERIFIER_MAX_KV_BYTES"] == str(verifier.max_kv_bytes), "one knob, in the ConfigMap"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_orchestrator_balances_over_headless_services(overlay):
    docs = render(overlay)
    services = of_kind(docs, "Service")
    args = argv(docs, "orchestrator")
    for role in ("verifier", "drafter"):
        target = flag(args, f"--{role}")
        assert target.startswith("dns:///"), f"--{role} {target}: a dns:/// target lets gRPC see every replica"
        host, port = target.removeprefix("dns:///").rsplit(":", 1)
        svc = services[host]
        assert svc["spec"]["clusterIP"] == "None", f"{host} must be headless (one DNS record per pod)"
        assert svc["spec"]["selector"] == deployment(docs, role)["spec"]["selector"]["matchLabels"]
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]] and int(port) == DEFAULT_PORTS[role]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_orchestrators_admit_what_the_verifiers_hold_and_queue_the_rest(overlay):
    """Every generation holds a verifier session. Orchestrators that together admit more generations than the
    verifiers hold answer the surplus 429 "verifier: session limit reached" (one orchestrator at 32 before one verifier
    at 8: 4 of 12 concurrent requests) while their own gauges say there is room: kakeya_num_requests_waiting, which an
    inference gateway's endpoint picker routes by, stays 0. Sized to the verifiers, the surplus waits in the
    orchestrator's --queue, where that gauge counts it."""
    docs = render(overlay)

    def capacity(role):
        args = build_parser().parse_args(argv(docs, role)[1:])
        return deployment(docs, role)["spec"]["replicas"] * args.max_sessions, args

    admitted, orchestrator = capacity("orchestrator")
    held, _ = capacity("verifier")
    assert 0 < admitted <= held, f"orchestrators admit {admitted} generations, verifiers hold {held} sessions"
    assert orchestrator.queue > 0, (
        "over --max-sessions a generation should wait, counted in kakeya_num_requests_waiting"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_volumes_secrets_config_and_budgets_line_up(overlay):
    docs = render(overlay)
    claims = set(of_kind(docs, "PersistentVolumeClaim"))
    env = config_env(docs)
    for role in ROLES:
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        for v in vols.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
                assert v["persistentVolumeClaim"]["readOnly"] is True
        assert {m["name"] for m in container(docs, role)["volumeMounts"]} <= set(vols)
        assert container(docs, role)["envFrom"] == [{"configMapRef": {"name": "kakeya-config"}}]
    assert {"KAKEYA_CACHE", "KAKEYA_SINK", "KAKEYA_FULL_KV_BITS", "KAKEYA_MAX_TOKENS_LIMIT"} <= set(env)
    verifier = build_parser().parse_args(argv(docs, "verifier")[1:])
    assert verifier.cache == env["KAKEYA_CACHE"] and verifier.full_kv_bits == int(env["KAKEYA_FULL_KV_BITS"])
    pdbs = of_kind(docs, "PodDisruptionBudget")
    for role in ROLES:
        assert (
            pdbs[f"kakeya-{role}"]["spec"]["selector"]["matchLabels"]
            == deployment(docs, role)["spec"]["selector"]["matchLabels"]
        )


PORT_FLAGS = {"--port": "grpc", "--http-port": "http", "--metrics-port": "metrics", "--health-port": "health"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_path_a_flag_names_is_mounted_and_every_port_is_declared(overlay):
    """A path no volume mounts is a read-only root's empty directory (the pod starts, then fails on a file it expects);
    a served port no containerPort names is one the Services, probes and NetworkPolicies (all by port name) never
    reach."""
    docs = render(overlay)
    services = of_kind(docs, "Service")
    for role in ROLES:
        c = container(docs, role)
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        args = argv(docs, role)
        for a in args[2:]:
            value = a.split("=", 1)[-1]
            if value.startswith("/"):
                assert any(value.startswith(m + "/") for m in mounts), f"{overlay} {role}: {a} is on no volume"
        for name, port_name in PORT_FLAGS.items():
            if (value := flag(args, name)) is not None:
                assert ports.get(port_name) == int(value), f"{overlay} {role}: {name}={value} vs containerPorts {ports}"
        labels = deployment(docs, role)["spec"]["template"]["metadata"]["labels"]
        for svc in services.values():
            if svc["spec"].get("selector") and svc["spec"]["selector"].items() <= labels.items():
                for p in svc["spec"]["ports"]:
                    assert p["targetPort"] in ports, f"{svc['metadata']['name']}: targetPort {p['targetPort']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_mounted_secret_is_read_by_a_flag(overlay):
    """A Secret mounted where no flag reads it is key material a pod holds for nothing (the public TLS key in the
    model servers), and an operator who creates it believes it is in use (the orchestrator serving TLS)."""
    docs = render(overlay)
    for role in ROLES:
        secrets = {v["name"] for v in deployment(docs, role)["spec"]["template"]["spec"]["volumes"] if "secret" in v}
        args = argv(docs, role)
        for mount in container(docs, role)["volumeMounts"]:
            if mount["name"] in secrets:
                assert any(mount["mountPath"] + "/" in a for a in args), f"{role}: {mount['mountPath']} read by no flag"


def test_the_docs_registry_command_maps_every_image_the_overlay_uses():
    """docs/deploy.md's command that points the cuda overlay at a registry: copied as it stands, every image
    placeholder must get a registry name. Mapping kakeya-accel alone left the orchestrators on a bare
    `kakeya:0.1.0-cpu`, which a cluster pulls from Docker Hub: ImagePullBackOff."""
    docs_text = (K8S.parents[1] / "docs" / "deploy.md").read_text()
    (command,) = re.findall(r"`cd deploy/k8s/overlays/cuda && (kustomize edit set image [^`]+)`", docs_text)
    mapped = dict(w.split("=", 1) for w in shlex.split(command)[4:])
    overlay = yaml.safe_load((K8S / "overlays" / "cuda" / "kustomization.yaml").read_text())
    assert set(mapped) == {i["name"] for i in overlay["images"]}
    for image in overlay["images"]:
        assert mapped[image["name"]] == f"REGISTRY/{image['newName']}:{image['newTag']}", image["name"]


def test_service_monitor_scrapes_a_named_metrics_port():
    """A CRD kubernetes-validate has no schema for: checked structurally against the Services."""
    docs = render("cuda")
    (sm,) = of_kind(docs, "ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    want = sm["spec"]["selector"]["matchLabels"]
    selected = [s for s in of_kind(docs, "Service").values() if want.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {
        "kakeya-verifier-headless",
        "kakeya-drafter-headless",
        "kakeya-orchestrator",
    }
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "tlsConfig"}
        for s in selected:
            assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}
    for overlay in OVERLAYS:
        for role in ROLES:
            ports = {p["name"]: p["containerPort"] for p in container(render(overlay), role)["ports"]}
            assert int(flag(argv(render(overlay), role), "--metrics-port")) == ports["metrics"], (
                f"{overlay} {role} serves /metrics"
            )
    assert not of_kind(render("cpu-dev"), "ServiceMonitor"), (
        "cpu-dev must apply on clusters without the Prometheus Operator"
    )


# --------------------------------------------------------------------------- who may call whom


def _mounted_secret(docs, role: str, path: str) -> dict:
    """The Secret volume a role's container mounts over ``path``'s directory."""
    pod = deployment(docs, role)["spec"]["template"]["spec"]
    (mount,) = [m for m in container(docs, role)["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return vol["secret"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_servers_admit_only_their_orchestrators(overlay):
    """Verifier and drafter listen on 0.0.0.0, so they must authenticate callers (they refuse to start
    otherwise): the token the orchestrators send, from a Secret no pod starts without."""
    from kakeya.runtime.security.auth import check_exposure

    docs = render(overlay)
    orch = build_parser().parse_args(argv(docs, "orchestrator")[1:])
    assert orch.backend_token_file == TOKEN_FILE
    assert _mounted_secret(docs, "orchestrator", TOKEN_FILE)["secretName"] == "kakeya-internal-token"
    for role in ("verifier", "drafter"):
        args = build_parser().parse_args(argv(docs, role)[1:])
        assert not args.insecure
        assert (
            check_exposure(
                role, args.host, mutual_tls=bool(args.tls_client_ca), token=bool(args.auth_token_file), insecure=False
            )
            is None
        )
        assert args.auth_token_file == TOKEN_FILE
        secret = _mounted_secret(docs, role, TOKEN_FILE)
        assert secret["secretName"] == "kakeya-internal-token" and not secret.get("optional", False)
        assert secret["defaultMode"] & 0o007 == 0, "the token is not world-readable"


def test_cuda_overlay_is_mutual_tls_with_a_cert_manager_ca():
    docs = render("cuda")
    certs = of_kind(docs, "Certificate")
    issuers = of_kind(docs, "Issuer")
    orch = build_parser().parse_args(argv(docs, "orchestrator")[1:])
    assert orch.tls_ca and orch.tls_client_cert and orch.tls_client_key
    client_secret = _mounted_secret(docs, "orchestrator", orch.tls_client_cert)["secretName"]
    (client_cert,) = [c for c in certs.values() if c["spec"]["secretName"] == client_secret]
    assert client_cert["spec"]["usages"] == ["client auth"]
    for role in ("verifier", "drafter"):
        args = build_parser().parse_args(argv(docs, role)[1:])
        assert args.tls_cert and args.tls_key and args.tls_client_ca, f"{role}: mutual TLS"
        secret = _mounted_secret(docs, role, args.tls_cert)["secretName"]
        (cert,) = [c for c in certs.values() if c["spec"]["secretName"] == secret]
        host = flag(argv(docs, "orchestrator"), f"--{role}").removeprefix("dns:///").rsplit(":", 1)[0]
        assert host in cert["spec"]["dnsNames"], f"the orchestrator dials {host}: the {role}'s certificate must name it"
        assert cert["spec"]["issuerRef"] == client_cert["spec"]["issuerRef"], "one CA signs both ends"
    ca_issuer = issuers[client_cert["spec"]["issuerRef"]["name"]]
    assert certs[ca_issuer["spec"]["ca"]["secretName"]]["spec"]["isCA"] is True
    assert not of_kind(render("cpu-dev"), "Certificate"), "cpu-dev must apply on clusters without cert-manager"


def test_the_internal_ca_keeps_its_key_when_cert_manager_renews_it():
    """cert-manager renews the CA at two thirds of its year by itself, and since 1.18 a Certificate without a
    rotationPolicy gets a fresh key then (Always). Leaves signed by the old key do not verify against the new root:
    until every pod has restarted with leaves re-issued from it, an orchestrator and a model server that trust
    different roots fail each other's handshake, and every split request fails. A root that keeps its key (Never)
    verifies the leaves of its earlier certificate too; re-keying it stays a deliberate step (docs/security.md)."""
    certs = of_kind(render("cuda"), "Certificate")
    (ca,) = [c for c in certs.values() if c["spec"].get("isCA")]
    assert ca["spec"]["privateKey"].get("rotationPolicy") == "Never"
    for cert in certs.values():  # the leaves re-key at each renewal, said outright (the default moved once)
        assert cert["spec"]["privateKey"].get("rotationPolicy") in ("Never", "Always"), cert["metadata"]["name"]


def _admits(policy: dict, port: str, labels: dict) -> bool:
    """Whether a NetworkPolicy lets a pod with ``labels`` (in any namespace) in on the named ``port``."""
    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        if "from" not in rule:
            return True
        if any(f["podSelector"]["matchLabels"].items() <= labels.items() for f in rule["from"]):
            return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_only_orchestrators_in_to_the_model_servers(overlay):
    docs = render(overlay)
    policies = of_kind(docs, "NetworkPolicy")
    orchestrator = deployment(docs, "orchestrator")["spec"]["template"]["metadata"]["labels"]
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    stranger = {"app.kubernetes.io/name": "kakeya", "app.kubernetes.io/component": "job"}
    for role in ROLES:
        (policy,) = [p for p in policies.values()
                     if p["spec"]["podSelector"]["matchLabels"] == deployment(docs, role)["spec"]["selector"]["matchLabels"]]  # fmt: skip
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert _admits(policy, "metrics", prometheus) and not _admits(policy, "metrics", orchestrator)
        if role == "orchestrator":
            assert _admits(policy, "grpc", stranger), "the public API is for everyone"
        else:
            assert _admits(policy, "grpc", orchestrator) and not _admits(policy, "grpc", stranger)
            assert not _admits(policy, "grpc", prometheus)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_http_api_serves_the_model_under_a_name_of_its_own(overlay):
    """OpenAI clients name the model in every request, and the HTTP front answers any other id 404. By default the id
    is the checkpoint folder's name, which here is the manifests' own layout: /models/target made every orchestrator
    serve the model `models` (`/v1/models`), a name clients (and a gateway's model routing) must guess. The id is one
    knob in the ConfigMap, passed as --served-model-name."""
    from kakeya.orchestrator.assembly import pair_paths
    from kakeya.orchestrator.fronts.http_server import served_model_name

    docs = render(overlay)
    env = config_env(docs)
    orchestrator = build_parser().parse_args(argv(docs, "orchestrator")[1:])
    verifier = build_parser().parse_args(argv(docs, "verifier")[1:])
    target = orchestrator.tokenizer or verifier.target or pair_paths(None, None)[0]
    served = orchestrator.served_model_name or served_model_name(target)
    assert served not in Path(env["KAKEYA_TARGET_DIR"]).parts, f"{overlay}: the model is served as {served!r}"
    assert orchestrator.served_model_name == env.get("KAKEYA_SERVED_MODEL_NAME"), "one knob, in the ConfigMap"


CRD_OWNERS = {"cert-manager.io": "cert-manager", "monitoring.coreos.com": "Prometheus Operator"}


def test_the_docs_quick_start_names_what_the_cuda_overlay_needs_installed():
    """`kubectl apply -k deploy/k8s/overlays/cuda`, as docs/deploy.md's quick start has it, on a cluster without
    cert-manager: the Certificates are refused ("no matches for kind Certificate") and every pod waits for its TLS
    Secret forever (ContainerCreating); without the Prometheus Operator the ServiceMonitor is refused. The quick start
    must say what to install first."""
    groups = {d["apiVersion"].split("/")[0] for d in render("cuda") if (d["apiVersion"], d["kind"]) in CRDS}
    assert groups == set(CRD_OWNERS), groups
    text = (K8S.parents[1] / "docs" / "deploy.md").read_text()
    (quick_start,) = re.findall(r"## Kubernetes \(`deploy/k8s/`\)\n\n```bash\n(.*?)```", text, re.DOTALL)
    applied = quick_start.index("kubectl apply -k deploy/k8s/overlays/cuda")
    for group in groups:
        assert CRD_OWNERS[group] in quick_start[:applied], (
            f"{CRD_OWNERS[group]} ({group}) is not named before the apply"
        )


def test_the_docs_public_tls_patch_serves_tls_with_a_key_only_the_pod_reads(tmp_path):
    """docs/deploy.md's JSON patch for public TLS, applied to the cuda overlay as it says: the orchestrator serves TLS
    from files on the mounted Secret, its probes stay on the plaintext health port, and the private key is not
    world-readable (a Secret volume without defaultMode is 0644), as the internal token and certificates are not."""
    from kakeya.runtime.security.tls import ServerTLS

    from .manifests import expand, render_over

    text = (K8S.parents[1] / "docs" / "deploy.md").read_text()
    (patch,) = re.findall(r"\*\*Public TLS\*\*.*?```yaml\n(.*?)```", text, re.DOTALL)
    orchestrator = {"kind": "Deployment", "name": "kakeya-orchestrator"}
    docs = render_over(tmp_path, "cuda", patches=[{"target": orchestrator, "patch": patch}])
    c = container(docs, "orchestrator")
    args = build_parser().parse_args(
        [expand(a, config_env(docs) | {"HOME": "/tmp"}) for a in c["command"][1:] + c["args"]]
    )
    assert ServerTLS.from_args(args).enabled
    for path in (args.tls_cert, args.tls_key):
        secret = _mounted_secret(docs, "orchestrator", path)
        assert secret.get("defaultMode", 0o644) & 0o007 == 0, f"{path} is world-readable"
    assert c["readinessProbe"]["grpc"]["port"] == args.health_port
