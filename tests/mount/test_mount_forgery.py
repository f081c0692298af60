"""A real mount against a real etcd in which an attacker without the secret forged the
next version of the dataset: the mount refuses it, ``kspeedfs ls`` does not
list it, and the genuine version, mounted by number, serves the genuine bytes.
"""
from __future__ import annotations

import os
import secrets
import uuid
from pathlib import Path

from bench.system import daemon_pid, is_mounted, unmount
from kspeedfs.config import StoreConfig
from kspeedfs.manifest.store.etcd import EtcdStore
from tests.etcd.test_etcd_forgery import forge_version
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.mounts import CHUNK, assert_same_tree, kspeedfs, make_tree


def test_mount_refuses_forged_version(etcd_server: EtcdServer, tmp_path: Path) -> None:
    prefix = f"/ksm-{uuid.uuid4().hex[:12]}/"
    secret = tmp_path / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    common = ["--etcd", etcd_server.endpoint, "--set", f"store.etcd_prefix={prefix}",
              "--set", f"cluster.secret_file={secret}", "--set", f"log.dir={tmp_path / 'log'}",
              "--set", "cluster.peers=false"]
    src = make_tree(tmp_path / "src", small_files=50)
    kspeedfs(["import", str(src), "--name", "ds", "--chunk-size", str(CHUNK), "-q", *common])
    make_tree(tmp_path / "evil" / "src", small_files=50, seed=666)
    with EtcdStore(StoreConfig(backend="etcd", etcd=[etcd_server.endpoint], etcd_prefix=prefix)) as raw:
        forge_version(raw, tmp_path / "evil", "ds", 2, None)

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        proc = kspeedfs(["mount", "ds", str(mnt), *common], check=False)
        assert proc.returncode != 0 and not is_mounted(mnt), proc.stderr
        assert "v2/info" in proc.stderr and "refused" in proc.stderr, proc.stderr

        ls = kspeedfs(["ls", *common])
        assert "ds" not in ls.stdout.split() and "refusing etcd key" in ls.stderr, ls

        kspeedfs(["mount", "ds", str(mnt), "--version", "1", *common])
        assert is_mounted(mnt)
        assert assert_same_tree(src, mnt) > 0          # the genuine bytes, every file
    finally:
        if is_mounted(mnt):
            unmount(mnt, daemon_pid(mnt), timeout=10.0)
