"""The plugin's errors, each carrying the gRPC status code kubelet acts on.

A CSI call's outcome is its status code: kubelet retries UNAVAILABLE and INTERNAL with
back-off, reports INVALID_ARGUMENT and NOT_FOUND to the user as the pod's event, and
waits on FAILED_PRECONDITION. ``server.py`` turns these into the call's status in one
place (``csi_call``); the message is always one line.
"""
from __future__ import annotations

import grpc


class CsiError(Exception):
    """A CSI call failed; ``code`` is its gRPC status."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(CsiError):
    """A request or volume context the plugin cannot act on (fix the PV or the pod)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CsiError):
    """The volume's dataset (or version) is not in the store, or a path is not a volume."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(CsiError):
    """The volume is staged or published there already, but differently."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(CsiError):
    """Not in this state: unstaging a volume still published, publishing one not staged,
    a capability a read-only filesystem does not have."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(CsiError):
    """The metadata store cannot be reached now; kubelet retries."""

    code = grpc.StatusCode.UNAVAILABLE
