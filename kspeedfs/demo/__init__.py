"""The README's main job: ``cluster.py`` (default) and ``single.py`` (``--single-node``)."""
