/* fuzz_engine.c — fuzz the soft engine's wire parsing, stateless and stateful.
 *
 * Build (tests/rdma/test_soft_fuzz.py does this; -fsanitize turns any out-of-bounds access,
 * use-after-free, leak or undefined behaviour into a failing exit status):
 *
 *   gcc -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all \
 *       -Inative native/fuzz/fuzz_engine.c -o fuzz_engine -lpthread
 *   ./fuzz_engine [-seconds N] [-runs N] [-seed N]
 *
 * It includes the engine's C files themselves (the engine alone: the binding is
 * soft_engine_py.c) so it drives the real static functions: ks_hdr_parse, ks_hello_parse, and the connection handlers the engine
 * thread runs (handle_conn: hello_rx -> hello_route -> resp_rx/resp_tx, req_rx), each
 * fed through an AF_UNIX socketpair.  The first input byte picks the target:
 *
 *   0  ks_hdr_parse on 32 bytes, every role, with consistency checks
 *   1  ks_hello_parse on the rest
 *   2  responder: a pending connection of an engine whose QP (RTS) expects a HELLO
 *      from QPN 0x654321; the input is its whole byte stream (HELLO, READ_REQ, SEND...)
 *   3  requester: a QP with 3 outstanding WRs (2 READs, 1 SEND) reading the input as
 *      the responses
 *
 * No libFuzzer on this machine (no clang); the standalone main() mutates built-in seeds
 * (valid streams for each target) with bit flips, interesting 32-bit values at header
 * fields, truncation, splicing and random bytes.  With clang, build with
 * -fsanitize=fuzzer,address -DKS_LIBFUZZER to use libFuzzer instead of main().
 */
#include "../soft_engine.c"
#include "../soft_wire.c"
#include "../soft_transport.c"
#include "../soft_qp.c"
#include "../soft_requester.c"
#include "../soft_responder.c"
#include "../soft_cq.c"
#include "../soft_mr.c"

#include <assert.h>
#include <stdio.h>

#define QPN_RESP 0x123456u
#define QPN_PEER 0x654321u
#define QPN_REQ 0x0abcdeu
#define PEER_IP 0x0100007fu /* 127.0.0.1, network order */
#define MR_LEN 8192
#define MAX_INPUT 65536

static ks_engine *E;
static ks_cq *CQ;
static ks_qp *QP_RESP, *QP_REQ;
static uint8_t *REMOTE_BUF; /* MR the responder serves (remote read) */
static uint8_t *LOCAL_BUF;  /* MR the requester / RECVs land in (local write) */
static uint32_t KEY_REMOTE, KEY_LOCAL;

static ks_qp *make_qp(uint32_t qpn, uint32_t slot)
{
    ks_qp *qp = calloc(1, sizeof *qp);
    qp->max_send_wr = qp->max_recv_wr = 8;
    qp->max_send_sge = qp->max_recv_sge = 2;
    qp->sq = calloc(8, sizeof(ks_wqe));
    qp->rq = calloc(8, sizeof(ks_rwqe));
    qp->pd = 1;
    qp->pdata_len = -1;
    qp->scq = qp->rcq = CQ;
    qp->qpn = qpn;
    qp->slot = slot;
    E->qps[slot] = qp;
    if (slot + 1 > E->qp_hi)
        E->qp_hi = slot + 1;
    qpn_insert(E, qp);
    return qp;
}

static void setup(void)
{
    E = calloc(1, sizeof *E);
    pthread_mutex_init(&E->lock, NULL);
    pthread_mutex_init(&E->cq_tab_lock, NULL);
    pthread_cond_init(&E->rx_cond, NULL);
    E->epfd = epoll_create1(EPOLL_CLOEXEC);
    E->kickfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    E->lfd = -1;
    CQ = calloc(1, sizeof *CQ);
    CQ->cap = 64;
    CQ->ring = calloc(CQ->cap, sizeof(ks_wc));
    CQ->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    CQ->kickfd = E->kickfd;
    CQ->engine_thread = pthread_self(); /* we play the engine thread */
    CQ->defer = &E->defer_sig;
    pthread_mutex_init(&CQ->lock, NULL);
    E->cqs[0] = CQ;
    REMOTE_BUF = malloc(MR_LEN);
    LOCAL_BUF = malloc(MR_LEN);
    for (int i = 0; i < MR_LEN; i++)
        REMOTE_BUF[i] = (uint8_t)i;
    KEY_REMOTE = 0xA5A5A000u | 1;
    KEY_LOCAL = 0x5A5A5000u | 2;
    ks_mr *r = calloc(1, sizeof *r), *l = calloc(1, sizeof *l);
    *r = (ks_mr){.key = KEY_REMOTE,
                 .pd = 1,
                 .addr = (uintptr_t)REMOTE_BUF,
                 .length = MR_LEN,
                 .access = KS_ACCESS_REMOTE_READ};
    *l = (ks_mr){.key = KEY_LOCAL,
                 .pd = 1,
                 .addr = (uintptr_t)LOCAL_BUF,
                 .length = MR_LEN,
                 .access = KS_ACCESS_LOCAL_WRITE};
    E->mrs[1] = r;
    E->mrs[2] = l;
    QP_RESP = make_qp(QPN_RESP, 0);
    QP_REQ = make_qp(QPN_REQ, 1);
}

