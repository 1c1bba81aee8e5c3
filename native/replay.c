/*
 * kmesh-trace native replay engine: restores chunks from files into registered (fixed) buffers with
 * io_uring (raw syscalls, no liburing), O_DIRECT, a configurable queue depth and worker count, and
 * records per-chunk submission/completion times (CLOCK_MONOTONIC ns), bytes and results. GPU routes
 * reach CUDA through the driver API loaded at run time (dlopen "libcuda.so.1"), so a host without CUDA
 * builds and runs the `host` route. It owns no policy: the Python side (kmesh_trace.native) decides
 * what to read where, poisons, verifies and times the GPU consumer.
 *
 * Buffer ownership is counted: a chunk's slot is acquired when its read is submitted (the kernel owns
 * it), released when its completion is reaped and, for GPU routes, its copy has been enqueued on the
 * caller's stream (the caller synchronises that stream before reusing the buffer). kr_ring_state()
 * reports what is still owned, so a caller can prove that every buffer was returned.
 *
 * Return codes, one domain per entry point (kmesh_trace.native.codes maps each into one message):
 *   - io_uring entry points (kr_probe_io_uring, kr_open, kr_register_*, kr_unregister_buffers,
 *     kr_restore) and kr_sample.result: 0 (or a count) on success, -errno on failure;
 *   - CUDA entry points (kr_cuda_load, kr_cuda_host_register, kr_cuda_host_unregister, kr_attach_cuda)
 *     and kr_sample.copy_result: 0 on success, a positive CUresult from the driver, or this library's
 *     own codes KR_ENOLIBCUDA (-1: libcuda.so.1 could not be loaded) and KR_ENOSYMBOL (-2: it lacks a
 *     driver API symbol used here). These are not errnos: -1 here is not -EPERM.
 *
 * The structures that cross into Python (struct kr_chunk, struct kr_sample) are described by
 * kr_layout(), which the binding compares with its own record layouts when it loads this library.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "layout_table.h"

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#define __NR_io_uring_enter 426
#define __NR_io_uring_register 427
#endif

/*
 * NOTE: UNMERGED KERNEL ABI COMPILED IN. The proposed (unmerged, 2025-2026) DMA-BUF registered-buffer
 * interface: IORING_REGISTER_BUFFERS_UPDATE with an extended-update flag whose data points at buffer
 * descriptors; a descriptor of type DMA-BUF carries the exporter's fd and the O_DIRECT block-device fd
 * the reads will target. No mainline <linux/io_uring.h> defines IORING_RSRC_F_EXTENDED_UPDATE,
 * IORING_BUF_TYPE_DMABUF or the descriptor: the values and struct kr_dmabuf_desc below are this
 * project's reading of the proposal, not a kernel ABI, and a kernel that merges a different version may
 * give them other meanings. A kernel header that defines the two constants wins (kr_dmabuf_abi() says
 * which were compiled in); a stock kernel answers the extended update with EINVAL, which the probe
 * reports. Only kr_register_dmabuf (the `dmabuf_fixed` route) uses them.
 */
#define KR_DMABUF_ABI_HEADER_FLAG 1u /* IORING_RSRC_F_EXTENDED_UPDATE came from the kernel header */
#define KR_DMABUF_ABI_HEADER_TYPE 2u /* IORING_BUF_TYPE_DMABUF came from the kernel header */
#ifndef IORING_RSRC_F_EXTENDED_UPDATE
#define IORING_RSRC_F_EXTENDED_UPDATE (1U << 31)
#define KR_DMABUF_ABI_FLAG_BITS 0u
#else
#define KR_DMABUF_ABI_FLAG_BITS KR_DMABUF_ABI_HEADER_FLAG
#endif
#ifndef IORING_BUF_TYPE_DMABUF
#define IORING_BUF_TYPE_DMABUF 1
#define KR_DMABUF_ABI_TYPE_BITS 0u
#else
#define KR_DMABUF_ABI_TYPE_BITS KR_DMABUF_ABI_HEADER_TYPE
#endif

/* Which of the proposed DMA-BUF constants came from the kernel header this was built against (bits
 * KR_DMABUF_ABI_HEADER_*); 0: both are this file's own values (the unmerged ABI, see above). */
