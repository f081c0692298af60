"""The RC QP state machine as ONE table, shared by every provider.

::

        +-------+  to_init   +------+  to_rtr   +-----+  to_rts   +-----+
        | RESET | ---------> | INIT | --------> | RTR | --------> | RTS |
        +-------+            +------+           +-----+           +-----+
            ^                    |                 |                 |  fatal WC,
            |  modify(RESET)     v                 v                 v  modify(ERR)
            +--------------------------------- +-----+ <-------------+
                                               | ERR |  every outstanding WR
                                               +-----+  completes WR_FLUSH_ERR

``TRANSITIONS[(from, to)] = Transition(required, optional)``: the attribute names (fields of
:class:`rdma.api.QPAttr`) that ``ibv_modify_qp`` needs and accepts for that move on an RC QP.
It follows the IB spec table that the kernel encodes in ``qp_state_table``
(drivers/infiniband/core/verbs.c); ``qp_state`` is implied and always allowed.  Any pair not
in the table is illegal and raises :class:`rdma.errors.QPStateError` naming both states.
Any state except RESET may go to ERR, any state may go to RESET, and ERR only leaves via
RESET: that is the recovery path ERR → RESET → INIT → RTR → RTS.

Two soft-provider extension attributes are accepted as *optional* where they make sense and
ignored by the verbs provider: ``private_data`` on INIT→RTR (bytes handed to the responder
with the connection, like rdma_cm private_data) and ``timeout_ms`` on RTR→RTS / RTS→RTS
(per-try transport timeout in milliseconds, overrides the ``timeout`` exponent).

Mask helpers (``attr_mask``, ``names_from_mask``) translate names ↔ ``IBV_QP_*`` bits so
the verbs provider can hand pyverbs a raw ``modify(attr, mask)``.  This module is pure: no
I/O, so tests (and Hypothesis) drive it directly.
"""
from __future__ import annotations

from dataclasses import dataclass

from .enums import ibv_qp_attr_mask as M
from .enums import ibv_qp_state as S
from .errors import QPAttrError, QPStateError

#: QPAttr field name → IBV_QP_* mask bit.
ATTR_MASK: dict[str, int] = {
    "qp_state": M.IBV_QP_STATE,
    "cur_qp_state": M.IBV_QP_CUR_STATE,
    "en_sqd_async_notify": M.IBV_QP_EN_SQD_ASYNC_NOTIFY,
    "qp_access_flags": M.IBV_QP_ACCESS_FLAGS,
    "pkey_index": M.IBV_QP_PKEY_INDEX,
    "port_num": M.IBV_QP_PORT,
    "qkey": M.IBV_QP_QKEY,
    "ah_attr": M.IBV_QP_AV,
    "path_mtu": M.IBV_QP_PATH_MTU,
    "timeout": M.IBV_QP_TIMEOUT,
    "retry_cnt": M.IBV_QP_RETRY_CNT,
    "rnr_retry": M.IBV_QP_RNR_RETRY,
    "rq_psn": M.IBV_QP_RQ_PSN,
    "max_rd_atomic": M.IBV_QP_MAX_QP_RD_ATOMIC,
    "alt_path": M.IBV_QP_ALT_PATH,
    "min_rnr_timer": M.IBV_QP_MIN_RNR_TIMER,
    "sq_psn": M.IBV_QP_SQ_PSN,
    "max_dest_rd_atomic": M.IBV_QP_MAX_DEST_RD_ATOMIC,
    "path_mig_state": M.IBV_QP_PATH_MIG_STATE,
    "cap": M.IBV_QP_CAP,
    "dest_qp_num": M.IBV_QP_DEST_QPN,
}
#: Soft-provider extensions: no mask bit, never passed to pyverbs.
SOFT_EXTENSION_ATTRS = frozenset({"private_data", "timeout_ms"})


@dataclass(frozen=True)
class Transition:
    required: frozenset[str]
    optional: frozenset[str] = frozenset()


def _t(required: str = "", optional: str = "") -> Transition:
    return Transition(frozenset(required.split()), frozenset(optional.split()))