/* Both QPs back to RTS with fresh queues, CQ emptied, graveyard freed. */
static void reset_state(void)
{
    ks_qp_to_reset(E, QP_RESP);
    ks_qp_to_reset(E, QP_REQ);
    graveyard_free(E);
    E->defer_sig = NULL;
    CQ->head = CQ->count = 0;
    CQ->signaled = 0;
    QP_RESP->state = KS_QPS_RTS;
    QP_RESP->access = KS_ACCESS_REMOTE_READ;
    QP_RESP->dest_qpn = QPN_PEER;
    QP_RESP->peer_ip = PEER_IP;
    QP_RESP->rq_psn = 100;
    for (int i = 0; i < 2; i++) { /* two RECVs: 64 B and 4 KiB */
        ks_rwqe *r = &QP_RESP->rq[QP_RESP->rq_tail++ % QP_RESP->max_recv_wr];
        r->wr_id = i;
        r->nsge = 1;
        r->sge[0] = (ks_sge){.addr = (uintptr_t)LOCAL_BUF + 4096 * i,
                             .length = i ? 4096 : 64,
                             .lkey = KEY_LOCAL};
        r->total = r->sge[0].length;
    }
    QP_REQ->state = KS_QPS_RTS;
    QP_REQ->dest_qpn = QPN_PEER;
    static const uint32_t lens[3] = {16, 5000, 40};
    static const uint32_t ops[3] = {KS_WR_RDMA_READ, KS_WR_RDMA_READ, KS_WR_SEND};
    for (int i = 0; i < 3; i++) {
        ks_wqe *w = &QP_REQ->sq[QP_REQ->sq_tail % QP_REQ->max_send_wr];
        memset(w, 0, sizeof *w);
        w->wr_id = i;
        w->opcode = ops[i];
        w->flags = KS_SEND_SIGNALED;
        w->psn = 7 + i;
        w->nsge = 2; /* the payload split over two SGEs */
        w->sge[0] = (ks_sge){.addr = (uintptr_t)LOCAL_BUF,
                             .length = lens[i] / 2,
                             .lkey = KEY_LOCAL};
        w->sge[1] = (ks_sge){.addr = (uintptr_t)LOCAL_BUF + 3000,
                             .length = lens[i] - lens[i] / 2,
                             .lkey = KEY_LOCAL};
        w->total = lens[i];
        QP_REQ->sq_tail++;
    }
    QP_REQ->sq_sent = QP_REQ->sq_tail; /* all on the wire: responses are due */
}

/* Run the handler on `c` until it dies or stops making progress; drain what it sends
 * so its writes never block the test. */
static void pump(ks_conn *c, int peer_fd)
{
    uint8_t sink[65536];
    for (int round = 0; round < 64 && !c->dead; round++) {
        pthread_mutex_lock(&E->lock); /* as the engine thread: req_rx drops it */
        handle_conn(E, c, EPOLLIN | EPOLLOUT);
        signal_flush(E);
        pthread_mutex_unlock(&E->lock);
        while (recv(peer_fd, sink, sizeof sink, MSG_DONTWAIT) > 0)
            ;
    }
}

static int feed(const uint8_t *data, size_t len, int role)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) < 0)
        return -1;
    int big = 1 << 20;
    setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    size_t off = 0;
    while (off < len) {
        ssize_t n = send(sv[1], data + off, len - off, MSG_NOSIGNAL);
        if (n <= 0)
            break;
        off += n;
    }
    shutdown(sv[1], SHUT_WR);
    ks_conn *c = conn_new(E, sv[0], role);
    if (!c) {
        close(sv[0]);
        close(sv[1]);
        return -1;
    }
    if (role == CONN_HELLO) {
        c->peer_ip = PEER_IP;
    } else {
        c->qp = QP_REQ;
        QP_REQ->req = c;
    }
    pump(c, sv[1]);
    close(sv[1]);
    return 0;
}

