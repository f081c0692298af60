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


# Every member at module level, written out (not set through globals()) so that a type
# checker sees them; tests/unit/test_enums.py checks that none is missing.
IBV_QPT_RC = ibv_qp_type.IBV_QPT_RC
IBV_QPT_UC = ibv_qp_type.IBV_QPT_UC
IBV_QPT_UD = ibv_qp_type.IBV_QPT_UD

IBV_QPS_RESET = ibv_qp_state.IBV_QPS_RESET
IBV_QPS_INIT = ibv_qp_state.IBV_QPS_INIT
IBV_QPS_RTR = ibv_qp_state.IBV_QPS_RTR
IBV_QPS_RTS = ibv_qp_state.IBV_QPS_RTS
IBV_QPS_SQD = ibv_qp_state.IBV_QPS_SQD
IBV_QPS_SQE = ibv_qp_state.IBV_QPS_SQE
IBV_QPS_ERR = ibv_qp_state.IBV_QPS_ERR
IBV_QPS_UNKNOWN = ibv_qp_state.IBV_QPS_UNKNOWN

IBV_QP_STATE = ibv_qp_attr_mask.IBV_QP_STATE
IBV_QP_CUR_STATE = ibv_qp_attr_mask.IBV_QP_CUR_STATE
IBV_QP_EN_SQD_ASYNC_NOTIFY = ibv_qp_attr_mask.IBV_QP_EN_SQD_ASYNC_NOTIFY
IBV_QP_ACCESS_FLAGS = ibv_qp_attr_mask.IBV_QP_ACCESS_FLAGS
IBV_QP_PKEY_INDEX = ibv_qp_attr_mask.IBV_QP_PKEY_INDEX
IBV_QP_PORT = ibv_qp_attr_mask.IBV_QP_PORT
IBV_QP_QKEY = ibv_qp_attr_mask.IBV_QP_QKEY
IBV_QP_AV = ibv_qp_attr_mask.IBV_QP_AV
IBV_QP_PATH_MTU = ibv_qp_attr_mask.IBV_QP_PATH_MTU
IBV_QP_TIMEOUT = ibv_qp_attr_mask.IBV_QP_TIMEOUT
IBV_QP_RETRY_CNT = ibv_qp_attr_mask.IBV_QP_RETRY_CNT
IBV_QP_RNR_RETRY = ibv_qp_attr_mask.IBV_QP_RNR_RETRY
IBV_QP_RQ_PSN = ibv_qp_attr_mask.IBV_QP_RQ_PSN
IBV_QP_MAX_QP_RD_ATOMIC = ibv_qp_attr_mask.IBV_QP_MAX_QP_RD_ATOMIC
IBV_QP_ALT_PATH = ibv_qp_attr_mask.IBV_QP_ALT_PATH
IBV_QP_MIN_RNR_TIMER = ibv_qp_attr_mask.IBV_QP_MIN_RNR_TIMER
IBV_QP_SQ_PSN = ibv_qp_attr_mask.IBV_QP_SQ_PSN
IBV_QP_MAX_DEST_RD_ATOMIC = ibv_qp_attr_mask.IBV_QP_MAX_DEST_RD_ATOMIC
IBV_QP_PATH_MIG_STATE = ibv_qp_attr_mask.IBV_QP_PATH_MIG_STATE
IBV_QP_CAP = ibv_qp_attr_mask.IBV_QP_CAP
IBV_QP_DEST_QPN = ibv_qp_attr_mask.IBV_QP_DEST_QPN

IBV_ACCESS_LOCAL_WRITE = ibv_access_flags.IBV_ACCESS_LOCAL_WRITE
IBV_ACCESS_REMOTE_WRITE = ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
IBV_ACCESS_REMOTE_READ = ibv_access_flags.IBV_ACCESS_REMOTE_READ
IBV_ACCESS_REMOTE_ATOMIC = ibv_access_flags.IBV_ACCESS_REMOTE_ATOMIC

IBV_WR_RDMA_WRITE = ibv_wr_opcode.IBV_WR_RDMA_WRITE
IBV_WR_RDMA_WRITE_WITH_IMM = ibv_wr_opcode.IBV_WR_RDMA_WRITE_WITH_IMM
IBV_WR_SEND = ibv_wr_opcode.IBV_WR_SEND
IBV_WR_SEND_WITH_IMM = ibv_wr_opcode.IBV_WR_SEND_WITH_IMM
IBV_WR_RDMA_READ = ibv_wr_opcode.IBV_WR_RDMA_READ
IBV_WR_ATOMIC_CMP_AND_SWP = ibv_wr_opcode.IBV_WR_ATOMIC_CMP_AND_SWP
IBV_WR_ATOMIC_FETCH_AND_ADD = ibv_wr_opcode.IBV_WR_ATOMIC_FETCH_AND_ADD

