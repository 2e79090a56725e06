/* kvtrace.probes.kv_access._drain: a KV access ring's drains without the GIL.

   The reference is the NumPy path in ring.py (`lap_ok`, `_decode_window`) and cuda_ring.py (`_drain_to`);
   this module does the same work and is used where it builds (tests/unit/probes/test_kv_drain_native.py
   and test_kv_drain_loop.py check that they keep the same records and count the same drops).

   Why it exists: a 1B-class model's engine is bound by its Python thread, and every time another thread
   takes the GIL back the engine's thread stops for it, however little that thread then does. The NumPy
   drain let go of the GIL and took it back a dozen times a drain (each NumPy operation on a big array,
   each torch copy or event wait), ~150 hand-overs a second at the default granularity. `drain_device`
   waits for the device, copies the new records to pinned memory and keeps the intact ones in memory of
   their own in one call without the GIL; `Drainer` (below) does that in a loop that never takes it, and
   writes the block records as frames itself (`FrameSink`).

   Records are 32 bytes (REC_DTYPE in format/kv_records.py); the lap tag is the top 15 bits of the 32-bit
   word at byte 24 (`meta`). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define REC_BYTES 32
#define META_OFFSET 24
#define LAP_SHIFT 17
#define LAP_MASK 0x7FFFu

/* ---- Records: bytes in memory of their own, read through the buffer protocol ----------------------- */

typedef struct {
    PyObject_HEAD
    char *data;
    Py_ssize_t size; /* bytes */
} Records;

static void records_dealloc(Records *self) {
    free(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int records_getbuffer(Records *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data ? self->data : "", self->size, 1, flags);
}

static Py_ssize_t records_len(Records *self) { return self->size; }

static PyBufferProcs records_as_buffer = {(getbufferproc)records_getbuffer, NULL};
static PySequenceMethods records_as_sequence = {.sq_length = (lenfunc)records_len};

static PyTypeObject RecordsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtrace.probes.kv_access._drain.Records",
    .tp_basicsize = sizeof(Records),
    .tp_dealloc = (destructor)records_dealloc,
    .tp_as_buffer = &records_as_buffer,
    .tp_as_sequence = &records_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Drained records (32 bytes each) in memory of their own; read-only buffer.",
};

static PyObject *records_new(char *data, Py_ssize_t size) {
    Records *r = PyObject_New(Records, &RecordsType);
    if (r == NULL) {
        free(data);
        return NULL;
    }
    r->data = data;
    r->size = size;
    return (PyObject *)r;
}

/* Copy the records of src (n of them, stored at ring positions first_pos..) whose lap tag is that of
   their position into dst; returns how many. Runs of intact records go in one memcpy each. No GIL. */
static Py_ssize_t keep_intact_into(const char *src, Py_ssize_t n, uint64_t first_pos, int log2cap, char *dst) {
    Py_ssize_t kept = 0, run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t meta;
        memcpy(&meta, src + i * REC_BYTES + META_OFFSET, sizeof meta);
        uint32_t lap = (uint32_t)(((first_pos + (uint64_t)i) >> log2cap) & LAP_MASK);
        if ((meta >> LAP_SHIFT) == lap) {
            run++;
            continue;
        }
        if (run) {
            memcpy(dst + kept * REC_BYTES, src + (i - run) * REC_BYTES, (size_t)run * REC_BYTES);
            kept += run;
            run = 0;
        }
    }
    if (run) {
        memcpy(dst + kept * REC_BYTES, src + (n - run) * REC_BYTES, (size_t)run * REC_BYTES);
        kept += run;
    }
    return kept;
}

/* The intact records of src (as keep_intact_into) in memory of their own, malloc'd (NULL when out of
   memory); *kept says how many. No GIL. */
static char *kept_copy(const char *src, Py_ssize_t n, uint64_t first_pos, int log2cap, Py_ssize_t *kept) {
    char *dst = malloc(n ? (size_t)n * REC_BYTES : 1);
    *kept = dst != NULL ? keep_intact_into(src, n, first_pos, log2cap, dst) : 0;
    return dst;
}

/* Copies shorter than this keep the GIL: letting it go and taking it back costs the thread waiting for it
   (vLLM's engine thread) two wake-ups, more than copying and checking a few hundred records (~1 us). */
#define RELEASE_GIL_BYTES (64 * 1024)

/* keep_intact(src, first_pos, log2cap) -> Records */
static PyObject *keep_intact(PyObject *mod, PyObject *args) {
    Py_buffer src;
    unsigned long long first_pos;
    int log2cap;
    if (!PyArg_ParseTuple(args, "y*Ki", &src, &first_pos, &log2cap))
        return NULL;
    if (src.len % REC_BYTES || log2cap < 1 || log2cap > 62) {
        PyBuffer_Release(&src);
        PyErr_Format(PyExc_ValueError, "keep_intact: %zd bytes is not a whole number of %d-byte records, or "
                     "log2 capacity %d is out of range", src.len, REC_BYTES, log2cap);
        return NULL;
    }
    Py_ssize_t kept = 0;
    char *dst = NULL;
    if (src.len < RELEASE_GIL_BYTES) {  /* a few records (a drain's layer timings): done before a hand-over would be */
        dst = kept_copy(src.buf, src.len / REC_BYTES, first_pos, log2cap, &kept);
    } else {
        Py_BEGIN_ALLOW_THREADS
        dst = kept_copy(src.buf, src.len / REC_BYTES, first_pos, log2cap, &kept);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    if (dst == NULL)
        return PyErr_NoMemory();
    return records_new(dst, kept * REC_BYTES);
}

/* ---- the device drain --------------------------------------------------------------------------------- */

/* CUDA driver entry points, passed in as addresses (ctypes reads them from libcuda, loaded by torch):
   this module links against nothing CUDA and builds on machines without it. cudaEvent_t, cudaStream_t
   and device pointers of the runtime are the driver's CUevent, CUstream and CUdeviceptr. */
typedef int (*event_sync_fn)(void *event);
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*memcpy_dtoh_async_fn)(void *dst, uint64_t src, size_t bytes, void *stream);

typedef struct {
    uint64_t dev, stage;  /* the ring on the device, its pinned staging memory */
    long long tail, cap;  /* the first position not yet drained, the capacity (a power of two) */
    long long head, lo, n; /* out: the snapshot head, the first position copied, how many copied */
} RingWindow;

/* Copy positions [max(tail, head - cap), head) of a ring to the start of its staging memory (two copies
   when they wrap). */
static int copy_window(memcpy_dtoh_async_fn memcpy_async, RingWindow *w, void *stream, const char **where) {
    w->lo = w->head - w->cap > w->tail ? w->head - w->cap : w->tail;
    w->n = w->head > w->lo ? w->head - w->lo : 0;
    if (w->n == 0)
        return 0;
    long long a = w->lo & (w->cap - 1), n1 = w->n < w->cap - a ? w->n : w->cap - a;
    int rc = memcpy_async((void *)(uintptr_t)w->stage, w->dev + (uint64_t)a * REC_BYTES, (size_t)n1 * REC_BYTES, stream);
    if (rc == 0 && w->n > n1)
        rc = memcpy_async((void *)(uintptr_t)(w->stage + (uint64_t)n1 * REC_BYTES), w->dev,
                          (size_t)(w->n - n1) * REC_BYTES, stream);
    if (rc)
        *where = "copying the ring to pinned memory";
    return rc;
}

