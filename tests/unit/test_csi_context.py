"""The CSI plugin's pure parts: a volume context → the ``kspeedfs mount`` arguments
(kspeedfs/csi/context.py), the systemd stager's command line (csi/stager.py), the
on-disk records (csi/state.py) and the stubs generated from csi.proto (csi/stubs.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.csi import context, stubs
from kspeedfs.csi.errors import InvalidArgument
from kspeedfs.csi.stager import SystemdStager
from kspeedfs.csi.state import StateDir, VolumeRecord


def test_a_full_context_becomes_mount_arguments() -> None:
    spec = context.parse({"dataset": "imagenet", "version": "3", "preload": "True",
                          "priority": "5", "cache.memory": "8GiB", "fuse.prefetch_chunks": "8",
                          "csi.storage.k8s.io/pod.name": "trainer-0"})
    assert (spec.dataset, spec.version, spec.preload, spec.priority) == ("imagenet", 3, True, 5)
    assert spec.mount_args(3) == ["--version", "3", "--allow-other", "--unload-on-exit",
                                  "--priority", "5", "--set", "cache.memory=8GiB",
                                  "--set", "fuse.prefetch_chunks=8"]


def test_the_smallest_context_pins_nothing_itself() -> None:
    spec = context.parse({"dataset": "imagenet"})
    assert spec.version is None and not spec.preload and not spec.ephemeral
    assert spec.mount_args(7) == ["--version", "7", "--allow-other"]


@pytest.mark.parametrize("ctx", [
    {}, {"dataset": ""}, {"dataset": "a b"}, {"dataset": "x", "version": "-1"},
    {"dataset": "x", "preload": "yes"}, {"dataset": "x", "priority": "1"},
    {"dataset": "x", "preload": "true", "priority": "5000"}, {"dataset": "x", "Dataset": "y"},
    {"dataset": "x", "fuse.engine": "pyfuse3"}, {"dataset": "x", "fuse.io_uring": "auto"},
    {"dataset": "x", "source.secret_access_key": "k"}, {"dataset": "x", "log.dir": "/etc"},
])
def test_a_bad_context_is_one_line(ctx: dict[str, str]) -> None:
    with pytest.raises(InvalidArgument) as e:
        context.parse(ctx)
    assert "\n" not in str(e.value)


def test_a_setting_value_is_checked_by_the_callers_check() -> None:
    def check(key: str, value: str) -> None:
        raise InvalidArgument(f"{key}: bad {value}")

    with pytest.raises(InvalidArgument, match="cache.memory: bad x"):
        context.parse({"dataset": "d", "cache.memory": "x"}, check)


def test_the_systemd_stager_runs_a_oneshot_unit_that_outlives_its_start() -> None:
    cmd = SystemdStager().command("kspeedfs-csi-ab", ["/usr/local/bin/kspeedfs", "mount", "d", "/s"])
    assert cmd[:2] == ["systemd-run", "--unit=kspeedfs-csi-ab"]
    assert {"--collect", "--property=Type=oneshot", "--property=RemainAfterExit=yes"} <= set(cmd)
    assert cmd[cmd.index("--"):] == ["--", "/usr/local/bin/kspeedfs", "mount", "d", "/s"]
    assert not any("RootDirectory" in a for a in cmd)


def test_the_systemd_stager_in_a_copied_root_shares_kubelets_directory_with_the_host() -> None:
    cmd = SystemdStager(root="/var/lib/kspeedfs/root/0.1.0").command("u", ["kspeedfs"])
    props = [a.partition("=")[2] for a in cmd if a.startswith("--property=")]
    assert "RootDirectory=/var/lib/kspeedfs/root/0.1.0" in props
    assert "MountFlags=shared" in props and "MountAPIVFS=yes" in props
    bind = next(p for p in props if p.startswith("BindPaths="))
    assert {"/var/lib/kubelet", "/run/kspeedfs", "/etc/kspeedfs"} <= set(bind[10:].split())


def test_records_survive_a_new_state_dir_object(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    record = VolumeRecord("pv/1", "/s", "d", 2, {"dataset": "d"}, ["u"], publishes=["/t1"])
    state.put(record)
    again = StateDir(tmp_path)
    assert again.get("pv/1") == record and list(again) == [record]
    again.remove("pv/1")
    assert again.get("pv/1") is None and list(again) == []


def test_the_stubs_speak_the_spec_field_numbers() -> None:
    pb, _ = stubs.load()
    fields = {f.name: f.number for f in pb.NodePublishVolumeRequest.DESCRIPTOR.fields}
    assert fields == {"volume_id": 1, "publish_context": 2, "staging_target_path": 3,
                      "target_path": 4, "volume_capability": 5, "readonly": 6, "secrets": 7,
                      "volume_context": 8}
    assert pb.DESCRIPTOR.package == "csi.v1"
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["Node"].methods] == [
        "NodeStageVolume", "NodeUnstageVolume", "NodePublishVolume", "NodeUnpublishVolume",
        "NodeGetVolumeStats", "NodeGetCapabilities", "NodeGetInfo"]


def test_the_plugin_refuses_a_tcp_endpoint_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kspeedfs.cli.app", "csi", "--endpoint",
                           "tcp://0.0.0.0:10000", "--state-dir", str(tmp_path / "state"),
                           "--store", str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("kspeedfs csi: error: --endpoint tcp://")


# -- fuzzed: a volume context is whatever a PV's author wrote, relayed by kubelet ----------

_KNOWN = st.sampled_from(["version", "preload", "priority", context.EPHEMERAL_KEY,
                          "csi.storage.k8s.io/pod.name", *sorted(context.SAFE_KEYS)])
_ODD = st.sampled_from(["Dataset", "fuse", ".", "", "store.etcd", "source.secret_access_key",
                        "fuse.engine", "log.dir"]) | st.text(max_size=24)
_PLAUSIBLE = st.sampled_from(["", "true", "False", "0", "1", "8", "-1", "5000", "0.5", "1GiB",
                              "debug", "127.0.0.1:0", "imagenet", "a b", "--set", "x=y", "1e3",
                              "nan", "\n"])
_VALUES = _PLAUSIBLE | st.text(max_size=24)
#: mostly known keys (so that many contexts parse), now and then one that is not
_CONTEXTS = st.builds(lambda known, odd: {**known, **odd},
                      st.dictionaries(_KNOWN, _PLAUSIBLE, max_size=3),
                      st.just({}) | st.dictionaries(_ODD, _VALUES, max_size=1))


def _config_check(key: str, value: str) -> None:
    """The plugin's check (cli/csi.py): the config loader with ``key=value`` set."""
    from kspeedfs.config import load
    from kspeedfs.errors import ConfigError

    try:
        load(None, {key: value})
    except ConfigError as e:
        raise InvalidArgument(f"volume context {key}: {e}") from None


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_CONTEXTS, st.sampled_from([True, True, True, False]))
def test_fuzz_any_context_is_a_spec_or_one_line(ctx: dict[str, str], named: bool) -> None:
    """Any context parses or is refused in one line; what parses mounts only what it may:
    a valid dataset name, a positive version, allowed keys with the values it was given,
    each ``--set`` one argument (no option smuggled in through a value)."""
    if named:
        ctx = {"dataset": "imagenet", **ctx}
    try:
        spec = context.parse(ctx, _config_check)
    except InvalidArgument as e:
        assert "\n" not in str(e), str(e)
        return
    assert spec.dataset == ctx["dataset"]
    assert spec.version == (int(ctx["version"]) if ctx.get("version") else None)
    assert spec.version is None or spec.version >= 1
    args = spec.mount_args(7)
    assert args[:3] == ["--version", "7", "--allow-other"]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert [s.partition("=")[0] for s in sets] == sorted(k for k in ctx if "." in k
                                                         and not k.startswith(context.KUBELET_PREFIX))
    assert all(s.partition("=")[0] in context.SAFE_KEYS and s.partition("=")[2] == ctx[s.partition("=")[0]]
               for s in sets)
    assert len(args) == 3 + 2 * len(sets) + (3 if spec.preload else 0)
