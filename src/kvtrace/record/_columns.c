/* kvtrace.probes._columns: the host probes' hot path in C.

   The native twin of record/buffers.py (read that first: it is the reference, with the same classes,
   methods and rows). Used where this extension builds and imports; the probes fall back to the Python
   classes otherwise, and tests/unit/record/test_buffers.py checks that both give the same rows.

   Why it exists: per block-pool call, the Python path spends ~1-3 us naming the request from the
   caller's frame (f_locals builds a dict of every local), appending to ten lists, and converting
   Python objects to Arrow later. Here a call appends to growable C arrays (tens of ns), the request is
   read from the caller's frame directly, and take() hands whole columns over as bytes, so Arrow arrays
   are made without a Python object per row.

   Thread safety: every method runs with the GIL held and never releases it, so a take() from another
   thread (the recorder's flush on SIGUSR2) sees whole rows only. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>  /* offsetof: Python.h stops including it in 3.12 */
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Reading a caller's argument without f_locals (which builds a dict of all its locals: ~0.5-2 us).
   3.11 and 3.12 interpreter frames are read through CPython's internal header, as Cython does (the
   fields used here, `tstate->cframe->current_frame`, `f_code`, `previous`, `localsplus`, are the same in
   both). 3.12's public PyFrame_GetVar is no cheaper than f_locals: it makes a frame object for every frame
   walked and builds the frame's locals dict, ~1 us a pool call on an H100's host. 3.13 and later (whose
   frames changed) use the public API; older versions call the Python implementation. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
#define KVT_FRAMES_INTERNAL 1
#define Py_BUILD_CORE 1
#include "internal/pycore_frame.h"
#undef Py_BUILD_CORE
#elif PY_VERSION_HEX >= 0x030D0000
#define KVT_FRAMES_PUBLIC 1
#endif
#if PY_VERSION_HEX >= 0x030C0000
#define KVT_T_OBJECT_EX Py_T_OBJECT_EX
#define KVT_T_BOOL Py_T_BOOL
#define KVT_READONLY Py_READONLY
#else
#include <structmember.h>
#define KVT_T_OBJECT_EX T_OBJECT_EX
#define KVT_T_BOOL T_BOOL
#define KVT_READONLY READONLY
#endif
#ifndef CO_FAST_CELL
#define CO_FAST_CELL 0x40 /* pycore_code.h: a local that is also a cell */
#endif

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* the clock of time.monotonic_ns() */
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* ---- reading ints ------------------------------------------------------------------------------ */

/* A Python int's value: loads for ints of at most two digits (60 bits: block ids, token counts, steps,
   clock readings), where PyLong_AsLongLong is a call of ~25 instructions (~230 for two digits), made
   once per block or row. -1 with an error set when it is not an int or does not fit. */
static inline long long as_int64(PyObject *v) {
#if PY_VERSION_HEX < 0x030C0000 /* 3.11's layout: ob_size is the signed count of 30-bit digits */
    if (PyLong_CheckExact(v)) {
        Py_ssize_t size = Py_SIZE(v);
        if (size == 0)
            return 0;
        if (size == 1)
            return (long long)((PyLongObject *)v)->ob_digit[0];
        if (size == -1)
            return -(long long)((PyLongObject *)v)->ob_digit[0];
        if (size == 2 || size == -2) { /* 60 bits: monotonic-clock nanoseconds (days of uptime) */
            const digit *d = ((PyLongObject *)v)->ob_digit;
            long long x = (long long)d[0] | ((long long)d[1] << PyLong_SHIFT);
            return size > 0 ? x : -x;
        }
    }
#endif
    return PyLong_AsLongLong(v);
}

/* ---- growable byte buffers ------------------------------------------------------------------- */

/* Bytes held in a bytearray, so that take() hands the bytes to Arrow without a copy (a bytearray
   exports its buffer; pa.py_buffer wraps it). `p` and `cap` mirror the bytearray's storage. */
typedef struct {
    PyObject *ba;
    char *p;
    Py_ssize_t n, cap;
    Py_ssize_t last; /* bytes at the last take: a new buffer starts at twice that, so that a log whose
                        rate varies from one take to the next rarely grows between takes. Growing
                        reallocates and copies the whole buffer, cold: with +1/8 of headroom, the
                        copies made ~36 k of the probes' ~580 k extra L2 misses a round (callgrind's
                        cache simulation, bench/count_instructions.py) */
} Buf;

static int buf_grow(Buf *b, Py_ssize_t extra) {
    Py_ssize_t cap = b->cap ? b->cap : 2 * b->last > 256 ? 2 * b->last : 256;
    while (cap < b->n + extra)
        cap *= 2;
    if (b->ba == NULL) {
        if ((b->ba = PyByteArray_FromStringAndSize(NULL, cap)) == NULL)
            return -1;
    } else if (PyByteArray_Resize(b->ba, cap) < 0) {
        return -1;
    }
    b->p = PyByteArray_AS_STRING(b->ba);
    b->cap = cap;
    return 0;
}

static inline int buf_reserve(Buf *b, Py_ssize_t extra) {
    return b->n + extra <= b->cap ? 0 : buf_grow(b, extra);
}

/* Stores of fixed size: callers reserve room first (constant sizes let the compiler use plain moves). */
#define STORE(b, T, v)                                                                                         \
    do {                                                                                                       \
        T _v = (T)(v);                                                                                         \
        memcpy((b)->p + (b)->n, &_v, sizeof(T));                                                               \
        (b)->n += sizeof(T);                                                                                   \
    } while (0)

static inline int buf_put(Buf *b, const void *src, Py_ssize_t k) {
    if (buf_reserve(b, k) < 0)
        return -1;
    memcpy(b->p + b->n, src, k);
    b->n += k;
    return 0;
}

static inline int put_i64(Buf *b, int64_t v) {
    if (buf_reserve(b, 8) < 0)
        return -1;
    STORE(b, int64_t, v);
    return 0;
}

static inline int put_i32(Buf *b, int32_t v) {
    if (buf_reserve(b, 4) < 0)
        return -1;
    STORE(b, int32_t, v);
    return 0;
}

static void buf_free(Buf *b) {
    Py_CLEAR(b->ba);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* The bytes so far (a bytearray cut to their length, no copy), and an empty buffer. */
static PyObject *buf_take(Buf *b) {
    PyObject *out = b->ba;
    if (out == NULL)
        return PyByteArray_FromStringAndSize(NULL, 0);
    b->ba = NULL;
    if (PyByteArray_Resize(out, b->n) < 0) { /* shrinking within the allocation: no copy */
        Py_DECREF(out);
        out = NULL;
    }
    Py_ssize_t last = b->n;
    buf_free(b);
    b->last = last;
    return out;
}

/* Bit `row` of an Arrow validity bitmap (LSB first); a new byte every 8 rows (reserve 1 byte first). */
static inline void bitmap_set(Buf *bits, Py_ssize_t row, int valid) {
    if ((row & 7) == 0)
        STORE(bits, char, 0);
    if (valid)
        bits->p[row >> 3] |= (char)(1 << (row & 7));
}

/* A nullable string column as Arrow lays it out: int32 offsets (a leading 0, then each row's end),
   UTF-8 bytes, validity bits. */
typedef struct {
    Buf ends, data, valid;
} StrCol;

/* The UTF-8 text of a row's value (NULL text for None): a pointer into the str for ASCII text. */
static int str_text(PyObject *s, const char **u, Py_ssize_t *k) {
    *u = NULL;
    *k = 0;
    if (s == NULL || s == Py_None)
        return 0;
    if (PyUnicode_Check(s) && PyUnicode_IS_COMPACT_ASCII(s)) { /* the usual request id: its own bytes */
        *u = (const char *)PyUnicode_DATA(s);
        *k = PyUnicode_GET_LENGTH(s);
        return 0;
    }
    *u = PyUnicode_AsUTF8AndSize(s, k);
    return *u == NULL ? -1 : 0;
}

/* Room for one more row of `k` bytes, so that str_write cannot fail. */
static inline int str_reserve(StrCol *c, Py_ssize_t k) {
    return buf_reserve(&c->ends, 8) < 0 || buf_reserve(&c->data, k) < 0 || buf_reserve(&c->valid, 1) < 0 ? -1 : 0;
}

static void str_write(StrCol *c, Py_ssize_t row, const char *u, Py_ssize_t k) {
    if (c->ends.n == 0)
        STORE(&c->ends, int32_t, 0);
    if (u != NULL) {
        memcpy(c->data.p + c->data.n, u, k);
        c->data.n += k;
    }
    bitmap_set(&c->valid, row, u != NULL);
    STORE(&c->ends, int32_t, c->data.n);
}

static void str_free(StrCol *c) {
    buf_free(&c->ends);
    buf_free(&c->data);
    buf_free(&c->valid);
}

/* (offsets, data, validity bitmap) as bytes, and an empty column. */
static PyObject *str_take(StrCol *c) {
    PyObject *out = Py_BuildValue("(NNN)", buf_take(&c->ends), buf_take(&c->data), buf_take(&c->valid));
    str_free(c);
    return out;
}

/* ---- naming the request from the caller's frame -------------------------------------------- */

static PyObject *s_request_id, *s_request, *s_step, *s_block_id, *s_block_hash, *s_null_block, *s_connector;

/* ---- reading a __slots__ attribute directly ---------------------------------------------------- */

/* Where an object of one exact type keeps a __slots__ attribute: the member descriptor's offset. A
   read is then a load (PyObject_GetAttr goes through the type's method cache and the descriptor,
   ~270 instructions, and a cache miss each time it is evicted between calls). Any other type, or an
   empty slot, takes PyObject_GetAttr. Holds a reference to the type, so its address stays its own. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t offset;
    int tried; /* slot_get_lazy: the first object's type was looked at */
} SlotRef;

static void slot_ref_init(SlotRef *r, PyObject *obj, PyObject *name) {
    Py_CLEAR(r->type);
    r->offset = -1;
    r->tried = 1;
    PyObject *d = PyObject_GetAttr((PyObject *)Py_TYPE(obj), name); /* a member descriptor: itself */
    if (d == NULL) {
        PyErr_Clear();
        return;
    }
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == KVT_T_OBJECT_EX && ((PyMemberDescrObject *)d)->d_common.d_type == Py_TYPE(obj)) {
            r->type = (PyTypeObject *)Py_NewRef((PyObject *)Py_TYPE(obj));
            r->offset = m->offset;
        }
    }
    Py_DECREF(d);
}

/* New reference to obj.name (NULL with an exception set if it has none). */
static inline PyObject *slot_get(SlotRef *r, PyObject *obj, PyObject *name) {
    if (Py_TYPE(obj) == r->type) {
        PyObject *v = *(PyObject **)((char *)obj + r->offset);
        if (v != NULL)
            return Py_NewRef(v);
    }
    return PyObject_GetAttr(obj, name);
}

/* slot_get for objects whose type is known only at the first read (vLLM's KVCacheBlock: a
   `dataclass(slots=True)`, so `block_id` and `_block_hash` are slots; a version without slots gets
   PyObject_GetAttr). */
static inline PyObject *slot_get_lazy(SlotRef *r, PyObject *obj, PyObject *name) {
    if (!r->tried)
        slot_ref_init(r, obj, name);
    return slot_get(r, obj, name);
}

/* Which argument of a code object names the request: the index of `request_id`, else of `request`,
   among its arguments (never other locals: see caller_request_id in buffers.py). A small table keyed
   by the code object's address, holding a reference so the address cannot be reused. */
#if defined(KVT_FRAMES_INTERNAL) || defined(KVT_FRAMES_PUBLIC)
#define ARG_CACHE 64
typedef struct {
    PyObject *code;
    int index;  /* -1: no such argument */
    int is_request; /* the argument is a Request (read .request_id), not the id itself */
    int is_cell;
} ArgEntry;
static ArgEntry arg_cache[ARG_CACHE];

static ArgEntry *arg_entry(PyCodeObject *code) {
    size_t h = ((uintptr_t)code >> 4) % ARG_CACHE;
    for (int probe = 0; probe < ARG_CACHE; probe++, h = (h + 1) % ARG_CACHE) {
        ArgEntry *e = &arg_cache[h];
        if (e->code == (PyObject *)code)
            return e;
        if (e->code != NULL)
            continue;
        PyObject *names = PyCode_GetVarnames(code);
        if (names == NULL)
            return NULL;
        Py_ssize_t nargs = code->co_argcount + code->co_kwonlyargcount;
        int found = -1, is_request = 0;
        for (int want = 0; want < 2 && found < 0; want++) {
            PyObject *name = want ? s_request : s_request_id;
            for (Py_ssize_t i = 0; i < nargs && i < PyTuple_GET_SIZE(names); i++) {
                int eq = PyUnicode_Compare(PyTuple_GET_ITEM(names, i), name) == 0;
                if (eq) {
                    found = (int)i;
                    is_request = want;
                    break;
                }
            }
        }
        Py_DECREF(names);
        e->code = Py_NewRef((PyObject *)code);
        e->index = found;
        e->is_request = is_request;
        e->is_cell = 0;
#ifdef KVT_FRAMES_INTERNAL
        if (found >= 0)
            e->is_cell = (PyBytes_AS_STRING(code->co_localspluskinds)[found] & CO_FAST_CELL) != 0;
#endif
        return e;
    }
    return NULL; /* table full: callers treat it as "no argument" (only a handful of callers exist) */
}

/* The request id (a str) named by `value`, the argument an ArgEntry points at; NULL if none. */
static PyObject *request_id_of(ArgEntry *e, PyObject *value) {
    if (value == NULL)
        return NULL;
    if (!e->is_request)
        return PyUnicode_Check(value) ? Py_NewRef(value) : NULL;
    PyObject *rid = PyObject_GetAttr(value, s_request_id);
    if (rid == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyUnicode_Check(rid))
        Py_CLEAR(rid);
    return rid;
}

#endif

/* New reference to the request id argument of the nearest of `up` Python frames, starting `skip`
   frames above the current one (skip=1 from a call made by a wrapper: the wrapper's caller); NULL
   (no error set) when none has one. */