/* A drain's device side, no GIL needed: (take_snapshot: the state words copied to snap_host and snap_event
   recorded first) the wait for the snapshot, its heads into w[i].head, both windows copied to their
   staging memory, and the live heads after the copy into live[]. 0 or the CUresult of the first call that
   failed (*where says which step); *have_heads once the snapshot was read. */
static int device_side(event_sync_fn sync, event_record_fn record, memcpy_dtoh_async_fn copy, uint64_t snap_host,
                       void *snap_event, const int head_word[2], const int live_word[2], uint64_t state,
                       uint64_t live_host, void *stream, void *copy_event, int take_snapshot, RingWindow w[2],
                       long long live[2], const char **where, int *have_heads) {
    int rc = 0;
    if (take_snapshot) {
        rc = copy((void *)(uintptr_t)snap_host, state, 8 * sizeof(long long), stream);
        if (rc == 0)
            rc = record(snap_event, stream);
    }
    if (rc == 0)
        rc = sync(snap_event);
    if (rc) {
        *where = take_snapshot ? "taking the snapshot" : "waiting for the snapshot";
        return rc;
    }
    const long long *snap = (const long long *)(uintptr_t)snap_host;
    w[0].head = snap[head_word[0]];
    w[1].head = snap[head_word[1]];
    *have_heads = 1;
    for (int i = 0; i < 2 && rc == 0; i++)
        rc = copy_window(copy, &w[i], stream, where);
    /* The live heads after the copy: a slot of position p may have been overwritten while it was
       copied only if position p + capacity was reserved by then, i.e. p < live head - capacity. */
    if (rc == 0 && (w[0].n || w[1].n)) {
        rc = copy((void *)(uintptr_t)live_host, state, 8 * sizeof(long long), stream);
        if (rc == 0)
            rc = record(copy_event, stream);
        if (rc == 0)
            rc = sync(copy_event);
        if (rc) {
            *where = "waiting for the copy";
        } else {
            const long long *lv = (const long long *)(uintptr_t)live_host;
            live[0] = lv[live_word[0]];
            live[1] = lv[live_word[1]];
        }
    }
    return rc;
}

/* The first position of a copied window that was not overwritten before or while it was copied, as an
   offset into the window (at most its length). */
static long long intact_from(const RingWindow *w, long long live) {
    long long min_valid = live - w->cap > w->lo ? live - w->cap : w->lo;
    return min_valid - w->lo < w->n ? min_valid - w->lo : w->n;
}

/* drain_device(fns, snap_event, snap_host, head_words, live_words, rec_ring, tim_ring, state, live_host,
                stream, copy_event, log2cap, take_snapshot=0)
     -> (error, where, heads, (rec_lo, rec_n, tim_lo, tim_n), (live_rec_head, live_tim_head), kept)

   fns: (cuEventSynchronize, cuEventRecord, cuMemcpyDtoHAsync_v2) addresses. snap_event: the event after
   which snap_host (pinned int64 words) holds the heads at words head_words = (rec, tim); live_words: the
   same heads' words in the live state. rec_ring and
   tim_ring: (device ring, pinned staging, tail, capacity). Copies both windows to staging and the live
   state words (8 of them) to live_host on `stream`, waits on copy_event, and keeps the intact block
   records of positions >= max(rec_lo, live_rec_head - capacity) (`kept`, a Records, or None when no
   block record was new; the timing window is left in its staging memory for the caller). take_snapshot:
   first copy the state words to snap_host on `stream` and record snap_event there (a drain the thread
   times itself: the heads of the last step the device has started, not a point the host picked). `error` is the
   CUresult of the first call that failed (0: none) and `where` says which step; `heads` (rec, tim) is
   None when the snapshot could not be read. */
static PyObject *drain_device(PyObject *mod, PyObject *args) {
    unsigned long long f_sync, f_record, f_copy, snap_event, snap_host, state, live_host, stream, copy_event;
    int head_word[2], live_word[2], log2cap, take_snapshot = 0;
    RingWindow w[2] = {{0}};
    if (!PyArg_ParseTuple(args, "(KKK)KK(ii)(ii)(KKLL)(KKLL)KKKKi|p", &f_sync, &f_record, &f_copy, &snap_event,
                          &snap_host, &head_word[0], &head_word[1], &live_word[0], &live_word[1], &w[0].dev, &w[0].stage, &w[0].tail,
                          &w[0].cap, &w[1].dev, &w[1].stage, &w[1].tail, &w[1].cap, &state, &live_host,
                          &stream, &copy_event, &log2cap, &take_snapshot))
        return NULL;
    for (int i = 0; i < 2; i++) {
        if (w[i].cap < 2 || (w[i].cap & (w[i].cap - 1)) || head_word[i] < 0 || head_word[i] > 7
            || live_word[i] < 0 || live_word[i] > 7) {
            PyErr_SetString(PyExc_ValueError, "drain_device: a capacity that is not a power of two, or a head word out of range");
            return NULL;
        }
    }
    event_sync_fn sync = (event_sync_fn)(uintptr_t)f_sync;
    event_record_fn record = (event_record_fn)(uintptr_t)f_record;
    memcpy_dtoh_async_fn copy = (memcpy_dtoh_async_fn)(uintptr_t)f_copy;
    const char *where = "";
    int rc = 0, have_heads = 0;
    long long live[2] = {0, 0};
    char *kept = NULL;
    Py_ssize_t nkept = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = device_side(sync, record, copy, snap_host, (void *)(uintptr_t)snap_event, head_word, live_word, state,
                     live_host, (void *)(uintptr_t)stream, (void *)(uintptr_t)copy_event, take_snapshot, w, live,
                     &where, &have_heads);
    if (rc == 0 && w[0].n) {
        long long skip = intact_from(&w[0], live[0]);
        kept = kept_copy((const char *)(uintptr_t)w[0].stage + skip * REC_BYTES, (Py_ssize_t)(w[0].n - skip),
                         (uint64_t)(w[0].lo + skip), log2cap, &nkept);
        if (kept == NULL) {
            rc = -1;
            where = "allocating memory for the records";
        }
    }
    Py_END_ALLOW_THREADS
    PyObject *records = Py_None, *heads = Py_None;
    if (kept != NULL && (records = records_new(kept, nkept * REC_BYTES)) == NULL)
        return NULL;
    if (kept == NULL)
        Py_INCREF(Py_None);
    if (have_heads && (heads = Py_BuildValue("(LL)", w[0].head, w[1].head)) == NULL) {
        Py_DECREF(records);
        return NULL;
    }
    if (!have_heads)
        Py_INCREF(Py_None);
    return Py_BuildValue("isN(LLLL)(LL)N", rc, where, heads, w[0].lo, w[0].n, w[1].lo, w[1].n, live[0], live[1],
                         records);
}

/* ---- kernel launches that keep the GIL ---------------------------------------------------------------- */