_NONE = _t()
TRANSITIONS: dict[tuple[S, S], Transition] = {
    (S.IBV_QPS_RESET, S.IBV_QPS_RESET): _NONE,
    (S.IBV_QPS_RESET, S.IBV_QPS_INIT): _t("pkey_index port_num qp_access_flags"),
    (S.IBV_QPS_INIT, S.IBV_QPS_INIT): _t("", "pkey_index port_num qp_access_flags"),
    (S.IBV_QPS_INIT, S.IBV_QPS_RTR): _t(
        "ah_attr path_mtu dest_qp_num rq_psn max_dest_rd_atomic min_rnr_timer",
        "alt_path qp_access_flags pkey_index private_data"),
    (S.IBV_QPS_RTR, S.IBV_QPS_RTS): _t(
        "sq_psn timeout retry_cnt rnr_retry max_rd_atomic",
        "cur_qp_state alt_path qp_access_flags min_rnr_timer path_mig_state timeout_ms"),
    (S.IBV_QPS_RTS, S.IBV_QPS_RTS): _t(
        "", "cur_qp_state qp_access_flags alt_path path_mig_state min_rnr_timer timeout_ms"),
    (S.IBV_QPS_RTS, S.IBV_QPS_SQD): _t("", "en_sqd_async_notify"),
    (S.IBV_QPS_SQD, S.IBV_QPS_RTS): _t("", "cur_qp_state alt_path qp_access_flags "
                                          "min_rnr_timer path_mig_state"),
    (S.IBV_QPS_SQD, S.IBV_QPS_SQD): _t("", "pkey_index qp_access_flags min_rnr_timer "
                                          "timeout retry_cnt rnr_retry max_rd_atomic "
                                          "max_dest_rd_atomic path_mig_state ah_attr "
                                          "alt_path"),
    (S.IBV_QPS_SQE, S.IBV_QPS_RTS): _t("", "cur_qp_state qp_access_flags"),
}
for _s in S:
    if _s is S.IBV_QPS_UNKNOWN:
        continue
    TRANSITIONS.setdefault((_s, S.IBV_QPS_RESET), _NONE)  # any → RESET
    if _s is not S.IBV_QPS_RESET:
        TRANSITIONS.setdefault((_s, S.IBV_QPS_ERR), _NONE)  # any but RESET → ERR
del _s

#: What the convenience methods need, as pyverbs' ``masks[IBV_QPT_RC][dst]``.
TO_INIT = TRANSITIONS[(S.IBV_QPS_RESET, S.IBV_QPS_INIT)].required
TO_RTR = TRANSITIONS[(S.IBV_QPS_INIT, S.IBV_QPS_RTR)].required
TO_RTS = TRANSITIONS[(S.IBV_QPS_RTR, S.IBV_QPS_RTS)].required


def check_transition(current: int, requested: int, names: set[str] | frozenset[str]) -> None:
    """Raise unless ``current → requested`` is legal with exactly-allowed attributes ``names``.

    ``names`` are QPAttr field names being set (``qp_state`` and ``cur_qp_state`` implied ok).
    Raises :class:`QPStateError` (illegal pair) or :class:`QPAttrError` (missing / extra).
    """
    try:
        key = (S(current), S(requested))
    except ValueError:
        raise QPStateError(current, requested, f"unknown QP state {current} -> {requested}") from None
    tr = TRANSITIONS.get(key)
    if tr is None:
        raise QPStateError(key[0], key[1])
    given = set(names) - {"qp_state"}
    missing = tr.required - given
    extra = given - tr.required - tr.optional - {"cur_qp_state"}
    if missing or extra:
        raise QPAttrError(key[0], key[1], missing, extra)


def attr_mask(names: set[str] | frozenset[str]) -> int:
    """IBV_QP_* mask for attribute names (soft extensions contribute nothing)."""
    mask = 0
    for n in names:
        if n in SOFT_EXTENSION_ATTRS:
            continue
        mask |= ATTR_MASK[n]
    return mask


def names_from_mask(mask: int) -> frozenset[str]:
    return frozenset(n for n, bit in ATTR_MASK.items() if mask & bit)


# ---- transport timeout arithmetic (IB: 4.096 us * 2**timeout per try) ----

def timeout_exponent_to_seconds(timeout: int) -> float:
    """Per-try Local ACK Timeout for the IB ``timeout`` exponent (0 means infinite → inf)."""
    if timeout == 0:
        return float("inf")
    return 4.096e-6 * (1 << timeout)


def total_timeout_seconds(timeout: int, retry_cnt: int, timeout_ms: int | None = None) -> float:
    """Time until a READ with no response completes RETRY_EXC_ERR: per_try × (retry_cnt+1).

    ``timeout_ms`` (soft extension), when > 0, replaces the exponent's per-try value.
    """
    per_try = timeout_ms / 1000.0 if timeout_ms else timeout_exponent_to_seconds(timeout)
    return per_try * (retry_cnt + 1)