static PyObject *frame_request_id(int skip, int up, PyObject *fallback_fn) {
#if defined(KVT_FRAMES_INTERNAL)
    (void)fallback_fn;
    _PyInterpreterFrame *f = PyThreadState_Get()->cframe->current_frame;
    for (int i = 0; f != NULL && i < skip + up;) {
        if (_PyFrame_IsIncomplete(f)) {
            f = f->previous;
            continue;
        }
        if (i >= skip) {
            ArgEntry *e = arg_entry(f->f_code);
            if (e == NULL)
                return NULL;
            if (e->index >= 0) {
                PyObject *v = f->localsplus[e->index];
                if (v != NULL && e->is_cell && PyCell_Check(v))
                    v = PyCell_GET(v);
                PyObject *rid = request_id_of(e, v);
                if (rid != NULL)
                    return rid;
            }
        }
        f = f->previous;
        i++;
    }
    return NULL;
#elif defined(KVT_FRAMES_PUBLIC)
    (void)fallback_fn;
    PyFrameObject *f = PyThreadState_GetFrame(PyThreadState_Get());
    PyObject *rid = NULL;
    for (int i = 0; f != NULL && i < skip + up && rid == NULL; i++) {
        if (i >= skip) {
            PyCodeObject *code = PyFrame_GetCode(f);
            ArgEntry *e = arg_entry(code);
            Py_DECREF(code);
            if (e == NULL) {
                Py_DECREF(f);
                return NULL;
            }
            if (e->index >= 0) {
                PyObject *v = PyFrame_GetVar(f, e->is_request ? s_request : s_request_id);
                if (v == NULL)
                    PyErr_Clear();
                rid = request_id_of(e, v);
                Py_XDECREF(v);
            }
        }
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    return rid;
#else
    /* The Python implementation: its frame 1 is the Python frame that called into this module. */
    PyObject *rid = PyObject_CallFunction(fallback_fn, "ii", skip + 1, up);
    if (rid == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyUnicode_Check(rid))
        Py_CLEAR(rid);
    return rid;
#endif
}

static PyObject *py_caller_request_id(PyObject *mod, PyObject *args) {
    int skip = 1, up = 3;
    PyObject *fallback = Py_None;
    if (!PyArg_ParseTuple(args, "|iiO", &skip, &up, &fallback))
        return NULL;
    PyObject *rid = frame_request_id(skip, up, fallback);
    return rid ? rid : Py_NewRef(Py_None);
}

/* ---- BlockLog: block_events rows ------------------------------------------------------------ */

enum { EV_ALLOC, EV_FREE, EV_TOUCH, EV_CACHE, EV_EVICT, EV_HOLD, EV_RELEASE };
static const char *const EVENT_NAMES[] = {"alloc", "free", "touch", "cache", "evict", "hold", "release"};

/* One block_events row as the hot path writes it: everything but its request id's text, its block ids
   and its hashes (each appended to a buffer of its own) in 32 bytes, two rows to a cache line. take()
   turns the rows into Arrow's columns. Under a real engine each cache line a row touches is a likely
   miss to DRAM (vLLM's own work in between evicts them): a row written as ten columns touched twelve
   buffer tails and their bookkeeping, a packed row three (with the caches cold, 1.2 -> 0.97 us an
   allocation row on this project's CPU machine: bench/bench_block_rows.py, docs/performance.md). */
typedef struct {
    int64_t ts;
    int64_t step;
    int32_t ids_end;    /* the row's ids end here in `ids` (int32 elements) */
    int32_t hashes_end; /* and its hashes in `hashes` (int64 elements) */
    int32_t rid_end;    /* and its request id's UTF-8 in `rid_text` (bytes) */
    int16_t group;
    int8_t event;
    uint8_t flags;      /* ROW_HASHED: the hashes are the row's; ROW_HAS_RID: it names a request */
} BlockRow;
#define ROW_HASHED 1
#define ROW_HAS_RID 2

/* The fields every row reads or writes come first, in as few cache lines as they fit. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t rows;
    Buf packed, rid_text, ids, hashes; /* BlockRow rows; request id bytes; int32 ids; int64 hashes */
    PyObject *ctx;         /* kvtrace.probes.context.ctx: .step, .request_id (fallback attribution) */
    SlotRef ctx_step;
    SlotRef block_id, block_hash; /* a KVCacheBlock's block_id and hash attribute (hash_attr) */
    int64_t since_ns, flush_ns;
    Py_ssize_t flush_rows;
    int in_alloc;          /* inside get_new_blocks: evictions wait for the allocation's row */
    PyObject *route, *main_ref; /* see log_for */
    PyObject *fallback_fn; /* the Python caller_request_id, where frames cannot be read here */
    PyObject *hash_attr;   /* the KVCacheBlock attribute that holds its hash (str) */
    SlotRef ctx_request_id, ctx_connector; /* ctx.request_id, .connector (EngineContext slots) */
    PyObject *pool_ref, *null_block; /* a weak reference to the last BlockPool seen by free/touch, and
                                        its null block (a strong reference would keep a dropped pool) */
    Buf pend_ids, pend_hashes;
    /* Pools other than the engine's own (a CPU offload tier's BlockPool, say) log to their own BlockLog,
       which `route(pool)` returns: see log_for. Weak references, as for pool_ref. */
    PyObject *last_ref, *last_log;
} BlockLog;

static int hash64(PyObject *key, int64_t *out) {
    /* First 8 bytes of a vLLM block hash as a little-endian signed int64 (columns.hash64). */
    const unsigned char *s = NULL;
    Py_ssize_t n = 0;
    if (PyBytes_Check(key)) {
        s = (const unsigned char *)PyBytes_AS_STRING(key);
        n = PyBytes_GET_SIZE(key);
    } else if (PyByteArray_Check(key)) {
        s = (const unsigned char *)PyByteArray_AS_STRING(key);
        n = PyByteArray_GET_SIZE(key);
    } else {
        Py_hash_t h = PyObject_Hash(key); /* older vLLM: a tuple-like hash, as hash() gives it */
        if (h == -1 && PyErr_Occurred())
            return -1;
        *out = (int64_t)h;
        return 0;
    }
    uint64_t v = 0;
    Py_ssize_t k = n < 8 ? n : 8;
    for (Py_ssize_t i = 0; i < k; i++)
        v |= (uint64_t)s[i] << (8 * i);
    if (k > 0 && k < 8 && (s[k - 1] & 0x80))
        v |= ~(uint64_t)0 << (8 * k); /* int.from_bytes(signed=True) of fewer than 8 bytes */
    *out = (int64_t)v;
    return 0;
}

static int64_t ctx_step(BlockLog *self) {
    PyObject *v = slot_get(&self->ctx_step, self->ctx, s_step);
    if (v == NULL)
        return -1;
    int64_t step = as_int64(v);
    Py_DECREF(v);
    return step;
}

/* The request a pool call is made for: the caller's argument, else ctx.request_id. New ref or None.
   `skip`: Python frames above the current one that are not vLLM's caller (1 when a Python wrapper
   calls the log, 0 from a BlockHook, which has no frame of its own). */
static PyObject *block_request(BlockLog *self, int skip) {
    PyObject *rid = frame_request_id(skip, 3, self->fallback_fn);
    if (rid != NULL)
        return rid;
    rid = slot_get(&self->ctx_request_id, self->ctx, s_request_id);
    if (rid == NULL)
        PyErr_Clear();
    return rid ? rid : Py_NewRef(Py_None);
}

/* One row. Its block ids (and hashes, if `hashed`) are already appended to `ids` (`hashes`): on an
   error the caller cuts them back. Everything that can fail happens before the first column is
   written, so the columns always hold whole rows. */
static int block_row(BlockLog *self, int64_t t, int event, int32_t group, PyObject *rid, int hashed) {
    int64_t step = ctx_step(self);
    if (step == -1 && PyErr_Occurred())
        return -1;
    const char *u;
    Py_ssize_t k;
    if (str_text(rid, &u, &k) < 0)
        return -1;
    if (self->rid_text.n + k > INT32_MAX || self->ids.n / 4 > INT32_MAX || self->hashes.n / 8 > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "block_events rows past 2^31 offsets between two takes");
        return -1;
    }
    if (buf_reserve(&self->packed, sizeof(BlockRow)) < 0 || buf_reserve(&self->rid_text, k) < 0)
        return -1;
    BlockRow *r = (BlockRow *)(self->packed.p + self->packed.n);
    if (u != NULL) {
        memcpy(self->rid_text.p + self->rid_text.n, u, k);
        self->rid_text.n += k;
    }
    r->ts = t;
    r->step = step;
    r->ids_end = (int32_t)(self->ids.n / 4);
    r->hashes_end = (int32_t)(self->hashes.n / 8);
    r->rid_end = (int32_t)self->rid_text.n;
    r->group = (int16_t)group;
    r->event = (int8_t)event;
    r->flags = (hashed ? ROW_HASHED : 0) | (u != NULL ? ROW_HAS_RID : 0);
    self->packed.n += sizeof(BlockRow);
    self->rows++;
    return 0;
}

/* Append the ids of `blocks` (KVCacheBlock objects) to the log's `ids`, leaving out `skip` (the null
   block); returns how many, or -1. */
static Py_ssize_t put_block_ids(BlockLog *self, PyObject *blocks, PyObject *skip) {
    Buf *ids = &self->ids;
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), k = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (buf_reserve(ids, n * 4) < 0)
        goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == skip)
            continue;
        PyObject *v = slot_get_lazy(&self->block_id, items[i], s_block_id);
        if (v == NULL)
            goto error;
        long id = (long)as_int64(v);
        Py_DECREF(v);
        if (id == -1 && PyErr_Occurred())
            goto error;
        if (put_i32(ids, (int32_t)id) < 0)
            goto error;
        k++;
    }
    Py_DECREF(seq);
    return k;
error:
    Py_DECREF(seq);
    return -1;
}

/* The object behind weak reference `ref` (NULL: none) as a new reference, or None when it is gone.
   (PyWeakref_GET_OBJECT is deprecated from 3.13, which has PyWeakref_GetRef.) */
static PyObject *ref_get(PyObject *ref) {
    if (ref == NULL)
        Py_RETURN_NONE;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(ref, &obj) <= 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return obj;
#else
    return Py_NewRef(PyWeakref_GET_OBJECT(ref));
#endif
}

static int ref_is_live(PyObject *ref) {
    if (ref == NULL)
        return 0;
    PyObject *target = ref_get(ref);
    Py_DECREF(target);
    return target != Py_None;
}

/* Is `obj` (held by the caller) what weak reference `ref` points to? Compared by address. */
static int ref_is(PyObject *ref, PyObject *obj) {
    if (ref == NULL)
        return 0;
    PyObject *target = ref_get(ref);
    Py_DECREF(target);
    return target == obj;
}

/* The log for rows of `pool`'s calls (borrowed), or NULL with an exception. Without a `route` every pool
   logs here (the log alone, as the unit tests use it). With one: the engine's pool (main_pool, or the
   first pool seen when none was named) logs here, and any other pool to the log route(pool) returns,
   the last one kept so that a run of calls on one pool costs a pointer compare. */
static BlockLog *log_for(BlockLog *self, PyObject *pool) {
    if (self->route == NULL || ref_is(self->main_ref, pool))
        return self;
    if (!ref_is_live(self->main_ref)) {
        PyObject *ref = PyWeakref_NewRef(pool, NULL);
        if (ref == NULL)
            return NULL;
        Py_XSETREF(self->main_ref, ref);
        return self;
    }
    if (ref_is(self->last_ref, pool))
        return (BlockLog *)self->last_log;
    PyObject *log = PyObject_CallOneArg(self->route, pool);
    if (log == NULL)
        return NULL;
    if (!PyObject_TypeCheck(log, Py_TYPE(self))) {
        Py_DECREF(log);
        PyErr_SetString(PyExc_TypeError, "BlockLog.route returned no BlockLog");
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef(pool, NULL);
    if (ref == NULL) {
        Py_DECREF(log);
        return NULL;
    }
    Py_XSETREF(self->last_ref, ref);
    Py_XSETREF(self->last_log, log);
    return (BlockLog *)log;
}

static PyObject *BlockLog_for_pool(BlockLog *self, PyObject *pool) {
    BlockLog *log = log_for(self, pool);
    return log ? Py_NewRef((PyObject *)log) : NULL;
}

static PyObject *BlockLog_get_route(BlockLog *self, void *closure) {
    return Py_NewRef(self->route ? self->route : Py_None);
}

static int BlockLog_set_route(BlockLog *self, PyObject *value, void *closure) {
    Py_CLEAR(self->last_ref);
    Py_CLEAR(self->last_log);
    if (value == NULL || value == Py_None) {
        Py_CLEAR(self->route);
        return 0;
    }
    if (!PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "route must be callable or None");
        return -1;
    }
    Py_XSETREF(self->route, Py_NewRef(value));
    return 0;
}

static PyObject *BlockLog_get_main_pool(BlockLog *self, void *closure) {
    return ref_get(self->main_ref);
}

static int BlockLog_set_main_pool(BlockLog *self, PyObject *value, void *closure) {
    if (value == NULL || value == Py_None) {
        Py_CLEAR(self->main_ref);
        return 0;
    }
    PyObject *ref = PyWeakref_NewRef(value, NULL);
    if (ref == NULL)
        return -1;
    Py_XSETREF(self->main_ref, ref);
    return 0;
}

static PyObject *due(BlockLog *self, int64_t t) {
    return PyBool_FromLong(self->rows >= self->flush_rows || t - self->since_ns >= self->flush_ns);
}

static int BlockLog_init(BlockLog *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"ctx", "fallback", "flush_rows", "flush_ns", "hash_attr", NULL};
    PyObject *ctx, *fallback = Py_None, *hash_attr = s_block_hash;
    Py_ssize_t flush_rows = 8192;
    long long flush_ns = 250000000LL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OnLU", names, &ctx, &fallback, &flush_rows, &flush_ns,
                                     &hash_attr))
        return -1;
    Py_XSETREF(self->ctx, Py_NewRef(ctx));
    Py_XSETREF(self->hash_attr, Py_NewRef(hash_attr));
    slot_ref_init(&self->ctx_step, ctx, s_step);
    slot_ref_init(&self->ctx_request_id, ctx, s_request_id);
    slot_ref_init(&self->ctx_connector, ctx, s_connector);
    Py_XSETREF(self->fallback_fn, Py_NewRef(fallback));
    self->flush_rows = flush_rows;
    self->flush_ns = flush_ns;
    self->since_ns = now_ns();
    return 0;
}

static void block_free_columns(BlockLog *self) {
    Buf *bufs[] = {&self->packed, &self->rid_text, &self->ids, &self->hashes};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        buf_free(bufs[i]);
    self->rows = 0;
}