/* cuLaunchKernel, set once by set_launcher (an address ctypes read from the libcuda torch loaded). */
typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned smem, void *stream, void **params, void **extra);
static launch_fn cu_launch = NULL;

static PyObject *set_launcher(PyObject *mod, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    cu_launch = (launch_fn)(uintptr_t)addr;
    Py_RETURN_NONE;
}

/* launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra): CuPy's driver.launchKernel, but the GIL
   is kept. The launch is a few microseconds of the driver's; letting the GIL go around it, as CuPy does,
   lets any thread waiting for the GIL (a drain, the shard writer, vLLM's own) run first, and the engine's
   thread then waits for it to give the GIL back. */
static PyObject *launch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long v[11];
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "launch takes 11 integers (CuPy's launchKernel arguments)");
        return NULL;
    }
    if (cu_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "launch: set_launcher was not called");
        return NULL;
    }
    for (int i = 0; i < 11; i++) {
        v[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (v[i] == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
    }
    int rc = cu_launch((void *)(uintptr_t)v[0], (unsigned)v[1], (unsigned)v[2], (unsigned)v[3], (unsigned)v[4],
                       (unsigned)v[5], (unsigned)v[6], (unsigned)v[7], (void *)(uintptr_t)v[8],
                       (void **)(uintptr_t)v[9], (void **)(uintptr_t)v[10]);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: CUresult %d", rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* state_launch(f, stream, params, args, step, active): a ring's per-step `kv_set_state` launch in one call.
   `args` is the address of the ring's StateArgs struct (cuda_ring.py `_StateArgs`: state pointer at 0,
   step int64 at 8, active int32 at 16, set int32 at 20) and `params` the kernelParams array pointing at it;
   the step and flags are written there, then the 1-thread kernel is launched on `stream` with the GIL kept
   (cuLaunchKernel copies the arguments at the launch). The same as setting the struct's fields through
   ctypes and calling `launch`, without the three ctypes stores and eleven arguments: the engine's thread
   calls this once a step. */
static PyObject *state_launch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "state_launch(f, stream, params, args, step, active)");
        return NULL;
    }
    if (cu_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "state_launch: set_launcher was not called");
        return NULL;
    }
    unsigned long long f = PyLong_AsUnsignedLongLong(args[0]), stream = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long params = PyLong_AsUnsignedLongLong(args[2]), where = PyLong_AsUnsignedLongLong(args[3]);
    long long step = PyLong_AsLongLong(args[4]);
    int active = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred() || active < 0)
        return NULL;
    if (where == 0) {
        PyErr_SetString(PyExc_ValueError, "state_launch: no argument struct");
        return NULL;
    }
    char *a = (char *)(uintptr_t)where;
    int32_t flags[2] = {active, 1};
    memcpy(a + 8, &step, sizeof step);
    memcpy(a + 16, flags, sizeof flags);
    int rc = cu_launch((void *)(uintptr_t)f, 1, 1, 1, 32, 1, 1, 0, (void *)(uintptr_t)stream,
                       (void **)(uintptr_t)params, NULL);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: CUresult %d", rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- the drain loop: timed drains on a thread that never takes the GIL --------------------------------

   Each drain that comes back to Python costs the engine's thread GIL hand-overs: the drain thread takes
   the GIL back after its native drain and again after writing the frame, with Python work between, and
   the engine waits for it each time (on a host-bound 1B engine the steps during a drain's hand-over ran
   5% slower than the others). `Drainer.run` instead stays in C, without the GIL, for as long as the
   caller asks: it waits for the next timed drain or a requested one, drains, writes the block records as
   a frame through a `FrameSink` (format/kv_frames.py's layout) and keeps the timing records, and comes
   back only at the caller's deadline (the ring's clock anchors, every few seconds) or when stopped. What
   needs Python (timing records, counts, errors, block records with no sink to write them) waits in the
   Drainer until `take()`. */

/* ---- FrameSink: the open frame file, written by C ---------------------------------------------------- */

#define FRAME_HEADER_BYTES 40
#define MAX_COPY_INTS 1024 /* 2 x kv_records.MAX_COPIES */

typedef struct {
    char magic[4];
    uint32_t copies;
    int64_t dev_ref, host_ref;
    double slope;
    uint64_t records;
} FrameHeader; /* "<4sIqqdQ": no padding, little-endian on the hosts kvtrace runs on */

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    int fd;                                 /* -1: no file (writes answer SINK_NO_FILE) */
    long long file_bytes, file_frames, file_records;
    int broken;                             /* a failed write could not be cut back: never seal the file */
    long long frames_total, bytes_total, records_total;
    char stop_cause[48];                    /* "" while writing; else records are counted lost under it */
    long long dropped;                      /* records counted lost since the last take() */
    int err;                                /* errno of a failed write not yet taken (0: none) */
} FrameSink;

enum { SINK_WRITTEN = 0, SINK_DROPPED = 1, SINK_NO_FILE = 2 };

/* The lock of a sink or a Drainer, taken by a caller that holds the GIL: at once when it is free, else
   with the GIL let go meanwhile (the loop may hold it for a frame's write, ~1 ms, and a thread waiting
   with the GIL would stop the engine's thread all that time). */
static void lock_gil_free(pthread_mutex_t *mu) {
    if (pthread_mutex_trylock(mu) == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(mu);
    Py_END_ALLOW_THREADS
}

static int sink_init(FrameSink *self, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, ""))
        return -1;
    pthread_mutex_init(&self->mu, NULL);
    self->fd = -1;
    return 0;
}

