"""The Kubernetes CSI node plugin (``kspeedfs csi``): kspeedfs datasets as read-only
volumes, one kspeedfs mount per volume per node, bound into every pod that uses it.

    kubelet ──gRPC, unix socket──▶ server.py   Identity + Node servicers; errors → status
                                   node.py     stage / publish / unpublish / unstage / stats
                                   context.py  volume context → what to mount (allow-listed)
                                   state.py    records on disk: a restarted plugin knows
                                   stager.py   where `kspeedfs mount` runs: outside the plugin
                                   binds.py    read-only bind mounts into pods' target paths
                                   stubs.py    CSI v1 messages, generated from csi.proto
                                   errors.py   one exception per gRPC status the plugin returns

The staged mount and its supervisor never run inside the plugin's process (stager.py):
restarting or upgrading the plugin leaves every pod's reads alone. docs/kubernetes.md
is the operator's side.
"""
