/* Optional JPEG decoder over libjpeg-turbo (its libjpeg API): the system's, linked at build
 * time.
 *
 * header(data) -> (width, height, components, color_space) | None
 * decode(data, channels, denom, fast, x0, y0, x1, y1) -> (pixels, width, height, x0) | None
 * image(data, channels, plain) -> (pixels, width, height) | None
 * dlpack(data, channels) -> DLPack capsule | None
 * pil_image(image_class, template, core_key, size_key, map_buffer, map_args, fallback, data)
 * dlpack_value(from_dlpack, channels, fallback, data), array_value(ndarray, dtype, channels,
 *     fallback, data): a JPEG field's value in one call (see each)
 * library() -> path | None: which libjpeg decodes (the shared library, by dladdr)
 *
 * decode: ``channels`` 1 (grey), 3 (RGB) or 4 (RGBX: RGB padded to 4 bytes, Pillow's layout);
 * the image scaled by 1/``denom`` (1, 2, 4 or 8, libjpeg-turbo's SIMD scales); with x1 > 0 only
 * the rows y0..y1 and the columns x0..x1 (of the scaled image) are decoded: the columns widen to
 * the iMCU boundaries libjpeg-turbo can crop at, and one more column each side (the returned
 * x0 and width say where; the columns x0..x1 asked for are those of a full decode), the rows
 * above are skipped without their inverse DCT, the rows below are not read at all.
 * ``pixels`` is a bytearray of height x width x channels.
 *
 * image: the whole image at full scale with simplejpeg's settings (accurate DCT, fancy
 * upsampling), the lean call the image modes make per sample. With ``plain`` true it declines,
 * before any decoding, a JPEG that is not "plain" for that output: one with EXIF (APP1) or an
 * ICC profile (APP2) before its frame header (Pillow would put them in ``img.info``), or whose
 * frame header does not have 1 component (channels 1) or 3 (channels 3 or 4); the same walk
 * over the markers as images._jpeg_frame.
 *
 * dlpack: what image(data, channels, False) decodes, for channels 3 as the CxHxW uint8 view of
 * the HxWx3 pixels (strides 1, 3 x width, 3; what torch.from_numpy of that view of image()'s
 * array gives), for channels 1 as HxW: a "dltensor" capsule (DLPack), so that an array library
 * makes its tensor over the pixels with no array object in between (torch: about 1.5 us less a
 * 64x64 image than torch.from_numpy of a numpy view). The pixels are freed by the DLPack
 * deleter, or with the capsule when nobody took it.
 *
 * All return None at anything unusual (a libjpeg error *or warning*, CMYK, a colour space it
 * does not convert, arguments out of range) and the Python code (simplejpeg, then Pillow) takes
 * over, so this module decides nothing about errors: tarshards.codecs stays the definition.
 *
 * Decompressors are kept between calls (a few slots, taken under the GIL, used without it), so a
 * small image does not pay for creating and destroying one.
 *
 * The entropy-coded data of a small single-scan JPEG is decoded from a copy followed by an EOI
 * marker and PAD_BYTES more bytes: libjpeg-turbo takes its fast Huffman decoder only while at
 * least 512 bytes per block of an MCU (up to 5120) remain in the source buffer, so a JPEG of a
 * few KB was decoded wholly by the slow one (about a tenth more time for a 64x64 image). Both
 * decoders stop at a marker and read nothing past it, so the bytes after the EOI are never read;
 * the pixels are the same. Only a JPEG that ends with its EOI is padded (a truncated one is read as
 * before: the warning at its end declines it). One difference, on corrupt data only: the fast decoder reads an invalid
 * Huffman code as 0 without the warning the slow one gives (what libjpeg-turbo does for the
 * whole of a large JPEG but its last few KB anyway), so such a small JPEG is decoded here
 * rather than declined.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#ifndef _WIN32
#include <dlfcn.h>
#endif

#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 1005000
#error "tarshards._jpeg needs libjpeg-turbo >= 1.5 (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
} error_mgr;

typedef struct {
    struct jpeg_decompress_struct d;
    error_mgr err;
    int ready;
    int busy;
    unsigned char *copy; /* the padded copy of a small JPEG (PyMem_Raw, kept with the slot) */
    size_t copy_size;
} slot_t;

