"""The CSI node plugin driven over its unix socket in the order kubelet uses, with real
kspeedfs mounts (embedded store) staged outside the plugin, real read-only bind mounts
into pods' target paths, and pods reading from mount namespaces of their own, every
byte checked (tests/fixtures/csi.py says what a real cluster adds).

Covered: Identity and NodeGetInfo/Capabilities; stage → publish → unpublish → unstage
with every call repeated; bad volume contexts and capabilities (one-line
INVALID_ARGUMENT / FAILED_PRECONDITION); a dataset or version that does not exist
(NOT_FOUND); an unreachable store (UNAVAILABLE); the plugin killed in the middle of a
stage and kubelet's retry; a version pinned at stage time across a re-import; two pods on one staged
volume, and Unstage refused while one is published; the plugin SIGKILLed and restarted
under a reading pod; the mount's daemon SIGKILLed under a published volume (the
supervisor resumes it); the daemon and supervisor both killed (reported abnormal,
staged again); a plugin of a new version handing staged mounts to new daemons
(the upgrade); two volumes staged at once; NodeGetVolumeStats; an inline ephemeral
volume.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.system import daemon_pid, is_mounted, supervisor_pid
from tests.fixtures.csi import (
    Plugin,
    Pod,
    cleanup_mounts,
    kubelet_paths,
    make_dataset,
    pb,
    wait_daemon_replaced,
)
from tests.fixtures.mounts import Cluster1, kspeedfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="FUSE and bind mounts need root")

CTX = {"dataset": "train"}


@pytest.fixture
def csi(tmp_path: Path) -> Iterator[tuple[Plugin, Path, Path]]:
    """A plugin serving an embedded store that holds ``train`` (version 1)."""
    src = make_dataset(tmp_path / "src")
    node = Cluster1(tmp_path)
    node.import_(src, "train")
    plugin = Plugin(node, tmp_path / "state")
    with cleanup_mounts(tmp_path):
        plugin.start()
        try:
            yield plugin, src, tmp_path
        finally:
            plugin.close()


def _error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    e = info.value
    assert "\n" not in e.details() and e.details(), e.details()
    return e


def _records(base: Path) -> list[Path]:
    return sorted((base / "state" / "volumes").glob("*.json"))


def _clean(read: dict[str, Any]) -> None:
    assert read["errors"] == [] and read["wrong"] == 0 and read["hung"] == 0, read
    assert read["mount_ns"] != os.readlink("/proc/self/ns/mnt")     # the pod's own namespace


def test_identity_and_node_info(csi) -> None:
    plugin, _, _ = csi
    info = plugin.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert info.name == "csi.kspeedfs.io" and info.vendor_version
    assert list(plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest()).capabilities) == []
    assert plugin.identity.Probe(pb.ProbeRequest()).ready.value is True
    assert plugin.node_stub.NodeGetInfo(pb.NodeGetInfoRequest()).node_id == "node-a"
    caps = plugin.node_stub.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest()).capabilities
    rpc = pb.NodeServiceCapability.RPC
    assert {c.rpc.type for c in caps} == {rpc.STAGE_UNSTAGE_VOLUME, rpc.GET_VOLUME_STATS,
                                          rpc.VOLUME_CONDITION}


def test_kubelet_order_every_call_twice_and_a_pod_reads_every_byte(csi) -> None:
    plugin, src, base = csi
    staging, target = kubelet_paths(base, "pv-train", "pod-1")
    for _ in range(2):
        plugin.stage("pv-train", staging, CTX)
    assert is_mounted(staging)
    daemon = daemon_pid(staging)
    for _ in range(2):
        plugin.publish("pv-train", staging, target)
    assert daemon_pid(staging) == daemon               # a repeat mounted nothing new
    with open("/proc/self/mountinfo") as f:
        assert sum(line.split()[4] == str(target) for line in f) == 1
    with pytest.raises(OSError), open(target / "d0" / "f00.bin", "r+b"):
        pass                                           # read-only whatever the pod asks
    pod = Pod(target, src, base)
    time.sleep(1.0)
    read = pod.stop()
    _clean(read)
    assert read["files"] >= 3
    for _ in range(2):
        plugin.unpublish("pv-train", target)
    assert not is_mounted(target) and not target.exists()
    for _ in range(2):
        plugin.unstage("pv-train", staging)
    assert not is_mounted(staging)
    assert _records(base) == []


def test_volume_context_and_capability_errors_are_one_line(csi) -> None:
    plugin, _, base = csi
    staging, _ = kubelet_paths(base, "pv-bad", "pod-1")
    invalid = [
        {}, {"dataset": "no such/name"}, {"dataset": "train", "version": "0"},
        {"dataset": "train", "version": "two"}, {"dataset": "train", "preload": "maybe"},
        {"dataset": "train", "colour": "blue"}, {"dataset": "train", "store.path": "/etc"},
        {"dataset": "train", "cache.disk_dir": "/"}, {"dataset": "train", "cache.memory": "lots"},
        {"dataset": "train", "priority": "5"},
        {"dataset": "train", "preload": "true"},       # needs the etcd store
    ]
    for context in invalid:
        e = _error(plugin.stage, "pv-bad", staging, context)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (context, e.details())
    e = _error(plugin.stage, "", staging, CTX)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "volume_id" in e.details()
    e = _error(plugin.stage, "pv-bad", staging, CTX, capability=pb.VolumeCapability())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    mode = pb.VolumeCapability.AccessMode
    writer = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                 access_mode=mode(mode=mode.SINGLE_NODE_WRITER))
    block = pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                                access_mode=mode(mode=mode.MULTI_NODE_READER_ONLY))
    for capability in (writer, block):
        e = _error(plugin.stage, "pv-bad", staging, CTX, capability=capability)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
    _, target = kubelet_paths(base, "pv-bad", "pod-1")
    e = _error(plugin.publish, "pv-bad", staging, target)           # never staged
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
    e = _error(plugin.publish, "pv-bad", None, target, CTX)         # no stage, not inline
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
    assert not is_mounted(staging) and not is_mounted(target) and _records(base) == []


def test_a_dataset_or_version_that_does_not_exist_is_not_found(csi) -> None:
    plugin, _, base = csi
    staging, _ = kubelet_paths(base, "pv-none", "pod-1")
    for context in ({"dataset": "nope"}, {"dataset": "train", "version": "9"}):
        e = _error(plugin.stage, "pv-none", staging, context)
        assert e.code() == grpc.StatusCode.NOT_FOUND and "does not exist" in e.details(), e.details()
    assert not is_mounted(staging) and _records(base) == []


def test_an_unreachable_store_is_unavailable(tmp_path: Path) -> None:
    """The plugin on an etcd store nothing answers at: Stage is UNAVAILABLE (kubelet
    retries), in one line, and nothing is mounted or recorded."""
    node = Cluster1(tmp_path)
    secret = tmp_path / "secret"
    kspeedfs(["secret", "generate", str(secret)])
    with socket.socket() as s:                 # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plugin = Plugin(node, tmp_path / "state", store=[
        "--etcd", f"http://127.0.0.1:{port}", "--set", f"cluster.secret_file={secret}",
        "--set", "store.etcd_timeout=1", "--set", f"log.dir={node.logs}"])
    staging, _ = kubelet_paths(tmp_path, "pv-train", "pod-1")
    with cleanup_mounts(tmp_path):
        plugin.start()
        try:
            e = _error(plugin.stage, "pv-train", staging, CTX)
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
        finally:
            plugin.close()
    assert not is_mounted(staging) and _records(tmp_path) == []


def test_the_plugin_sigkilled_in_the_middle_of_a_stage_converges_on_kubelets_retry(csi) -> None:
    """SIGKILL while ``kspeedfs mount`` runs for a Stage: the call fails (kubelet sees
    UNAVAILABLE), the mount it started finishes on its own; kubelet's retry, answered by
    a new plugin, succeeds with exactly one mount at the staging path."""
    plugin, src, base = csi
    staging, target = kubelet_paths(base, "pv-train", "pod-1")
    failed: list[grpc.RpcError] = []

    def stage() -> None:
        try:
            plugin.stage("pv-train", staging, CTX)
        except grpc.RpcError as e:
            failed.append(e)

    caller = threading.Thread(target=stage)
    caller.start()
    deadline = time.monotonic() + 30
    while not _records(base) and time.monotonic() < deadline:   # the record comes first
        time.sleep(0.01)
    os.kill(plugin.proc.pid, signal.SIGKILL)   # the channel open, as kubelet's is
    caller.join(timeout=60)
    assert failed and failed[0].code() == grpc.StatusCode.UNAVAILABLE, failed
    plugin.kill()
    plugin.start()
    for attempt in range(5):                   # kubelet's retries, with back-off
        try:
            plugin.stage("pv-train", staging, CTX)
            break
        except grpc.RpcError as e:             # the first mount finished under the retry's
            assert e.code() == grpc.StatusCode.INTERNAL and attempt < 4, e.details()
            time.sleep(0.5)
    with open("/proc/self/mountinfo") as f:
        assert sum(line.split()[4] == str(staging) for line in f) == 1
    plugin.publish("pv-train", staging, target)
    pod = Pod(target, src, base)
    time.sleep(0.3)
    _clean(pod.stop())
    plugin.unpublish("pv-train", target)
    plugin.unstage("pv-train", staging)
    assert not is_mounted(staging) and _records(base) == []


def test_the_version_is_pinned_at_stage_time(csi) -> None:
    plugin, src, base = csi
    staging, target = kubelet_paths(base, "pv-train", "pod-1")
    plugin.stage("pv-train", staging, CTX)
    plugin.publish("pv-train", staging, target)
    first = (target / "d0" / "f00.bin").read_bytes()
    changed = base / "src2"
    make_dataset(changed, seed=8)
    plugin.node.import_(changed, "train")                          # version 2
    assert (target / "d0" / "f00.bin").read_bytes() == first == (src / "d0" / "f00.bin").read_bytes()
    assert "train@1" in plugin.stats("pv-train", target).volume_condition.message
    plugin.stage("pv-train", staging, CTX)                         # a repeat: still 1
    assert "train@1" in plugin.stats("pv-train", target).volume_condition.message
    staging2, target2 = kubelet_paths(base, "pv-train-now", "pod-2")
    plugin.stage("pv-train-now", staging2, CTX)
    plugin.publish("pv-train-now", staging2, target2)
    assert "train@2" in plugin.stats("pv-train-now", target2).volume_condition.message
    assert (target2 / "d0" / "f00.bin").read_bytes() == (changed / "d0" / "f00.bin").read_bytes()
    for vid, s, t in (("pv-train", staging, target), ("pv-train-now", staging2, target2)):
        plugin.unpublish(vid, t)
        plugin.unstage(vid, s)


def test_two_pods_share_one_stage_which_is_not_unstaged_while_one_reads(csi) -> None:
    plugin, src, base = csi
    staging, target1 = kubelet_paths(base, "pv-train", "pod-1")
    _, target2 = kubelet_paths(base, "pv-train", "pod-2")
    plugin.stage("pv-train", staging, CTX)
    plugin.publish("pv-train", staging, target1)
    plugin.publish("pv-train", staging, target2)
    pods = [Pod(target1, src, base), Pod(target2, src, base)]
    time.sleep(0.5)
    _clean(pods[0].stop())
    plugin.unpublish("pv-train", target1)
    e = _error(plugin.unstage, "pv-train", staging)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and str(target2) in e.details(), e.details()
    assert is_mounted(staging) and is_mounted(target2)
    time.sleep(0.5)
    read = pods[1].stop()
    _clean(read)
    plugin.unpublish("pv-train", target2)
    plugin.unstage("pv-train", staging)
    assert not is_mounted(staging) and _records(base) == []


def test_the_plugin_sigkilled_and_restarted_while_a_pod_reads(csi) -> None:
    """Three SIGKILLs of the plugin, each followed by a new one, while a pod reads: the
    staged mount (daemon, supervisor) is untouched, the pod sees no error, and the last
    plugin answers Publish, Unpublish and Unstage from the records on disk."""
    plugin, src, base = csi
    staging, target = kubelet_paths(base, "pv-train", "pod-1")
    plugin.stage("pv-train", staging, CTX)
    plugin.publish("pv-train", staging, target)
    daemon, supervisor = daemon_pid(staging), supervisor_pid(staging)
    assert daemon and supervisor
    pod = Pod(target, src, base)
    restarts = []
    for _ in range(3):
        time.sleep(0.5)
        plugin.kill(signal.SIGKILL)
        assert is_mounted(staging) and is_mounted(target)
        restarts.append(plugin.start())
    time.sleep(0.5)
    read = pod.stop()
    _clean(read)
    assert (daemon_pid(staging), supervisor_pid(staging)) == (daemon, supervisor)
    plugin.stage("pv-train", staging, CTX)                         # kubelet's repeats
    plugin.publish("pv-train", staging, target)
    assert daemon_pid(staging) == daemon
    e = _error(plugin.unstage, "pv-train", staging)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
    plugin.unpublish("pv-train", target)
    plugin.unstage("pv-train", staging)
    assert not is_mounted(staging) and _records(base) == []
    print(f"\nplugin SIGKILLed 3 times under a pod: {read['files']} files, {read['reads']} reads "
          f"of 128 KiB ({read['bytes'] / 1e6:.0f} MB), 0 errors, longest read "
          f"{read['longest_read'] * 1e3:.1f} ms; a new plugin answered Probe after "
          + ", ".join(f"{s:.2f}" for s in restarts) + " s")


def test_a_plugin_of_another_version_hands_staged_mounts_to_new_daemons(csi) -> None:
    """The upgrade: the records say another kspeedfs version's daemon serves the staged
    mount; the plugin that starts hands it over (``kspeedfs mount --upgrade``) before it
    serves, under a reading pod: a new daemon, no error."""
    plugin, src, base = csi
    staging, target = kubelet_paths(base, "pv-train", "pod-1")
    plugin.stage("pv-train", staging, CTX)
    plugin.publish("pv-train", staging, target)
    old = daemon_pid(staging)
    pod = Pod(target, src, base)
    time.sleep(0.5)
    plugin.kill(signal.SIGKILL)
    (record,) = _records(base)
    data = json.loads(record.read_text())
    assert data["mounted_by"] and len(data["units"]) == 1
    record.write_text(json.dumps({**data, "mounted_by": "0.0.1"}))
    plugin.start()
    new = wait_daemon_replaced(staging, old)
    time.sleep(0.5)
    read = pod.stop()
    _clean(read)
    data = json.loads(record.read_text())
    assert data["mounted_by"] != "0.0.1" and len(data["units"]) == 2
    assert "handed from kspeedfs 0.0.1" in plugin.log.read_text()
    plugin.kill(signal.SIGKILL)                     # a restart of the same version: no upgrade
    plugin.start()
    assert daemon_pid(staging) == new
    plugin.unpublish("pv-train", target)
    plugin.unstage("pv-train", staging)
    assert not is_mounted(staging)
    print(f"\nstaged mount upgraded by a new plugin under a pod: {read['reads']} reads, "
          f"0 errors, longest read {read['longest_read'] * 1e3:.0f} ms")


def test_the_mount_daemon_sigkilled_under_a_published_volume(csi) -> None:
    plugin, src, base = csi
    staging, target = kubelet_paths(base, "pv-train", "pod-1")
    plugin.stage("pv-train", staging, CTX)
    plugin.publish("pv-train", staging, target)
    pod = Pod(target, src, base)
    for _ in range(2):
        time.sleep(0.5)
        old = daemon_pid(staging)
        assert old
        os.kill(old, signal.SIGKILL)
        wait_daemon_replaced(staging, old)
    time.sleep(0.5)
    read = pod.stop()
    _clean(read)
    print(f"\nmount daemon SIGKILLed twice under a published volume: {read['files']} files, "
          f"{read['reads']} reads, 0 errors, longest read {read['longest_read'] * 1e3:.0f} ms")
    assert not plugin.stats("pv-train", target).volume_condition.abnormal
    plugin.unpublish("pv-train", target)
    plugin.unstage("pv-train", staging)
    assert not is_mounted(staging)


def test_a_dead_mount_is_reported_abnormal_and_staged_again(csi) -> None:
    """The mount's daemon and supervisor SIGKILLed at once (the one fault a supervisor
    cannot survive): NodeGetVolumeStats reports the volume abnormal, in one line; the
    Stage kubelet repeats mounts it again over the dead one; a new pod reads every byte;
    the dead pod's bind unpublishes cleanly."""
    plugin, src, base = csi
    staging, target = kubelet_paths(base, "pv-train", "pod-1")
    plugin.stage("pv-train", staging, CTX)
    plugin.publish("pv-train", staging, target)
    pids = [daemon_pid(staging), supervisor_pid(staging)]
    assert all(pids)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10          # ECONNABORTED or EIO while the fds close
    while time.monotonic() < deadline:
        condition = plugin.stats("pv-train", target).volume_condition
        if "not connected" in condition.message:
            break
        time.sleep(0.1)
    assert condition.abnormal and "not connected" in condition.message, condition
    assert "\n" not in condition.message
    plugin.stage("pv-train", staging, CTX)
    assert daemon_pid(staging) not in (None, pids[0])
    assert not plugin.stats("pv-train", staging).volume_condition.abnormal
    _, target2 = kubelet_paths(base, "pv-train", "pod-2")
    plugin.publish("pv-train", staging, target2)
    pod = Pod(target2, src, base)
    time.sleep(0.3)
    _clean(pod.stop())
    for t in (target, target2):
        plugin.unpublish("pv-train", t)
    plugin.unstage("pv-train", staging)
    assert not is_mounted(staging) and not is_mounted(target) and _records(base) == []