static void BlockLog_dealloc(BlockLog *self) {
    block_free_columns(self);
    buf_free(&self->pend_ids);
    buf_free(&self->pend_hashes);
    Py_XDECREF(self->ctx);
    Py_XDECREF(self->fallback_fn);
    Py_XDECREF(self->hash_attr);
    Py_CLEAR(self->ctx_step.type);
    Py_CLEAR(self->ctx_request_id.type);
    Py_CLEAR(self->ctx_connector.type);
    Py_CLEAR(self->block_id.type);
    Py_CLEAR(self->block_hash.type);
    Py_CLEAR(self->pool_ref);
    Py_CLEAR(self->null_block);
    Py_CLEAR(self->route);
    Py_CLEAR(self->main_ref);
    Py_CLEAR(self->last_ref);
    Py_CLEAR(self->last_log);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* get_new_blocks starts (evictions wait for its row: in_alloc) or ends without a row (raised). */
static void alloc_begin(BlockLog *self) {
    self->in_alloc = 1;
    self->pend_ids.n = self->pend_hashes.n = 0;
}

static void alloc_end(BlockLog *self) {
    self->in_alloc = 0;
    self->pend_ids.n = self->pend_hashes.n = 0;
}

static PyObject *BlockLog_begin_alloc(BlockLog *self, PyObject *unused) {
    alloc_begin(self);
    Py_RETURN_NONE;
}

static PyObject *BlockLog_end_alloc(BlockLog *self, PyObject *unused) {
    alloc_end(self);
    Py_RETURN_NONE;
}

/* get_new_blocks returned `blocks`: the evictions it made (one row), then the allocation (one row). */
static PyObject *log_alloc(BlockLog *self, PyObject *blocks, int skip) {
    self->in_alloc = 0;
    int64_t t = now_ns();
    PyObject *rid = block_request(self, skip);
    Py_ssize_t ids0 = self->ids.n, hashes0 = self->hashes.n;
    int err = 0;
    if (self->pend_ids.n) {
        err = buf_put(&self->ids, self->pend_ids.p, self->pend_ids.n) < 0
              || buf_put(&self->hashes, self->pend_hashes.p, self->pend_hashes.n) < 0
              || block_row(self, t, EV_EVICT, 0, rid, 1) < 0;
        self->pend_ids.n = self->pend_hashes.n = 0;
        if (err) {
            self->ids.n = ids0;
            self->hashes.n = hashes0;
        }
    }
    if (!err) {
        ids0 = self->ids.n;
        Py_ssize_t k = put_block_ids(self, blocks, NULL);
        err = k < 0 || (k > 0 && block_row(self, t, EV_ALLOC, 0, rid, 0) < 0);
        if (k <= 0 || err)
            self->ids.n = ids0;
    }
    Py_DECREF(rid);
    return err ? NULL : due(self, t);
}

static PyObject *BlockLog_alloc(BlockLog *self, PyObject *blocks) { return log_alloc(self, blocks, 1); }

/* _maybe_evict_cached_block evicted block `id_obj`, whose hash was `key`. */
static PyObject *log_evict(BlockLog *self, PyObject *id_obj, PyObject *key, int skip) {
    long id = (long)as_int64(id_obj);
    int64_t h;
    if ((id == -1 && PyErr_Occurred()) || hash64(key, &h) < 0)
        return NULL;
    if (self->in_alloc) {
        if (put_i32(&self->pend_ids, (int32_t)id) < 0 || put_i64(&self->pend_hashes, h) < 0)
            return NULL;
        Py_RETURN_FALSE;
    }
    int64_t t = now_ns(); /* an eviction outside allocation (evict_blocks) */
    PyObject *rid = block_request(self, skip);
    Py_ssize_t ids0 = self->ids.n, hashes0 = self->hashes.n;
    int err = put_i32(&self->ids, (int32_t)id) < 0 || put_i64(&self->hashes, h) < 0
              || block_row(self, t, EV_EVICT, 0, rid, 1) < 0;
    if (err) {
        self->ids.n = ids0;
        self->hashes.n = hashes0;
    }
    Py_DECREF(rid);
    return err ? NULL : due(self, t);
}

static PyObject *BlockLog_evict(BlockLog *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "evict(block_id, key)");
        return NULL;
    }
    return log_evict(self, args[0], args[1], 1);
}

/* Is `pool` the pool whose null block the log holds? */
static int is_last_pool(BlockLog *self, PyObject *pool) { return ref_is(self->pool_ref, pool); }

/* free_blocks / touch of `blocks` on `pool`: one row of their ids without the null block. */
static PyObject *block_ids_row(BlockLog *self, PyObject *pool, PyObject *blocks, int event, int skip) {
    if (!is_last_pool(self, pool)) {
        /* A pool's null block never changes: read it once per pool. */
        PyObject *null = PyObject_GetAttr(pool, s_null_block);
        if (null == NULL)
            return NULL;
        Py_XSETREF(self->null_block, null);
        Py_XSETREF(self->pool_ref, PyWeakref_NewRef(pool, NULL));
        if (self->pool_ref == NULL)
            PyErr_Clear(); /* a pool without weak references: read its null block every time */
    }
    Py_ssize_t before = self->ids.n;
    Py_ssize_t k = put_block_ids(self, blocks, self->null_block);
    if (k < 0) { /* the ids before the bad block are cut too, or the next row would take them */
        self->ids.n = before;
        return NULL;
    }
    if (k == 0) {
        self->ids.n = before;
        Py_RETURN_FALSE;
    }
    /* A touch or free made inside a KV connector's method (ctx.connector set by the connector probe)
       is the connector holding blocks during a transfer, or letting them go: not a prefix-cache hit, not
       a request's free. */
    PyObject *holder = slot_get(&self->ctx_connector, self->ctx, s_connector);
    if (holder == NULL) {
        PyErr_Clear();
    } else {
        if (holder != Py_None)
            event = event == EV_TOUCH ? EV_HOLD : EV_RELEASE;
        Py_DECREF(holder);
    }
    int64_t t = now_ns();
    PyObject *rid = block_request(self, skip);
    int err = block_row(self, t, event, 0, rid, 0) < 0;
    Py_DECREF(rid);
    if (err)
        self->ids.n = before;
    return err ? NULL : due(self, t);
}

static PyObject *pool_blocks_row(BlockLog *self, PyObject *const *args, Py_ssize_t nargs, int event) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (pool, blocks)");
        return NULL;
    }
    return block_ids_row(self, args[0], args[1], event, 1);
}

static PyObject *BlockLog_free(BlockLog *self, PyObject *const *args, Py_ssize_t nargs) {
    return pool_blocks_row(self, args, nargs, EV_FREE);
}

static PyObject *BlockLog_touch(BlockLog *self, PyObject *const *args, Py_ssize_t nargs) {
    return pool_blocks_row(self, args, nargs, EV_TOUCH);
}

/* cache_full_blocks(request, blocks, num_cached, num_full, group): blocks[num_cached:num_full] that
   have a hash (null or masked-out blocks were not cached), with their hashes. */
static PyObject *BlockLog_cache(BlockLog *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "cache(request, blocks, num_cached, num_full, group)");
        return NULL;
    }
    Py_ssize_t lo = PyLong_AsSsize_t(args[2]), hi = PyLong_AsSsize_t(args[3]);
    long group = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "blocks must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (lo < 0)
        lo = 0;
    if (hi > n)
        hi = n;
    Py_ssize_t ids0 = self->ids.n, hashes0 = self->hashes.n, k = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = lo; i < hi; i++) {
        PyObject *key = slot_get_lazy(&self->block_hash, items[i], self->hash_attr);
        if (key == NULL)
            goto error;
        if (key == Py_None) {
            Py_DECREF(key);
            continue;
        }
        int64_t h;
        int bad = hash64(key, &h) < 0;
        Py_DECREF(key);
        PyObject *v = bad ? NULL : slot_get_lazy(&self->block_id, items[i], s_block_id);
        if (v == NULL)
            goto error;
        long id = (long)as_int64(v);
        Py_DECREF(v);
        if ((id == -1 && PyErr_Occurred()) || put_i32(&self->ids, (int32_t)id) < 0
            || put_i64(&self->hashes, h) < 0)
            goto error;
        k++;
    }
    Py_DECREF(seq);
    if (k == 0)
        Py_RETURN_FALSE;
    int64_t t = now_ns();
    PyObject *rid = PyObject_GetAttr(args[0], s_request_id);
    if (rid == NULL)
        goto undo;
    int err = block_row(self, t, EV_CACHE, (int32_t)group, rid, 1) < 0;
    Py_DECREF(rid);
    if (err)
        goto undo;
    return due(self, t);
error:
    Py_DECREF(seq);
undo:
    self->ids.n = ids0;
    self->hashes.n = hashes0;
    return NULL;
}

/* The packed rows as Arrow's column buffers: fixed-width columns, (offsets, data, validity) for the two
   string columns, list offsets with their leading 0. Returns 0, or -1 with an exception. */
static int block_columns(BlockLog *self, Buf *ts, Buf *step, StrCol *event, Buf *group, StrCol *rid, Buf *ids_end,
                         Buf *hashes_end, Buf *hashed) {
    Py_ssize_t n = self->rows;
    Py_ssize_t event_bytes = 0;
    const BlockRow *rows = (const BlockRow *)self->packed.p;
    for (Py_ssize_t i = 0; i < n; i++)
        event_bytes += (Py_ssize_t)strlen(EVENT_NAMES[rows[i].event]);
    Py_ssize_t bits = (n + 7) / 8;
    if (buf_reserve(ts, 8 * n) < 0 || buf_reserve(step, 8 * n) < 0 || buf_reserve(group, 2 * n) < 0
        || buf_reserve(ids_end, 4 * (n + 1)) < 0 || buf_reserve(hashes_end, 4 * (n + 1)) < 0
        || buf_reserve(hashed, bits) < 0 || buf_reserve(&event->ends, 4 * (n + 1)) < 0
        || buf_reserve(&event->data, event_bytes) < 0 || buf_reserve(&event->valid, bits) < 0
        || buf_reserve(&rid->ends, 4 * (n + 1)) < 0 || buf_reserve(&rid->valid, bits) < 0)
        return -1;
    STORE(ids_end, int32_t, 0);
    STORE(hashes_end, int32_t, 0);
    STORE(&rid->ends, int32_t, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        const BlockRow *r = &rows[i];
        STORE(ts, int64_t, r->ts);
        STORE(step, int64_t, r->step);
        STORE(group, int16_t, r->group);
        STORE(ids_end, int32_t, r->ids_end);
        STORE(hashes_end, int32_t, r->hashes_end);
        bitmap_set(hashed, i, r->flags & ROW_HASHED);
        const char *name = EVENT_NAMES[r->event];
        str_write(event, i, name, (Py_ssize_t)strlen(name));
        bitmap_set(&rid->valid, i, r->flags & ROW_HAS_RID);
        STORE(&rid->ends, int32_t, r->rid_end);
    }
    return 0;
}

/* The rows so far as column buffers (dict), and an empty log; None when there are none. Without memory
   for the columns the rows stay for the next take (MemoryError). */
static PyObject *BlockLog_take_raw(BlockLog *self, PyObject *unused) {
    self->since_ns = now_ns();
    if (self->rows == 0)
        Py_RETURN_NONE;
    Buf ts = {0}, step = {0}, group = {0}, ids_end = {0}, hashes_end = {0}, hashed = {0};
    StrCol event = {{0}}, rid = {{0}};
    if (block_columns(self, &ts, &step, &event, &group, &rid, &ids_end, &hashes_end, &hashed) < 0) {
        Buf *temps[] = {&ts, &step, &group, &ids_end, &hashes_end, &hashed};
        for (size_t i = 0; i < sizeof temps / sizeof temps[0]; i++)
            buf_free(temps[i]);
        str_free(&event);
        str_free(&rid);
        return NULL;
    }
    Py_ssize_t rows = self->rows, packed = self->packed.n, text = self->rid_text.n;
    rid.data = self->rid_text; /* the request ids' bytes are the column's data as they are */
    self->rid_text = (Buf){0};
    /* Every buffer is handed over (N) or freed, the call failing or not. */
    PyObject *out = Py_BuildValue(
        "{s:n,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "rows", rows, "ts_ns", buf_take(&ts),
        "step", buf_take(&step), "event", str_take(&event), "kv_group", buf_take(&group),
        "request_id", str_take(&rid), "ids", buf_take(&self->ids), "ids_end", buf_take(&ids_end),
        "hashes", buf_take(&self->hashes), "hashes_end", buf_take(&hashes_end), "hashed", buf_take(&hashed));
    block_free_columns(self);
    /* The next take's rows start in buffers twice this one's size (see Buf.last). */
    self->packed.last = packed;
    self->rid_text.last = text;
    return out;
}

static PyObject *BlockLog_get_rows(BlockLog *self, void *closure) { return PyLong_FromSsize_t(self->rows); }

static PyMethodDef BlockLog_methods[] = {
    {"begin_alloc", (PyCFunction)BlockLog_begin_alloc, METH_NOARGS, "get_new_blocks starts: hold evictions"},
    {"end_alloc", (PyCFunction)BlockLog_end_alloc, METH_NOARGS, "get_new_blocks raised: forget them"},
    {"alloc", (PyCFunction)BlockLog_alloc, METH_O, "alloc(blocks) -> bool: time to take()"},
    {"evict", (PyCFunction)(void (*)(void))BlockLog_evict, METH_FASTCALL, "evict(block_id, key) -> bool"},
    {"free", (PyCFunction)(void (*)(void))BlockLog_free, METH_FASTCALL, "free(pool, blocks) -> bool"},
    {"touch", (PyCFunction)(void (*)(void))BlockLog_touch, METH_FASTCALL, "touch(pool, blocks) -> bool"},
    {"cache", (PyCFunction)(void (*)(void))BlockLog_cache, METH_FASTCALL,
     "cache(request, blocks, num_cached, num_full, group) -> bool"},
    {"take_raw", (PyCFunction)BlockLog_take_raw, METH_NOARGS, "the rows as column buffers, or None"},
    {"for_pool", (PyCFunction)BlockLog_for_pool, METH_O, "for_pool(pool) -> the BlockLog of its rows"},
    {NULL}};

static PyGetSetDef BlockLog_getset[] = {
    {"rows", (getter)BlockLog_get_rows, NULL, "rows held", NULL},
    {"route", (getter)BlockLog_get_route, (setter)BlockLog_set_route,
     "route(pool) -> BlockLog for pools other than main_pool (None: every pool logs here)", NULL},
    {"main_pool", (getter)BlockLog_get_main_pool, (setter)BlockLog_set_main_pool,
     "the pool whose rows this log keeps when routing (weak; the first pool seen if unset)", NULL},
    {NULL}};

static PyTypeObject BlockLogType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtrace.probes._columns.BlockLog",
    .tp_basicsize = sizeof(BlockLog),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "block_events rows as columns (see columns.BlockLog)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BlockLog_init,
    .tp_dealloc = (destructor)BlockLog_dealloc,
    .tp_methods = BlockLog_methods,
    .tp_getset = BlockLog_getset,
};