/* the fast Huffman decoder wants 512 bytes per block of an MCU (at most 10 blocks) left in the
 * buffer; JPEGs up to PAD_LIMIT bytes are copied (larger ones are decoded mostly by it anyway) */
#define PAD_BYTES 8192
#define PAD_LIMIT 65536

#define NSLOTS 4
static slot_t slots[NSLOTS];

static int slots_in_use = 0; /* taken and not yet given back (GIL held for both) */

static void
on_error(j_common_ptr c)
{
    longjmp(((error_mgr *)c->err)->jump, 1);
}

static void
on_message(j_common_ptr c, int level)
{
    if (level < 0) /* a warning (corrupt data...): strict, let the Python path decide */
        longjmp(((error_mgr *)c->err)->jump, 1);
}

static void
on_output(j_common_ptr c)
{
    (void)c;
}

/* a decompressor made in ``s``, errors turned into a longjmp to s->err.jump: 1, or 0 where the
 * library refused (its version or struct size not this build's) */
static int
create_with(slot_t *s)
{
    s->d.err = jpeg_std_error(&s->err.pub);
    s->err.pub.error_exit = on_error;
    s->err.pub.emit_message = on_message;
    s->err.pub.output_message = on_output;
    if (setjmp(s->err.jump))
        return 0;
    jpeg_CreateDecompress(&s->d, JPEG_LIB_VERSION, sizeof(struct jpeg_decompress_struct));
    return 1;
}

static int
init_slot(slot_t *s)
{
    s->ready = create_with(s);
    return s->ready;
}

/* a free slot (GIL held): a kept one, or, when all are in use by other threads, one made for
 * this call (freed by give_slot); NULL when none could be made */
static slot_t *
take_slot(void)
{
    for (int i = 0; i < NSLOTS; i++) {
        slot_t *s = &slots[i];
        if (s->busy)
            continue;
        if (!s->ready && !init_slot(s))
            return NULL;
        s->busy = 1;
        slots_in_use++;
        return s;
    }
    slot_t *s = (slot_t *)PyMem_RawCalloc(1, sizeof(slot_t));
    if (s == NULL)
        return NULL;
    if (!init_slot(s)) {
        PyMem_RawFree(s);
        return NULL;
    }
    s->busy = 2; /* made for this call */
    slots_in_use++;
    return s;
}

static void
give_slot(slot_t *s)
{
    slots_in_use--;
    if (s->busy == 2) {
        jpeg_destroy_decompress(&s->d);
        PyMem_RawFree(s->copy);
        PyMem_RawFree(s);
        return;
    }
    jpeg_abort_decompress(&s->d);
    s->busy = 0;
}

static PyObject *
jpeg_header(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    slot_t *s = take_slot();
    if (s == NULL) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    volatile int ok = 0;
    volatile JDIMENSION w = 0, h = 0;
    volatile int comps = 0, space = 0;
    if (setjmp(s->err.jump) == 0 && view.len > 0) {
        jpeg_mem_src(&s->d, (const unsigned char *)view.buf, (unsigned long)view.len);
        jpeg_read_header(&s->d, TRUE);
        w = s->d.image_width;
        h = s->d.image_height;
        comps = s->d.num_components;
        space = (int)s->d.jpeg_color_space;
        ok = 1;
    }
    give_slot(s);
    PyBuffer_Release(&view);
    if (!ok)
        Py_RETURN_NONE;
    return Py_BuildValue("(IIii)", (unsigned)w, (unsigned)h, comps, space);
}

/* after the header of a single-scan JPEG (sequential, all components in its one scan): its
 * entropy-coded data, when small, from the slot's padded copy (see the top). The header is read
 * from the JPEG itself, and so is every scan of a multi-scan one: marker segments are read by
 * their length, which would take in the bytes after a truncated JPEG's end. No GIL needed (the
 * buffer is held by the caller, the copy is the slot's). */
