/* kvtrace.probes.kv_access._drain: a KV access ring's drain with one release of the GIL.

   The reference is the NumPy path in ring.py (`lap_ok`, `_decode_window`) and cuda_ring.py (`_drain_to`);
   this module does the same work and is used where it builds (tests/unit/probes/test_kv_drain_native.py
   checks that both keep the same records).

   Why it exists: a 1B-class model's engine is bound by its Python thread, and every time another thread
   takes the GIL back the engine's thread stops for two thread wake-ups, however little that thread then
   does. The NumPy drain let go of the GIL and took it back a dozen times a drain (each NumPy operation on
   a big array, each torch copy or event wait), ~150 hand-overs a second at the default granularity.
   Here a drain waits for the device, copies the new records to pinned memory, and keeps the intact ones in
   memory of their own, all without the GIL: one hand-over per drain.

   Records are 32 bytes (REC_DTYPE in format/kv_records.py); the lap tag is the top 15 bits of the 32-bit
   word at byte 24 (`meta`). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    if (take_snapshot) {
        rc = copy((void *)(uintptr_t)snap_host, state, 8 * sizeof(long long), (void *)(uintptr_t)stream);
        if (rc == 0)
            rc = record((void *)(uintptr_t)snap_event, (void *)(uintptr_t)stream);
    }
    if (rc == 0)
        rc = sync((void *)(uintptr_t)snap_event);
    if (rc) {
        where = take_snapshot ? "taking the snapshot" : "waiting for the snapshot";
    } else {
        const long long *snap = (const long long *)(uintptr_t)snap_host;
        w[0].head = snap[head_word[0]];
        w[1].head = snap[head_word[1]];
        have_heads = 1;
        for (int i = 0; i < 2 && rc == 0; i++)
            rc = copy_window(copy, &w[i], (void *)(uintptr_t)stream, &where);
        /* The live heads after the copy: a slot of position p may have been overwritten while it was
           copied only if position p + capacity was reserved by then, i.e. p < live head - capacity. */
        if (rc == 0 && (w[0].n || w[1].n)) {
            rc = copy((void *)(uintptr_t)live_host, state, 8 * sizeof(long long), (void *)(uintptr_t)stream);
            if (rc == 0)
                rc = record((void *)(uintptr_t)copy_event, (void *)(uintptr_t)stream);
            if (rc == 0)
                rc = sync((void *)(uintptr_t)copy_event);
            if (rc) {
                where = "waiting for the copy";
            } else {
                const long long *lv = (const long long *)(uintptr_t)live_host;
                live[0] = lv[live_word[0]];
                live[1] = lv[live_word[1]];
            }
        }
        if (rc == 0 && w[0].n) {
            long long min_valid = live[0] - w[0].cap > w[0].lo ? live[0] - w[0].cap : w[0].lo;
            long long skip = min_valid - w[0].lo < w[0].n ? min_valid - w[0].lo : w[0].n;
            kept = kept_copy((const char *)(uintptr_t)w[0].stage + skip * REC_BYTES, (Py_ssize_t)(w[0].n - skip),
                             (uint64_t)(w[0].lo + skip), log2cap, &nkept);
            if (kept == NULL) {
                rc = -1;
                where = "allocating memory for the records";
            }
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

static PyMethodDef methods[] = {
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
    if (PyType_Ready(&RecordsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RecordsType);
    if (PyModule_AddObject(m, "Records", (PyObject *)&RecordsType) < 0) {
        Py_DECREF(&RecordsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