unsigned kr_dmabuf_abi(void) { return KR_DMABUF_ABI_FLAG_BITS | KR_DMABUF_ABI_TYPE_BITS; }
struct kr_dmabuf_desc {
    uint32_t type;      /* IORING_BUF_TYPE_DMABUF */
    int32_t dmabuf_fd;  /* exported GPU arena */
    int32_t target_fd;  /* raw NVMe block device opened O_DIRECT */
    uint32_t flags;
    uint64_t len;       /* bytes of the DMA-BUF to map */
    uint64_t resv[2];
};

#define KR_MAX_WORKERS 64
#define KR_MAX_BUFFERS 1024

/* One chunk to restore (input). */
struct kr_chunk {
    int32_t fd;          /* file (or device) descriptor opened O_DIRECT */
    int32_t buf_index;   /* registered buffer index */
    int64_t file_offset; /* where the chunk starts in the file */
    int64_t size;        /* bytes */
    int64_t buf_offset;  /* where it lands inside the registered buffer (and inside the GPU arena) */
};

/* What happened to one chunk (output). */
struct kr_sample {
    int64_t submit_ns;   /* first submission */
    int64_t complete_ns; /* last completion reaped */
    int64_t result;      /* bytes read, or -errno of the first failure */
    int32_t worker;      /* which ring/worker read it */
    int32_t num_sqes;    /* submissions it took (short reads are resubmitted) */
    int32_t copy_result; /* CUresult of the host->device copy (0 when none was asked for) */
    int32_t pad;
};

/* The layout of the structures that cross into Python (layout_table.h). */
#define KR_TYPE(T) LAYOUT_TYPE(#T, struct T)
#define KR_FIELD(T, F) LAYOUT_FIELD(#T, struct T, F)
static const layout_row kr_layout_rows[] = {
    KR_TYPE(kr_chunk),
    KR_FIELD(kr_chunk, fd), KR_FIELD(kr_chunk, buf_index), KR_FIELD(kr_chunk, file_offset),
    KR_FIELD(kr_chunk, size), KR_FIELD(kr_chunk, buf_offset),
    KR_TYPE(kr_sample),
    KR_FIELD(kr_sample, submit_ns), KR_FIELD(kr_sample, complete_ns), KR_FIELD(kr_sample, result),
    KR_FIELD(kr_sample, worker), KR_FIELD(kr_sample, num_sqes), KR_FIELD(kr_sample, copy_result),
    KR_FIELD(kr_sample, pad),
};

/* Row i of the layout table: 0, or -ERANGE past its end. */
int kr_layout(unsigned i, const char **type, const char **field, uint64_t *offset, uint64_t *size) {
    return layout_row_at(kr_layout_rows, sizeof kr_layout_rows / sizeof kr_layout_rows[0], i, type, field, offset,
                         size) ? -ERANGE : 0;
}

struct ring {
    int fd;
    unsigned depth;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len, sqes_len;
    int single_mmap;
    unsigned inflight; /* submitted, completion not yet reaped */
};

typedef int (*cu_memcpy_htod_async_t)(uint64_t dst, const void *src, size_t n, void *stream);
typedef int (*cu_ctx_set_current_t)(void *ctx);
typedef int (*cu_ctx_get_current_t)(void **ctx);
typedef int (*cu_host_register_t)(void *p, size_t n, unsigned flags);
typedef int (*cu_host_unregister_t)(void *p);
typedef int (*cu_init_t)(unsigned flags);

struct kr_ctx {
    unsigned depth, num_workers;
    struct ring rings[KR_MAX_WORKERS];
    unsigned num_buffers;
    struct iovec bufs[KR_MAX_BUFFERS];
    /* GPU copy hook (host_fixed): every completed chunk is copied to dev_base + buf_offset. */
    void *cu_ctx, *cu_stream;
    uint64_t dev_base;
    int cuda_on;
    /* drained-ownership accounting */
    atomic_llong slots_acquired, slots_released;
    /* Set when a ring failed and reads it had submitted could not be reaped: the kernel may still write
     * into the buffers and complete them later, so every later restore on this context is refused. */
    atomic_int broken;
};

/* ---------------------------------------------------------------- CUDA (dlopen) */

