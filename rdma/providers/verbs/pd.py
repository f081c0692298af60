"""Verbs protection domain (``ibv_alloc_pd``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pyverbs.pd import PD as _PD

from ...api import MR, PD, QP, QPInitAttr
from .errors import mapped

if TYPE_CHECKING:
    from .device import VerbsContext


class VerbsPD(PD):
    def __init__(self, ctx: VerbsContext) -> None:
        super().__init__(ctx)
        with mapped("ibv_alloc_pd"):
            self.raw = _PD(ctx.raw)

    def reg_mr(self, buf: Any, access: int) -> MR:
        """Register ``buf`` (a writable buffer) or allocate an int's worth of memory."""
        from .mr import VerbsMR

        self._check_open()
        return VerbsMR(self, buf, access)

    def create_qp(self, init_attr: QPInitAttr) -> QP:
        from .qp import VerbsQP

        self._check_open()
        return VerbsQP(self, init_attr)

    def _close_impl(self) -> None:
        raw = getattr(self, "raw", None)
        if raw is not None:
            raw.close()
