"""Soft-RoCE guests: the real kernel RDMA stack (rdma_rxe) in QEMU TCG guests.

Why a VM: the host kernel here has no RDMA and cannot load modules, and KVM does not boot
a stock kernel on these machines, but QEMU's software emulation does (~5 s to working rxe
devices).  The guest runs the *host's own* userland read-only over 9p (Python, the venv,
pyverbs 44, this checkout), so a payload is just a shell script run as root in the guest.

What a run looks like::

    run dir (host, rw 9p "run" → /run/ks in every guest)
      a.sh  b.sh            payloads, written by the harness
      a.rc  b.rc            exit status, written by the guest's init
      a.serial  b.serial    console logs (host side)
      anything the payloads write there (junit XML, JSON results)

       guest a                                      guest b
    +--------------------+   wire 0 (UDP pair  +--------------------+
    | eth0 198.18.1.1 ---+---- on 127.0.0.1) --+--- eth0 198.18.1.2 |
    | eth1 198.18.2.1 ---+---- wire 1 ---------+--- eth1 198.18.2.2 |
    |  rxe0 rxe1         |                     |  rxe0 rxe1         |
    +--------------------+                     +--------------------+

A *wire* is a pair of QEMU ``-netdev socket,udp=`` endpoints bound to 127.0.0.1: each end
sends its frames to the other's port, so a wire connects exactly two NICs (of one guest
or of two) and nothing else — no bridge, no tap, no route to the outside.

Build (``ensure_image``), cached outside the work tree in ``$KSPEEDFS_VM_CACHE``
(default ``/var/cache/kspeedfs-vm/<kernel version>/``), rebuilt only when its inputs
change: ``apt-get download`` of the kernel package that ``linux-image-amd64`` depends on,
unpacked with ``dpkg -x`` (never installed), ``depmod``; the uncompressed kernel (the xz
payload of the bzImage: ~3.5 s faster to boot under TCG than ``-kernel vmlinuz``); an
initramfs of busybox-static + the modules below in ``modprobe --show-depends`` order +
``init.sh``.  Host packages needed: qemu-system-x86, busybox-static, kmod (the ``run``
script's APT_PACKAGES).

Cleanup: every QEMU runs in its own process group, is waited for, and is killed by PID
(SIGTERM, then SIGKILL) on timeout or any exception; ``run_guests`` returns only when
all of them are gone.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import lzma
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
INIT = HERE / "init.sh"
CACHE = Path(os.environ.get("KSPEEDFS_VM_CACHE", "/var/cache/kspeedfs-vm"))
QEMU = "qemu-system-x86_64"
BUSYBOX = "/bin/busybox"
#: what the guest needs, dependencies resolved by modprobe.  crc32_generic: rxe asks the
#: crypto API for "crc32" and the initramfs has no module tree for request_module().
MODULES = ("virtio_pci virtio_net 9pnet_virtio 9p virtio_rng crc32_generic crc32-pclmul "
           "rdma_rxe ib_uverbs rdma_ucm sch_netem").split()
XZ_MAGIC = b"\xfd7zXZ\x00"
#: exit status of a guest that never reported one (crashed, timed out, no payload)
NO_STATUS = 125


class VMUnavailable(Exception):
    """QEMU or the guest image cannot be had here; the message says why (tests skip)."""


def unavailable() -> str | None:
    """Why guests cannot run here, or None."""
    if os.geteuid() != 0:
        return "guest harness needs root (depmod into the cache, apt-get download)"
    for exe, pkg in ((QEMU, "qemu-system-x86"), ("depmod", "kmod"), ("modprobe", "kmod"),
                     ("apt-get", "apt"), ("dpkg", "dpkg")):
        if shutil.which(exe) is None and not Path("/usr/sbin", exe).exists():
            return f"{exe} not found (apt-get install {pkg}, or ./run setup)"
    if not Path(BUSYBOX).exists():
        return f"{BUSYBOX} not found (apt-get install busybox-static)"
    return None


# ---------------------------------------------------------------------------- build

def _sh(*argv: str | Path, cwd: Path | None = None) -> str:
    res = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise VMUnavailable(f"{' '.join(map(str, argv))} failed ({res.returncode}): "
                            f"{(res.stderr or res.stdout).strip()[-500:]}")
    return res.stdout


def kernel_package() -> str:
    """The versioned image package ``linux-image-amd64`` currently depends on."""
    out = _sh("apt-cache", "depends", "linux-image-amd64")
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split()[1]
    raise VMUnavailable(f"apt-cache depends linux-image-amd64 names no kernel:\n{out}")


@dataclass(frozen=True)
class Image:
    kver: str
    kernel: Path
    initrd: Path


def _extract_vmlinux(vmlinuz: Path, out: Path) -> None:
    """The ELF kernel inside a bzImage: the xz stream after the real-mode stub."""
    data = vmlinuz.read_bytes()
    at = data.find(XZ_MAGIC)
    if at < 0:
        raise VMUnavailable(f"{vmlinuz}: no xz payload (kernel compressed otherwise?)")
    elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[at:])
    if elf[:4] != b"\x7fELF":
        raise VMUnavailable(f"{vmlinuz}: xz payload at {at} is not an ELF kernel")
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(elf)
    tmp.rename(out)


def _module_order(root: Path, kver: str) -> list[Path]:
    seen: dict[str, Path] = {}
    for m in MODULES:
        out = _sh("modprobe", "-d", root, "-S", kver, "--show-depends", m)
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and parts[1] not in seen:
                seen[parts[1]] = Path(parts[1])
    return list(seen.values())


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A ``newc`` cpio archive (name, mode, data); directories have empty data."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], 1):
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        out += hdr.encode() + nb
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def ensure_image(cache: Path = CACHE) -> Image:
    """Build (or reuse) the kernel + initramfs for the current Debian kernel package."""
    why = unavailable()
    if why:
        raise VMUnavailable(why)
    pkg = kernel_package()
    kver = pkg.removeprefix("linux-image-")
    d = cache / kver
    root = d / "root"
    d.mkdir(parents=True, exist_ok=True)
    vmlinuz = root / "boot" / f"vmlinuz-{kver}"
    if not vmlinuz.exists():
        log.info("vm: fetching %s", pkg)
        dl = d / "dl"
        shutil.rmtree(dl, ignore_errors=True)
        dl.mkdir()
        _sh("apt-get", "download", pkg, cwd=dl)
        (deb,) = dl.glob("*.deb")
        shutil.rmtree(root, ignore_errors=True)
        _sh("dpkg-deb", "-x", deb, root)
        shutil.rmtree(dl)
    if not (root / "lib/modules" / kver / "modules.dep").exists():
        _sh("depmod", "-b", root, kver)
    kernel = d / "vmlinux"
    if not kernel.exists():
        _extract_vmlinux(vmlinuz, kernel)
    mods = _module_order(root, kver)
    key = hashlib.sha256(INIT.read_bytes() + Path(BUSYBOX).read_bytes()
                         + "\n".join(map(str, mods)).encode()).hexdigest()[:16]
    initrd = d / f"initramfs-{key}.cpio.gz"
    if not initrd.exists():
        import gzip

        entries: list[tuple[str, int, bytes]] = [
            (n, 0o40755, b"") for n in ("bin", "dev", "proc", "sys", "host", "lib",
                                        "lib/modules")]
        entries.append(("bin/busybox", 0o100755, Path(BUSYBOX).read_bytes()))
        entries.append(("init", 0o100755, INIT.read_bytes()))
        names = []
        for ko in mods:
            entries.append((f"lib/modules/{ko.name}", 0o100644, ko.read_bytes()))
            names.append(ko.name)
        entries.append(("modules.order", 0o100644, ("\n".join(names) + "\n").encode()))
        tmp = initrd.with_suffix(".tmp")
        tmp.write_bytes(gzip.compress(_cpio_newc(entries), compresslevel=1))
        tmp.rename(initrd)
        for old in d.glob("initramfs-*.cpio.gz"):
            if old != initrd:
                old.unlink(missing_ok=True)
    return Image(kver, kernel, initrd)


# ---------------------------------------------------------------------------- guests

@dataclass(frozen=True)
class Nic:
    """One NIC: end ``end`` (0 or 1) of wire ``wire``, with IPv4 ``addr`` (CIDR)."""

    wire: int
    end: int
    addr: str


@dataclass
class GuestSpec:
    name: str
    nics: Sequence[Nic]
    payload: str                     # shell script body, run by /bin/sh in the guest
    rxe: bool = True
    loopwire: bool = False           # eth0/eth1 are the two ends of one wire
    mem_mb: int = 1024


@dataclass
class GuestResult:
    name: str
    rc: int
    serial: str
    wall_s: float
    boot_s: float | None = None      # guest uptime when its devices were ready

    @property
    def tail(self) -> str:
        return "\n".join(self.serial.splitlines()[-60:])


def _free_udp_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _mac(guest: int, nic: int) -> str:
    return f"52:54:00:4b:{guest:02x}:{nic:02x}"


def qemu_argv(image: Image, spec: GuestSpec, index: int, run_dir: Path,
              wire_ports: dict[int, tuple[int, int]]) -> list[str]:
    cmdline = (f"console=ttyS0 loglevel=4 panic=-1 ks.name={spec.name} "
               f"ks.ip={','.join(n.addr for n in spec.nics)} ks.rxe={int(spec.rxe)} "
               f"ks.loopwire={int(spec.loopwire)}")
    keep = guest_keep_paths()
    if keep:
        cmdline += f" ks.keep={','.join(keep)}"
    argv = [QEMU, "-accel", "tcg,thread=single", "-cpu", "max", "-smp", "1",
            "-m", str(spec.mem_mb), "-M", "pc", "-nodefaults", "-no-user-config",
            "-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
            "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", cmdline,
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                       "multidevs=remap,id=hostroot",
            "-virtfs", f"local,path={run_dir},mount_tag=run,security_model=none,"
                       "multidevs=remap,id=run",
            "-device", "virtio-rng-pci"]
    for i, nic in enumerate(spec.nics):
        mine, other = wire_ports[nic.wire][nic.end], wire_ports[nic.wire][1 - nic.end]
        argv += ["-netdev", f"socket,id=n{i},udp=127.0.0.1:{other},"
                            f"localaddr=127.0.0.1:{mine}",
                 "-device", f"virtio-net-pci,netdev=n{i},mac={_mac(index, i)}"]
    return argv


def guest_keep_paths() -> list[str]:
    """The checkout and the venv, when they live where the guest mounts tmpfs (/tmp,
    /var/tmp, /run): CI may clone into /tmp. Paths with spaces or commas cannot be passed
    on the kernel command line and are left out (the guest then cannot see them)."""
    import sys

    out = []
    for p in (str(REPO), sys.prefix):
        p = os.path.realpath(p)
        if p.startswith(("/tmp/", "/var/tmp/", "/run/")) and not any(c in p for c in " ,\t"):
            out.append(p)
    return out


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM then SIGKILL to this QEMU's process group, by PID; reap it."""
    if proc.poll() is not None:
        return
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_guests(specs: Sequence[GuestSpec], run_dir: Path, timeout: float = 300.0,
               image: Image | None = None) -> dict[str, GuestResult]:
    """Boot every guest at once, run their payloads, wait for all, clean up.

    Returns one :class:`GuestResult` per guest (``rc`` = the payload's exit status, or
    :data:`NO_STATUS` if the guest never reported one).  Never leaves a QEMU behind."""
    image = image or ensure_image()
    run_dir.mkdir(parents=True, exist_ok=True)
    wires = sorted({n.wire for s in specs for n in s.nics})
    ports = _free_udp_ports(2 * len(wires))
    wire_ports = {w: (ports[2 * i], ports[2 * i + 1]) for i, w in enumerate(wires)}
    procs: list[tuple[GuestSpec, subprocess.Popen[bytes], Path, float]] = []
    results: dict[str, GuestResult] = {}
    try:
        for i, spec in enumerate(specs):
            (run_dir / f"{spec.name}.sh").write_text(spec.payload)
            (run_dir / f"{spec.name}.rc").unlink(missing_ok=True)
            serial = run_dir / f"{spec.name}.serial"
            with open(serial, "wb") as out:
                proc = subprocess.Popen(qemu_argv(image, spec, i, run_dir, wire_ports),
                                        stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            log.info("vm: guest %s is QEMU pid %d", spec.name, proc.pid)
            procs.append((spec, proc, serial, time.monotonic()))
        deadline = time.monotonic() + timeout
        for spec, proc, serial, t0 in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("vm: guest %s timed out after %.0fs", spec.name, timeout)
            wall = time.monotonic() - t0
            _kill(proc)
            results[spec.name] = _result(spec, run_dir, serial, wall)
    finally:
        for _, proc, _, _ in procs:
            _kill(proc)
    return results


def _result(spec: GuestSpec, run_dir: Path, serial: Path, wall: float) -> GuestResult:
    text = serial.read_text(errors="replace") if serial.exists() else ""
    rc = NO_STATUS
    with contextlib.suppress(OSError, ValueError):
        rc = int((run_dir / f"{spec.name}.rc").read_text().strip())
    boot = None
    for line in text.splitlines():
        if "[ks-init" in line and "] ready:" in line:
            with contextlib.suppress(ValueError):
                boot = float(line.split("[ks-init ", 1)[1].split("]", 1)[0])
    return GuestResult(spec.name, rc, text, wall, boot)


def pytest_payload(args: str, *, env: dict[str, str] | None = None, python: str | None = None,
                   repo: Path = REPO) -> str:
    """A payload that runs pytest from this checkout inside the guest (read-only root:
    no bytecode, no cache provider)."""
    py = python or os.environ.get("KSPEEDFS_VM_PYTHON") or _venv_python()
    exports = "".join(f"export {k}='{v}'\n" for k, v in (env or {}).items())
    return (f"set -u\n{exports}cd {repo}\n"
            f"exec {py} -m pytest -p no:cacheprovider -q -rs {args}\n")


def _venv_python() -> str:
    import sys

    return sys.executable