static void *cuda_lib;
static cu_memcpy_htod_async_t p_memcpy;
static cu_ctx_set_current_t p_set_current;
static cu_ctx_get_current_t p_get_current;
static cu_host_register_t p_host_register;
static cu_host_unregister_t p_host_unregister;
static cu_init_t p_init;
static pthread_mutex_t cuda_lock = PTHREAD_MUTEX_INITIALIZER;

/* This library's own codes in the CUDA entry points' domain (not errnos; see the top of the file). */
#define KR_ENOLIBCUDA (-1)
#define KR_ENOSYMBOL (-2)

/* 0 when libcuda.so.1 is loaded and initialised; KR_ENOLIBCUDA no library; KR_ENOSYMBOL missing symbol;
 * >0 cuInit's CUresult. */
int kr_cuda_load(void) {
    int rc = 0;
    pthread_mutex_lock(&cuda_lock);
    if (!cuda_lib) {
        cuda_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!cuda_lib) { rc = KR_ENOLIBCUDA; goto out; }
        p_init = (cu_init_t)dlsym(cuda_lib, "cuInit");
        p_memcpy = (cu_memcpy_htod_async_t)dlsym(cuda_lib, "cuMemcpyHtoDAsync_v2");
        p_set_current = (cu_ctx_set_current_t)dlsym(cuda_lib, "cuCtxSetCurrent");
        p_get_current = (cu_ctx_get_current_t)dlsym(cuda_lib, "cuCtxGetCurrent");
        p_host_register = (cu_host_register_t)dlsym(cuda_lib, "cuMemHostRegister_v2");
        p_host_unregister = (cu_host_unregister_t)dlsym(cuda_lib, "cuMemHostUnregister");
        if (!p_init || !p_memcpy || !p_set_current || !p_get_current || !p_host_register || !p_host_unregister) {
            dlclose(cuda_lib);
            cuda_lib = NULL;
            rc = KR_ENOSYMBOL;
            goto out;
        }
    }
    rc = p_init(0);
out:
    pthread_mutex_unlock(&cuda_lock);
    return rc;
}

/* Page-lock a host range for CUDA (it may already be registered with io_uring: both only pin pages). */
int kr_cuda_host_register(void *p, size_t n) {
    int rc = kr_cuda_load();
    return rc ? rc : p_host_register(p, n, 1 /* CU_MEMHOSTREGISTER_PORTABLE */);
}

int kr_cuda_host_unregister(void *p) { return cuda_lib ? p_host_unregister(p) : KR_ENOLIBCUDA; }

/* ---------------------------------------------------------------- io_uring */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t kr_now_ns(void) { return now_ns(); }

#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif

/* A ring of `depth` entries. COOP_TASKRUN (Linux 5.19+; older kernels answer EINVAL and get a plain ring):
 * completions are handed to this task when it next enters the kernel, as it always does to reap, rather
 * than by interrupting it; the same setting fio's io_uring engine asks for. */
static int ring_setup(struct ring *r, unsigned depth) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    memset(r, 0, sizeof *r);
    r->fd = -1;
    p.flags = IORING_SETUP_COOP_TASKRUN;
    int fd = (int)syscall(__NR_io_uring_setup, depth, &p);
    if (fd < 0 && errno == EINVAL) {
        memset(&p, 0, sizeof p);
        fd = (int)syscall(__NR_io_uring_setup, depth, &p);
    }
    if (fd < 0) return -errno;
    r->fd = fd;
    r->depth = depth;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    r->single_mmap = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (r->single_mmap && r->cq_len > r->sq_len) r->sq_len = r->cq_len;
    r->sq_ptr = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED) goto fail;
    if (r->single_mmap) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED) goto fail;
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail;
    char *sq = r->sq_ptr, *cq = r->cq_ptr;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
fail:;
    int e = -errno;
    if (r->sq_ptr && r->sq_ptr != MAP_FAILED) munmap(r->sq_ptr, r->sq_len);
    if (!r->single_mmap && r->cq_ptr && r->cq_ptr != MAP_FAILED) munmap(r->cq_ptr, r->cq_len);
    close(fd);
    r->fd = -1;
    return e;
}