/* ---- BlockHook: a BlockPool method whose block_events rows are made in C ------------------------

   A Python wrapper costs every pool call a Python frame of its own: its code, globals and the probe's
   attributes are read again each time, cold after vLLM's own work in between, which is most of what a
   call costs (callgrind's cache model, docs/performance.md). A BlockHook stands in the class instead:
   a method descriptor (so vLLM's `pool.touch(blocks)` stays a method call with no bound method made)
   whose call calls vLLM's function, then writes the row through the BlockLog functions above, with no
   Python frame of its own. It reads vLLM's parameters by position or by keyword (their positions come
   from the original's signature, buffers.block_hook) and passes every argument on as given.

   Like the Python wrappers (kv_blocks.py), which remain where this does not build: vLLM's own errors
   propagate; an error of the log's hands the exception to `on_error` (Probe.fail, which switches the
   probe, and so every hook of it, off) and vLLM's result is returned; `on_full` (Probe.take) runs
   when the log says it is time to hand its rows over; `before` (a test's fault injection) runs
   before a get_new_blocks row is made. */

enum { HK_ALLOC, HK_FREE, HK_TOUCH, HK_CACHE, HK_EVICT };
static const char *const HOOK_KINDS[] = {"alloc", "free", "touch", "cache", "evict", NULL};
static const int HOOK_NPARAMS[] = {0, 1, 1, 5, 1};
#define HOOK_MAX_PARAMS 5

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig, *log, *on_full, *on_error, *before, *dict;
    int kind;
    char enabled;
    Py_ssize_t pos[HOOK_MAX_PARAMS]; /* the parameters' positions in vLLM's signature (self is 0) */
    PyObject *names[HOOK_MAX_PARAMS]; /* and their names, for keyword arguments */
} BlockHook;

/* Parameter `i` of the call, by position or keyword; NULL (no error) when not given. */
static PyObject *hook_arg(BlockHook *h, int i, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (h->pos[i] < nargs)
        return args[h->pos[i]];
    if (kwnames != NULL) {
        /* Keyword names are interned, as ours are: compare addresses first, text only if none is ours. */
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++)
            if (PyTuple_GET_ITEM(kwnames, k) == h->names[i])
                return args[nargs + k];
        for (Py_ssize_t k = 0; k < nk; k++)
            if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, k), h->names[i]) == 0)
                return args[nargs + k];
    }
    return NULL;
}

/* The log raised (an exception is set): hand it to on_error, switch this hook off, clear it. An
   exception that is not an Exception (KeyboardInterrupt) stays set, as a Python wrapper's would. */
static int hook_fault(BlockHook *h) {
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    h->enabled = 0;
    PyObject *r = value ? PyObject_CallOneArg(h->on_error, value) : NULL;
    if (r == NULL)
        PyErr_Clear();
    Py_XDECREF(r);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 0;
}

/* After a log call that returned `due` (new reference, or NULL with an exception): hand the rows over
   when due. Returns -1 only for an exception that must reach vLLM (see hook_fault). */
static int hook_done(BlockHook *h, PyObject *due) {
    if (due == NULL)
        return hook_fault(h);
    int now = due == Py_True;
    Py_DECREF(due);
    if (now) {
        PyObject *r = PyObject_CallNoArgs(h->on_full);
        if (r == NULL)
            return hook_fault(h);
        Py_DECREF(r);
    }
    return 0;
}

/* The result vLLM gets: `result` as it is, or NULL when hook_done asks for an exception to pass. */
static PyObject *hook_return(PyObject *result, int status) {
    if (status < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *hook_vectorcall(BlockHook *h, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!h->enabled || nargs < 1)
        return PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
    BlockLog *log = log_for((BlockLog *)h->log, args[0]); /* args[0]: the pool (self) */
    if (log == NULL) {
        if (hook_fault(h) < 0)
            return NULL;
        return PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
    }
    PyObject *result;
    switch (h->kind) {
    case HK_ALLOC: {
        alloc_begin(log); /* evictions inside wait for this allocation's row */
        result = PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
        if (result == NULL || !h->enabled) {
            alloc_end(log);
            return result;
        }
        if (h->before != NULL) {
            PyObject *r = PyObject_CallNoArgs(h->before);
            if (r == NULL) {
                alloc_end(log);
                return hook_return(result, hook_fault(h));
            }
            Py_DECREF(r);
        }
        return hook_return(result, hook_done(h, log_alloc(log, result, 0)));
    }
    case HK_EVICT: {
        PyObject *block = hook_arg(h, 0, args, nargs, kwnames);
        if (block == NULL)
            return PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
        /* The hash before vLLM resets it. */
        PyObject *key = slot_get_lazy(&log->block_hash, block, log->hash_attr);
        if (key == NULL) {
            if (hook_fault(h) < 0)
                return NULL;
            return PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
        }
        result = PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
        int status = 0;
        if (result != NULL && h->enabled) {
            int evicted = result == Py_True ? 1 : result == Py_False ? 0 : PyObject_IsTrue(result);
            if (evicted < 0) {
                status = hook_fault(h);
            } else if (evicted) {
                PyObject *id = slot_get_lazy(&log->block_id, block, s_block_id);
                status = id == NULL ? hook_fault(h) : hook_done(h, log_evict(log, id, key, 0));
                Py_XDECREF(id);
            }
        }
        Py_DECREF(key);
        return result == NULL ? NULL : hook_return(result, status);
    }
    case HK_FREE: {
        /* The blocks may come as a one-shot iterator: read them once, pass vLLM the list. */
        PyObject *blocks = hook_arg(h, 0, args, nargs, kwnames);
        if (blocks == NULL || PyList_CheckExact(blocks) || PyTuple_CheckExact(blocks)) {
            result = PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
            if (result == NULL || blocks == NULL || !h->enabled)
                return result;
            return hook_return(result, hook_done(h, block_ids_row(log, args[0], blocks, EV_FREE, 0)));
        }
        PyObject *list = PySequence_List(blocks); /* vLLM's error, if any: as its own call would raise */
        if (list == NULL)
            return NULL;
        Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
        PyObject **copy = PyMem_Malloc(total * sizeof(PyObject *));
        if (copy == NULL) {
            Py_DECREF(list);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t k = 0; k < total; k++)
            copy[k] = args[k] == blocks ? list : args[k];
        result = PyObject_Vectorcall(h->orig, copy, nargs, kwnames);
        PyMem_Free(copy);
        int status = 0;
        if (result != NULL && h->enabled)
            status = hook_done(h, block_ids_row(log, args[0], list, EV_FREE, 0));
        Py_DECREF(list);
        return result == NULL ? NULL : hook_return(result, status);
    }
    case HK_TOUCH: {
        result = PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
        PyObject *blocks = hook_arg(h, 0, args, nargs, kwnames);
        if (result == NULL || blocks == NULL || !h->enabled)
            return result;
        return hook_return(result, hook_done(h, block_ids_row(log, args[0], blocks, EV_TOUCH, 0)));
    }
    case HK_CACHE: {
        result = PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
        if (result == NULL || !h->enabled)
            return result;
        PyObject *given[5]; /* request, blocks, num_cached_blocks, num_full_blocks, kv_cache_group_id */
        for (int i = 0; i < 5; i++) {
            if ((given[i] = hook_arg(h, i, args, nargs, kwnames)) == NULL) {
                PyErr_Format(PyExc_TypeError, "cache_full_blocks called without %U", h->names[i]);
                return hook_return(result, hook_fault(h));
            }
        }
        /* Only calls that cache blocks make a row (num_full_blocks > num_cached_blocks). */
        int more = PyObject_RichCompareBool(given[3], given[2], Py_GT);
        if (more < 0)
            return hook_return(result, hook_fault(h));
        if (!more)
            return result;
        return hook_return(result, hook_done(h, BlockLog_cache(log, given, 5)));
    }
    }
    return PyObject_Vectorcall(h->orig, args, nargsf, kwnames);
}

/* BlockHook(kind, orig, log, positions, names, on_full, on_error, before=None) */
static PyObject *BlockHook_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"kind", "orig", "log", "positions", "names", "on_full", "on_error", "before", NULL};
    const char *kind;
    PyObject *orig, *log, *positions, *names, *on_full, *on_error, *before = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO!O!O!OO|O", kwlist, &kind, &orig, &BlockLogType, &log,
                                     &PyTuple_Type, &positions, &PyTuple_Type, &names, &on_full, &on_error,
                                     &before))
        return NULL;
    int k = 0;
    while (HOOK_KINDS[k] != NULL && strcmp(HOOK_KINDS[k], kind) != 0)
        k++;
    if (HOOK_KINDS[k] == NULL) {
        PyErr_Format(PyExc_ValueError, "unknown hook kind %s", kind);
        return NULL;
    }
    Py_ssize_t n = HOOK_NPARAMS[k];
    if (PyTuple_GET_SIZE(positions) != n || PyTuple_GET_SIZE(names) != n) {
        PyErr_Format(PyExc_ValueError, "a %s hook reads %zd parameters", kind, n);
        return NULL;
    }
    BlockHook *h = (BlockHook *)type->tp_alloc(type, 0);
    if (h == NULL)
        return NULL;
    h->vectorcall = (vectorcallfunc)hook_vectorcall;
    h->kind = k;
    h->enabled = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        h->pos[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(positions, i));
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if ((h->pos[i] < 1 && PyErr_Occurred()) || !PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_ValueError, "positions are ints >= 1, names are str");
            Py_DECREF(h);
            return NULL;
        }
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name);
        h->names[i] = name;
    }
    h->orig = Py_NewRef(orig);
    h->log = Py_NewRef(log);
    h->on_full = Py_NewRef(on_full);
    h->on_error = Py_NewRef(on_error);
    h->before = before == Py_None ? NULL : Py_NewRef(before);
    return (PyObject *)h;
}

static int BlockHook_traverse(BlockHook *h, visitproc visit, void *arg) {
    Py_VISIT(h->orig);
    Py_VISIT(h->log);
    Py_VISIT(h->on_full);
    Py_VISIT(h->on_error);
    Py_VISIT(h->before);
    Py_VISIT(h->dict);
    return 0;
}

static int BlockHook_clear(BlockHook *h) {
    h->enabled = 0;
    Py_CLEAR(h->orig);
    Py_CLEAR(h->log);
    Py_CLEAR(h->on_full);
    Py_CLEAR(h->on_error);
    Py_CLEAR(h->before);
    Py_CLEAR(h->dict);
    for (int i = 0; i < HOOK_MAX_PARAMS; i++)
        Py_CLEAR(h->names[i]);
    return 0;
}

static PyObject *BlockHook_call(BlockHook *h, PyObject *args, PyObject *kw) {
    if (h->orig == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "BlockHook cleared");
        return NULL;
    }
    return PyVectorcall_Call((PyObject *)h, args, kw);
}

static void BlockHook_dealloc(BlockHook *h) {
    PyObject_GC_UnTrack(h);
    BlockHook_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

/* Read from a class (BlockPool.touch): the hook itself; from an instance: a bound method. */
static PyObject *BlockHook_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *BlockHook_repr(BlockHook *h) {
    return PyUnicode_FromFormat("<kvtrace BlockHook %s of %R>", HOOK_KINDS[h->kind], h->orig);
}

static PyMemberDef BlockHook_members[] = {
    {"enabled", KVT_T_BOOL, offsetof(BlockHook, enabled), 0, "rows are made (False: calls go straight to vLLM's)"},
    {NULL}};

static PyTypeObject BlockHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtrace.probes._columns.BlockHook",
    .tp_basicsize = sizeof(BlockHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "a BlockPool method that records block_events rows in C (see buffers.block_hook)",
    .tp_new = BlockHook_new,
    .tp_dealloc = (destructor)BlockHook_dealloc,
    .tp_traverse = (traverseproc)BlockHook_traverse,
    .tp_clear = (inquiry)BlockHook_clear,
    .tp_call = (ternaryfunc)BlockHook_call,
    .tp_descr_get = BlockHook_get,
    .tp_repr = (reprfunc)BlockHook_repr,
    .tp_members = BlockHook_members,
    .tp_dictoffset = offsetof(BlockHook, dict),
    .tp_vectorcall_offset = offsetof(BlockHook, vectorcall),
};

/* ---- DecodeLog: step_requests rows of decoding requests, kept as runs ----------------------------

   Most step_requests rows are decodes, and a decoding request's rows follow each other: step s+1,
   the same tokens (1, or the speculative count), computed_before grown by those tokens, no new block.
   The log keeps them as runs (a `decode_runs` row each: first step, steps, request, tokens, computed
   before the first step, new blocks in the first step), which ingest expands back into their rows
   (kvtrace.ingest.shards.expand_decode_runs). A request decodes ~30 steps per block it fills, so the
   log hands over ~20x fewer rows than one per (step, request), and copies each request id once per
   run instead of every step.

   Finding a request's run must not cost a cache miss per row: vLLM lists its running requests in the
   same order from one step to the next (finished ones leave, new ones join at the end), so the log
   keeps the last call's rows in that order (`prev`: the request id object, its run, computed count,
   tokens) and walks them beside the new call's ids, both sequentially: a request is looked for from
   the walk's cursor on (it is nearly always there, or a place or two on where requests left), then
   from the start (a request vLLM moved). Found, its row goes on with its run if it continues it; any
   other row opens a run. A previous row that no row of this call took ends its run. Runs are exact
   however they are cut; they and their rows reach the columns only at take(). The usual step of a busy
   engine (the same requests in the same order, a token each) is applied to `prev` in place
   (`decode_steady`): under an engine the log's state is cold at each call, and that step then touches
   one array of it instead of two (bench/bench_decode_rows.py). */

typedef struct {
    PyObject *rid; /* the request id (own reference: its address cannot be reused meanwhile) */
    int64_t first_step;
    int32_t steps; /* 0 while the run is open (in `prev`) */
    int32_t first_computed, tokens, first_blocks;
} DecodeRun;

typedef struct {
    PyObject *rid; /* borrowed from its run (while add() reads a call's rows: from the call's list) */
    int32_t run;   /* index in `runs` (while add() reads a call's rows: the row's new blocks) */
    int32_t computed, tokens;
} DecodeLast;

typedef struct {
    PyObject_HEAD
    Py_ssize_t rows;                /* decode rows added since the last take (what the runs stand for) */
    DecodeRun *runs;                /* every run since the last take, in the order they opened */
    Py_ssize_t nruns, runs_cap;
    DecodeLast *prev, *cur;         /* the last call's decode rows in its order, and the call's own */
    Py_ssize_t nprev, last_cap;
    int64_t prev_step;
    int64_t since_ns, flush_ns;
    Py_ssize_t flush_rows;          /* runs held before add() asks for a take */
} DecodeLog;

static int DecodeLog_init(DecodeLog *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"flush_rows", "flush_ns", NULL};
    Py_ssize_t flush_rows = 16384;
    long long flush_ns = 250000000LL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|nL", names, &flush_rows, &flush_ns))
        return -1;
    self->flush_rows = flush_rows;
    self->flush_ns = flush_ns;
    self->since_ns = now_ns();
    return 0;
}

