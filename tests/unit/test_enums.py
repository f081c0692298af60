"""rdma.enums: every member of every verbs.h enum is also a module-level name."""
from __future__ import annotations

from enum import Enum

import rdma.enums as enums


def test_every_enum_member_is_exported_at_module_level() -> None:
    classes = [v for k, v in vars(enums).items()
               if k.startswith("ibv_") and isinstance(v, type) and issubclass(v, Enum)]
    assert len(classes) == 10
    for cls in classes:
        for member in cls:
            assert getattr(enums, member.name, None) is member, (cls.__name__, member.name)