static void sink_dealloc(FrameSink *self) {
    pthread_mutex_destroy(&self->mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Write all of iov or nothing; 0 or an errno. */
static int write_all(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        ssize_t done = writev(fd, iov, n);
        if (done < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (done == 0)
            return ENOSPC;
        while (n > 0 && (size_t)done >= iov[0].iov_len) {
            done -= (ssize_t)iov[0].iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov[0].iov_base = (char *)iov[0].iov_base + done;
            iov[0].iov_len -= (size_t)done;
        }
    }
    return 0;
}

/* One frame: its header, the copies and `rows` records of 32 bytes. Whole or cut back, under the sink's
   lock; a failure stops the sink (cause writer-error) and counts the frame's records lost. No GIL needed. */
static int sink_write_frame(FrameSink *s, const int64_t clock_ns[2], double slope, const int32_t *copies,
                            int ncopies, const char *recs, long long rows) {
    FrameHeader h;
    memcpy(h.magic, "KVRF", 4);
    h.copies = (uint32_t)ncopies;
    h.dev_ref = clock_ns[0];
    h.host_ref = clock_ns[1];
    h.slope = slope;
    h.records = (uint64_t)rows;
    struct iovec iov[3] = {{&h, sizeof h}, {(void *)copies, (size_t)ncopies * 4}, {(void *)recs, (size_t)rows * REC_BYTES}};
    size_t total = sizeof h + iov[1].iov_len + iov[2].iov_len;
    int result = SINK_WRITTEN;
    pthread_mutex_lock(&s->mu);
    if (s->fd < 0) {
        result = SINK_NO_FILE;
    } else if (s->stop_cause[0] || s->broken) {
        if (!s->stop_cause[0])
            strcpy(s->stop_cause, "writer-error");
        s->dropped += rows;
        result = SINK_DROPPED;
    } else {
        int e = write_all(s->fd, iov, 3);
        if (e) {
            if (ftruncate(s->fd, (off_t)s->file_bytes) != 0 || lseek(s->fd, (off_t)s->file_bytes, SEEK_SET) < 0)
                s->broken = 1; /* a cut tail stays: readers stop at the last whole frame */
            strcpy(s->stop_cause, "writer-error");
            if (!s->err)
                s->err = e;
            s->dropped += rows;
            result = SINK_DROPPED;
        } else {
            s->file_bytes += (long long)total;
            s->file_frames++;
            s->file_records += rows;
            s->frames_total++;
            s->bytes_total += (long long)total;
            s->records_total += rows;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return result;
}

static int parse_copies(PyObject *seq, int32_t *out, int *n) {
    PyObject *fast = PySequence_Fast(seq, "copies must be a sequence of ints");
    if (fast == NULL)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    if (len > MAX_COPY_INTS || len % 2) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "copies: %zd ints (pairs, at most %d)", len, MAX_COPY_INTS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = (int32_t)v;
    }
    *n = (int)len;
    Py_DECREF(fast);
    return 0;
}

/* write(records, dev_ref, host_ref, slope, copies) -> SINK_* : one frame from Python (GIL let go). */
static PyObject *sink_write(FrameSink *self, PyObject *args) {
    Py_buffer recs;
    long long dev_ref, host_ref;
    double slope;
    PyObject *copies_obj;
    int32_t copies[MAX_COPY_INTS];
    int ncopies = 0;
    if (!PyArg_ParseTuple(args, "y*LLdO", &recs, &dev_ref, &host_ref, &slope, &copies_obj))
        return NULL;
    if (recs.len % REC_BYTES || parse_copies(copies_obj, copies, &ncopies) < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "write: %zd bytes is not a whole number of %d-byte records", recs.len, REC_BYTES);
        PyBuffer_Release(&recs);
        return NULL;
    }
    int64_t clock[2] = {dev_ref, host_ref};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sink_write_frame(self, clock, slope, copies, ncopies, recs.buf, recs.len / REC_BYTES);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&recs);
    return PyLong_FromLong(rc);
}

/* swap(fd, file_bytes) -> (old fd, its bytes, frames, records, broken): hand the sink another file (-1: none)
   and return the one it had, which it never writes again. */
static PyObject *sink_swap(FrameSink *self, PyObject *args) {
    int fd;
    long long bytes;
    if (!PyArg_ParseTuple(args, "iL", &fd, &bytes))
        return NULL;
    lock_gil_free(&self->mu);
    PyObject *old = Py_BuildValue("(iLLLi)", self->fd, self->file_bytes, self->file_frames, self->file_records, self->broken);
    self->fd = fd;
    self->file_bytes = fd < 0 ? 0 : bytes;
    self->file_frames = self->file_records = 0;
    self->broken = 0;
    pthread_mutex_unlock(&self->mu);
    return old;
}

/* stop(cause): from now on records are counted lost under `cause` (the first cause stays). */
static PyObject *sink_stop(FrameSink *self, PyObject *args) {
    const char *cause;
    if (!PyArg_ParseTuple(args, "s", &cause))
        return NULL;
    lock_gil_free(&self->mu);
    if (!self->stop_cause[0]) {
        strncpy(self->stop_cause, cause, sizeof self->stop_cause - 1);
        self->stop_cause[sizeof self->stop_cause - 1] = 0;
    }
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

/* take() -> (records lost since the last take, their cause, errno of a failed write or 0) */
static PyObject *sink_take(FrameSink *self, PyObject *unused) {
    lock_gil_free(&self->mu);
    PyObject *r = Py_BuildValue("(Lsi)", self->dropped, self->stop_cause, self->err);
    self->dropped = 0;
    self->err = 0;
    pthread_mutex_unlock(&self->mu);
    return r;
}

static PyObject *sink_counts(FrameSink *self, PyObject *unused) {
    lock_gil_free(&self->mu);
    PyObject *r = Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:i,s:i}", "frames_total", self->frames_total, "bytes_total",
                                self->bytes_total, "records_total", self->records_total, "file_bytes", self->file_bytes,
                                "file_records", self->file_records, "fd", self->fd, "broken", self->broken);
    pthread_mutex_unlock(&self->mu);
    return r;
}

static PyMethodDef sink_methods[] = {
    {"write", (PyCFunction)sink_write, METH_VARARGS,
     "write(records, dev_ref, host_ref, slope, copies) -> 0 written, 1 counted lost, 2 no file: one frame."},
    {"swap", (PyCFunction)sink_swap, METH_VARARGS,
     "swap(fd, file_bytes) -> (old fd, bytes, frames, records, broken): write another file from now on."},
    {"stop", (PyCFunction)sink_stop, METH_VARARGS, "stop(cause): count records lost under cause from now on."},
    {"take", (PyCFunction)sink_take, METH_NOARGS, "take() -> (records lost since the last take, cause, errno)."},
    {"counts", (PyCFunction)sink_counts, METH_NOARGS,
     "counts() -> {frames_total, bytes_total, records_total, file_bytes, file_records, fd, broken}."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FrameSinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtrace.probes.kv_access._drain.FrameSink",
    .tp_basicsize = sizeof(FrameSink),
    .tp_dealloc = (destructor)sink_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A frame file's writer for threads without the GIL (format/kv_frames.py's frames); the file's "
              "life (open, header, seal) stays with FrameWriter.",
    .tp_methods = sink_methods,
    .tp_init = (initproc)sink_init,
    .tp_new = PyType_GenericNew,
};

/* ---- Drainer ----------------------------------------------------------------------------------------- */

#define STASH_MAX_BYTES (64LL << 20) /* records kept for take() beyond this are counted lost (buffer-cap) */
#define MAX_SPANS 65536

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_reserve(Buf *b, size_t more) {
    if (b->len + more <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more)
        cap *= 2;
    char *d = realloc(b->data, cap);
    if (d == NULL)
        return -1;
    b->data = d;
    b->cap = cap;
    return 0;
}