/* Room for `n` rows of one call, and as many new runs. */
static int decode_reserve(DecodeLog *self, Py_ssize_t n) {
    if (n > self->last_cap) {
        DecodeLast *p = PyMem_Realloc(self->prev, (size_t)n * sizeof(DecodeLast));
        if (p == NULL)
            goto nomem;
        self->prev = p;
        DecodeLast *c = PyMem_Realloc(self->cur, (size_t)n * sizeof(DecodeLast));
        if (c == NULL)
            goto nomem; /* prev is larger than needed: harmless */
        self->cur = c;
        self->last_cap = n;
    }
    if (self->nruns + n > self->runs_cap) {
        Py_ssize_t cap = self->runs_cap ? self->runs_cap : 1024;
        while (cap < self->nruns + n)
            cap *= 2;
        DecodeRun *r = PyMem_Realloc(self->runs, (size_t)cap * sizeof(DecodeRun));
        if (r == NULL)
            goto nomem;
        self->runs = r;
        self->runs_cap = cap;
    }
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* Where request `rid` is among the previous rows not taken yet: from `p` on (usually `p` itself: the
   same order as the last call), then from the start; -1 if not there (a new run). */
static inline Py_ssize_t find_last(DecodeLog *self, PyObject *rid, Py_ssize_t p) {
    for (Py_ssize_t k = p; k < self->nprev; k++)
        if (self->prev[k].rid == rid)
            return k;
    for (Py_ssize_t k = 0; k < p && k < self->nprev; k++)
        if (self->prev[k].rid == rid)
            return k;
    return -1;
}

/* The run of previous row `p` ends with the last call's step. */
static inline void end_run(DecodeLog *self, DecodeLast *p) {
    DecodeRun *r = &self->runs[p->run];
    r->steps = (int32_t)(self->prev_step - r->first_step + 1);
}

/* Whether a row of the step after `last`'s goes on with its run: the same tokens, computed grown by
   them, no new block. */
static inline int run_goes_on(const DecodeLast *last, int32_t computed, int32_t tokens, int32_t blocks) {
    return blocks == 0 && tokens == last->tokens && (int64_t)computed == (int64_t)last->computed + last->tokens;
}

/* A new run of request `rid` from `step` (room reserved by decode_reserve); its index. */
static inline int32_t open_run(DecodeLog *self, PyObject *rid, int64_t step, int32_t computed, int32_t tokens,
                               int32_t blocks) {
    DecodeRun *r = &self->runs[self->nruns];
    r->rid = Py_NewRef(rid);
    r->first_step = step;
    r->steps = 0;
    r->first_computed = computed;
    r->tokens = tokens;
    r->first_blocks = blocks;
    return (int32_t)self->nruns++;
}

static void decode_clear(DecodeLog *self) {
    for (Py_ssize_t i = 0; i < self->nruns; i++)
        Py_CLEAR(self->runs[i].rid);
    self->nruns = self->nprev = 0;
    self->rows = 0;
}

static void DecodeLog_dealloc(DecodeLog *self) {
    decode_clear(self);
    PyMem_Free(self->runs);
    PyMem_Free(self->prev);
    PyMem_Free(self->cur);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The usual step of a busy engine: the same requests as the last call, in the same order, one token each.
   Its rows are applied to `prev` in place, without `cur`, so the step touches one array of the log's state
   instead of two (each a cold cache line a row under an engine). 1 when done; 0, having changed nothing,
   when a row is not that (another request at its place, a value the general path must look at): the
   general path then reads the call. Never fails. */
static int decode_steady(DecodeLog *self, PyObject *ids, PyObject *comps, PyObject *news, Py_ssize_t n) {
    PyObject **rid = PySequence_Fast_ITEMS(ids), **cv = PySequence_Fast_ITEMS(comps),
             **gv = PySequence_Fast_ITEMS(news);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* the same object as the last call's row: a str checked when its run opened (and held by it) */
        if (rid[i] != self->prev[i].rid || !PyLong_CheckExact(cv[i]))
            return 0;
        PyObject *g = gv[i];
        if (g != Py_None && !(PyTuple_CheckExact(g) && PyTuple_GET_SIZE(g) > 0
                              && PyList_CheckExact(PyTuple_GET_ITEM(g, 0))
                              && PyList_GET_SIZE(PyTuple_GET_ITEM(g, 0)) <= INT32_MAX))
            return 0;
        long long computed = as_int64(cv[i]);
        if (computed < 0 || computed > INT32_MAX) {
            PyErr_Clear(); /* (an overflow's error, if any: the general path raises it) */
            return 0;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        DecodeLast *last = &self->prev[i];
        int32_t computed = (int32_t)as_int64(cv[i]);
        PyObject *g = gv[i];
        int32_t blocks = g == Py_None ? 0 : (int32_t)PyList_GET_SIZE(PyTuple_GET_ITEM(g, 0));
        if (!run_goes_on(last, computed, 1, blocks)) {
            end_run(self, last);
            last->run = open_run(self, last->rid, self->prev_step + 1, computed, 1, blocks);
            last->tokens = 1;
        }
        last->computed = computed;
    }
    return 1;
}

/* add(step, ids, computed, new_block_ids, skip, num_scheduled): a decode row for each position of the
   SchedulerOutput's cached requests (ids, num_computed_tokens, new_block_ids lists) that is not in
   `skip` (sorted positions of prefill rows, or None); tokens 1 each when `num_scheduled` is None,
   else num_scheduled[id]. Every row is read and checked first: a call that raises changes nothing.
   Returns True when it is time to take(). */
static PyObject *DecodeLog_add(DecodeLog *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "add(step, ids, computed, new_block_ids, skip, num_scheduled)");
        return NULL;
    }
    int64_t step = PyLong_AsLongLong(args[0]);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    PyObject *ids = PySequence_Fast(args[1], "ids"), *comps = NULL, *news = NULL, *skip = NULL;
    PyObject *num_sched = args[5] == Py_None ? NULL : args[5];
    Py_ssize_t j = 0, nskip = 0;
    if (ids == NULL || (comps = PySequence_Fast(args[2], "computed")) == NULL
        || (news = PySequence_Fast(args[3], "new_block_ids")) == NULL)
        goto error;
    if (args[4] != Py_None) {
        if ((skip = PySequence_Fast(args[4], "skip")) == NULL)
            goto error;
        nskip = PySequence_Fast_GET_SIZE(skip);
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    if (PySequence_Fast_GET_SIZE(comps) != n || PySequence_Fast_GET_SIZE(news) != n) {
        PyErr_SetString(PyExc_ValueError, "ids, computed and new_block_ids differ in length");
        goto error;
    }
    if (decode_reserve(self, n) < 0)
        goto error;
    if (skip == NULL && num_sched == NULL && n > 0 && n == self->nprev && self->prev_step == step - 1
        && decode_steady(self, ids, comps, news, n)) {
        self->rows += n;
        self->prev_step = step;
        goto added;
    }
    /* Read and check every decode row into `cur` (nothing else changes until all are read). */
    Py_ssize_t ncur = 0;
    Py_ssize_t next_skip = nskip ? PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(skip, 0)) : -1;
    if (next_skip == -1 && PyErr_Occurred())
        goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == next_skip) { /* a prefill row */
            j++;
            next_skip = j < nskip ? PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(skip, j)) : -1;
            if (next_skip == -1 && PyErr_Occurred())
                goto error;
            continue;
        }
        PyObject *rid = PySequence_Fast_GET_ITEM(ids, i);
        if (!PyUnicode_Check(rid)) {
            PyErr_Format(PyExc_TypeError, "request id %R is not a str", rid);
            goto error;
        }
        if (!PyUnicode_IS_COMPACT_ASCII(rid)) { /* its UTF-8, made now (and kept by the str): a text take()
                                                   cannot write, refused here, never poisons a take */
            const char *u;
            Py_ssize_t k;
            if (str_text(rid, &u, &k) < 0)
                goto error;
        }
        long long computed = as_int64(PySequence_Fast_GET_ITEM(comps, i));
        if (computed == -1 && PyErr_Occurred())
            goto error;
        long long tokens = 1;
        if (num_sched != NULL) {
            PyObject *v = PyDict_GetItemWithError(num_sched, rid);
            if (v == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, rid);
                goto error;
            }
            tokens = as_int64(v);
            if (tokens == -1 && PyErr_Occurred())
                goto error;
        }
        long nb = 0; /* None (no new blocks) or a tuple of per-group lists: count group 0's */
        PyObject *groups = PySequence_Fast_GET_ITEM(news, i);
        if (groups == Py_None) {
            /* the usual decode step: no new block */
        } else if (PyTuple_CheckExact(groups) && PyTuple_GET_SIZE(groups) > 0
                   && PyList_CheckExact(PyTuple_GET_ITEM(groups, 0))) { /* what vLLM passes */
            nb = (long)PyList_GET_SIZE(PyTuple_GET_ITEM(groups, 0));
        } else {
            int truth = PyObject_IsTrue(groups);
            if (truth < 0)
                goto error;
            if (truth) {
                PyObject *first = PySequence_GetItem(groups, 0);
                if (first == NULL)
                    goto error;
                nb = (long)PyObject_Length(first);
                Py_DECREF(first);
                if (nb < 0)
                    goto error;
            }
        }
        if (computed < 0 || computed > INT32_MAX || tokens < 0 || tokens > INT32_MAX || nb > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "decode row of %R out of int32 range", rid);
            goto error;
        }
        DecodeLast *c = &self->cur[ncur++];
        c->rid = rid;
        c->run = (int32_t)nb;
        c->computed = (int32_t)computed;
        c->tokens = (int32_t)tokens;
    }
    /* Nothing below fails: walk the previous rows beside this call's. */
    Py_ssize_t p = 0;
    int consecutive = self->prev_step == step - 1;
    for (Py_ssize_t i = 0; i < ncur; i++) {
        DecodeLast *c = &self->cur[i];
        int32_t blocks = c->run;
        Py_ssize_t k = find_last(self, c->rid, p);
        DecodeLast *last = k < 0 ? NULL : &self->prev[k];
        if (last != NULL) {
            last->rid = NULL; /* taken: not found again, and its run does not end below */
            p = k + 1;
        }
        if (last != NULL && consecutive && run_goes_on(last, c->computed, c->tokens, blocks)) {
            c->run = last->run; /* the run goes on */
        } else {
            if (last != NULL)
                end_run(self, last);
            c->run = open_run(self, c->rid, step, c->computed, c->tokens, blocks);
        }
    }
    self->rows += ncur;
    for (Py_ssize_t k = 0; k < self->nprev; k++) /* not in this call: their runs end */
        if (self->prev[k].rid != NULL)
            end_run(self, &self->prev[k]);
    DecodeLast *swap = self->prev;
    self->prev = self->cur;
    self->cur = swap;
    self->nprev = ncur;
    self->prev_step = step;
added:
    Py_DECREF(ids);
    Py_DECREF(comps);
    Py_DECREF(news);
    Py_XDECREF(skip);
    int64_t t = now_ns();
    return PyBool_FromLong(self->nruns >= self->flush_rows || t - self->since_ns >= self->flush_ns);
error:
    Py_XDECREF(ids);
    Py_XDECREF(comps);
    Py_XDECREF(news);
    Py_XDECREF(skip);
    return NULL;
}

/* Every run so far as decode_runs column buffers (a dict; the open ones end here), and an empty log;
   None when there are none. */
static PyObject *DecodeLog_take_raw(DecodeLog *self, PyObject *unused) {
    self->since_ns = now_ns();
    if (self->nruns == 0) {
        decode_clear(self);
        Py_RETURN_NONE;
    }
    Buf step = {0}, steps = {0}, tokens = {0}, computed = {0}, blocks = {0};
    StrCol rid = {{0}};
    Py_ssize_t n = self->nruns, text = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *u;
        Py_ssize_t k;
        str_text(self->runs[i].rid, &u, &k); /* cannot fail: add() made each id's UTF-8 */
        text += k;
    }
    if (buf_reserve(&step, n * 8) < 0 || buf_reserve(&steps, n * 4) < 0 || buf_reserve(&tokens, n * 4) < 0
        || buf_reserve(&computed, n * 4) < 0 || buf_reserve(&blocks, n * 4) < 0
        || buf_reserve(&rid.ends, 4 + n * 4) < 0 || buf_reserve(&rid.data, text) < 0
        || buf_reserve(&rid.valid, n / 8 + 1) < 0) {
        buf_free(&step), buf_free(&steps), buf_free(&tokens), buf_free(&computed), buf_free(&blocks);
        str_free(&rid);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->nprev; i++) /* the open runs end with the last call's step */
        end_run(self, &self->prev[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        DecodeRun *r = &self->runs[i];
        const char *u;
        Py_ssize_t k;
        str_text(r->rid, &u, &k); /* cannot fail: add() made each id's UTF-8 */
        STORE(&step, int64_t, r->first_step);
        STORE(&steps, int32_t, r->steps);
        str_write(&rid, i, u, k);
        STORE(&tokens, int32_t, r->tokens);
        STORE(&computed, int32_t, r->first_computed);
        STORE(&blocks, int32_t, r->first_blocks);
    }
    decode_clear(self);
    return Py_BuildValue("{s:n,s:N,s:N,s:N,s:N,s:N,s:N}", "runs", n, "step", buf_take(&step),
                         "steps", buf_take(&steps), "request_id", str_take(&rid), "tokens", buf_take(&tokens),
                         "computed_before", buf_take(&computed), "new_blocks", buf_take(&blocks));
}

static PyObject *DecodeLog_get_rows(DecodeLog *self, void *closure) { return PyLong_FromSsize_t(self->rows); }

static PyMethodDef DecodeLog_methods[] = {
    {"add", (PyCFunction)(void (*)(void))DecodeLog_add, METH_FASTCALL,
     "add(step, ids, computed, new_block_ids, skip, num_scheduled) -> bool: time to take()"},
    {"take_raw", (PyCFunction)DecodeLog_take_raw, METH_NOARGS, "the runs as column buffers, or None"},
    {NULL}};

