/* soft_wire.c — the wire protocol: the request/response header and the HELLO, built
 * and parsed (totally: every field checked against its opcode and direction). */
#define _GNU_SOURCE
#include "soft_engine_i.h"

#include <errno.h>

/* --------------------------------------------------------------------------- wire */

static uint32_t rd32(const uint8_t *p)
{
    return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const uint8_t *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static void wr32(uint8_t *p, uint32_t v)
{
    p[0] = v;
    p[1] = v >> 8;
    p[2] = v >> 16;
    p[3] = v >> 24;
}
static void wr64(uint8_t *p, uint64_t v)
{
    wr32(p, (uint32_t)v);
    wr32(p + 4, (uint32_t)(v >> 32));
}

void ks_hdr_build(uint8_t *buf, const struct ks_hdr *h)
{
    wr32(buf, KS_MAGIC);
    buf[4] = KS_VERSION;
    buf[5] = h->opcode;
    buf[6] = h->status;
    buf[7] = 0;
    wr32(buf + 8, h->psn & 0xFFFFFF);
    wr32(buf + 12, h->length);
    wr32(buf + 16, h->rkey);
    wr32(buf + 20, h->rlen);
    wr64(buf + 24, h->raddr);
}

int ks_hdr_parse(const uint8_t *buf, struct ks_hdr *h, int role)
{
    h->magic = rd32(buf);
    h->version = buf[4];
    h->opcode = buf[5];
    h->status = buf[6];
    h->flags = buf[7];
    h->psn = rd32(buf + 8);
    h->length = rd32(buf + 12);
    h->rkey = rd32(buf + 16);
    h->rlen = rd32(buf + 20);
    h->raddr = rd64(buf + 24);
    if (h->magic != KS_MAGIC || h->version != KS_VERSION || h->flags != 0 || h->psn > 0xFFFFFF)
        return -EPROTO;
    switch (h->opcode) {
    case KS_OP_HELLO:
        if (role != KS_ROLE_HELLO && role != KS_ROLE_ANY)
            return -EPROTO;
        if (h->psn != 0 || h->rkey != 0 || h->rlen != 0 || h->raddr != 0)
            return -EPROTO;
        if (role == KS_ROLE_HELLO && h->status != 0)
            return -EPROTO; /* an incoming HELLO is a request */
        if (h->length > KS_HELLO_FIXED + KS_MAX_PDATA)
            return -EMSGSIZE;
        return 0;
    case KS_OP_READ_REQ:
        if (role != KS_ROLE_REQUESTS && role != KS_ROLE_ANY)
            return -EPROTO;
        if (h->length != 0 || h->status != 0)
            return -EPROTO;
        if (h->rlen > KS_MAX_MSG)
            return -EMSGSIZE;
        return 0;
    case KS_OP_SEND:
        if (role != KS_ROLE_REQUESTS && role != KS_ROLE_ANY)
            return -EPROTO;
        if (h->status != 0 || h->rkey != 0 || h->rlen != 0 || h->raddr != 0)
            return -EPROTO;
        if (h->length > KS_MAX_SEND)
            return -EMSGSIZE;
        return 0;
    case KS_OP_READ_RESP:
        if (role != KS_ROLE_RESPONSES && role != KS_ROLE_ANY)
            return -EPROTO;
        if (h->length > KS_MAX_MSG)
            return -EMSGSIZE;
        if (h->status != 0 && h->length != 0)
            return -EPROTO;
        return 0;
    case KS_OP_SEND_ACK:
        if (role != KS_ROLE_RESPONSES && role != KS_ROLE_ANY)
            return -EPROTO;
        if (h->length != 0)
            return -EPROTO;
        return 0;
    default:
        return -EPROTO;
    }
}

int ks_hello_parse(const uint8_t *buf, uint32_t len, struct ks_hello *out, uint32_t *need)
{
    struct ks_hdr h;
    *need = KS_HDR_LEN;
    if (len < KS_HDR_LEN)
        return -EAGAIN;
    int rc = ks_hdr_parse(buf, &h, KS_ROLE_HELLO);
    if (rc < 0)
        return rc;
    if (h.length < KS_HELLO_FIXED)
        return -EPROTO;
    *need = KS_HDR_LEN + h.length; /* <= KS_HELLO_BUF: ks_hdr_parse checked */
    if (len < *need)
        return -EAGAIN;
    if (len > *need)
        return -EPROTO;
    const uint8_t *p = buf + KS_HDR_LEN;
    out->dest_qpn = rd32(p);
    out->src_qpn = rd32(p + 4);
    if (out->dest_qpn > 0xFFFFFF || out->src_qpn > 0xFFFFFF || rd32(p + 8) != 0)
        return -EPROTO;
    out->pdata = p + KS_HELLO_FIXED;
    out->pdata_len = h.length - KS_HELLO_FIXED;
    return 0;
}