static void check_hdr(const uint8_t *buf)
{
    static const int roles[] = {KS_ROLE_ANY, KS_ROLE_REQUESTS, KS_ROLE_RESPONSES,
                                KS_ROLE_HELLO};
    for (int i = 0; i < 4; i++) {
        struct ks_hdr h;
        int rc = ks_hdr_parse(buf, &h, roles[i]);
        assert(rc == 0 || rc == -EPROTO || rc == -EMSGSIZE);
        if (rc != 0)
            continue;
        assert(h.magic == KS_MAGIC && h.version == KS_VERSION && h.flags == 0);
        assert(h.psn <= 0xFFFFFF && h.opcode >= KS_OP_HELLO && h.opcode <= KS_OP_SEND_ACK);
        if (h.opcode == KS_OP_HELLO)
            assert(h.length <= KS_HELLO_FIXED + KS_MAX_PDATA);
        if (h.opcode == KS_OP_SEND)
            assert(h.length <= KS_MAX_SEND);
        if (h.opcode == KS_OP_READ_REQ)
            assert(h.length == 0 && h.rlen <= KS_MAX_MSG);
        uint8_t again[KS_HDR_LEN]; /* what parses, rebuilds to the same bytes */
        ks_hdr_build(again, &h);
        assert(memcmp(again, buf, KS_HDR_LEN) == 0);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    if (len < 1 || len > MAX_INPUT)
        return 0;
    uint8_t target = data[0] % 4;
    data++;
    len--;
    if (target == 0) {
        uint8_t buf[KS_HDR_LEN] = {0};
        memcpy(buf, data, len < KS_HDR_LEN ? len : KS_HDR_LEN);
        check_hdr(buf);
        return 0;
    }
    if (target == 1) {
        uint8_t *copy = malloc(len ? len : 1); /* exact size: ASan sees any overread */
        memcpy(copy, data, len);
        struct ks_hello hl;
        uint32_t need;
        int rc = ks_hello_parse(copy, (uint32_t)len, &hl, &need);
        assert(rc == 0 || rc == -EAGAIN || rc == -EPROTO || rc == -EMSGSIZE);
        if (rc == -EAGAIN)
            assert(need > len && need <= KS_HELLO_BUF);
        if (rc == 0)
            assert(need == len && hl.pdata_len <= KS_MAX_PDATA &&
                   hl.pdata + hl.pdata_len == copy + len);
        free(copy);
        return 0;
    }
    if (!E)
        setup();
    reset_state();
    feed(data, len, target == 2 ? CONN_HELLO : CONN_REQ);
    for (int i = 0; i < 2; i++) { /* whatever happened, no QP points at garbage */
        ks_qp *qp = i ? QP_REQ : QP_RESP;
        assert(!qp->resp || !qp->resp->dead);
        assert(!qp->req || !qp->req->dead);
        assert(qp->ncand == 0); /* an RTS QP never keeps candidates */
    }
    return 0;
}

#ifndef KS_LIBFUZZER
/* ------------------------------------------------------------- standalone driver */

static uint64_t rng_state;

static uint64_t rnd(void)
{
    uint64_t x = rng_state; /* xorshift64*: reproducible from -seed */
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static size_t put_hdr(uint8_t *p, uint8_t op, uint32_t psn, uint32_t length, uint32_t rkey,
                      uint32_t rlen, uint64_t raddr)
{
    struct ks_hdr h = {.opcode = op,
                       .psn = psn,
                       .length = length,
                       .rkey = rkey,
                       .rlen = rlen,
                       .raddr = raddr};
    ks_hdr_build(p, &h);
    return KS_HDR_LEN;
}

static size_t put_hello(uint8_t *p, uint32_t dest, uint32_t src, uint32_t npdata)
{
    size_t n = put_hdr(p, KS_OP_HELLO, 0, KS_HELLO_FIXED + npdata, 0, 0, 0);
    wr32(p + n, dest);
    wr32(p + n + 4, src);
    wr32(p + n + 8, 0);
    memset(p + n + 12, 'p', npdata);
    return n + KS_HELLO_FIXED + npdata;
}

/* A valid input for each target. */
static size_t seed(uint8_t *p, int target)
{
    size_t n = 0;
    p[n++] = (uint8_t)target;
    switch (target) {
    case 0:
        return n + put_hdr(p + n, KS_OP_READ_REQ, 5, 0, KEY_REMOTE, 64, 0x1000);
    case 1:
        return n + put_hello(p + n, QPN_RESP, QPN_PEER, rnd() % 40);
    case 2: {
        n += put_hello(p + n, QPN_RESP, QPN_PEER, 16);
        uint32_t psn = 100;
        for (int i = 0; i < 6; i++) {
            if (rnd() % 2) {
                uint32_t off = rnd() % MR_LEN, len = rnd() % (MR_LEN - off + 1);
                n += put_hdr(p + n, KS_OP_READ_REQ, psn++, 0, KEY_REMOTE, len,
                             (uintptr_t)REMOTE_BUF + off);
            } else {
                uint32_t len = rnd() % 100;
                n += put_hdr(p + n, KS_OP_SEND, psn++, len, 0, 0, 0);
                memset(p + n, 's', len);
                n += len;
            }
        }
        return n;
    }
    default: {
        static const uint32_t lens[3] = {16, 5000, 40};
        for (int i = 0; i < 3; i++) {
            int read = i < 2;
            n += put_hdr(p + n, read ? KS_OP_READ_RESP : KS_OP_SEND_ACK, 7 + i,
                         read ? lens[i] : 0, 0, 0, 0);
            if (read) {
                memset(p + n, 'r', lens[i]);
                n += lens[i];
            }
        }
        return n;
    }
    }
}

static const uint32_t INTERESTING[] = {0,
                                       1,
                                       0x7F,
                                       0x80,
                                       0xFF,
                                       0xFFFF,
                                       0xFFFFFF,
                                       0x1000000,
                                       0x7FFFFFFF,
                                       0x80000000u,
                                       0xFFFFFFFFu,
                                       KS_MAX_SEND,
                                       KS_MAX_SEND + 1,
                                       KS_MAX_MSG,
                                       KS_MAX_MSG + 1,
                                       KS_HELLO_FIXED + KS_MAX_PDATA,
                                       QPN_RESP,
                                       QPN_PEER,
                                       4096,
                                       4097,
                                       MR_LEN,
                                       MR_LEN + 1};

static size_t mutate(uint8_t *p, size_t n, size_t cap)
{
    int rounds = 1 + rnd() % 4;
    for (int r = 0; r < rounds && n > 1; r++) {
        size_t at = 1 + rnd() % (n - 1);
        switch (rnd() % 7) {
        case 0:
            p[at] ^= (uint8_t)(1u << (rnd() % 8));
            break;
        case 1:
            p[at] = (uint8_t)rnd();
            break;
        case 2: { /* a 32-bit field of some header */
            size_t f = 1 + ((at - 1) & ~(size_t)3);
            if (f + 4 <= n)
                wr32(p + f, INTERESTING[rnd() % (sizeof INTERESTING / sizeof *INTERESTING)]);
            break;
        }
        case 3:
            n = at; /* truncate */
            break;
        case 4: { /* duplicate a slice (replayed / reordered) */
            size_t len = rnd() % (n - at + 1);
            if (n + len <= cap) {
                memmove(p + at + len, p + at, n - at);
                n += len;
            }
            break;
        }
        case 5: { /* insert random bytes */
            size_t len = 1 + rnd() % 16;
            if (n + len <= cap) {
                memmove(p + at + len, p + at, n - at);
                for (size_t i = 0; i < len; i++)
                    p[at + i] = (uint8_t)rnd();
                n += len;
            }
            break;
        }
        default: /* delete a slice */
            if (n - at > 1) {
                size_t len = 1 + rnd() % (n - at - 1);
                memmove(p + at, p + at + len, n - at - len);
                n -= len;
            }
        }
    }
    return n;
}

int main(int argc, char **argv)
{
    double seconds = 5;
    long runs = -1;
    uint64_t s = (uint64_t)now_ns();
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-seconds"))
            seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "-runs"))
            runs = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "-seed"))
            s = strtoull(argv[i + 1], NULL, 0);
    }
    rng_state = s ? s : 1;
    setup();
    static uint8_t buf[MAX_INPUT];
    uint64_t end = now_ns() + (uint64_t)(seconds * 1e9);
    long n = 0;
    long per_target[4] = {0};
    while ((runs < 0 || n < runs) && (runs >= 0 || now_ns() < end)) {
        int target = (int)(rnd() % 4);
        size_t len = seed(buf, target);
        if (rnd() % 8) /* 1 in 8 stays valid: the positive path too */
            len = mutate(buf, len, sizeof buf);
        LLVMFuzzerTestOneInput(buf, len);
        per_target[target]++;
        n++;
    }
    reset_state();
    printf("fuzz_engine: seed %llu, %ld inputs (hdr %ld, hello %ld, responder %ld, "
           "requester %ld), %llu connections dropped, %llu B served, no failure\n",
           (unsigned long long)s, n, per_target[0], per_target[1], per_target[2],
           per_target[3], (unsigned long long)E->n_dropped_conns,
           (unsigned long long)E->n_tx_bytes);
    return 0;
}
#endif