static PyGetSetDef DecodeLog_getset[] = {
    {"rows", (getter)DecodeLog_get_rows, NULL, "decode rows added since the last take", NULL}, {NULL}};

static PyTypeObject DecodeLogType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtrace.probes._columns.DecodeLog",
    .tp_basicsize = sizeof(DecodeLog),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "decode step_requests rows kept as decode_runs (see columns.DecodeLog)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)DecodeLog_init,
    .tp_dealloc = (destructor)DecodeLog_dealloc,
    .tp_methods = DecodeLog_methods,
    .tp_getset = DecodeLog_getset,
};

/* ---- RowLog: any table's rows, appended as tuples ------------------------------------------- */

/* One column of a RowLog: kinds 'b' 'h' 'i' 'q' (int8/16/32/64), 's' (string), 'I' 'Q' (lists of
   int32/int64). `values` holds fixed-size values or list items, `offsets` the strings' and lists' int32
   offsets (a leading 0), `data` the strings' bytes, `valid` the validity bitmap. */
typedef struct {
    char kind;
    Buf values, offsets, data, valid;
} Column;

typedef struct {
    PyObject_HEAD
    Py_ssize_t ncols, rows, max_rows;
    Column *cols;  /* filled from `stage` at take_raw */
    Buf stage;     /* the rows appended since the last take_raw, one record each (see stage_value) */
    Py_ssize_t bad_rows;  /* rows that did not fit the schema: counted, never stored */
    Py_ssize_t over_rows; /* rows past max_rows (a writer far behind): counted, never stored */
} RowLog;

static int item_size(char kind) {
    switch (kind) {
    case 'b': return 1;
    case 'h': return 2;
    case 'i': case 'I': return 4;
    default: return 8;
    }
}

/* A Python int as `kind`'s width; -1 with an error when it does not fit (as Arrow refuses it). A list
   item of an int64 list may be bytes: a vLLM block hash, stored as its first 8 bytes (hash64). */
static int int_of(PyObject *v, char kind, int64_t *out) {
    if ((kind == 'Q') && (PyBytes_Check(v) || PyByteArray_Check(v)))
        return hash64(v, out);
    if (!PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "not an int");
        return -1;
    }
    long long x = as_int64(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    int64_t lo = kind == 'b' ? INT8_MIN : kind == 'h' ? INT16_MIN : (kind == 'i' || kind == 'I') ? INT32_MIN : INT64_MIN;
    int64_t hi = kind == 'b' ? INT8_MAX : kind == 'h' ? INT16_MAX : (kind == 'i' || kind == 'I') ? INT32_MAX : INT64_MAX;
    if (x < lo || x > hi) {
        PyErr_SetString(PyExc_OverflowError, "int out of the column's range");
        return -1;
    }
    *out = x;
    return 0;
}

static inline void store_int(Buf *b, char kind, int64_t x) {
    switch (item_size(kind)) {
    case 1: STORE(b, int8_t, x); break;
    case 2: STORE(b, int16_t, x); break;
    case 4: STORE(b, int32_t, x); break;
    default: STORE(b, int64_t, x);
    }
}

/* A RowLog keeps each appended row as one record in `stage`, row-major, and makes the columns at
   take_raw. Writing the row's values into each column's buffers at append (as it first did) touched
   ~4 cache lines per column (the Column's bookkeeping, the value and validity tails): ~100 lines for
   a `steps` row, cold again by the next step. A staged row is one contiguous record (~3 lines for
   `steps`), and the columns are made in one sequential pass at take_raw, which the recorder calls
   from its writer thread, off the scheduler's.

   A record: a uint64 null mask (bit j: column j is None), then each non-null value in column order:
   an int64 for the integer kinds (range-checked at append), an int32 byte count and the UTF-8 bytes
   for 's', an int32 item count and the items at the list's width for 'I' / 'Q'. */
#define ROWLOG_MAX_COLUMNS 64

/* Stage value `v` of column kind `kind`; -1 (error set) when it does not fit the column. */
static int stage_value(Buf *s, char kind, PyObject *v) {
    switch (kind) {
    case 's': {
        const char *u = NULL;
        Py_ssize_t k = 0;
        if (!PyUnicode_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "not a str");
            return -1;
        }
        if (str_text(v, &u, &k) < 0)
            return -1;
        if (k > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "str too long");
            return -1;
        }
        if (buf_reserve(s, 4 + k) < 0)
            return -1;
        STORE(s, int32_t, k);
        memcpy(s->p + s->n, u, k);
        s->n += k;
        return 0;
    }
    case 'I': case 'Q': {
        PyObject *seq = PySequence_Fast(v, "not a sequence");
        if (seq == NULL)
            return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > INT32_MAX || buf_reserve(s, 4 + n * item_size(kind)) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_OverflowError, "list too long");
            Py_DECREF(seq);
            return -1;
        }
        STORE(s, int32_t, n);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t x;
            if (int_of(PySequence_Fast_GET_ITEM(seq, i), kind, &x) < 0) {
                Py_DECREF(seq);
                return -1;
            }
            store_int(s, kind, x);
        }
        Py_DECREF(seq);
        return 0;
    }
    default: {
        int64_t x;
        if (int_of(v, kind, &x) < 0 || buf_reserve(s, 8) < 0)
            return -1;
        STORE(s, int64_t, x);
        return 0;
    }
    }
}

/* Column `c`'s value of row `row` from the staged record at `*at` (moved past it); -1 when out of
   memory. Leaves partial bytes on error: the caller cuts every column back to the row's start. */
static int column_from_stage(Column *c, Py_ssize_t row, int valid, const char **at) {
    if (buf_reserve(&c->valid, 1) < 0)
        return -1;
    switch (c->kind) {
    case 's': case 'I': case 'Q': {
        Buf *items = c->kind == 's' ? &c->data : &c->values;
        Py_ssize_t size = c->kind == 's' ? 1 : item_size(c->kind);
        if (buf_reserve(&c->offsets, 8) < 0)
            return -1;
        if (c->offsets.n == 0)
            STORE(&c->offsets, int32_t, 0);
        if (valid) {
            int32_t k;
            memcpy(&k, *at, 4);
            if (buf_put(items, *at + 4, k * size) < 0)
                return -1;
            *at += 4 + k * size;
        }
        STORE(&c->offsets, int32_t, items->n / size);
        break;
    }
    default: {
        int64_t x = 0;
        if (buf_reserve(&c->values, 8) < 0)
            return -1;
        if (valid) {
            memcpy(&x, *at, 8);
            *at += 8;
        }
        store_int(&c->values, c->kind, x);
    }
    }
    bitmap_set(&c->valid, row, valid);
    return 0;
}

typedef struct {
    Py_ssize_t values, offsets, data, valid;
} ColumnMark;

static void column_truncate(Column *c, Py_ssize_t row, ColumnMark m) {
    c->values.n = m.values;
    c->offsets.n = m.offsets;
    c->data.n = m.data;
    c->valid.n = m.valid;
    if ((row & 7) && c->valid.n > (row >> 3))
        c->valid.p[row >> 3] &= (char)((1 << (row & 7)) - 1);
}

static void rowlog_free_columns(RowLog *self) {
    for (Py_ssize_t j = 0; j < self->ncols; j++) {
        buf_free(&self->cols[j].values);
        buf_free(&self->cols[j].offsets);
        buf_free(&self->cols[j].data);
        buf_free(&self->cols[j].valid);
    }
    buf_free(&self->stage);
    self->rows = 0;
}

static int RowLog_init(RowLog *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"kinds", "max_rows", NULL};
    const char *kinds;
    Py_ssize_t max_rows = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|n", names, &kinds, &max_rows))
        return -1;
    if (self->cols != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RowLog initialised twice");
        return -1;
    }
    Py_ssize_t n = (Py_ssize_t)strlen(kinds);
    if (n > ROWLOG_MAX_COLUMNS) { /* a record's null mask is one uint64 */
        PyErr_Format(PyExc_ValueError, "a RowLog keeps at most %d columns, not %zd", ROWLOG_MAX_COLUMNS, n);
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++)
        if (!strchr("bhiqsIQ", kinds[j])) {
            PyErr_Format(PyExc_ValueError, "unknown column kind %c", kinds[j]);
            return -1;
        }
    self->cols = PyMem_Calloc(n ? n : 1, sizeof(Column));
    if (self->cols == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++)
        self->cols[j].kind = kinds[j];
    self->ncols = n;
    self->max_rows = max_rows;
    return 0;
}

static void RowLog_dealloc(RowLog *self) {
    if (self->cols != NULL) {
        rowlog_free_columns(self);
        PyMem_Free(self->cols);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* append(row): a tuple with a value per column (None: null). A row that does not fit (wrong length,
   type or range) is counted in bad_rows and not stored; append itself never raises for it, so a
   probe's bad row is the recorder's to report, as with rows kept as tuples. */
static PyObject *RowLog_append(RowLog *self, PyObject *row) {
    if (self->cols == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RowLog not initialised");
        return NULL;
    }
    if (self->rows >= self->max_rows) {
        self->over_rows++;
        Py_RETURN_NONE;
    }
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != self->ncols) {
        self->bad_rows++;
        Py_RETURN_NONE;
    }
    Buf *s = &self->stage;
    Py_ssize_t start = s->n, j;
    uint64_t nulls = 0;
    if (buf_reserve(s, 8) < 0) {
        PyErr_Clear();
        self->over_rows++;
        Py_RETURN_NONE;
    }
    s->n += 8; /* the null mask, written once the row is whole */
    for (j = 0; j < self->ncols; j++) {
        PyObject *v = PyTuple_GET_ITEM(row, j);
        if (v == Py_None)
            nulls |= (uint64_t)1 << j;
        else if (stage_value(s, self->cols[j].kind, v) < 0)
            break;
    }
    if (j < self->ncols) { /* the row does not fit: nothing of it stays */
        int oom = PyErr_ExceptionMatches(PyExc_MemoryError);
        PyErr_Clear();
        s->n = start;
        self->bad_rows += !oom;
        self->over_rows += oom;
    } else {
        memcpy(s->p + start, &nulls, 8);
        self->rows++;
    }
    Py_RETURN_NONE;
}

/* extend(rows): append each row of an iterable. */
static PyObject *RowLog_extend(RowLog *self, PyObject *rows) {
    PyObject *it = PyObject_GetIter(rows);
    if (it == NULL)
        return NULL;
    PyObject *row;
    while ((row = PyIter_Next(it)) != NULL) {
        PyObject *r = RowLog_append(self, row);
        Py_DECREF(row);
        if (r == NULL) {
            Py_DECREF(it);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* Make the columns of the staged rows: one sequential pass over the records. Out of memory at a row,
   the rows from there on are counted in over_rows, and the rows before it are kept whole. */
static void rowlog_columns_from_stage(RowLog *self) {
    const char *at = self->stage.p;
    ColumnMark marks[ROWLOG_MAX_COLUMNS];
    for (Py_ssize_t r = 0; r < self->rows; r++) {
        uint64_t nulls;
        memcpy(&nulls, at, 8);
        at += 8;
        Py_ssize_t j;
        for (j = 0; j < self->ncols; j++) {
            Column *c = &self->cols[j];
            marks[j] = (ColumnMark){c->values.n, c->offsets.n, c->data.n, c->valid.n};
        }
        for (j = 0; j < self->ncols; j++)
            if (column_from_stage(&self->cols[j], r, !((nulls >> j) & 1), &at) < 0)
                break;
        if (j < self->ncols) {
            PyErr_Clear();
            for (Py_ssize_t i = 0; i < self->ncols; i++)
                column_truncate(&self->cols[i], r, marks[i]);
            self->over_rows += self->rows - r;
            self->rows = r;
            break;
        }
    }
    self->stage.n = 0; /* the stage's memory is kept for the next rows */
}

/* (rows, [per column: (validity, values, offsets, data)], bad_rows, over_rows), and an empty log.
   The counts are reset before any Python object is made: making one may run the garbage collector,
   and a finalizer may let the scheduler's thread append meanwhile. Such a row goes to the stage, which
   the columns no longer read, and stays for the next take. */
static PyObject *RowLog_take_raw(RowLog *self, PyObject *unused) {
    if (self->cols == NULL)
        Py_RETURN_NONE;
    rowlog_columns_from_stage(self);
    Py_ssize_t rows = self->rows, bad = self->bad_rows, over = self->over_rows;
    self->rows = self->bad_rows = self->over_rows = 0;
    PyObject *cols = PyList_New(self->ncols);
    if (cols == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < self->ncols; j++) {
        Column *c = &self->cols[j];
        PyObject *t = Py_BuildValue("(NNNN)", buf_take(&c->valid), buf_take(&c->values), buf_take(&c->offsets),
                                    buf_take(&c->data));
        if (t == NULL) {
            Py_DECREF(cols);
            return NULL;
        }
        PyList_SET_ITEM(cols, j, t);
    }
    return Py_BuildValue("(nNnn)", rows, cols, bad, over);
}

static PyObject *RowLog_clear(RowLog *self, PyObject *unused) {
    if (self->cols != NULL)
        rowlog_free_columns(self);
    self->bad_rows = self->over_rows = 0;
    Py_RETURN_NONE;
}

static Py_ssize_t RowLog_len(RowLog *self) { return self->rows; }

static PyMethodDef RowLog_methods[] = {
    {"append", (PyCFunction)RowLog_append, METH_O, "append(row): a tuple of the table's columns"},
    {"extend", (PyCFunction)RowLog_extend, METH_O, "extend(rows): append each row"},
    {"take_raw", (PyCFunction)RowLog_take_raw, METH_NOARGS, "the rows as column buffers, and an empty log"},
    {"clear", (PyCFunction)RowLog_clear, METH_NOARGS, "forget every row (a forked child)"},
    {NULL}};

static PySequenceMethods RowLog_as_sequence = {.sq_length = (lenfunc)RowLog_len};

static PyTypeObject RowLogType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtrace.probes._columns.RowLog",
    .tp_basicsize = sizeof(RowLog),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "a table's rows as columns, appended as tuples (see columns.RowLog)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RowLog_init,
    .tp_dealloc = (destructor)RowLog_dealloc,
    .tp_methods = RowLog_methods,
    .tp_as_sequence = &RowLog_as_sequence,
};

/* ---- positions ------------------------------------------------------------------------------ */

/* positions(seq, members): the indices of `seq`'s items that are in `members` (a set), in order. The
   scheduler probe's prefill rows among a step's cached requests: one pass with hashed lookups, where
   list.index per wanted item compares strings along the list (~200 comparisons each). */
static PyObject *py_positions(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "positions(seq, members)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "seq must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t n = out ? PySequence_Fast_GET_SIZE(seq) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int has = PySequence_Contains(args[1], PySequence_Fast_GET_ITEM(seq, i));
        PyObject *index = has == 1 ? PyLong_FromSsize_t(i) : NULL;
        if (has < 0 || (has == 1 && (index == NULL || PyList_Append(out, index) < 0))) {
            Py_XDECREF(index);
            Py_CLEAR(out);
            break;
        }
        Py_XDECREF(index);
    }
    Py_DECREF(seq);
    return out;
}

/* ---- StepRows: the scheduler probe's per-step work, for a step that only decodes ---------------------

   SchedulerProbe.on_schedule and after_update (probes/vllm/scheduler.py, the reference) in C for the
   usual step of a busy engine: every scheduled request decodes (none new, resumed or in a chunked
   prefill). Under an engine, vLLM's own work between two steps evicts the probe's bytecode and data from
   the core's caches, and the Python methods (~300 bytecodes a decode step) then cost several times what
   they do warm. `decode(sched, out, t0, ...)` makes such a step's decode rows and its pending step row;
   `end(sched, step, ...)` completes the row and hands it over when the step ends. The attributes both
   need are read by the probe's wrapper, in Python, and passed in (see decode). Each returns False, having
   changed nothing, for a step it does not handle, and the probe's Python method runs instead: a step
   with a prefill, prefills still chunked, first tokens due, or before the probe has recorded the engine's
   configuration (its first step: then `ready`). Why admission stopped comes from the probe's
   `_admission_stop`, unless nothing waits, nothing was preempted and admission saw nothing: "none". */

static PyObject *s_kv_holding_waiting, *s_skipped_waiting, *s_kvtrace_step, *s_admission_stop, *s_take,
    *s_has_requests, *s_went_idle, *s_append, *s_none, *s_config_recorded, *s_inject;

#define STEP_ROW_LEN 22 /* kvtrace.format.schema's `steps` columns */

typedef struct {
    PyObject_HEAD
    PyObject *probe, *decode_log, *pending, *chunks, *first_due, *steps, *ctx, *queue_lengths;
    char ready;
} StepRows;

static int optional_attr(PyObject *obj, PyObject *name, PyObject **out) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, out);
#else
    return _PyObject_LookupAttr(obj, name, out);
#endif
}

