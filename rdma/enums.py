"""rdma-core (libibverbs) constants under their rdma-core names, shared by every provider.

Values are the ones in ``<infiniband/verbs.h>`` so a WC status logged by the soft provider
means exactly what it means on hardware (``IBV_WC_RETRY_EXC_ERR == 12`` everywhere).
Each C enum is an ``IntEnum`` named as in verbs.h (``ibv_wc_status`` ...), and every member
is also exported at module level, as ``pyverbs.enums`` does: ``from rdma.enums import
IBV_QPS_RTS``.  Only what kspeedfs uses is listed; add members with their verbs.h values.
"""
from __future__ import annotations

from enum import IntEnum, IntFlag


class ibv_qp_type(IntEnum):
    IBV_QPT_RC = 2
    IBV_QPT_UC = 3
    IBV_QPT_UD = 4


class ibv_qp_state(IntEnum):
    IBV_QPS_RESET = 0
    IBV_QPS_INIT = 1
    IBV_QPS_RTR = 2
    IBV_QPS_RTS = 3
    IBV_QPS_SQD = 4
    IBV_QPS_SQE = 5
    IBV_QPS_ERR = 6
    IBV_QPS_UNKNOWN = 7


class ibv_qp_attr_mask(IntFlag):
    IBV_QP_STATE = 1 << 0
    IBV_QP_CUR_STATE = 1 << 1
    IBV_QP_EN_SQD_ASYNC_NOTIFY = 1 << 2
    IBV_QP_ACCESS_FLAGS = 1 << 3
    IBV_QP_PKEY_INDEX = 1 << 4
    IBV_QP_PORT = 1 << 5
    IBV_QP_QKEY = 1 << 6
    IBV_QP_AV = 1 << 7
    IBV_QP_PATH_MTU = 1 << 8
    IBV_QP_TIMEOUT = 1 << 9
    IBV_QP_RETRY_CNT = 1 << 10
    IBV_QP_RNR_RETRY = 1 << 11
    IBV_QP_RQ_PSN = 1 << 12
    IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13
    IBV_QP_ALT_PATH = 1 << 14
    IBV_QP_MIN_RNR_TIMER = 1 << 15
    IBV_QP_SQ_PSN = 1 << 16
    IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17
    IBV_QP_PATH_MIG_STATE = 1 << 18
    IBV_QP_CAP = 1 << 19
    IBV_QP_DEST_QPN = 1 << 20


class ibv_access_flags(IntFlag):
    IBV_ACCESS_LOCAL_WRITE = 1
    IBV_ACCESS_REMOTE_WRITE = 2
    IBV_ACCESS_REMOTE_READ = 4
    IBV_ACCESS_REMOTE_ATOMIC = 8


class ibv_wr_opcode(IntEnum):
    IBV_WR_RDMA_WRITE = 0
    IBV_WR_RDMA_WRITE_WITH_IMM = 1
    IBV_WR_SEND = 2
    IBV_WR_SEND_WITH_IMM = 3
    IBV_WR_RDMA_READ = 4
    IBV_WR_ATOMIC_CMP_AND_SWP = 5
    IBV_WR_ATOMIC_FETCH_AND_ADD = 6


class ibv_send_flags(IntFlag):
    IBV_SEND_FENCE = 1
    IBV_SEND_SIGNALED = 2
    IBV_SEND_SOLICITED = 4
    IBV_SEND_INLINE = 8


class ibv_wc_opcode(IntEnum):
    IBV_WC_SEND = 0
    IBV_WC_RDMA_WRITE = 1
    IBV_WC_RDMA_READ = 2
    IBV_WC_COMP_SWAP = 3
    IBV_WC_FETCH_ADD = 4
    IBV_WC_BIND_MW = 5
    IBV_WC_RECV = 128
    IBV_WC_RECV_RDMA_WITH_IMM = 129