static void ring_close(struct ring *r) {
    if (r->fd < 0) return;
    munmap(r->sqes, r->sqes_len);
    if (!r->single_mmap) munmap(r->cq_ptr, r->cq_len);
    munmap(r->sq_ptr, r->sq_len);
    close(r->fd);
    r->fd = -1;
}

static int ring_register(struct ring *r, unsigned op, const void *arg, unsigned nr) {
    int rc = (int)syscall(__NR_io_uring_register, r->fd, op, arg, nr);
    return rc < 0 ? -errno : rc;
}

/* 0 when this kernel lets us set up a ring and supports IORING_OP_READ_FIXED; else -errno. */
int kr_probe_io_uring(void) {
    struct ring r;
    int rc = ring_setup(&r, 2);
    if (rc) return rc;
    size_t n = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *pr = calloc(1, n);
    if (!pr) { ring_close(&r); return -ENOMEM; }
    rc = ring_register(&r, IORING_REGISTER_PROBE, pr, 256);
    if (rc >= 0) {
        rc = (pr->last_op >= IORING_OP_READ_FIXED && (pr->ops[IORING_OP_READ_FIXED].flags & IO_URING_OP_SUPPORTED))
                 ? 0 : -EOPNOTSUPP;
    }
    free(pr);
    ring_close(&r);
    return rc;
}

/* ---------------------------------------------------------------- context */

void kr_close(struct kr_ctx *c);

/* Create `num_workers` rings of `depth` entries each. Returns 0 and *out, or -errno. */
int kr_open(unsigned depth, unsigned num_workers, struct kr_ctx **out) {
    if (depth == 0 || depth > 4096 || num_workers == 0 || num_workers > KR_MAX_WORKERS) return -EINVAL;
    struct kr_ctx *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    c->depth = depth;
    c->num_workers = num_workers;
    for (unsigned w = 0; w < num_workers; w++) c->rings[w].fd = -1;
    for (unsigned w = 0; w < num_workers; w++) {
        int rc = ring_setup(&c->rings[w], depth);
        if (rc) { kr_close(c); return rc; }
    }
    *out = c;
    return 0;
}

/* Register host buffers (page aligned, pinned by the kernel) with every ring. */
int kr_register_buffers(struct kr_ctx *c, void *const *addrs, const uint64_t *lens, unsigned n) {
    if (n == 0 || n > KR_MAX_BUFFERS || c->num_buffers) return -EINVAL;
    for (unsigned i = 0; i < n; i++) {
        c->bufs[i].iov_base = addrs[i];
        c->bufs[i].iov_len = lens[i];
    }
    for (unsigned w = 0; w < c->num_workers; w++) {
        int rc = ring_register(&c->rings[w], IORING_REGISTER_BUFFERS, c->bufs, n);
        if (rc < 0) {
            for (unsigned v = 0; v < w; v++) ring_register(&c->rings[v], IORING_UNREGISTER_BUFFERS, NULL, 0);
            return rc;
        }
    }
    c->num_buffers = n;
    return 0;
}

int kr_unregister_buffers(struct kr_ctx *c) {
    int rc = 0;
    if (!c->num_buffers) return 0;
    for (unsigned w = 0; w < c->num_workers; w++) {
        int r = ring_register(&c->rings[w], IORING_UNREGISTER_BUFFERS, NULL, 0);
        if (r < 0 && !rc) rc = r;
    }
    c->num_buffers = 0;
    memset(c->bufs, 0, sizeof c->bufs); /* a later sparse table must not inherit these host addresses */
    return rc;
}

/*
 * Register a GPU arena exported as a DMA-BUF as fixed buffer `slot` of every ring, through the proposed
 * extended IORING_REGISTER_BUFFERS_UPDATE. The table must have room: call kr_register_sparse first.
 * Returns 0 or -errno (stock kernels: -EINVAL).
 */
int kr_register_sparse(struct kr_ctx *c, unsigned n) {
    /* bufs[] has KR_MAX_BUFFERS entries and restores index it by buf_index < num_buffers. */
    if (n == 0 || n > KR_MAX_BUFFERS || c->num_buffers) return -EINVAL;
    struct io_uring_rsrc_register rr;
    memset(&rr, 0, sizeof rr);
    rr.nr = n;
    rr.flags = IORING_RSRC_REGISTER_SPARSE;
    for (unsigned w = 0; w < c->num_workers; w++) {
        int rc = ring_register(&c->rings[w], IORING_REGISTER_BUFFERS2, &rr, sizeof rr);
        if (rc < 0) {
            for (unsigned v = 0; v < w; v++) ring_register(&c->rings[v], IORING_UNREGISTER_BUFFERS, NULL, 0);
            return rc;
        }
    }
    memset(c->bufs, 0, n * sizeof c->bufs[0]); /* no user mapping: DMA-BUF slots are addressed by offset */
    c->num_buffers = n;
    return 0;
}

