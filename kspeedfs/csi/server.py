"""The gRPC side of the plugin: the Identity and Node servicers over a unix socket.

Each RPC is a few lines: unpack the request, call ``node.py`` (under the volume's lock
for stage, unstage, publish and unpublish), pack the response. :func:`csi_call` is the
one place an outcome becomes a status: a :class:`~kspeedfs.csi.errors.CsiError` is its
code and its one-line message, an ``OSError`` is INTERNAL with its one line, anything
else is INTERNAL "internal error" with the traceback in the log; every call is logged
once with its duration.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc

from . import node, stubs
from .errors import CsiError, InvalidArgument

log = logging.getLogger(__name__)

DRIVER_NAME = "csi.kspeedfs.io"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kspeedfs")
    except PackageNotFoundError:
        return "0+unknown"


kspeedfs_version = _version()

pb, pb_grpc = stubs.load()

F = TypeVar("F", bound=Callable[..., Any])


def csi_call(fn: F) -> F:
    @functools.wraps(fn)
    def call(self: Any, request: Any, ctx: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        what = f"{fn.__name__}({getattr(request, 'volume_id', '')})"
        try:
            reply = fn(self, request, ctx)
        except CsiError as e:
            message = " ".join(str(e).split())
            log.info("%s: %s %s (%.3f s)", what, e.code.name, message, time.monotonic() - t0)
            ctx.abort(e.code, message)
        except OSError as e:
            message = f"{e.filename}: {e.strerror}" if e.filename else str(e)
            log.warning("%s: %s (%.3f s)", what, message, time.monotonic() - t0)
            ctx.abort(grpc.StatusCode.INTERNAL, message)
        except Exception as e:
            log.error("%s: internal error: %r", what, e)
            log.debug("exception information:", exc_info=e)
            ctx.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        log.info("%s: OK (%.3f s)", what, time.monotonic() - t0)
        return reply
    return call  # type: ignore[return-value]


class Identity(pb_grpc.IdentityServicer):  # type: ignore[name-defined,misc]  # generated at run time
    def __init__(self, plugin: node.Plugin) -> None:
        self.plugin = plugin

    @csi_call
    def GetPluginInfo(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=kspeedfs_version)

    @csi_call
    def GetPluginCapabilities(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        return pb.GetPluginCapabilitiesResponse()    # a node plugin alone: no controller

    @csi_call
    def Probe(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        ready = os.access(self.plugin.state.volumes, os.W_OK)
        return pb.ProbeResponse(ready={"value": ready})


_RPC = pb.NodeServiceCapability.RPC


class Node(pb_grpc.NodeServicer):  # type: ignore[name-defined,misc]  # generated at run time
    """The CSI Node service over gRPC: each RPC checks its request and calls ``node.py``.

    Promises kubelet what ``node.py`` does: idempotent stage and unstage, a read-only bind
    on publish whatever ``readonly`` says, unpublish, and statfs usage with a volume
    condition. It advertises exactly STAGE_UNSTAGE_VOLUME, GET_VOLUME_STATS and
    VOLUME_CONDITION. A missing required field is INVALID_ARGUMENT, a block or writing
    capability is refused (``node.check_capability``), and every outcome becomes a status
    in :func:`csi_call`. Owns nothing but a reference to the shared ``node.Plugin``.
    Threads: gRPC runs RPCs on its executor's threads, several at once. Stage, unstage,
    publish and unpublish hold ``plugin.lock(volume_id)``, so calls on one volume run one at
    a time; ``NodeGetVolumeStats`` takes no lock."""

    def __init__(self, plugin: node.Plugin) -> None:
        self.plugin = plugin

    @csi_call
    def NodeGetInfo(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        return pb.NodeGetInfoResponse(node_id=self.plugin.node_id)

    @csi_call
    def NodeGetCapabilities(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        kinds = (_RPC.STAGE_UNSTAGE_VOLUME, _RPC.GET_VOLUME_STATS, _RPC.VOLUME_CONDITION)
        return pb.NodeGetCapabilitiesResponse(
            capabilities=[pb.NodeServiceCapability(rpc=_RPC(type=k)) for k in kinds])

    @csi_call
    def NodeStageVolume(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        vid, staging = _required(request, "volume_id", "staging_target_path")
        node.check_capability(_capability(request))
        with self.plugin.lock(vid):
            node.stage(self.plugin, vid, staging, dict(request.volume_context))
        return pb.NodeStageVolumeResponse()

    @csi_call
    def NodeUnstageVolume(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        vid, staging = _required(request, "volume_id", "staging_target_path")
        with self.plugin.lock(vid):
            node.unstage(self.plugin, vid, staging)
        return pb.NodeUnstageVolumeResponse()

    @csi_call
    def NodePublishVolume(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        vid, target = _required(request, "volume_id", "target_path")
        # readonly=false is accepted: the bind is read-only whatever the pod asked, as
        # the filesystem under it is
        node.check_capability(_capability(request))
        with self.plugin.lock(vid):
            node.publish(self.plugin, vid, request.staging_target_path, target,
                         dict(request.volume_context))
        return pb.NodePublishVolumeResponse()

    @csi_call
    def NodeUnpublishVolume(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        vid, target = _required(request, "volume_id", "target_path")
        with self.plugin.lock(vid):
            node.unpublish(self.plugin, vid, target)
        return pb.NodeUnpublishVolumeResponse()

    @csi_call
    def NodeGetVolumeStats(self, request: Any, ctx: grpc.ServicerContext) -> Any:
        vid, path = _required(request, "volume_id", "volume_path")
        s = node.stats(self.plugin, vid, path)
        usage = [] if s.abnormal else [
            pb.VolumeUsage(total=s.bytes_total, used=s.bytes_total, available=0,
                           unit=pb.VolumeUsage.BYTES),
            pb.VolumeUsage(total=s.files_total, used=s.files_total, available=0,
                           unit=pb.VolumeUsage.INODES)]
        return pb.NodeGetVolumeStatsResponse(
            usage=usage, volume_condition=pb.VolumeCondition(abnormal=s.abnormal, message=s.message))


def _required(request: Any, *names: str) -> list[str]:
    """The request's string fields ``names``; INVALID_ARGUMENT naming the first empty one."""
    values = [getattr(request, name) for name in names]
    for name, value in zip(names, values, strict=False):
        if not value:
            raise InvalidArgument(f"{name} is required")
    return values


def _capability(request: Any) -> Any:
    return request.volume_capability if request.HasField("volume_capability") else None


def unix_socket_path(endpoint: str) -> str:
    """``unix:///csi/csi.sock`` (or a bare path) → ``/csi/csi.sock``."""
    if endpoint.startswith("unix://"):
        return endpoint[len("unix://"):]
    if "://" in endpoint:
        from ..errors import ConfigError

        raise ConfigError(f"--endpoint {endpoint}: only unix:// sockets (kubelet's registrar "
                          "dials a socket on the node)")
    return endpoint


def start(plugin: node.Plugin, endpoint: str, workers: int = 8) -> grpc.Server:
    """Serve ``plugin`` on ``endpoint`` (a stale socket file is replaced); the started
    server."""
    path = unix_socket_path(endpoint)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.unlink(path)          # left by a plugin that was killed
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                    thread_name_prefix="csi"))
    pb_grpc.add_IdentityServicer_to_server(Identity(plugin), server)
    pb_grpc.add_NodeServicer_to_server(Node(plugin), server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    log.info("CSI node plugin %s %s serving node %s on %s", DRIVER_NAME, kspeedfs_version,
             plugin.node_id, path)
    return server