/* A chunk kept for take(): header, then (block chunks) the copies, then the records. */
typedef struct {
    int64_t dev_ref, host_ref;
    double slope;
    int64_t n;       /* records */
    int64_t ncopies; /* ints after the header (blocks only; 0 for timings) */
} ChunkHeader;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    event_sync_fn sync;
    event_record_fn record;
    memcpy_dtoh_async_fn copy;
    uint64_t snap_host, state, live_host; /* snapshot slots (8 words each), the device state words, live copy */
    int timed_slot;
    void *timed_event, *stream, *copy_event;
    int head_word[2], live_word[2];
    RingWindow w[2]; /* [0] block records, [1] timing records: dev, stage, tail, cap */
    int log2cap[2];
    PyObject *sink;  /* FrameSink or NULL: block records are then kept for take() */
    /* what frames carry */
    int64_t clock[2];
    double slope;
    int32_t copies[MAX_COPY_INTS];
    int ncopies;
    /* when to drain */
    int auto_drain;
    double every_s, min_s, fill_s, next_drain;
    double mark_t;
    double held_at; /* when the hold under way began (hold(..., pause_clock)) */
    long long mark[2];
    int have_mark;
    /* requests (from any thread): the newest explicit snapshot waits here */
    int pending_slot;
    void *pending_event;
    long long req_seq, done_seq;
    int stop, held, busy, running;
    /* kept for take() */
    Buf blocks, timings;
    char *kbuf, *tbuf; /* the kept records of the drain under way (the loop's thread only) */
    size_t kcap, tcap;
    /* since the last take() */
    long long drains, kv_rows, timing_rows, kv_wrap, timing_wrap, kv_error, timing_error, kv_cap, timing_cap, errors;
    double drain_s;
    double thread_cpu_s; /* the loop's thread's CPU clock after its last drain (absolute) */
    int err_rc;
    char err_where[96];
    /* drain spans (start, end CLOCK_MONOTONIC ns) for benchmarks, when asked */
    int spans_on;
    long long *spans;
    size_t nspans;
} Drainer;

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int log2_of(long long cap) {
    int k = 0;
    while ((1LL << k) < cap)
        k++;
    return k;
}

/* Drainer(fns, snap_host, timed_slot, timed_event, head_words, live_words, (rec ring, stage, cap),
           (tim ring, stage, cap), state, live_host, stream, copy_event, sink=None) */
static int drainer_init(Drainer *self, PyObject *args, PyObject *kw) {
    unsigned long long f_sync, f_record, f_copy, snap_host, timed_event, state, live_host, stream, copy_event;
    unsigned long long rdev, rstage, tdev, tstage;
    long long rcap, tcap;
    PyObject *sink = Py_None;
    if (!PyArg_ParseTuple(args, "(KKK)KiK(ii)(ii)(KKL)(KKL)KKKK|O", &f_sync, &f_record, &f_copy, &snap_host,
                          &self->timed_slot, &timed_event, &self->head_word[0], &self->head_word[1],
                          &self->live_word[0], &self->live_word[1], &rdev, &rstage, &rcap, &tdev, &tstage, &tcap,
                          &state, &live_host, &stream, &copy_event, &sink))
        return -1;
    long long caps[2] = {rcap, tcap};
    for (int i = 0; i < 2; i++) {
        if (caps[i] < 2 || (caps[i] & (caps[i] - 1)) || self->head_word[i] < 0 || self->head_word[i] > 7
            || self->live_word[i] < 0 || self->live_word[i] > 7) {
            PyErr_SetString(PyExc_ValueError, "Drainer: a capacity that is not a power of two, or a head word out of range");
            return -1;
        }
    }
    if (sink != Py_None && !PyObject_TypeCheck(sink, &FrameSinkType)) {
        PyErr_SetString(PyExc_TypeError, "Drainer: sink must be a FrameSink or None");
        return -1;
    }
    if (self->timed_slot < 0) {
        PyErr_SetString(PyExc_ValueError, "Drainer: timed_slot must be >= 0");
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&self->cv, &ca);
    pthread_condattr_destroy(&ca);
    self->sync = (event_sync_fn)(uintptr_t)f_sync;
    self->record = (event_record_fn)(uintptr_t)f_record;
    self->copy = (memcpy_dtoh_async_fn)(uintptr_t)f_copy;
    self->snap_host = snap_host;
    self->timed_event = (void *)(uintptr_t)timed_event;
    self->state = state;
    self->live_host = live_host;
    self->stream = (void *)(uintptr_t)stream;
    self->copy_event = (void *)(uintptr_t)copy_event;
    self->w[0].dev = rdev;
    self->w[0].stage = rstage;
    self->w[0].cap = rcap;
    self->w[1].dev = tdev;
    self->w[1].stage = tstage;
    self->w[1].cap = tcap;
    self->log2cap[0] = log2_of(rcap);
    self->log2cap[1] = log2_of(tcap);
    if (sink != Py_None) {
        Py_INCREF(sink);
        self->sink = sink;
    }
    self->slope = 1.0;
    self->auto_drain = 1;
    self->every_s = 0.1;
    self->min_s = 0.001;
    self->fill_s = 0.01;
    self->next_drain = mono_s() + self->fill_s;
    self->pending_slot = -1;
    return 0;
}

static void drainer_dealloc(Drainer *self) {
    Py_XDECREF(self->sink);
    free(self->blocks.data);
    free(self->timings.data);
    free(self->kbuf);
    free(self->tbuf);
    free(self->spans);
    pthread_mutex_destroy(&self->mu);
    pthread_cond_destroy(&self->cv);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static double drain_interval(Drainer *d) {
    double s = d->fill_s < d->every_s ? d->fill_s : d->every_s;
    return s > d->min_s ? s : d->min_s;
}

/* Seconds that fill a quarter of either ring at the rate since the last drain (cuda_ring._learn_rate). */
static void learn_rate(Drainer *d, const long long head[2], double now) {
    double prev_t = d->mark_t;
    long long prev[2] = {d->mark[0], d->mark[1]};
    int had = d->have_mark;
    d->mark_t = now;
    d->mark[0] = head[0];
    d->mark[1] = head[1];
    d->have_mark = 1;
    if (!had || now <= prev_t)
        return;
    double q0 = (double)(head[0] - prev[0]) / (double)(d->w[0].cap / 4);
    double q1 = (double)(head[1] - prev[1]) / (double)(d->w[1].cap / 4);
    double quarters = q0 > q1 ? q0 : q1;
    d->fill_s = quarters > 0 ? (now - prev_t) / quarters : 1e300;
}

static char *grow(char **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        char *p = realloc(*buf, bytes);
        if (p == NULL)
            return NULL;
        *buf = p;
        *cap = bytes;
    }
    return *buf ? *buf : (char *)"";
}

/* Keep a chunk for take(); 0, or -1 when over STASH_MAX_BYTES or out of memory (the caller counts it). */
static int stash(Buf *b, const int64_t clock[2], double slope, const int32_t *copies, int ncopies, const char *recs,
                 long long n) {
    size_t copy_bytes = ((size_t)ncopies * 4 + 7) & ~(size_t)7;
    size_t bytes = sizeof(ChunkHeader) + copy_bytes + (size_t)n * REC_BYTES;
    if ((long long)(b->len + bytes) > STASH_MAX_BYTES || buf_reserve(b, bytes) < 0)
        return -1;
    ChunkHeader h = {clock[0], clock[1], slope, n, ncopies};
    memcpy(b->data + b->len, &h, sizeof h);
    memset(b->data + b->len + sizeof h, 0, copy_bytes);
    if (ncopies)
        memcpy(b->data + b->len + sizeof h, copies, (size_t)ncopies * 4);
    memcpy(b->data + b->len + sizeof h + copy_bytes, recs, (size_t)n * REC_BYTES);
    b->len += bytes;
    return 0;
}

/* One drain, on the loop's thread, without the GIL: what drain_device does, then the block records out as a
   frame (or kept, with no sink) and the timing records kept; the counts under the lock. `take_snapshot`:
   the state words are copied to the slot first (a timed drain: the heads of the last step the device has
   started). Every position of [tail, head) of both rings is then kept or counted: overwritten before or
   while it was copied (ring-wrap), kept past STASH_MAX_BYTES (buffer-cap), or lost to an error once the
   heads were known (drain-error). */
