"""The Kubernetes manifests (mount/kubernetes/) are valid objects for two supported
minor versions, strictly (an unknown field fails), as files and as kustomize renders
them with every component; the commands they run parse with the real CLI; the image
installs what ./run installs. Offline: kubernetes-validate's bundled schemas, and
kubectl's built-in kustomize when kubectl is on PATH. Nothing here talks to a cluster."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "mount" / "kubernetes"
VERSIONS = ("1.36.0", "1.37.0")
#: kinds from CRDs kubernetes-validate has no schema for
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
COMPONENTS = ("etcd", "monitoring", "rdma")


def _objects(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _manifests() -> dict[Path, list[dict]]:
    return {p: _objects(p.read_text()) for p in sorted(KUBE.rglob("*.yaml"))
            if p.name != "kustomization.yaml"}


def _validate(obj: dict, version: str) -> None:
    if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
        with pytest.raises(kv.utils.SchemaNotFoundError):
            kv.validate(obj, version, strict=True)
        return
    try:
        kv.validate(obj, version, strict=True)
    except kv.utils.ValidationError as e:
        raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} on {version}: "
                             f"{e.message} at {list(e.path)}") from None


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_strictly(version: str) -> None:
    files = _manifests()
    assert len(files) >= 10
    for objects in files.values():
        for obj in objects:
            _validate(obj, version)


def test_every_file_is_in_a_kustomization_or_an_example() -> None:
    listed = set()
    for k in KUBE.rglob("kustomization.yaml"):
        doc = yaml.safe_load(k.read_text())
        listed |= {(k.parent / r).resolve() for r in doc.get("resources", [])}
        listed |= {(k.parent / c).resolve() for c in doc.get("components", [])}
        for g in doc.get("configMapGenerator", []):
            listed |= {(k.parent / f).resolve() for f in g.get("files", [])}
    for p in _manifests():
        assert p.resolve() in listed or p.parent.name == "examples", p
    assert (KUBE / "kspeedfs.toml").resolve() in listed
    assert {KUBE / c for c in COMPONENTS} <= {p.parent for p in KUBE.rglob("kustomization.yaml")}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not on PATH")
@pytest.mark.parametrize("version", VERSIONS)
def test_kustomize_renders_the_base_with_every_component_validly(tmp_path: Path, version: str) -> None:
    overlay = tmp_path / "all"
    shutil.copytree(KUBE, overlay / "base", ignore=shutil.ignore_patterns("Containerfile"))
    base = yaml.safe_load((overlay / "base" / "kustomization.yaml").read_text())
    base["components"] = list(COMPONENTS)
    (overlay / "base" / "kustomization.yaml").write_text(yaml.safe_dump(base))
    out = subprocess.run(["kubectl", "kustomize", str(overlay / "base")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    objects = _objects(out.stdout)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("CSIDriver", "csi.kspeedfs.io"), ("DaemonSet", "kspeedfs-csi-node"),
            ("DaemonSet", "kspeedfs-node"), ("StatefulSet", "kspeedfs-etcd"),
            ("ServiceMonitor", "kspeedfs-node"), ("ConfigMap", "kspeedfs-config")} <= kinds
    for obj in objects:
        _validate(obj, version)
        if obj["kind"] not in ("Namespace", "CSIDriver"):
            assert obj["metadata"].get("namespace") == "kspeedfs", obj["metadata"]
    node = next(o for o in objects if (o["kind"], o["metadata"]["name"]) == ("DaemonSet", "kspeedfs-node"))
    limits = node["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["rdma/hca_shared_devices_a"] == "1"              # the rdma component
    images = {c["image"] for o in objects if o["kind"] == "DaemonSet"
              for c in o["spec"]["template"]["spec"]["containers"]}
    assert "ghcr.io/kspeedfs/kspeedfs:0.1.0" in images


def _kspeedfs_argv(script: str) -> list[str]:
    """The ``kspeedfs ...`` arguments an init/container script execs, shell variables made
    placeholders."""
    line = re.search(r"exec /usr/local/bin/kspeedfs (.*)", script.replace("\\\n", " ")).group(1)
    return shlex.split(re.sub(r"\$\(?\{?(\w+)\)?\}?", r"X\1", line))


def test_the_commands_the_manifests_run_parse_with_the_cli() -> None:
    from kspeedfs.cli.app import build_parser

    files = _manifests()
    (csi,) = files[KUBE / "csi-node.yaml"]
    plugin = next(c for c in csi["spec"]["template"]["spec"]["containers"] if c["name"] == "kspeedfs-csi")
    args = build_parser().parse_args(_kspeedfs_argv(plugin["args"][0]))
    assert (args.command, args.stager, args.endpoint) == ("csi", "systemd", "unix:///csi/csi.sock")
    (node,) = files[KUBE / "node.yaml"]
    container = node["spec"]["template"]["spec"]["containers"][0]
    argv = [a.replace("$(NODE_NAME)", "node-1") for a in container["args"]]   # kubelet expands it
    assert build_parser().parse_args(argv).command == "node"
    preload = files[KUBE / "examples" / "preload-job.yaml"][0]
    job = preload["spec"]["template"]["spec"]["containers"][0]
    assert build_parser().parse_args(job["args"]).command == "preload"
    from kspeedfs.csi import context

    for objects in files.values():
        for obj in objects:
            attrs = (obj.get("spec", {}).get("csi") or {}).get("volumeAttributes")
            if attrs:
                context.parse(attrs)                      # a PV's context is one the plugin takes


def test_the_image_installs_what_run_setup_installs() -> None:
    run = (ROOT / "run").read_text()
    apt = set(re.search(r"APT_PACKAGES=\(([^)]*)\)", run).group(1).split()) - {"#"}
    apt = {p for p in apt if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", p)}
    image = (KUBE / "Containerfile").read_text()
    listed = set(re.search(r'ARG APT_PACKAGES="([^"]*)"', image).group(1).replace("\\\n", " ").split())
    # the guest test lane's, and the lint's (./run lint)
    assert apt - listed == {"qemu-system-x86", "busybox-static", "clang-format"}
    assert listed <= apt
    assert "[csi]" in image and "kspeedfs.csi.stubs" in image