/* len(queue) as the probe reads it: queue_lengths[type(queue)](queue) where the type is there (a vLLM queue
   whose __len__ is deque's), else len(queue); -1 with an error set. */
static Py_ssize_t queue_len(StepRows *self, PyObject *queue) {
    PyObject *fn = PyDict_GetItemWithError(self->queue_lengths, (PyObject *)Py_TYPE(queue));
    if (fn == NULL)
        return PyErr_Occurred() ? -1 : PyObject_Length(queue);
    PyObject *n = PyObject_CallOneArg(fn, queue);
    if (n == NULL)
        return -1;
    Py_ssize_t v = PyLong_AsSsize_t(n);
    Py_DECREF(n);
    return v;
}

static int StepRows_init(StepRows *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"probe", "decode_log", "pending", "chunks", "first_due", "steps", "ctx",
                            "queue_lengths", NULL};
    PyObject *v[8];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOO", names, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                                     &v[6], &v[7]))
        return -1;
    if (!PyObject_TypeCheck(v[1], &DecodeLogType)) {
        PyErr_SetString(PyExc_TypeError, "StepRows: decode_log must be a native DecodeLog");
        return -1;
    }
    if (!PyDict_Check(v[2]) || !PyDict_Check(v[3]) || !PyDict_Check(v[4]) || !PyDict_Check(v[7])) {
        PyErr_SetString(PyExc_TypeError, "StepRows: pending, chunks, first_due and queue_lengths must be dicts");
        return -1;
    }
    PyObject **slots[8] = {&self->probe, &self->decode_log, &self->pending, &self->chunks, &self->first_due,
                           &self->steps, &self->ctx, &self->queue_lengths};
    for (int i = 0; i < 8; i++)
        Py_XSETREF(*slots[i], Py_NewRef(v[i]));
    self->ready = 0;
    return 0;
}

/* Ready once the probe has recorded the engine's configuration (its first step, in Python) and injects no
   fault (a test's: it must reach the Python methods): 1, else 0; -1 with an error set. */
static int steps_ready(StepRows *self) {
    PyObject *recorded = PyObject_GetAttr(self->probe, s_config_recorded), *inject = NULL;
    int r = -1, a, b;
    if (recorded != NULL && (a = PyObject_IsTrue(recorded)) >= 0
        && (inject = PyObject_GetAttr(self->probe, s_inject)) != NULL && (b = PyObject_IsTrue(inject)) >= 0)
        r = self->ready = a && !b;
    Py_XDECREF(recorded);
    Py_XDECREF(inject);
    return r;
}

/* decode(sched, out, t0, news, ids, resumed, comps, new_ids, num_sched, total, step, free, gpu_blocks,
          waiting, holding, budget, running, max_running, preempted, seen): the values read by the scheduler
   probe's wrapper, in Python, where each is a specialised attribute read of an object vLLM has just used
   (~0.05 us with the caches cold), where PyObject_GetAttr from here looks the name up in the type's method
   cache and the instance's keys, lines vLLM's own code never touches (~0.4 us each cold; 18 reads measured
   9.5 against 3.3 us a step, the CPU machine): news = out.scheduled_new_reqs; ids, resumed, comps, new_ids =
   out.scheduled_cached_reqs' req_ids, resumed_req_ids (None where vLLM has none), num_computed_tokens,
   new_block_ids; num_sched, total = out.num_scheduled_tokens, out.total_num_scheduled_tokens; step =
   sched.current_step; free, gpu_blocks = the free blocks and num_gpu_blocks of the block pool
   (sched.kv_cache_manager.block_pool); waiting, holding = sched.waiting and its holding queue (kv_holding_waiting, or 0.26-0.27's
   skipped_waiting; None: looked up here); budget, running, max_running = sched.max_num_scheduled_tokens,
   .running, .max_num_running_reqs; preempted, seen = the probe's preempted_this_step and seen. */
#define DECODE_NARGS 20
static PyObject *StepRows_decode(StepRows *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != DECODE_NARGS) {
        PyErr_SetString(PyExc_TypeError, "decode(sched, out, t0, news, ids, resumed, comps, new_ids, num_sched, total, "
                                         "step, free, gpu_blocks, waiting, holding, budget, running, max_running, "
                                         "preempted, seen)");
        return NULL;
    }
    if (self->probe == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "StepRows cleared");
        return NULL;
    }
    PyObject *sched = args[0], *out = args[1], *t0 = args[2], *news = args[3], *ids = args[4], *resumed = args[5],
             *comps = args[6], *new_ids = args[7], *num_sched = args[8], *total = args[9], *step = args[10],
             *free = args[11], *gpu_blocks = args[12], *waiting = args[13], *budget = args[15],
             *running = args[16], *max_running = args[17], *preempted = args[18], *seen = args[19];
    if (!self->ready) {
        int r = steps_ready(self);
        if (r <= 0)
            return r < 0 ? NULL : Py_NewRef(Py_False);
    }
    if (PyDict_GET_SIZE(self->chunks) != 0)
        Py_RETURN_FALSE;
    int64_t t1 = now_ns();
    PyObject *result = NULL, *holding = NULL, *num_waiting = NULL, *admission = NULL, *row = NULL, *due = NULL;
    Py_ssize_t n;
    /* a step this handles: nothing new, nothing resumed (every cached request decodes) */
    if ((n = PyObject_Length(news)) < 0)
        return NULL;
    if (n != 0)
        Py_RETURN_FALSE;
    if (resumed != Py_None) {
        int r = PyObject_IsTrue(resumed);
        if (r != 0)
            return r < 0 ? NULL : Py_NewRef(Py_False);
    }
    Py_ssize_t decoding = PyObject_Length(ids), nsched;
    long long total_v;
    if (decoding < 0 || (nsched = PyObject_Length(num_sched)) < 0
        || ((total_v = PyLong_AsLongLong(total)) == -1 && PyErr_Occurred()))
        return NULL;
    /* the step id for the probes (ctx.step) and for the worker (travels with the output, pickled) */
    if (PyObject_SetAttr(self->ctx, s_step, step) < 0)
        return NULL;
    if (PyObject_SetAttr(out, s_kvtrace_step, step) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
    }
    if (decoding > 0) {
        /* every row 1 token (the usual case) when the rows' total says so */
        PyObject *add_args[6] = {step, ids, comps, new_ids, Py_None, total_v == decoding ? Py_None : num_sched};
        if ((due = DecodeLog_add((DecodeLog *)self->decode_log, add_args, 6)) == NULL)
            goto done;
        if (due == Py_True) {
            PyObject *r = PyObject_CallMethodNoArgs(self->probe, s_take);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
    }
    long long blocks_total, free_v;
    if (((blocks_total = PyLong_AsLongLong(gpu_blocks) - 1) == -2 && PyErr_Occurred())
        || ((free_v = PyLong_AsLongLong(free)) == -1 && PyErr_Occurred()))
        goto done;
    /* waiting: vLLM's queue, and those holding KV blocks (0.32+) or passed over (0.26-0.27's own queue) */
    holding = args[14] == Py_None ? NULL : Py_NewRef(args[14]);
    if (holding == NULL) {
        if (optional_attr(sched, s_kv_holding_waiting, &holding) < 0)
            goto done;
        if (holding == Py_None)
            Py_CLEAR(holding);
        if (holding == NULL && optional_attr(sched, s_skipped_waiting, &holding) < 0)
            goto done;
    }
    Py_ssize_t nw = queue_len(self, waiting), nh = holding == NULL ? 0 : queue_len(self, holding), nrunning;
    long long preempted_v;
    if (nw < 0 || nh < 0 || (num_waiting = PyLong_FromSsize_t(nw + nh)) == NULL
        || (nrunning = PyObject_Length(running)) < 0
        || ((preempted_v = PyLong_AsLongLong(preempted)) == -1 && PyErr_Occurred()))
        goto done;
    if (nw + nh == 0 && preempted_v == 0 && seen == Py_None)
        admission = Py_NewRef(s_none);
    else if ((admission = PyObject_CallMethodObjArgs(self->probe, s_admission_stop, sched, total, budget, num_waiting,
                                                     NULL)) == NULL)
        goto done;
    if ((row = PyList_New(STEP_ROW_LEN)) == NULL)
        goto done;
    PyObject *zero = PyLong_FromLong(0); /* a cached small int: never NULL */
    PyObject *values[STEP_ROW_LEN] = {
        Py_NewRef(step), Py_NewRef(t0), PyLong_FromLongLong(t1), Py_NewRef(Py_None), Py_NewRef(total),
        Py_NewRef(zero), Py_NewRef(total), Py_NewRef(zero), PyLong_FromSsize_t(nsched), PyLong_FromSsize_t(nrunning),
        Py_NewRef(num_waiting), PyLong_FromLongLong(blocks_total - free_v), PyLong_FromLongLong(blocks_total),
        Py_NewRef(budget), Py_NewRef(max_running), Py_NewRef(admission), Py_NewRef(preempted), Py_NewRef(zero),
        Py_NewRef(zero), Py_NewRef(zero), Py_NewRef(zero), zero};
    int failed = 0;
    for (int i = 0; i < STEP_ROW_LEN; i++) {
        failed |= values[i] == NULL;
        PyList_SET_ITEM(row, i, values[i]); /* a NULL item is fine in a list that is dropped at once */
    }
    if (failed || PyDict_SetItem(self->pending, step, row) < 0)
        goto done;
    result = Py_NewRef(Py_True);
done:
    Py_XDECREF(holding); Py_XDECREF(num_waiting); Py_XDECREF(admission); Py_XDECREF(row); Py_XDECREF(due);
    return result;
}

/* end(sched, step, finished, running): finished = the probe's finished_in_update, running = sched.running
   (read by the wrapper, as decode's values are). */
static PyObject *StepRows_end(StepRows *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "end(sched, step, finished, running)");
        return NULL;
    }
    if (self->probe == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "StepRows cleared");
        return NULL;
    }
    PyObject *sched = args[0], *step = args[1], *finished = args[2], *running = args[3];
    if (!self->ready || PyDict_GET_SIZE(self->first_due) != 0)
        Py_RETURN_FALSE; /* first tokens due: the Python method looks at those requests */
    int64_t t = now_ns();
    PyObject *row = PyDict_GetItemWithError(self->pending, step), *tuple = NULL, *r = NULL;
    if (row == NULL && PyErr_Occurred())
        return NULL;
    if (row != NULL) {
        Py_INCREF(row);
        if (PyDict_DelItem(self->pending, step) < 0)
            goto error;
        if (!PyList_CheckExact(row) || PyList_GET_SIZE(row) != STEP_ROW_LEN) {
            PyErr_SetString(PyExc_TypeError, "StepRows: a pending step row is not a list of the steps columns");
            goto error;
        }
        PyObject *t_end = PyLong_FromLongLong(t);
        if (t_end == NULL)
            goto error;
        PyList_SetItem(row, 3, t_end);
        PyList_SetItem(row, 19, Py_NewRef(finished));
        if ((tuple = PyList_AsTuple(row)) == NULL
            || (r = Py_IS_TYPE(self->steps, &RowLogType) ? RowLog_append((RowLog *)self->steps, tuple)
                                                         : PyObject_CallMethodOneArg(self->steps, s_append, tuple)) == NULL)
            goto error;
        Py_CLEAR(r);
    }
    /* the engine goes idle (it blocks on its input queue next): rows held as columns go to the recorder
       (`running` first: while requests run the engine is busy, and has_requests() is four of vLLM's calls) */
    int busy;
    if ((busy = PyObject_IsTrue(running)) < 0)
        goto error;
    if (!busy) {
        int has;
        if ((r = PyObject_CallMethodNoArgs(sched, s_has_requests)) == NULL || (has = PyObject_IsTrue(r)) < 0)
            goto error;
        Py_CLEAR(r);
        if (!has && (r = PyObject_CallMethodNoArgs(self->probe, s_went_idle)) == NULL)
            goto error;
    }
    Py_XDECREF(row); Py_XDECREF(tuple); Py_XDECREF(r);
    Py_RETURN_TRUE;
error:
    Py_XDECREF(row); Py_XDECREF(tuple); Py_XDECREF(r);
    return NULL;
}