def test_two_volumes_staged_at_once_are_served_in_parallel(csi) -> None:
    """kubelet stages different volumes concurrently: the calls run on the server's
    threads at the same time (one lock per volume), and each gets its own mount."""
    plugin, src, base = csi
    paths = {vid: kubelet_paths(base, vid, f"pod-{vid}") for vid in ("pv-a", "pv-b")}
    errors: list[Exception] = []

    def stage(vid: str) -> None:
        try:
            plugin.stage(vid, paths[vid][0], CTX)
            plugin.publish(vid, paths[vid][0], paths[vid][1])
        except grpc.RpcError as e:
            errors.append(e)

    callers = [threading.Thread(target=stage, args=(vid,)) for vid in paths]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert errors == []
    assert daemon_pid(paths["pv-a"][0]) != daemon_pid(paths["pv-b"][0])
    for vid, (staging, target) in paths.items():
        assert (target / "d0" / "f00.bin").read_bytes() == (src / "d0" / "f00.bin").read_bytes()
        plugin.unpublish(vid, target)
        plugin.unstage(vid, staging)
    assert _records(base) == []


def test_volume_stats(csi) -> None:
    plugin, src, base = csi
    staging, target = kubelet_paths(base, "pv-train", "pod-1")
    plugin.stage("pv-train", staging, CTX)
    plugin.publish("pv-train", staging, target)
    stats = plugin.stats("pv-train", target)
    usage = {u.unit: u for u in stats.usage}
    files = [p for p in src.rglob("*") if p.is_file()]
    entries = len(list(src.rglob("*"))) + 1                        # and the root
    size = sum(p.stat().st_size for p in files)
    assert size <= usage[pb.VolumeUsage.BYTES].total < size + 4096 * len(files) + 4096
    assert usage[pb.VolumeUsage.BYTES].available == 0
    assert usage[pb.VolumeUsage.INODES].total == entries
    assert not stats.volume_condition.abnormal and "train@1" in stats.volume_condition.message
    assert plugin.stats("pv-train", staging).usage                 # the staging path too
    for vid, path, code in (("pv-other", target, grpc.StatusCode.NOT_FOUND),
                            ("pv-train", base / "nowhere", grpc.StatusCode.NOT_FOUND),
                            ("pv-train", src, grpc.StatusCode.NOT_FOUND)):
        assert _error(plugin.stats, vid, path).code() == code
    plugin.unpublish("pv-train", target)
    plugin.unstage("pv-train", staging)


def test_an_inline_ephemeral_volume(csi) -> None:
    plugin, src, base = csi
    _, target = kubelet_paths(base, "csi-0a1b2c", "pod-1")
    context = {**CTX, "csi.storage.k8s.io/ephemeral": "true", "csi.storage.k8s.io/pod.name": "pod-1"}
    for _ in range(2):
        plugin.publish("csi-0a1b2c", None, target, context)
    internal = [p for p in (base / "state" / "ephemeral").iterdir()]
    assert len(internal) == 1 and is_mounted(internal[0])
    pod = Pod(target, src, base)
    time.sleep(0.5)
    _clean(pod.stop())
    for _ in range(2):
        plugin.unpublish("csi-0a1b2c", target)
    assert not is_mounted(target) and not is_mounted(internal[0]) and _records(base) == []