static void
pad_entropy_data(slot_t *s)
{
    struct jpeg_source_mgr *src = s->d.src;
    size_t n = src->bytes_in_buffer;
    /* a JPEG that does not end with its EOI (truncated, trailing bytes) is read as it is */
    if (n > PAD_LIMIT || n < 2 || src->next_input_byte[n - 2] != 0xFF ||
        src->next_input_byte[n - 1] != 0xD9 || jpeg_has_multiple_scans(&s->d))
        return;
    size_t need = n + 2 + PAD_BYTES;
    if (s->copy_size < need) {
        unsigned char *grown = (unsigned char *)PyMem_RawRealloc(s->copy, need);
        if (grown == NULL)
            return; /* decoded from the JPEG itself */
        s->copy = grown;
        s->copy_size = need;
    }
    memcpy(s->copy, src->next_input_byte, n);
    s->copy[n] = 0xFF; /* one more EOI: where both Huffman decoders stop */
    s->copy[n + 1] = 0xD9;
    src->next_input_byte = s->copy;
    src->bytes_in_buffer = need;
}

/* A DLPack tensor (the DLPack 0.x ABI, the "dltensor" capsule every array library imports):
 * the structs as the DLPack specification lays them out, and one block holding them, the shape,
 * the strides and the pixels, freed by its deleter (any thread, no GIL: torch calls it when the
 * tensor goes). */
typedef struct {
    int32_t device_type; /* 1: CPU */
    int32_t device_id;
} dl_device_t;

typedef struct {
    uint8_t code; /* 1: unsigned int */
    uint8_t bits;
    uint16_t lanes;
} dl_dtype_t;

typedef struct {
    void *data;
    dl_device_t device;
    int32_t ndim;
    dl_dtype_t dtype;
    int64_t *shape;
    int64_t *strides; /* in elements */
    uint64_t byte_offset;
} dl_tensor_t;

typedef struct dl_managed_s {
    dl_tensor_t dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed_s *);
} dl_managed_t;

typedef struct {
    dl_managed_t managed;
    int64_t shape[3];
    int64_t strides[3];
    /* the pixels follow, at PIXELS_AT */
} dl_block_t;

#define PIXELS_AT ((sizeof(dl_block_t) + 63) & ~(size_t)63)

static void
dl_block_free(dl_managed_t *m)
{
    free(m);
}

/* what decode, image and dlpack share: the pixels of ``view`` into res (1), declined (0), or a
 * Python error set (-1: out of memory); into a bytearray, with ``raw`` 1 a dl_block_t, with
 * ``raw`` 2 the caller's memory res->into */
typedef struct {
    PyObject *pixels; /* a bytearray of rows x width x channels */
    dl_block_t *block; /* or, with raw, the block whose pixels they are */
    JDIMENSION width, rows, xoff;
    /* with raw == 2, the caller's memory the pixels go to (into_h rows of into_w x channels),
     * declined where the image has another size */
    unsigned char *into;
    JDIMENSION into_w, into_h;
} decoded_t;