static int StepRows_traverse(StepRows *self, visitproc visit, void *arg) {
    Py_VISIT(self->probe); Py_VISIT(self->decode_log); Py_VISIT(self->pending); Py_VISIT(self->chunks);
    Py_VISIT(self->first_due); Py_VISIT(self->steps); Py_VISIT(self->ctx);
    Py_VISIT(self->queue_lengths);
    return 0;
}

static int StepRows_clear(StepRows *self) {
    Py_CLEAR(self->probe); Py_CLEAR(self->decode_log); Py_CLEAR(self->pending); Py_CLEAR(self->chunks);
    Py_CLEAR(self->first_due); Py_CLEAR(self->steps); Py_CLEAR(self->ctx);
    Py_CLEAR(self->queue_lengths);
    return 0;
}

static void StepRows_dealloc(StepRows *self) {
    PyObject_GC_UnTrack(self);
    StepRows_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef StepRows_methods[] = {
    {"decode", (PyCFunction)(void (*)(void))StepRows_decode, METH_FASTCALL,
     "decode(sched, out, t0, news, ids, resumed, comps, new_ids, num_sched, total, step, free, gpu_blocks, waiting, "
     "holding, budget, running, max_running, preempted, seen) -> bool: a step that only decodes recorded (False: not "
     "such a step, nothing done)"},
    {"end", (PyCFunction)(void (*)(void))StepRows_end, METH_FASTCALL,
     "end(sched, step, finished, running) -> bool: the step's row handed over (False: first tokens due, nothing "
     "done)"},
    {NULL}};

static PyMemberDef StepRows_members[] = {
    {"ready", KVT_T_BOOL, offsetof(StepRows, ready), KVT_READONLY, "steps are handled (the engine's configuration is recorded)"},
    {NULL}};

static PyTypeObject StepRowsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtrace.probes._columns.StepRows",
    .tp_basicsize = sizeof(StepRows),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "the scheduler probe's per-step rows of a step that only decodes (see probes/vllm/scheduler.py)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)StepRows_init,
    .tp_dealloc = (destructor)StepRows_dealloc,
    .tp_traverse = (traverseproc)StepRows_traverse,
    .tp_clear = (inquiry)StepRows_clear,
    .tp_methods = StepRows_methods,
    .tp_members = StepRows_members,
};

static int intern_step_names(void) {
    struct {
        PyObject **at;
        const char *name;
    } names[] = {{&s_kv_holding_waiting, "kv_holding_waiting"}, {&s_skipped_waiting, "skipped_waiting"},
                 {&s_kvtrace_step, "_kvtrace_step"}, {&s_admission_stop, "_admission_stop"}, {&s_take, "take"},
                 {&s_has_requests, "has_requests"}, {&s_went_idle, "went_idle"}, {&s_append, "append"},
                 {&s_none, "none"},
                 {&s_config_recorded, "config_recorded"}, {&s_inject, "inject"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].at = PyUnicode_InternFromString(names[i].name)) == NULL)
            return -1;
    return 0;
}

/* ---- Arrow C data interface: a log's column buffers as one record batch ------------------------
   pa.Array.from_buffers per column (two or three pa.py_buffer each) and RecordBatch.from_arrays cost
   ~6 us a column in pyarrow's Python layer (~140 us for the 22 columns of `steps`, several times that
   cold, in place); importing one ArrowArray that points at the same bytes is one call (~20 us). The
   structs follow https://arrow.apache.org/docs/format/CDataInterface.html: a struct array (the batch)
   whose children are the columns; each list column has its item values as its own child. The buffers
   stay the bytearrays take_raw made (no copy); the batch holds them until Arrow releases it. */

struct ArrowArray {
    int64_t length, null_count, offset, n_buffers, n_children;
    const void **buffers;
    struct ArrowArray **children;
    struct ArrowArray *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};

/* Everything a batch's structs need, in one allocation owned by the root (children are released with
   it: Arrow's importer never releases a child on its own). */
typedef struct {
    PyObject *owned;                 /* the Python objects whose bytes the buffers point into */
    struct ArrowArray *cols, *items; /* per column: its array, and its list items' array */
    struct ArrowArray **col_ptrs, **item_ptrs;
    const void **bufs;               /* 3 per column + 2 per column for the items, + 1 for the root */
} ArrowBatch;

static void arrow_child_release(struct ArrowArray *a) { a->release = NULL; }

static void arrow_root_release(struct ArrowArray *a) {
    if (a->release == NULL)
        return;
    ArrowBatch *b = (ArrowBatch *)a->private_data;
    /* Arrow may drop the batch on a thread without the GIL; at exit, Python may be gone: leak then. */
#if PY_VERSION_HEX >= 0x030D0000
    int alive = Py_IsInitialized() && !Py_IsFinalizing();
#else
    int alive = Py_IsInitialized() && !_Py_IsFinalizing();
#endif
    if (alive) {
        PyGILState_STATE g = PyGILState_Ensure();
        Py_XDECREF(b->owned);
        PyGILState_Release(g);
    }
    PyMem_RawFree(b);
    a->release = NULL;
}

static void arrow_root_free(PyObject *capsule) { /* the capsule's root, imported (released=NULL) or not */
    struct ArrowArray *root = PyCapsule_GetPointer(capsule, "kvtrace.arrow_array");
    if (root == NULL)
        return;
    if (root->release != NULL) {
        ArrowBatch *b = (ArrowBatch *)root->private_data;
        Py_XDECREF(b->owned); /* with the GIL (a capsule destructor): no need to take it */
        b->owned = NULL;
        root->release(root);
    }
    PyMem_RawFree(root);
}

/* A bytearray's bytes, or NULL for None (no buffer: an absent validity bitmap); -1 for anything else. */
static int arrow_bytes(PyObject *o, const void **out, Py_ssize_t *len) {
    if (o == Py_None) {
        *out = NULL;
        *len = 0;
        return 0;
    }
    if (!PyByteArray_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "arrow_batch: a buffer is not a bytearray or None");
        return -1;
    }
    *len = PyByteArray_GET_SIZE(o);
    *out = *len ? (const void *)PyByteArray_AS_STRING(o) : NULL;
    return 0;
}

/* arrow_batch(rows, columns): (capsule, address) of an ArrowArray of `rows` rows to import with
   pa.RecordBatch._import_from_c(address, schema). `columns` is a sequence of one tuple per column:
   ("f", width, validity, values)                    fixed width (bytes per value)
   ("s", validity, offsets, data)                    utf8 string, int32 offsets
   ("l", validity, offsets, item_width, items)       list of fixed-width items, int32 offsets
   where each buffer is a bytearray, or None for an absent validity bitmap (no nulls). Each buffer's
   length is checked against `rows` here; the caller validates the batch it imports (Arrow's cheap
   validate). The capsule frees the structs once they are imported (or never were). */
static PyObject *py_arrow_batch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "arrow_batch(rows, columns)");
        return NULL;
    }
    Py_ssize_t rows = PyLong_AsSsize_t(args[0]);
    if (rows < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "arrow_batch: rows < 0");
        return NULL;
    }
    PyObject *cols = PySequence_Tuple(args[1]);
    if (cols == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(cols);
    size_t size = sizeof(ArrowBatch) + (size_t)n * (2 * sizeof(struct ArrowArray) + 2 * sizeof(void *))
                  + (size_t)(5 * n + 1) * sizeof(void *);
    ArrowBatch *b = PyMem_RawCalloc(1, size);
    struct ArrowArray *root = PyMem_RawCalloc(1, sizeof(struct ArrowArray));
    PyObject *capsule = NULL;
    if (b == NULL || root == NULL) {
        PyMem_RawFree(b);
        PyMem_RawFree(root);
        Py_DECREF(cols);
        return PyErr_NoMemory();
    }
    char *at = (char *)(b + 1);
    b->cols = (struct ArrowArray *)at, at += n * sizeof(struct ArrowArray);
    b->items = (struct ArrowArray *)at, at += n * sizeof(struct ArrowArray);
    b->col_ptrs = (struct ArrowArray **)at, at += n * sizeof(void *);
    b->item_ptrs = (struct ArrowArray **)at, at += n * sizeof(void *);
    b->bufs = (const void **)at;
    b->owned = cols; /* the tuples hold the bytearrays */
    root->length = rows;
    root->n_buffers = 1;
    root->buffers = b->bufs; /* bufs[0]: the struct's validity, none */
    root->n_children = n;
    root->children = b->col_ptrs;
    root->release = arrow_root_release;
    root->private_data = b;
    const void **next = b->bufs + 1;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *c = PyTuple_GET_ITEM(cols, j);
        struct ArrowArray *a = &b->cols[j];
        b->col_ptrs[j] = a;
        a->length = rows;
        a->null_count = -1; /* not counted: Arrow counts the bitmap when asked */
        a->release = arrow_child_release;
        a->buffers = next;
        const char *kind = NULL;
        if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) < 1 || !PyUnicode_Check(PyTuple_GET_ITEM(c, 0))
            || (kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(c, 0))) == NULL) {
            PyErr_Format(PyExc_TypeError, "arrow_batch: column %zd is not a (kind, ...) tuple", j);
            goto error;
        }
        Py_ssize_t len[3];
        if (kind[0] == 'f' && PyTuple_GET_SIZE(c) == 4) {
            Py_ssize_t width = PyLong_AsSsize_t(PyTuple_GET_ITEM(c, 1));
            if (width <= 0 || arrow_bytes(PyTuple_GET_ITEM(c, 2), &next[0], &len[0]) < 0
                || arrow_bytes(PyTuple_GET_ITEM(c, 3), &next[1], &len[1]) < 0)
                goto bad;
            if (len[1] < rows * width || (next[0] != NULL && len[0] < (rows + 7) / 8))
                goto short_;
            a->n_buffers = 2;
        } else if (kind[0] == 's' && PyTuple_GET_SIZE(c) == 4) {
            for (int k = 0; k < 3; k++)
                if (arrow_bytes(PyTuple_GET_ITEM(c, 1 + k), &next[k], &len[k]) < 0)
                    goto bad;
            if ((next[0] != NULL && len[0] < (rows + 7) / 8) || len[1] < (rows + 1) * 4
                || (rows && ((const int32_t *)next[1])[rows] > len[2]))
                goto short_;
            a->n_buffers = 3;
        } else if (kind[0] == 'l' && PyTuple_GET_SIZE(c) == 5) {
            Py_ssize_t width = PyLong_AsSsize_t(PyTuple_GET_ITEM(c, 3));
            const void **item_bufs = next + 2;
            Py_ssize_t item_len;
            if (width <= 0 || arrow_bytes(PyTuple_GET_ITEM(c, 1), &next[0], &len[0]) < 0
                || arrow_bytes(PyTuple_GET_ITEM(c, 2), &next[1], &len[1]) < 0
                || arrow_bytes(PyTuple_GET_ITEM(c, 4), &item_bufs[1], &item_len) < 0)
                goto bad;
            if ((next[0] != NULL && len[0] < (rows + 7) / 8) || len[1] < (rows + 1) * 4)
                goto short_;
            int64_t items = rows ? ((const int32_t *)next[1])[rows] : 0;
            if (items < 0 || item_len < items * width)
                goto short_;
            item_bufs[0] = NULL; /* items are never null */
            struct ArrowArray *it = &b->items[j];
            it->length = items;
            it->null_count = 0;
            it->n_buffers = 2;
            it->buffers = item_bufs;
            it->release = arrow_child_release;
            b->item_ptrs[j] = it;
            a->n_buffers = 2;
            a->n_children = 1;
            a->children = &b->item_ptrs[j];
            next += 2;
        } else {
            PyErr_Format(PyExc_ValueError, "arrow_batch: column %zd: unknown kind or arity", j);
            goto error;
        }
        if (a->buffers[0] == NULL)
            a->null_count = 0;
        next += 3;
        continue;
    bad:
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "arrow_batch: column %zd: bad width", j);
        goto error;
    short_:
        PyErr_Format(PyExc_ValueError, "arrow_batch: column %zd: buffers shorter than %zd rows", j, rows);
        goto error;
    }
    capsule = PyCapsule_New(root, "kvtrace.arrow_array", arrow_root_free);
    if (capsule == NULL)
        goto error;
    return Py_BuildValue("(Nn)", capsule, (Py_ssize_t)(uintptr_t)root);
error:
    b->owned = NULL;
    Py_DECREF(cols);
    PyMem_RawFree(b);
    PyMem_RawFree(root);
    return NULL;
}

/* ---- module --------------------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"caller_request_id", py_caller_request_id, METH_VARARGS,
     "caller_request_id(skip=1, up=3, fallback=None): the request id argument of the nearest of `up` "
     "Python frames above the `skip` nearest, or None"},
    {"arrow_batch", (PyCFunction)(void (*)(void))py_arrow_batch, METH_FASTCALL,
     "arrow_batch(rows, columns): (capsule, address) of an ArrowArray over the columns' bytearrays, for "
     "pa.RecordBatch._import_from_c(address, schema)"},
    {"positions", (PyCFunction)(void (*)(void))py_positions, METH_FASTCALL,
     "positions(seq, members): indices of seq's items that are in members, in order"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_columns", "kvtrace's host-probe hot path in C",
                                        -1, module_methods};

PyMODINIT_FUNC PyInit__columns(void) {
    s_request_id = PyUnicode_InternFromString("request_id");
    s_request = PyUnicode_InternFromString("request");
    s_step = PyUnicode_InternFromString("step");
    s_connector = PyUnicode_InternFromString("connector");
    s_block_id = PyUnicode_InternFromString("block_id");
    s_block_hash = PyUnicode_InternFromString("block_hash");
    s_null_block = PyUnicode_InternFromString("null_block");
    if (!s_request_id || !s_request || !s_step || !s_block_id || !s_block_hash || !s_null_block
        || intern_step_names() < 0)
        return NULL;
    if (PyType_Ready(&BlockLogType) < 0 || PyType_Ready(&DecodeLogType) < 0 || PyType_Ready(&RowLogType) < 0
        || PyType_Ready(&BlockHookType) < 0 || PyType_Ready(&StepRowsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "BlockLog", (PyObject *)&BlockLogType) < 0
        || PyModule_AddObjectRef(m, "DecodeLog", (PyObject *)&DecodeLogType) < 0
        || PyModule_AddObjectRef(m, "RowLog", (PyObject *)&RowLogType) < 0
        || PyModule_AddObjectRef(m, "BlockHook", (PyObject *)&BlockHookType) < 0
        || PyModule_AddObjectRef(m, "StepRows", (PyObject *)&StepRowsType) < 0
        || PyModule_AddIntConstant(m, "FRAMES_NATIVE",
#if defined(KVT_FRAMES_INTERNAL) || defined(KVT_FRAMES_PUBLIC)
                                   1
#else
                                   0
#endif
                                   ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