int kr_register_dmabuf(struct kr_ctx *c, unsigned slot, int dmabuf_fd, int target_fd, uint64_t len) {
    if (slot >= c->num_buffers) return -EINVAL;
    struct kr_dmabuf_desc d;
    memset(&d, 0, sizeof d);
    d.type = IORING_BUF_TYPE_DMABUF;
    d.dmabuf_fd = dmabuf_fd;
    d.target_fd = target_fd;
    d.len = len;
    struct io_uring_rsrc_update2 up;
    memset(&up, 0, sizeof up);
    up.offset = slot;
    up.data = (uint64_t)(uintptr_t)&d;
    up.nr = 1;
    up.resv = IORING_RSRC_F_EXTENDED_UPDATE;
    for (unsigned w = 0; w < c->num_workers; w++) {
        int rc = ring_register(&c->rings[w], IORING_REGISTER_BUFFERS_UPDATE, &up, sizeof up);
        if (rc < 0) return rc;
        if (rc != 1) return -EIO;
    }
    return 0;
}

/* Attach the host_fixed copy: completed chunks go to dev_base + buf_offset on `stream` in the current context. */
int kr_attach_cuda(struct kr_ctx *c, uint64_t dev_base, void *stream) {
    int rc = kr_cuda_load();
    if (rc) return rc;
    void *cur = NULL;
    rc = p_get_current(&cur);
    if (rc) return rc;
    if (!cur) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    c->cu_ctx = cur;
    c->cu_stream = stream;
    c->dev_base = dev_base;
    c->cuda_on = 1;
    return 0;
}

void kr_detach_cuda(struct kr_ctx *c) { c->cuda_on = 0; }

void kr_close(struct kr_ctx *c) {
    if (!c) return;
    kr_unregister_buffers(c);
    for (unsigned w = 0; w < c->num_workers; w++) ring_close(&c->rings[w]);
    free(c);
}

/* ---------------------------------------------------------------- restore */

struct job {
    struct kr_ctx *c;
    unsigned worker;
    const struct kr_chunk *chunks;
    struct kr_sample *samples;
    const unsigned *idx; /* chunk indices this worker reads */
    unsigned n;
    int rc;
};

static void prep_read(struct kr_ctx *c, struct ring *r, const struct kr_chunk *ch, int64_t done, unsigned id) {
    unsigned tail = *r->sq_tail;
    unsigned i = tail & *r->sq_mask;
    struct io_uring_sqe *s = &r->sqes[i];
    memset(s, 0, sizeof *s);
    s->opcode = IORING_OP_READ_FIXED;
    s->fd = ch->fd;
    /* A host buffer is addressed by its user address; a DMA-BUF slot (no user mapping) by its offset. */
    unsigned b = (unsigned)ch->buf_index; /* kr_restore checked it; checked again because bufs[] is fixed size */
    uint64_t base = (ch->buf_index >= 0 && b < c->num_buffers && b < KR_MAX_BUFFERS && c->bufs[b].iov_base)
                        ? (uint64_t)(uintptr_t)c->bufs[b].iov_base : 0;
    s->addr = base + (uint64_t)ch->buf_offset + (uint64_t)done;
    s->len = (uint32_t)(ch->size - done);
    s->off = (uint64_t)(ch->file_offset + done);
    s->buf_index = (uint16_t)ch->buf_index;
    s->user_data = id;
    r->sq_array[i] = i;
    atomic_store_explicit((_Atomic unsigned *)r->sq_tail, tail + 1, memory_order_release);
}

/* Where a job stands: bytes done per chunk, short reads waiting to be resubmitted, counts. */
struct jstate {
    int64_t *done;
    unsigned *retry;
    unsigned nretry, next, finished, to_submit;
};