static void drain_once(Drainer *d, int slot, void *event, int take_snapshot) {
    long long t0 = mono_ns();
    uint64_t snap_host = d->snap_host + (uint64_t)slot * 8 * sizeof(long long);
    RingWindow w[2] = {d->w[0], d->w[1]};
    const char *where = "";
    int rc = 0, have_heads = 0;
    long long head[2] = {0, 0}, live[2] = {0, 0}, kept[2] = {0, 0}, capped[2] = {0, 0};
    rc = device_side(d->sync, d->record, d->copy, snap_host, event, d->head_word, d->live_word, d->state, d->live_host,
                     d->stream, d->copy_event, take_snapshot, w, live, &where, &have_heads);
    if (have_heads) {
        head[0] = w[0].head;
        head[1] = w[1].head;
        learn_rate(d, head, mono_s());
    }
    if (rc == 0) {
        char **bufs[2] = {&d->kbuf, &d->tbuf};
        size_t *caps[2] = {&d->kcap, &d->tcap};
        char *out[2] = {NULL, NULL};
        for (int i = 0; i < 2 && rc == 0; i++) {
            if (!w[i].n)
                continue;
            long long skip = intact_from(&w[i], live[i]);
            out[i] = grow(bufs[i], caps[i], (size_t)(w[i].n - skip) * REC_BYTES + 1);
            if (out[i] == NULL) {
                rc = -1;
                where = "allocating memory for the records";
                break;
            }
            kept[i] = keep_intact_into((const char *)(uintptr_t)w[i].stage + skip * REC_BYTES, (Py_ssize_t)(w[i].n - skip),
                                       (uint64_t)(w[i].lo + skip), d->log2cap[i], out[i]);
        }
        if (rc == 0) {
            pthread_mutex_lock(&d->mu);
            int64_t clock[2] = {d->clock[0], d->clock[1]};
            double slope = d->slope;
            int32_t copies[MAX_COPY_INTS];
            int ncopies = d->ncopies;
            memcpy(copies, d->copies, (size_t)ncopies * 4);
            pthread_mutex_unlock(&d->mu);
            int sunk = SINK_NO_FILE;
            if (kept[0] && d->sink != NULL)  /* written (or counted lost by the sink) outside our lock */
                sunk = sink_write_frame((FrameSink *)d->sink, clock, slope, copies, ncopies, out[0], kept[0]);
            pthread_mutex_lock(&d->mu);
            if (kept[0] && sunk == SINK_NO_FILE && stash(&d->blocks, clock, slope, copies, ncopies, out[0], kept[0]) < 0) {
                capped[0] = kept[0];
                kept[0] = 0;
            }
            if (kept[1] && stash(&d->timings, clock, slope, NULL, 0, out[1], kept[1]) < 0) {
                capped[1] = kept[1];
                kept[1] = 0;
            }
            pthread_mutex_unlock(&d->mu);
        }
    }
    long long t1 = mono_ns();
    pthread_mutex_lock(&d->mu);
    long long *rows[2] = {&d->kv_rows, &d->timing_rows}, *wrap[2] = {&d->kv_wrap, &d->timing_wrap};
    long long *cap[2] = {&d->kv_cap, &d->timing_cap}, *lost[2] = {&d->kv_error, &d->timing_error};
    for (int i = 0; i < 2 && have_heads; i++) {
        long long window = head[i] > d->w[i].tail ? head[i] - d->w[i].tail : 0;
        if (rc == 0) {
            *rows[i] += kept[i];
            *cap[i] += capped[i];
            *wrap[i] += window - kept[i] - capped[i];
        } else {
            *lost[i] += window;
        }
        if (head[i] > d->w[i].tail)
            d->w[i].tail = head[i];
    }
    if (rc) {
        d->errors++;
        d->err_rc = rc;
        strncpy(d->err_where, where, sizeof d->err_where - 1);
        d->err_where[sizeof d->err_where - 1] = 0;
    }
    d->drains++;
    d->drain_s += (t1 - t0) * 1e-9;
    struct timespec cpu;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu) == 0)
        d->thread_cpu_s = (double)cpu.tv_sec + cpu.tv_nsec * 1e-9;
    if (d->spans_on && d->nspans < MAX_SPANS) {
        if (d->spans == NULL)
            d->spans = malloc(MAX_SPANS * 2 * sizeof(long long));
        if (d->spans != NULL) {
            d->spans[2 * d->nspans] = t0;
            d->spans[2 * d->nspans + 1] = t1;
            d->nspans++;
        }
    }
    pthread_mutex_unlock(&d->mu);
}