static int
decode_view(Py_buffer *view, long channels, long denom, int fast, long x0, long y0, long x1,
            long y1, int raw, decoded_t *res)
{
    J_COLOR_SPACE out_space;
    if (channels == 1)
        out_space = JCS_GRAYSCALE;
    else if (channels == 3)
        out_space = JCS_RGB;
    else if (channels == 4)
        out_space = JCS_EXT_RGBX;
    else
        return 0;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8)
        return 0;
    if (view->len == 0)
        return 0;
    slot_t *s = take_slot();
    if (s == NULL)
        return 0;
    struct jpeg_decompress_struct *d = &s->d;
    /* volatile: kept across the longjmp of a libjpeg error */
    PyObject *volatile out = NULL;
    dl_block_t *volatile block = NULL;
    volatile JDIMENSION xoff = 0, width = 0, rows = 0;
    volatile int failed = 0;
    PyThreadState *volatile ts = PyEval_SaveThread();
    if (setjmp(s->err.jump)) {
        failed = 1;
        goto done;
    }
    jpeg_mem_src(d, (const unsigned char *)view->buf, (unsigned long)view->len);
    jpeg_read_header(d, TRUE);
    if (d->jpeg_color_space != JCS_YCbCr && d->jpeg_color_space != JCS_GRAYSCALE &&
        d->jpeg_color_space != JCS_RGB) {
        failed = 1; /* CMYK, YCCK, unknown: not ours */
        goto done;
    }
    pad_entropy_data(s);
    d->out_color_space = out_space;
    d->scale_num = 1;
    d->scale_denom = (unsigned int)denom;
    d->dct_method = fast ? JDCT_IFAST : JDCT_ISLOW;
    d->do_fancy_upsampling = fast ? FALSE : TRUE;
    jpeg_start_decompress(d);
    JDIMENSION ow = d->output_width, oh = d->output_height;
    JDIMENSION top = 0, bottom = oh; /* not used after a longjmp */
    if (x1 > 0) {
        if (x0 < 0 || y0 < 0 || x1 <= x0 || y1 <= y0 || (unsigned long)x1 > ow ||
            (unsigned long)y1 > oh) {
            failed = 1;
            goto done;
        }
        top = (JDIMENSION)y0;
        bottom = (JDIMENSION)y1;
        if (x0 > 0 || (JDIMENSION)x1 < ow) {
            /* one column more each side: the edge columns of a cropped decode are upsampled
             * without their neighbours' chroma, so they differ from a full decode; the
             * columns asked for then match it */
            JDIMENSION lo = x0 > 0 ? (JDIMENSION)x0 - 1 : 0;
            JDIMENSION hi = (JDIMENSION)x1 < ow ? (JDIMENSION)x1 + 1 : ow;
            JDIMENSION cx = lo, cw = hi - lo;
            jpeg_crop_scanline(d, &cx, &cw);
            xoff = cx;
        }
    }
    width = d->output_width;
    rows = bottom - top;
    unsigned char *px;
    if (raw == 2) {
        if (width != res->into_w || rows != res->into_h) {
            failed = 1; /* another size: not for this memory */
            goto done;
        }
        px = res->into;
    }
    else if (raw) {
        block = (dl_block_t *)malloc(PIXELS_AT + (size_t)rows * width * channels);
        if (block == NULL) {
            failed = 2; /* out of memory */
            goto done;
        }
        px = (unsigned char *)block + PIXELS_AT;
    }
    else {
        PyEval_RestoreThread(ts);
        out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)rows * width * channels);
        ts = PyEval_SaveThread();
        if (out == NULL) {
            failed = 1;
            goto done;
        }
        px = (unsigned char *)PyByteArray_AS_STRING(out);
    }
    {
        size_t stride = (size_t)width * channels;
        if (top > 0 && jpeg_skip_scanlines(d, top) != top) {
            failed = 1;
            goto done;
        }
        while (d->output_scanline < bottom) {
            JSAMPROW ptrs[16];
            JDIMENSION n = bottom - d->output_scanline;
            if (n > 16)
                n = 16;
            for (JDIMENSION i = 0; i < n; i++)
                ptrs[i] = px + (size_t)(d->output_scanline - top + i) * stride;
            if (jpeg_read_scanlines(d, ptrs, n) == 0) {
                failed = 1;
                goto done;
            }
        }
    }
done:
    PyEval_RestoreThread(ts);
    give_slot(s);
    if (failed) {
        if (failed == 2) {
            PyErr_NoMemory();
            return -1;
        }
        if (out == NULL && !raw && PyErr_Occurred())
            return -1; /* out of memory */
        Py_XDECREF(out);
        free(block);
        return 0;
    }
    res->pixels = out;
    res->block = block;
    res->width = width;
    res->rows = rows;
    res->xoff = xoff;
    return 1;
}

static PyObject *
jpeg_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "decode takes 8 arguments");
        return NULL;
    }
    long channels = PyLong_AsLong(args[1]);
    long denom = PyLong_AsLong(args[2]);
    int fast = PyObject_IsTrue(args[3]);
    long x0 = PyLong_AsLong(args[4]), y0 = PyLong_AsLong(args[5]);
    long x1 = PyLong_AsLong(args[6]), y1 = PyLong_AsLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    decoded_t res;
    int ok = decode_view(&view, channels, denom, fast, x0, y0, x1, y1, 0, &res);
    PyBuffer_Release(&view);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(NIII)", res.pixels, (unsigned)res.width, (unsigned)res.rows,
                         (unsigned)res.xoff);
}