static int ring_enter(struct ring *r, unsigned to_submit) {
    int rc;
    do {
        rc = (int)syscall(__NR_io_uring_enter, r->fd, to_submit, 1, IORING_ENTER_GETEVENTS, NULL, 0);
    } while (rc < 0 && errno == EINTR);
    return rc < 0 ? -errno : rc;
}

/* Chunk k ends unread (the ring failed): it carries the ring's error and its slot is returned. */
static void give_up(struct job *j, struct jstate *st, unsigned k) {
    struct kr_sample *s = &j->samples[j->idx[k]];
    s->complete_ns = now_ns();
    s->result = j->rc;
    atomic_fetch_add(&j->c->slots_released, 1);
    st->finished++;
}

/* Reap every completion posted so far. A short read is resubmitted, unless the job is already failing. */
static void reap(struct job *j, struct ring *r, struct jstate *st) {
    struct kr_ctx *c = j->c;
    unsigned head = *r->cq_head;
    unsigned tail = atomic_load_explicit((_Atomic unsigned *)r->cq_tail, memory_order_acquire);
    for (; head != tail; head++) {
        struct io_uring_cqe *e = &r->cqes[head & *r->cq_mask];
        unsigned k = (unsigned)e->user_data;
        int res = e->res;
        const struct kr_chunk *ch = &j->chunks[j->idx[k]];
        struct kr_sample *s = &j->samples[j->idx[k]];
        r->inflight--;
        if (res > 0 && st->done[k] + res < ch->size) { /* short read: the rest goes back in the queue */
            st->done[k] += res;
            if (j->rc) give_up(j, st, k);
            else st->retry[st->nretry++] = k;
            continue;
        }
        s->complete_ns = now_ns();
        if (res < 0) s->result = res;
        else if (res == 0) s->result = -ENODATA; /* end of file before the chunk's end */
        else s->result = st->done[k] + res;
        if (c->cuda_on && s->result == ch->size) {
            s->copy_result = p_memcpy(c->dev_base + (uint64_t)ch->buf_offset,
                                      (const char *)c->bufs[ch->buf_index].iov_base + ch->buf_offset,
                                      (size_t)ch->size, c->cu_stream);
        }
        atomic_fetch_add(&c->slots_released, 1);
        st->finished++;
    }
    atomic_store_explicit((_Atomic unsigned *)r->cq_head, head, memory_order_release);
}

/*
 * The ring failed with reads of this job queued or in flight; nothing of it may be left for a later
 * restore to reap (its user_data indexes this job's arrays). Submissions the kernel has not consumed are
 * withdrawn (without SQPOLL it consumes them only inside io_uring_enter, so sq_head says which), then
 * every read it did take is waited for. If even waiting fails, the context is marked broken.
 */
static void drain(struct job *j, struct ring *r, struct jstate *st) {
    unsigned head = atomic_load_explicit((_Atomic unsigned *)r->sq_head, memory_order_acquire);
    unsigned tail = *r->sq_tail;
    for (unsigned i = head; i != tail; i++) {
        r->inflight--;
        give_up(j, st, (unsigned)r->sqes[r->sq_array[i & *r->sq_mask]].user_data);
    }
    atomic_store_explicit((_Atomic unsigned *)r->sq_tail, head, memory_order_release);
    st->to_submit = 0;
    while (st->nretry) give_up(j, st, st->retry[--st->nretry]);
    while (r->inflight) {
        if (ring_enter(r, 0) < 0) {
            atomic_store(&j->c->broken, 1);
            return;
        }
        reap(j, r, st);
    }
}