/* CLOCK_MONOTONIC seconds -> the timespec pthread_cond_timedwait takes (the Drainer's condition uses that clock) */
static void timespec_at(struct timespec *ts, double t) {
    ts->tv_sec = (time_t)t;
    ts->tv_nsec = (long)((t - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* run(until) -> "stop" | "time": drain when due (every drain_interval, or a requested snapshot) until
   CLOCK_MONOTONIC reaches `until` (seconds) or stop() is called; without the GIL throughout. */
static PyObject *drainer_run(Drainer *d, PyObject *args) {
    double until;
    if (!PyArg_ParseTuple(args, "d", &until))
        return NULL;
    lock_gil_free(&d->mu);
    if (d->running) {
        pthread_mutex_unlock(&d->mu);
        PyErr_SetString(PyExc_RuntimeError, "Drainer.run is already running on another thread");
        return NULL;
    }
    d->running = 1;
    pthread_mutex_unlock(&d->mu);
    int stopped = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&d->mu);
    for (;;) {
        double now = mono_s();
        if (d->stop) {
            stopped = 1;
            break;
        }
        if (!d->held && d->pending_slot >= 0) {
            int slot = d->pending_slot;
            void *ev = d->pending_event;
            long long ticket = d->req_seq;
            d->pending_slot = -1;
            d->busy = 1;
            pthread_mutex_unlock(&d->mu);
            drain_once(d, slot, ev, 0);
            pthread_mutex_lock(&d->mu);
            d->busy = 0;
            d->done_seq = ticket;
            d->next_drain = mono_s() + drain_interval(d);
            pthread_cond_broadcast(&d->cv);
            continue;
        }
        if (!d->held && d->auto_drain && now >= d->next_drain) {
            d->busy = 1;
            pthread_mutex_unlock(&d->mu);
            drain_once(d, d->timed_slot, d->timed_event, 1);
            pthread_mutex_lock(&d->mu);
            d->busy = 0;
            d->next_drain = mono_s() + drain_interval(d);
            pthread_cond_broadcast(&d->cv);
            continue;
        }
        if (now >= until)
            break;
        double deadline = until;
        if (!d->held && d->auto_drain && d->next_drain < deadline)
            deadline = d->next_drain;
        struct timespec ts;
        timespec_at(&ts, deadline);
        pthread_cond_timedwait(&d->cv, &d->mu, &ts);
    }
    d->running = 0;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    Py_END_ALLOW_THREADS
    return PyUnicode_FromString(stopped ? "stop" : "time");
}

/* request(slot, event) -> ticket: drain up to snapshot `slot` (its copy done when `event` is); only the
   newest request waits, as the Python thread took only the newest snapshot. */
static PyObject *drainer_request(Drainer *d, PyObject *args) {
    int slot;
    unsigned long long event;
    if (!PyArg_ParseTuple(args, "iK", &slot, &event))
        return NULL;
    if (slot < 0) {
        PyErr_SetString(PyExc_ValueError, "request: slot must be >= 0");
        return NULL;
    }
    lock_gil_free(&d->mu);
    d->pending_slot = slot;
    d->pending_event = (void *)(uintptr_t)event;
    long long ticket = ++d->req_seq;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return PyLong_FromLongLong(ticket);
}

static void deadline_after(struct timespec *ts, double seconds) { timespec_at(ts, mono_s() + seconds); }

/* wait(ticket, timeout_s) -> bool: whether the request's drain is done (GIL let go meanwhile). */
static PyObject *drainer_wait(Drainer *d, PyObject *args) {
    long long ticket;
    double timeout;
    if (!PyArg_ParseTuple(args, "Ld", &ticket, &timeout))
        return NULL;
    int done;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    deadline_after(&ts, timeout);
    pthread_mutex_lock(&d->mu);
    while (d->done_seq < ticket && !d->stop) {
        if (pthread_cond_timedwait(&d->cv, &d->mu, &ts) == ETIMEDOUT)
            break;
    }
    done = d->done_seq >= ticket;
    pthread_mutex_unlock(&d->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *drainer_stop(Drainer *d, PyObject *unused) {
    lock_gil_free(&d->mu);
    d->stop = 1;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    Py_RETURN_NONE;
}

/* hold(on, timeout_s=5, pause_clock=False) -> seconds waited: while held no drain starts; holding waits
   for one under way. pause_clock: the drain clock stops while held (the next timed drain and the fill
   rate's mark move on by the time held), so that releasing it does not start a drain that fell due while
   held: benchmarks that hold the loop for part of a run then see drains as often per unheld second as a
   run sees them. */
static PyObject *drainer_hold(Drainer *d, PyObject *args) {
    int on, pause_clock = 0;
    double timeout = 5.0;
    if (!PyArg_ParseTuple(args, "p|dp", &on, &timeout, &pause_clock))
        return NULL;
    double t0 = mono_s();
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    deadline_after(&ts, timeout);
    pthread_mutex_lock(&d->mu);
    if (on && !d->held) {
        d->held_at = t0;
    } else if (!on && d->held && pause_clock) {
        double held_s = mono_s() - d->held_at;
        d->next_drain += held_s;
        d->mark_t += held_s;
    }
    d->held = on;
    pthread_cond_broadcast(&d->cv);
    while (on && d->busy) {
        if (pthread_cond_timedwait(&d->cv, &d->mu, &ts) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&d->mu);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(mono_s() - t0);
}

/* set_clock(dev_ref, host_ref, slope): the clock mapping the next frames and timing chunks carry. */
static PyObject *drainer_set_clock(Drainer *d, PyObject *args) {
    long long dev, host;
    double slope;
    if (!PyArg_ParseTuple(args, "LLd", &dev, &host, &slope))
        return NULL;
    lock_gil_free(&d->mu);
    d->clock[0] = dev;
    d->clock[1] = host;
    d->slope = slope;
    pthread_mutex_unlock(&d->mu);
    Py_RETURN_NONE;
}

static PyObject *drainer_set_copies(Drainer *d, PyObject *arg) {
    int32_t copies[MAX_COPY_INTS];
    int n = 0;
    if (parse_copies(arg, copies, &n) < 0)
        return NULL;
    lock_gil_free(&d->mu);
    memcpy(d->copies, copies, (size_t)n * 4);
    d->ncopies = n;
    pthread_mutex_unlock(&d->mu);
    Py_RETURN_NONE;
}

/* set_policy(every_s, min_s, fill_s, auto_drain): when timed drains run; the next one after the interval. */
static PyObject *drainer_set_policy(Drainer *d, PyObject *args) {
    double every, min_s, fill;
    int auto_drain;
    if (!PyArg_ParseTuple(args, "dddp", &every, &min_s, &fill, &auto_drain))
        return NULL;
    lock_gil_free(&d->mu);
    d->every_s = every;
    d->min_s = min_s;
    d->fill_s = fill;
    d->auto_drain = auto_drain;
    d->next_drain = mono_s() + drain_interval(d);
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    Py_RETURN_NONE;
}

static PyObject *drainer_set_tails(Drainer *d, PyObject *args) {
    long long rec, tim;
    if (!PyArg_ParseTuple(args, "LL", &rec, &tim))
        return NULL;
    lock_gil_free(&d->mu);
    d->w[0].tail = rec;
    d->w[1].tail = tim;
    pthread_mutex_unlock(&d->mu);
    Py_RETURN_NONE;
}

static PyObject *drainer_spans(Drainer *d, PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|p", &on))
        return NULL;
    lock_gil_free(&d->mu);
    if (on >= 0)
        d->spans_on = on;
    PyObject *list = PyList_New((Py_ssize_t)d->nspans);
    for (size_t i = 0; list != NULL && i < d->nspans; i++)
        PyList_SET_ITEM(list, (Py_ssize_t)i, Py_BuildValue("(LL)", d->spans[2 * i], d->spans[2 * i + 1]));
    d->nspans = 0;
    pthread_mutex_unlock(&d->mu);
    return list;
}

/* The chunks of a stash as a list of (Records, (dev_ref, host_ref, slope), copies tuple or None). */
static PyObject *chunks_of(const Buf *b, int with_copies) {
    PyObject *list = PyList_New(0);
    size_t at = 0;
    while (list != NULL && at + sizeof(ChunkHeader) <= b->len) {
        ChunkHeader h;
        memcpy(&h, b->data + at, sizeof h);
        size_t copy_bytes = ((size_t)h.ncopies * 4 + 7) & ~(size_t)7;
        const char *copies = b->data + at + sizeof h, *recs = copies + copy_bytes;
        size_t bytes = (size_t)h.n * REC_BYTES;
        char *own = malloc(bytes ? bytes : 1);
        PyObject *r = own != NULL ? records_new(own, (Py_ssize_t)bytes) : PyErr_NoMemory();
        if (r == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        memcpy(own, recs, bytes);
        PyObject *cp = Py_None;
        Py_INCREF(Py_None);
        if (with_copies) {
            Py_DECREF(Py_None);
            cp = PyTuple_New((Py_ssize_t)h.ncopies);
            for (int64_t i = 0; cp != NULL && i < h.ncopies; i++) {
                int32_t v;
                memcpy(&v, copies + i * 4, 4);
                PyTuple_SET_ITEM(cp, (Py_ssize_t)i, PyLong_FromLong(v));
            }
        }
        PyObject *item = cp != NULL ? Py_BuildValue("(N(LLd)N)", r, (long long)h.dev_ref, (long long)h.host_ref, h.slope, cp) : NULL;
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
        at += sizeof h + copy_bytes + bytes;
    }
    return list;
}

/* take() -> (block chunks, timing chunks, counts, error or None): what the drains since the last take
   left for Python. Block chunks only where there was no sink (or it had no file); counts since the last
   take; error = (CUresult, where, how many drains failed) of the last failed drain. */
static PyObject *drainer_take(Drainer *d, PyObject *unused) {
    lock_gil_free(&d->mu);
    Buf blocks = d->blocks, timings = d->timings;
    memset(&d->blocks, 0, sizeof d->blocks);
    memset(&d->timings, 0, sizeof d->timings);
    PyObject *counts = Py_BuildValue(
        "{s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:d,s:L,s:L}", "drains", d->drains, "kv_rows", d->kv_rows, "timing_rows",
        d->timing_rows, "kv_wrap", d->kv_wrap, "timing_wrap", d->timing_wrap, "kv_error", d->kv_error, "timing_error",
        d->timing_error, "kv_cap", d->kv_cap, "timing_cap", d->timing_cap, "drain_s", d->drain_s, "tail",
        d->w[0].tail, "timing_tail", d->w[1].tail);
    PyObject *error = Py_None;
    if (d->errors)
        error = Py_BuildValue("(isL)", d->err_rc, d->err_where, d->errors);
    else
        Py_INCREF(Py_None);
    d->drains = d->kv_rows = d->timing_rows = d->kv_wrap = d->timing_wrap = d->kv_error = d->timing_error = 0;
    d->kv_cap = d->timing_cap = d->errors = 0;
    d->drain_s = 0;
    pthread_mutex_unlock(&d->mu);
    PyObject *b = chunks_of(&blocks, 1), *t = b != NULL ? chunks_of(&timings, 0) : NULL;
    free(blocks.data);
    free(timings.data);
    if (b == NULL || t == NULL || counts == NULL || error == NULL) {
        Py_XDECREF(b);
        Py_XDECREF(t);
        Py_XDECREF(counts);
        Py_XDECREF(error);
        return NULL;
    }
    return Py_BuildValue("(NNNN)", b, t, counts, error);
}

/* thread_cpu_s() -> the CPU seconds of the loop's thread as of its last drain */
static PyObject *drainer_thread_cpu_s(Drainer *d, PyObject *unused) {
    lock_gil_free(&d->mu);
    double s = d->thread_cpu_s;
    pthread_mutex_unlock(&d->mu);
    return PyFloat_FromDouble(s);
}

static PyMethodDef drainer_methods[] = {
    {"thread_cpu_s", (PyCFunction)drainer_thread_cpu_s, METH_NOARGS,
     "thread_cpu_s() -> CPU seconds of the loop's thread as of its last drain."},
    {"run", (PyCFunction)drainer_run, METH_VARARGS,
     "run(until) -> 'stop' | 'time': drain when due without the GIL until CLOCK_MONOTONIC reaches until (s) or stop()."},
    {"request", (PyCFunction)drainer_request, METH_VARARGS,
     "request(slot, event) -> ticket: drain up to snapshot slot once its copy (event) is done."},
    {"wait", (PyCFunction)drainer_wait, METH_VARARGS, "wait(ticket, timeout_s) -> whether that drain is done."},
    {"stop", (PyCFunction)drainer_stop, METH_NOARGS, "stop(): run() returns after the drain under way."},
    {"hold", (PyCFunction)drainer_hold, METH_VARARGS,
     "hold(on, timeout_s=5, pause_clock=False) -> seconds waited: no drain starts while held; pause_clock: "
     "the drain clock stops meanwhile (benchmarks)."},
    {"set_clock", (PyCFunction)drainer_set_clock, METH_VARARGS, "set_clock(dev_ref, host_ref, slope)."},
    {"set_copies", (PyCFunction)drainer_set_copies, METH_O, "set_copies(ints): (layer, source) pairs, flattened."},
    {"set_policy", (PyCFunction)drainer_set_policy, METH_VARARGS, "set_policy(every_s, min_s, fill_s, auto_drain)."},
    {"set_tails", (PyCFunction)drainer_set_tails, METH_VARARGS, "set_tails(record tail, timing tail)."},
    {"spans", (PyCFunction)drainer_spans, METH_VARARGS,
     "spans(on=None) -> [(start_ns, end_ns)]: the drains since the last call, when switched on (benchmarks)."},
    {"take", (PyCFunction)drainer_take, METH_NOARGS,
     "take() -> (block chunks, timing chunks, counts, error): what the drains left for Python since the last take."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DrainerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtrace.probes.kv_access._drain.Drainer",
    .tp_basicsize = sizeof(Drainer),
    .tp_dealloc = (destructor)drainer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A CUDA KV access ring's drains in a loop that never takes the GIL (see the source).",
    .tp_methods = drainer_methods,
    .tp_init = (initproc)drainer_init,
    .tp_new = PyType_GenericNew,
};

/* ---- the driver's calls on host memory (tests and benchmarks on machines without a GPU) --------------- */

static int host_sync(void *event) { return 0; }
static int host_record(void *event, void *stream) { return 0; }
static int host_copy(void *dst, uint64_t src, size_t bytes, void *stream) {
    memcpy(dst, (const void *)(uintptr_t)src, bytes);
    return 0;
}

/* host_driver() -> (sync, record, copy) addresses for drain_device and Drainer where "device" memory is host
   memory: copies are memcpy, events are done at once. C functions, so that a Drainer on them takes the GIL
   no more than it does on the real driver (a ctypes callback would take it for every call). */
static PyObject *host_driver(PyObject *mod, PyObject *unused) {
    return Py_BuildValue("(KKK)", (unsigned long long)(uintptr_t)host_sync, (unsigned long long)(uintptr_t)host_record,
                         (unsigned long long)(uintptr_t)host_copy);
}

static PyMethodDef methods[] = {
    {"host_driver", host_driver, METH_NOARGS,
     "host_driver() -> (sync, record, copy): the driver's calls on host memory, for tests and benchmarks."},
    {"state_launch", (PyCFunction)(void (*)(void))state_launch, METH_FASTCALL,
     "state_launch(f, stream, params, args, step, active): write a ring's step and flags into its StateArgs "
     "struct and launch kv_set_state (1 thread) on the stream, with the GIL kept."},
    {"set_launcher", set_launcher, METH_O, "set_launcher(address of cuLaunchKernel): what launch calls."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra): cuLaunchKernel with the GIL kept."},
    {"keep_intact", keep_intact, METH_VARARGS,
     "keep_intact(records, first_pos, log2cap) -> Records: the records (32 bytes each, stored at ring "
     "positions first_pos..) whose lap tag is their position's, in memory of their own; without the GIL."},
    {"drain_device", drain_device, METH_VARARGS,
     "One drain of a CUDA KV access ring without the GIL (see the source for the arguments)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_drain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__drain(void) {
    if (PyType_Ready(&RecordsType) < 0 || PyType_Ready(&FrameSinkType) < 0 || PyType_Ready(&DrainerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyTypeObject *types[] = {&RecordsType, &FrameSinkType, &DrainerType};
    const char *names[] = {"Records", "FrameSink", "Drainer"};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
