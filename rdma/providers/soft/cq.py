"""Soft completion queue: a WC ring in the engine plus an eventfd the engine writes when
the ring goes non-empty; ``poll`` drains it when it empties the ring, so ``fd`` is
readable iff WCs are queued (what ``poll_async`` waits for with trio)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...api import CQ, WC
from ...enums import ibv_wc_opcode, ibv_wc_status

if TYPE_CHECKING:
    from .device import SoftContext

_STATUS = {int(s): s for s in ibv_wc_status}
_OPCODE = {int(o): o for o in ibv_wc_opcode}


class SoftCQ(CQ):
    def __init__(self, ctx: SoftContext, cqe: int) -> None:
        super().__init__(ctx, cqe)
        self.engine = ctx.engine
        self.handle, self._fd = self.engine.call("create_cq", self.engine.raw.create_cq,
                                                 int(cqe))

    @property
    def fd(self) -> int:
        self._check_open()
        fd: int = self._fd
        return fd

    def poll(self, num_entries: int = 1) -> list[WC]:
        self._check_open()
        raw = self.engine.call("poll_cq", self.engine.raw.poll_cq, self.handle,
                               int(num_entries))
        return [WC(wr_id, _STATUS[st], _OPCODE[op], byte_len, qpn, verr)
                for wr_id, st, op, byte_len, qpn, verr in raw]

    def modify(self, cq_count: int, cq_period: int) -> None:
        self._check_open()
        self.engine.call("modify_cq", self.engine.raw.modify_cq, self.handle, int(cq_count),
                         int(cq_period))

    def _close_impl(self) -> None:
        if not hasattr(self, 'handle'):
            return  # construction failed before the engine made it
        try:
            import trio

            trio.lowlevel.notify_closing(self._fd)
        except (ImportError, RuntimeError):
            pass  # not inside trio: nobody can be waiting there
        self.engine.call("destroy_cq", self.engine.raw.destroy_cq, self.handle)