static void *run_job(void *arg) {
    struct job *j = arg;
    struct kr_ctx *c = j->c;
    struct ring *r = &c->rings[j->worker];
    struct jstate st = {calloc(j->n ? j->n : 1, sizeof(int64_t)), malloc((j->n ? j->n : 1) * sizeof(unsigned)),
                        0, 0, 0, 0};
    j->rc = 0;
    if (!st.done || !st.retry) { j->rc = -ENOMEM; goto out; }
    if (c->cuda_on && p_set_current(c->cu_ctx)) { j->rc = -EFAULT; goto out; }
    while (st.finished < j->n) {
        /* Fill the queue: resubmissions of short reads first, then new chunks. */
        while (r->inflight < r->depth && (st.nretry || st.next < j->n)) {
            unsigned k = st.nretry ? st.retry[--st.nretry] : st.next++;
            const struct kr_chunk *ch = &j->chunks[j->idx[k]];
            struct kr_sample *s = &j->samples[j->idx[k]];
            if (s->num_sqes == 0) {
                s->submit_ns = now_ns();
                s->worker = (int32_t)j->worker;
                atomic_fetch_add(&c->slots_acquired, 1);
            }
            s->num_sqes++;
            prep_read(c, r, ch, st.done[k], k);
            r->inflight++;
            st.to_submit++;
        }
        int rc = ring_enter(r, st.to_submit);
        if (rc < 0) {
            j->rc = rc;
            drain(j, r, &st);
            break;
        }
        st.to_submit -= (unsigned)rc <= st.to_submit ? (unsigned)rc : st.to_submit;
        reap(j, r, &st);
    }
    /* Chunks never submitted carry the error too: no sample of a failed job may look like a read. */
    for (unsigned k = st.next; j->rc && k < j->n; k++) j->samples[j->idx[k]].result = j->rc;
out:
    free(st.done);
    free(st.retry);
    return NULL;
}

/*
 * Read every chunk; samples[i] describes chunks[i]. Chunk i goes to worker i % num_workers.
 * *io_done_ns is the time the last completion was reaped (timer 1). Returns 0, or -errno of a ring
 * failure (per-chunk read failures are in samples[i].result, never silent); after a ring failure every
 * read it had submitted has been reaped, or else the context is broken and answers -EBADFD from then on.
 */
int kr_restore(struct kr_ctx *c, const struct kr_chunk *chunks, unsigned n, struct kr_sample *samples,
               int64_t *io_done_ns) {
    unsigned nw = c->num_workers < n ? c->num_workers : (n ? n : 1);
    struct job jobs[KR_MAX_WORKERS];
    pthread_t th[KR_MAX_WORKERS];
    if (atomic_load(&c->broken)) return -EBADFD; /* see kr_ctx.broken */
    unsigned *idx = malloc((n ? n : 1) * sizeof *idx);
    if (!idx) return -ENOMEM;
    memset(samples, 0, n * sizeof *samples);
    for (unsigned i = 0; i < n; i++) {
        if (chunks[i].size <= 0 || chunks[i].size > (1LL << 30) || chunks[i].buf_index < 0 ||
            (unsigned)chunks[i].buf_index >= c->num_buffers) { free(idx); return -EINVAL; }
    }
    unsigned pos = 0;
    for (unsigned w = 0; w < nw; w++) {
        jobs[w] = (struct job){c, w, chunks, samples, idx + pos, 0, 0};
        for (unsigned i = w; i < n; i += nw) idx[pos++] = i;
        jobs[w].n = (unsigned)(idx + pos - jobs[w].idx);
    }
    int rc = 0;
    if (nw == 1) {
        run_job(&jobs[0]);
    } else {
        for (unsigned w = 0; w < nw; w++)
            if (pthread_create(&th[w], NULL, run_job, &jobs[w])) { jobs[w].rc = -EAGAIN; th[w] = 0; }
        for (unsigned w = 0; w < nw; w++)
            if (th[w]) pthread_join(th[w], NULL);
    }
    for (unsigned w = 0; w < nw; w++)
        if (jobs[w].rc && !rc) rc = jobs[w].rc;
    *io_done_ns = now_ns();
    free(idx);
    return rc;
}

/* Ownership state: slots acquired and released so far, and completions still owned by the kernel. */
void kr_ring_state(struct kr_ctx *c, int64_t *acquired, int64_t *released, int64_t *inflight, int64_t *cq_pending) {
    int64_t inf = 0, pend = 0;
    for (unsigned w = 0; w < c->num_workers; w++) {
        struct ring *r = &c->rings[w];
        inf += r->inflight;
        pend += (unsigned)(atomic_load_explicit((_Atomic unsigned *)r->cq_tail, memory_order_acquire) - *r->cq_head);
    }
    *acquired = atomic_load(&c->slots_acquired);
    *released = atomic_load(&c->slots_released);
    *inflight = inf;
    *cq_pending = pend;
}