/* the components of a JPEG's frame header when no APP1/APP2 (or scan) comes before it, else 0:
 * images._jpeg_frame in C */
static int
plain_components(const unsigned char *data, Py_ssize_t n)
{
    Py_ssize_t pos = 2;
    while (pos + 9 < n && data[pos] == 0xFF) {
        unsigned char marker = data[pos + 1];
        if (marker == 0xE1 || marker == 0xE2 || marker == 0xDA)
            return 0;
        if (marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 &&
            marker != 0xCC)
            return data[pos + 9];
        pos += 2 + (((Py_ssize_t)data[pos + 2] << 8) | data[pos + 3]);
    }
    return 0;
}

static PyObject *
jpeg_image(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "image takes 3 arguments");
        return NULL;
    }
    long channels = PyLong_AsLong(args[1]);
    if (channels == -1 && PyErr_Occurred())
        return NULL;
    int plain = PyObject_IsTrue(args[2]);
    if (plain < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    decoded_t res;
    int ok = 0;
    if (!plain ||
        plain_components((const unsigned char *)view.buf, view.len) == (channels == 1 ? 1 : 3))
        ok = decode_view(&view, channels, 1, 0, 0, 0, 0, 0, 0, &res);
    PyBuffer_Release(&view);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(NII)", res.pixels, (unsigned)res.width, (unsigned)res.rows);
}

/* pil_image(image_class, template, core_key, size_key, map_buffer, map_args, fallback, data):
 * a plain RGB JPEG (image(data, 4, True)) as an instance of image_class whose __dict__ is a copy
 * of template with core_key set to map_buffer(pixels, (width, height), "raw", 0, map_args),
 * size_key to (width, height) and "info" to a new dict: what images._templated's wrap makes,
 * made here (the template is checked there); anything declined is fallback(data). */
static PyObject *raw_name, *info_name, *zero_obj;

static PyObject *
jpeg_pil_image(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "pil_image takes 8 arguments");
        return NULL;
    }
    PyObject *cls = args[0], *tmpl = args[1], *data = args[7];
    if (!PyType_Check(cls) || !PyDict_Check(tmpl)) {
        PyErr_SetString(PyExc_TypeError, "pil_image: a class and a dict");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    decoded_t res;
    int ok = 0;
    if (plain_components((const unsigned char *)view.buf, view.len) == 3)
        ok = decode_view(&view, 4, 1, 0, 0, 0, 0, 0, 0, &res);
    PyBuffer_Release(&view);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        return PyObject_CallOneArg(args[6], data);
    PyObject *obj = NULL, *core = NULL, *attrs = NULL, *info = NULL;
    PyObject *size = Py_BuildValue("(II)", (unsigned)res.width, (unsigned)res.rows);
    if (size == NULL)
        goto done;
    PyObject *margs[5] = {res.pixels, size, raw_name, zero_obj, args[5]};
    core = PyObject_Vectorcall(args[4], margs, 5, NULL);
    if (core == NULL)
        goto done;
    attrs = PyDict_Copy(tmpl);
    info = PyDict_New();
    if (attrs == NULL || info == NULL || PyDict_SetItem(attrs, args[2], core) < 0 ||
        PyDict_SetItem(attrs, args[3], size) < 0 || PyDict_SetItem(attrs, info_name, info) < 0)
        goto done;
    obj = ((PyTypeObject *)cls)->tp_alloc((PyTypeObject *)cls, 0); /* object.__new__(cls) */
    if (obj != NULL && PyObject_GenericSetDict(obj, attrs, NULL) < 0)
        Py_CLEAR(obj);
done:
    Py_DECREF(res.pixels);
    Py_XDECREF(size);
    Py_XDECREF(core);
    Py_XDECREF(attrs);
    Py_XDECREF(info);
    return obj;
}

/* the capsule's destructor: a capsule nobody consumed (still named "dltensor") owns its tensor */
static void
dl_capsule_free(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        dl_managed_t *m = (dl_managed_t *)PyCapsule_GetPointer(capsule, "dltensor");
        m->deleter(m);
    }
}