class ibv_wc_status(IntEnum):
    IBV_WC_SUCCESS = 0
    IBV_WC_LOC_LEN_ERR = 1
    IBV_WC_LOC_QP_OP_ERR = 2
    IBV_WC_LOC_EEC_OP_ERR = 3
    IBV_WC_LOC_PROT_ERR = 4
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_WC_MW_BIND_ERR = 6
    IBV_WC_BAD_RESP_ERR = 7
    IBV_WC_LOC_ACCESS_ERR = 8
    IBV_WC_REM_INV_REQ_ERR = 9
    IBV_WC_REM_ACCESS_ERR = 10
    IBV_WC_REM_OP_ERR = 11
    IBV_WC_RETRY_EXC_ERR = 12
    IBV_WC_RNR_RETRY_EXC_ERR = 13
    IBV_WC_LOC_RDD_VIOL_ERR = 14
    IBV_WC_REM_INV_RD_REQ_ERR = 15
    IBV_WC_REM_ABORT_ERR = 16
    IBV_WC_INV_EECN_ERR = 17
    IBV_WC_INV_EEC_STATE_ERR = 18
    IBV_WC_FATAL_ERR = 19
    IBV_WC_RESP_TIMEOUT_ERR = 20
    IBV_WC_GENERAL_ERR = 21


class ibv_mtu(IntEnum):
    IBV_MTU_256 = 1
    IBV_MTU_512 = 2
    IBV_MTU_1024 = 3
    IBV_MTU_2048 = 4
    IBV_MTU_4096 = 5


class ibv_port_state(IntEnum):
    IBV_PORT_NOP = 0
    IBV_PORT_DOWN = 1
    IBV_PORT_INIT = 2
    IBV_PORT_ARMED = 3
    IBV_PORT_ACTIVE = 4
    IBV_PORT_ACTIVE_DEFER = 5


#: ``ibv_wc_status_str()`` equivalents, used in log lines and error messages.
WC_STATUS_STR: dict[int, str] = {
    ibv_wc_status.IBV_WC_SUCCESS: "success",
    ibv_wc_status.IBV_WC_LOC_LEN_ERR: "local length error",
    ibv_wc_status.IBV_WC_LOC_QP_OP_ERR: "local QP operation error",
    ibv_wc_status.IBV_WC_LOC_PROT_ERR: "local protection error",
    ibv_wc_status.IBV_WC_WR_FLUSH_ERR: "Work Request Flushed Error",
    ibv_wc_status.IBV_WC_BAD_RESP_ERR: "bad response error",
    ibv_wc_status.IBV_WC_LOC_ACCESS_ERR: "local access error",
    ibv_wc_status.IBV_WC_REM_INV_REQ_ERR: "remote invalid request error",
    ibv_wc_status.IBV_WC_REM_ACCESS_ERR: "remote access error",
    ibv_wc_status.IBV_WC_REM_OP_ERR: "remote operation error",
    ibv_wc_status.IBV_WC_RETRY_EXC_ERR: "transport retry counter exceeded",
    ibv_wc_status.IBV_WC_RNR_RETRY_EXC_ERR: "RNR retry counter exceeded",
    ibv_wc_status.IBV_WC_FATAL_ERR: "fatal error",
    ibv_wc_status.IBV_WC_GENERAL_ERR: "general error",
}


def wc_status_str(status: int) -> str:
    """Like ``ibv_wc_status_str``: a human string for a WC status value."""
    try:
        return WC_STATUS_STR.get(status) or ibv_wc_status(status).name
    except ValueError:
        return f"unknown WC status {status}"


def _export(*enums: type) -> None:
    g = globals()
    for enum in enums:
        for member in enum:  # type: ignore[attr-defined]
            g[member.name] = member


_export(ibv_qp_type, ibv_qp_state, ibv_qp_attr_mask, ibv_access_flags, ibv_wr_opcode,
        ibv_send_flags, ibv_wc_opcode, ibv_wc_status, ibv_mtu, ibv_port_state)
# Aliases that verbs.h also spells out.
IBV_ACCESS_ALL_REMOTE = (ibv_access_flags.IBV_ACCESS_REMOTE_READ
                         | ibv_access_flags.IBV_ACCESS_REMOTE_WRITE)