IBV_SEND_FENCE = ibv_send_flags.IBV_SEND_FENCE
IBV_SEND_SIGNALED = ibv_send_flags.IBV_SEND_SIGNALED
IBV_SEND_SOLICITED = ibv_send_flags.IBV_SEND_SOLICITED
IBV_SEND_INLINE = ibv_send_flags.IBV_SEND_INLINE

IBV_WC_SEND = ibv_wc_opcode.IBV_WC_SEND
IBV_WC_RDMA_WRITE = ibv_wc_opcode.IBV_WC_RDMA_WRITE
IBV_WC_RDMA_READ = ibv_wc_opcode.IBV_WC_RDMA_READ
IBV_WC_COMP_SWAP = ibv_wc_opcode.IBV_WC_COMP_SWAP
IBV_WC_FETCH_ADD = ibv_wc_opcode.IBV_WC_FETCH_ADD
IBV_WC_BIND_MW = ibv_wc_opcode.IBV_WC_BIND_MW
IBV_WC_RECV = ibv_wc_opcode.IBV_WC_RECV
IBV_WC_RECV_RDMA_WITH_IMM = ibv_wc_opcode.IBV_WC_RECV_RDMA_WITH_IMM

IBV_WC_SUCCESS = ibv_wc_status.IBV_WC_SUCCESS
IBV_WC_LOC_LEN_ERR = ibv_wc_status.IBV_WC_LOC_LEN_ERR
IBV_WC_LOC_QP_OP_ERR = ibv_wc_status.IBV_WC_LOC_QP_OP_ERR
IBV_WC_LOC_EEC_OP_ERR = ibv_wc_status.IBV_WC_LOC_EEC_OP_ERR
IBV_WC_LOC_PROT_ERR = ibv_wc_status.IBV_WC_LOC_PROT_ERR
IBV_WC_WR_FLUSH_ERR = ibv_wc_status.IBV_WC_WR_FLUSH_ERR
IBV_WC_MW_BIND_ERR = ibv_wc_status.IBV_WC_MW_BIND_ERR
IBV_WC_BAD_RESP_ERR = ibv_wc_status.IBV_WC_BAD_RESP_ERR
IBV_WC_LOC_ACCESS_ERR = ibv_wc_status.IBV_WC_LOC_ACCESS_ERR
IBV_WC_REM_INV_REQ_ERR = ibv_wc_status.IBV_WC_REM_INV_REQ_ERR
IBV_WC_REM_ACCESS_ERR = ibv_wc_status.IBV_WC_REM_ACCESS_ERR
IBV_WC_REM_OP_ERR = ibv_wc_status.IBV_WC_REM_OP_ERR
IBV_WC_RETRY_EXC_ERR = ibv_wc_status.IBV_WC_RETRY_EXC_ERR
IBV_WC_RNR_RETRY_EXC_ERR = ibv_wc_status.IBV_WC_RNR_RETRY_EXC_ERR
IBV_WC_LOC_RDD_VIOL_ERR = ibv_wc_status.IBV_WC_LOC_RDD_VIOL_ERR
IBV_WC_REM_INV_RD_REQ_ERR = ibv_wc_status.IBV_WC_REM_INV_RD_REQ_ERR
IBV_WC_REM_ABORT_ERR = ibv_wc_status.IBV_WC_REM_ABORT_ERR
IBV_WC_INV_EECN_ERR = ibv_wc_status.IBV_WC_INV_EECN_ERR
IBV_WC_INV_EEC_STATE_ERR = ibv_wc_status.IBV_WC_INV_EEC_STATE_ERR
IBV_WC_FATAL_ERR = ibv_wc_status.IBV_WC_FATAL_ERR
IBV_WC_RESP_TIMEOUT_ERR = ibv_wc_status.IBV_WC_RESP_TIMEOUT_ERR
IBV_WC_GENERAL_ERR = ibv_wc_status.IBV_WC_GENERAL_ERR

IBV_MTU_256 = ibv_mtu.IBV_MTU_256
IBV_MTU_512 = ibv_mtu.IBV_MTU_512
IBV_MTU_1024 = ibv_mtu.IBV_MTU_1024
IBV_MTU_2048 = ibv_mtu.IBV_MTU_2048
IBV_MTU_4096 = ibv_mtu.IBV_MTU_4096

IBV_PORT_NOP = ibv_port_state.IBV_PORT_NOP
IBV_PORT_DOWN = ibv_port_state.IBV_PORT_DOWN
IBV_PORT_INIT = ibv_port_state.IBV_PORT_INIT
IBV_PORT_ARMED = ibv_port_state.IBV_PORT_ARMED
IBV_PORT_ACTIVE = ibv_port_state.IBV_PORT_ACTIVE
IBV_PORT_ACTIVE_DEFER = ibv_port_state.IBV_PORT_ACTIVE_DEFER

# Aliases that verbs.h also spells out.
IBV_ACCESS_ALL_REMOTE = (ibv_access_flags.IBV_ACCESS_REMOTE_READ
                         | ibv_access_flags.IBV_ACCESS_REMOTE_WRITE)