/* the DLPack capsule of data's pixels (see the top), Py_None when declined, NULL on an error */
static PyObject *
dlpack_capsule(PyObject *data, long channels)
{
    if (channels != 1 && channels != 3)
        Py_RETURN_NONE;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    decoded_t res;
    int ok = decode_view(&view, channels, 1, 0, 0, 0, 0, 0, 1, &res);
    PyBuffer_Release(&view);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        Py_RETURN_NONE;
    dl_block_t *b = res.block;
    dl_tensor_t *t = &b->managed.dl_tensor;
    t->data = (unsigned char *)b + PIXELS_AT;
    t->device.device_type = 1; /* kDLCPU */
    t->device.device_id = 0;
    t->dtype.code = 1; /* kDLUInt */
    t->dtype.bits = 8;
    t->dtype.lanes = 1;
    t->byte_offset = 0;
    t->shape = b->shape;
    t->strides = b->strides;
    if (channels == 3) { /* CxHxW over the HxWx3 pixels */
        t->ndim = 3;
        b->shape[0] = 3;
        b->shape[1] = res.rows;
        b->shape[2] = res.width;
        b->strides[0] = 1;
        b->strides[1] = 3 * (int64_t)res.width;
        b->strides[2] = 3;
    }
    else {
        t->ndim = 2;
        b->shape[0] = res.rows;
        b->shape[1] = res.width;
        b->strides[0] = res.width;
        b->strides[1] = 1;
    }
    b->managed.manager_ctx = NULL;
    b->managed.deleter = dl_block_free;
    PyObject *capsule = PyCapsule_New(&b->managed, "dltensor", dl_capsule_free);
    if (capsule == NULL)
        free(b);
    return capsule;
}

static PyObject *
jpeg_dlpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "dlpack takes 2 arguments");
        return NULL;
    }
    long channels = PyLong_AsLong(args[1]);
    if (channels == -1 && PyErr_Occurred())
        return NULL;
    return dlpack_capsule(args[0], channels);
}

/* dlpack_value(from_dlpack, channels, fallback, data): from_dlpack(dlpack(data, channels)), or
 * fallback(data) when declined: a JPEG field's decoder in one C call */
static PyObject *
jpeg_dlpack_value(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "dlpack_value takes 4 arguments");
        return NULL;
    }
    long channels = PyLong_AsLong(args[1]);
    if (channels == -1 && PyErr_Occurred())
        return NULL;
    PyObject *capsule = dlpack_capsule(args[3], channels);
    if (capsule == NULL)
        return NULL;
    if (capsule == Py_None) {
        Py_DECREF(capsule);
        return PyObject_CallOneArg(args[2], args[3]);
    }
    PyObject *value = PyObject_CallOneArg(args[0], capsule);
    Py_DECREF(capsule);
    return value;
}

/* array_value(ndarray, dtype, channels, fallback, data): ndarray(shape, dtype, pixels) of
 * image(data, channels, False), shape (height, width, 3) for channels 3, (height, width) for 1,
 * or fallback(data) when declined: a JPEG field's decoder in one C call */
static PyObject *
jpeg_array_value(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "array_value takes 5 arguments");
        return NULL;
    }
    long channels = PyLong_AsLong(args[2]);
    if (channels == -1 && PyErr_Occurred())
        return NULL;
    decoded_t res;
    int ok = 0;
    if (channels == 1 || channels == 3) {
        Py_buffer view;
        if (PyObject_GetBuffer(args[4], &view, PyBUF_SIMPLE) < 0)
            return NULL;
        ok = decode_view(&view, channels, 1, 0, 0, 0, 0, 0, 0, &res);
        PyBuffer_Release(&view);
    }
    if (ok < 0)
        return NULL;
    if (ok == 0)
        return PyObject_CallOneArg(args[3], args[4]);
    PyObject *shape = channels == 3
                          ? Py_BuildValue("(III)", (unsigned)res.rows, (unsigned)res.width, 3u)
                          : Py_BuildValue("(II)", (unsigned)res.rows, (unsigned)res.width);
    PyObject *value = NULL;
    if (shape != NULL) {
        PyObject *call[3] = {shape, args[1], res.pixels};
        value = PyObject_Vectorcall(args[0], call, 3, NULL);
        Py_DECREF(shape);
    }
    Py_DECREF(res.pixels);
    return value;
}

