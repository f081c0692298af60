"""RDMA providers.  Each submodule exposes ``get_device_list()`` and ``open_device(dev)``;
:func:`rdma.api.load_provider` imports them lazily by name."""
