"""The soft provider's wire format, Python side: what ``to_rtr`` sends (HELLO) and what
tests use to craft hostile input.  The authoritative description, and the parser the
engine trusts, is ``native/soft_engine.h`` / ``ks_hdr_parse``; this module only packs.

Fixed 32-byte little-endian header::

    magic u32 "KSRD" | version u8 | opcode u8 | status u8 | flags u8 | psn u32 |
    length u32 | rkey u32 | rlen u32 | raddr u64

HELLO payload: ``dest_qpn u32 | src_qpn u32 | reserved u32 | private_data (<= 256)``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

HDR = struct.Struct("<IBBBBIIIIQ")
HDR_LEN = HDR.size  # 32
MAGIC = 0x4452534B
VERSION = 1
HELLO_FIXED = struct.Struct("<III")

OP_HELLO = 1
OP_READ_REQ = 2
OP_READ_RESP = 3
OP_SEND = 4
OP_SEND_ACK = 5

assert HDR_LEN == 32


@dataclass(frozen=True)
class Header:
    opcode: int
    status: int = 0
    psn: int = 0
    length: int = 0
    rkey: int = 0
    rlen: int = 0
    raddr: int = 0
    magic: int = MAGIC
    version: int = VERSION
    flags: int = 0

    def pack(self) -> bytes:
        return HDR.pack(self.magic, self.version, self.opcode, self.status, self.flags,
                        self.psn, self.length, self.rkey, self.rlen, self.raddr)

    @classmethod
    def unpack(cls, buf: bytes) -> Header:
        (magic, version, opcode, status, flags, psn, length, rkey, rlen,
         raddr) = HDR.unpack(buf[:HDR_LEN])
        return cls(opcode=opcode, status=status, psn=psn, length=length, rkey=rkey,
                   rlen=rlen, raddr=raddr, magic=magic, version=version, flags=flags)


def hello(dest_qpn: int, src_qpn: int, private_data: bytes = b"") -> bytes:
    """The first message on a requester connection: routes it to ``dest_qpn``."""
    payload = HELLO_FIXED.pack(dest_qpn, src_qpn, 0) + private_data
    return Header(opcode=OP_HELLO, length=len(payload)).pack() + payload


def read_req(psn: int, raddr: int, rkey: int, rlen: int) -> bytes:
    return Header(opcode=OP_READ_REQ, psn=psn, rkey=rkey, rlen=rlen, raddr=raddr).pack()


def send(psn: int, payload: bytes) -> bytes:
    return Header(opcode=OP_SEND, psn=psn, length=len(payload)).pack() + payload