/* into(channels, data, out) -> bool: a JPEG's pixels decoded straight into out, a writable
 * C-contiguous uint8 buffer of shape (height, width, channels) (channels 3) or (height, width)
 * (channels 1), as image(data, channels, False) gives them; False, out's contents undefined,
 * where the C decoder declines the JPEG or it has another size (the caller decodes it another
 * way then) */
static PyObject *
jpeg_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "into takes 3 arguments");
        return NULL;
    }
    long channels = PyLong_AsLong(args[0]);
    if (channels == -1 && PyErr_Occurred())
        return NULL;
    if (channels != 1 && channels != 3)
        Py_RETURN_FALSE;
    Py_buffer out;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return NULL;
    int shaped = out.itemsize == 1 && (out.format == NULL || strcmp(out.format, "B") == 0) &&
                 out.ndim == (channels == 3 ? 3 : 2) && (channels == 1 || out.shape[2] == 3) &&
                 out.shape[0] > 0 && out.shape[1] > 0;
    if (!shaped) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError,
                        "into: out must be a C-contiguous uint8 (height, width[, 3]) buffer");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    decoded_t res;
    res.into = (unsigned char *)out.buf;
    res.into_h = (JDIMENSION)out.shape[0];
    res.into_w = (JDIMENSION)out.shape[1];
    int ok = decode_view(&view, channels, 1, 0, 0, 0, 0, 0, 2, &res);
    PyBuffer_Release(&view);
    PyBuffer_Release(&out);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

/* the path of the shared library libjpeg's functions come from (dladdr), or None */
static PyObject *
jpeg_library(PyObject *self, PyObject *unused)
{
#ifndef _WIN32
    Dl_info info;
    if (dladdr((void *)jpeg_read_header, &info) && info.dli_fname != NULL)
        return PyUnicode_DecodeFSDefault(info.dli_fname);
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"library", (PyCFunction)jpeg_library, METH_NOARGS,
     "library() -> the path of the libjpeg decoding, or None where unknown"},
    {"into", (PyCFunction)(void (*)(void))jpeg_into, METH_FASTCALL,
     "into(channels, data, out) -> bool: the pixels decoded straight into out (same size only)"},
    {"header", (PyCFunction)jpeg_header, METH_O,
     "header(data) -> (width, height, components, color_space) or None"},
    {"decode", (PyCFunction)(void (*)(void))jpeg_decode, METH_FASTCALL,
     "decode(data, channels, denom, fast, x0, y0, x1, y1) -> (pixels, width, height, x0) or None"},
    {"image", (PyCFunction)(void (*)(void))jpeg_image, METH_FASTCALL,
     "image(data, channels, plain) -> (pixels, width, height) or None"},
    {"pil_image", (PyCFunction)(void (*)(void))jpeg_pil_image, METH_FASTCALL,
     "pil_image(image_class, template, core_key, size_key, map_buffer, map_args, fallback, data)"},
    {"dlpack_value", (PyCFunction)(void (*)(void))jpeg_dlpack_value, METH_FASTCALL,
     "dlpack_value(from_dlpack, channels, fallback, data)"},
    {"array_value", (PyCFunction)(void (*)(void))jpeg_array_value, METH_FASTCALL,
     "array_value(ndarray, dtype, channels, fallback, data)"},
    {"dlpack", (PyCFunction)(void (*)(void))jpeg_dlpack, METH_FASTCALL,
     "dlpack(data, channels) -> DLPack capsule of the CxHxW (channels 3) or HxW pixels, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tarshards._jpeg", "JPEG decoding over libjpeg-turbo (optional)", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__jpeg(void)
{
    raw_name = PyUnicode_InternFromString("raw");
    info_name = PyUnicode_InternFromString("info");
    zero_obj = PyLong_FromLong(0);
    if (raw_name == NULL || info_name == NULL || zero_obj == NULL)
        return NULL;
    return PyModule_Create(&module);
}
