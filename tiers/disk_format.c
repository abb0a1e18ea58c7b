/* disk_format.c - encoding and checking a disk-tier file's header and chunk
 * table (the field table is at the top of tiers/disk.c).  Every field of a
 * header that passes disk_hdr_decode has exactly the value the writer
 * would give it, so a decoded header re-encodes to the same bytes: there
 * is one valid encoding of each object, and anything else is corrupt. */
#include "tiers/disk_format.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>
#include <zstd.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "backend/backend.h"
#include "util/le.h"

static bool name_char(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

bool disk_name_ok(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (n >= DISK_NAME_MAX || !name_char(s[n]))
            return false;
    return n > 0;
}

size_t disk_hdr_size(uint32_t n_chunks)
{
    return DISK_FIXED_LEN + (size_t)n_chunks * DISK_ENTRY_LEN + 8;
}

uint32_t disk_n_chunks(uint64_t data_len)
{
    return (uint32_t)((data_len + DISK_CHUNK - 1) / DISK_CHUNK);
}

uint64_t disk_meta_off(uint32_t n_chunks)
{
    return disk_align(disk_hdr_size(n_chunks));
}

uint64_t disk_data_off(uint32_t n_chunks, uint64_t meta_len)
{
    return disk_meta_off(n_chunks) + disk_align(meta_len);
}

uint64_t disk_file_size(const struct disk_hdr *h)
{
    if (!h->n_chunks)
        return disk_data_off(0, h->meta_len);
    const struct disk_chunk *c = &h->chunks[h->n_chunks - 1];
    return c->off + disk_align(c->stored_len);
}

/* Field offsets of the fixed part. */
enum {
    O_MAGIC = 0, O_VERSION = 8, O_HDR_LEN = 12, O_FINGERPRINT = 16, O_DTYPE = 24, O_BLOCK = 28, O_LAYERS = 32,
    O_KV_HEADS = 36, O_HEAD_DIM = 40, O_RESERVED1 = 44, O_NS = 48, O_NAME = 112, O_META_OFF = 176,
    O_META_LEN = 184, O_META_SUM = 192, O_DATA_LEN = 200, O_CHUNK_SIZE = 208, O_N_CHUNKS = 212,
    O_RESERVED2 = 216,
};

void disk_hdr_encode(struct disk_hdr *h, void *out)
{
    uint8_t *p = out;
    h->version = DISK_VERSION;
    h->hdr_len = (uint32_t)disk_hdr_size(h->n_chunks);
    memset(p, 0, h->hdr_len);
    memcpy(p + O_MAGIC, DISK_MAGIC, 8);
    put32(p + O_VERSION, h->version);
    put32(p + O_HDR_LEN, h->hdr_len);
    put64(p + O_FINGERPRINT, h->layout.fingerprint);
    put32(p + O_DTYPE, h->layout.dtype);
    put32(p + O_BLOCK, h->layout.block_tokens);
    put32(p + O_LAYERS, h->layout.n_layers);
    put32(p + O_KV_HEADS, h->layout.n_kv_heads);
    put32(p + O_HEAD_DIM, h->layout.head_dim);
    memcpy(p + O_NS, h->ns, strnlen(h->ns, DISK_NAME_MAX));
    memcpy(p + O_NAME, h->name, strnlen(h->name, DISK_NAME_MAX));
    put64(p + O_META_OFF, h->meta_off);
    put64(p + O_META_LEN, h->meta_len);
    put64(p + O_META_SUM, h->meta_sum);
    put64(p + O_DATA_LEN, h->data_len);
    put32(p + O_CHUNK_SIZE, h->chunk_size);
    put32(p + O_N_CHUNKS, h->n_chunks);
    for (uint32_t i = 0; i < h->n_chunks; i++) {
        uint8_t *e = p + DISK_FIXED_LEN + (size_t)i * DISK_ENTRY_LEN;
        put64(e, h->chunks[i].off);
        put32(e + 8, h->chunks[i].raw_len);
        put32(e + 12, h->chunks[i].stored_len);
        put32(e + 16, h->chunks[i].codec);
        put64(e + 24, h->chunks[i].sum);
    }
    put64(p + h->hdr_len - 8, XXH3_64bits(p, h->hdr_len - 8));
}

#define FAIL(st, ...)                                                                                              \
    do {                                                                                                           \
        snprintf(why, DISK_WHY_LEN, __VA_ARGS__);                                                                  \
        return st;                                                                                                 \
    } while (0)

enum disk_check disk_hdr_peek(const void *buf, size_t n, uint32_t *hdr_len, char why[DISK_WHY_LEN])
{
    const uint8_t *p = buf;
    if (n < DISK_FIXED_LEN)
        FAIL(DISK_CORRUPT, "truncated: %zu bytes, shorter than a header", n);
    if (memcmp(p + O_MAGIC, DISK_MAGIC, 8) != 0)
        FAIL(DISK_CORRUPT, "not a kvtier disk file (bad magic)");
    uint32_t v = get32(p + O_VERSION);
    if (v != DISK_VERSION)
        FAIL(DISK_FOREIGN, "format version %u (this build reads %u)", v, DISK_VERSION);
    uint32_t n_chunks = get32(p + O_N_CHUNKS);
    if (n_chunks > disk_n_chunks(DISK_MAX_DATA))
        FAIL(DISK_CORRUPT, "chunk count %u out of range", n_chunks);
    *hdr_len = get32(p + O_HDR_LEN);
    if (*hdr_len != disk_hdr_size(n_chunks))
        FAIL(DISK_CORRUPT, "header size %u does not match its %u chunks", *hdr_len, n_chunks);
    return DISK_VALID;
}

/* The name field: 1..64 name characters, then zeros. */
static bool get_name(const uint8_t *p, char out[DISK_NAME_MAX + 1])
{
    size_t n = strnlen((const char *)p, DISK_NAME_MAX);
    for (size_t i = n; i < DISK_NAME_MAX; i++)
        if (p[i])
            return false;
    memcpy(out, p, n);
    out[n] = '\0';
    return disk_name_ok(out);
}

enum disk_check disk_hdr_decode(const void *buf, size_t n, uint64_t file_size, struct disk_hdr *h,
                                char why[DISK_WHY_LEN])
{
    const uint8_t *p = buf;
    uint32_t hdr_len;
    enum disk_check st = disk_hdr_peek(buf, n, &hdr_len, why);
    if (st != DISK_VALID)
        return st;
    if (n < hdr_len)
        FAIL(DISK_CORRUPT, "truncated: %zu bytes of a %u-byte header", n, hdr_len);
    if (get64(p + hdr_len - 8) != XXH3_64bits(p, hdr_len - 8))
        FAIL(DISK_CORRUPT, "header checksum mismatch");
    *h = (struct disk_hdr){
        .version = DISK_VERSION,
        .hdr_len = hdr_len,
        .layout = {get64(p + O_FINGERPRINT), get32(p + O_DTYPE), get32(p + O_BLOCK), get32(p + O_LAYERS),
                   get32(p + O_KV_HEADS), get32(p + O_HEAD_DIM)},
        .meta_off = get64(p + O_META_OFF),
        .meta_len = get64(p + O_META_LEN),
        .meta_sum = get64(p + O_META_SUM),
        .data_len = get64(p + O_DATA_LEN),
        .chunk_size = get32(p + O_CHUNK_SIZE),
        .n_chunks = get32(p + O_N_CHUNKS),
    };
    if (get32(p + O_RESERVED1) || get64(p + O_RESERVED2))
        FAIL(DISK_CORRUPT, "reserved header fields not zero");
    if (!get_name(p + O_NS, h->ns) || !get_name(p + O_NAME, h->name))
        FAIL(DISK_CORRUPT, "bad namespace or name field");
    if (h->chunk_size != DISK_CHUNK)
        FAIL(DISK_CORRUPT, "chunk size %u (expected %zu)", h->chunk_size, DISK_CHUNK);
    if (h->data_len > DISK_MAX_DATA || disk_n_chunks(h->data_len) != h->n_chunks)
        FAIL(DISK_CORRUPT, "data length %llu does not match %u chunks", (unsigned long long)h->data_len, h->n_chunks);
    if (h->meta_len > DISK_MAX_META)
        FAIL(DISK_CORRUPT, "meta length %llu over %zu", (unsigned long long)h->meta_len, DISK_MAX_META);
    if (h->meta_off != disk_meta_off(h->n_chunks))
        FAIL(DISK_CORRUPT, "meta offset %llu (expected %llu)", (unsigned long long)h->meta_off,
             (unsigned long long)disk_meta_off(h->n_chunks));
    if (h->meta_len == 0 && h->meta_sum != 0)
        FAIL(DISK_CORRUPT, "checksum of an empty meta not zero");
    struct disk_chunk *c = NULL;
    if (h->n_chunks && !(c = malloc(h->n_chunks * sizeof *c)))
        FAIL(DISK_NOMEM, "out of memory for a table of %u chunks", h->n_chunks);
    uint64_t off = disk_data_off(h->n_chunks, h->meta_len), left = h->data_len;
    for (uint32_t i = 0; i < h->n_chunks; i++) {
        const uint8_t *e = p + DISK_FIXED_LEN + (size_t)i * DISK_ENTRY_LEN;
        c[i] = (struct disk_chunk){get64(e), get32(e + 8), get32(e + 12), get32(e + 16), get64(e + 24)};
        uint32_t raw = (uint32_t)(left < DISK_CHUNK ? left : DISK_CHUNK);
        const char *bad = NULL;
        if (c[i].off != off)
            bad = "offset";
        else if (c[i].raw_len != raw)
            bad = "raw length";
        else if (c[i].codec > DISK_CODEC_SHUF4_ZSTD || get32(e + 20))
            bad = "codec";
        else if (c[i].codec == DISK_CODEC_RAW ? c[i].stored_len != raw : !c[i].stored_len || c[i].stored_len >= raw)
            bad = "stored length";
        if (bad) {
            free(c);
            FAIL(DISK_CORRUPT, "chunk %u: bad %s", i, bad);
        }
        off += disk_align(c[i].stored_len);
        left -= raw;
    }
    h->chunks = c;
    if (file_size != disk_file_size(h)) {
        disk_hdr_release(h);
        FAIL(DISK_CORRUPT, "truncated or extended: %llu bytes, the header says %llu", (unsigned long long)file_size,
             (unsigned long long)off);
    }
    return DISK_VALID;
}

void disk_hdr_release(struct disk_hdr *h)
{
    free(h->chunks);
    h->chunks = NULL;
}

void *disk_blob_encode(const struct kv_disk_layout *layout, const char *ns, const char *name, const void *data,
                       size_t data_len, ZSTD_CCtx *cctx, size_t *out_len)
{
    struct disk_hdr h = {.layout = *layout, .meta_off = disk_meta_off(disk_n_chunks(data_len)),
                         .data_len = data_len, .chunk_size = DISK_CHUNK, .n_chunks = disk_n_chunks(data_len)};
    if (data_len > DISK_MAX_DATA || !disk_name_ok(ns) || !disk_name_ok(name))
        return NULL;
    snprintf(h.ns, sizeof(h.ns), "%s", ns);
    snprintf(h.name, sizeof(h.name), "%s", name);
    const uint8_t *raw = data;
    size_t first = data_len < DISK_CHUNK ? data_len : DISK_CHUNK;
    /* compressed chunks are packed one after the other in packed, then
     * copied to their offsets: the offsets depend on every earlier size */
    uint8_t *packed = cctx && data_len ? malloc(data_len) : NULL, *scratch = packed ? malloc(first) : NULL;
    const uint8_t **src = malloc((h.n_chunks ? h.n_chunks : 1) * sizeof(*src));
    h.chunks = calloc(h.n_chunks ? h.n_chunks : 1, sizeof(*h.chunks));
    uint8_t *p = NULL;
    if (h.chunks && src && (!cctx || !data_len || scratch)) {
        uint64_t off = disk_data_off(h.n_chunks, 0);
        size_t pos = 0;
        enum disk_codec codec = disk_codec_for(layout->dtype);
        for (uint32_t i = 0; i < h.n_chunks; i++) {
            size_t at = (size_t)i * DISK_CHUNK, len = data_len - at < DISK_CHUNK ? data_len - at : DISK_CHUNK;
            size_t stored = packed ? disk_chunk_pack(cctx, codec, raw + at, len, scratch, packed + pos) : 0;
            src[i] = stored ? packed + pos : raw + at;
            h.chunks[i] = (struct disk_chunk){.off = off, .raw_len = (uint32_t)len,
                                              .stored_len = (uint32_t)(stored ? stored : len),
                                              .codec = stored ? codec : DISK_CODEC_RAW};
            h.chunks[i].sum = XXH3_64bits(src[i], h.chunks[i].stored_len);
            pos += stored;
            off += disk_align(h.chunks[i].stored_len);
        }
        p = calloc(1, (size_t)disk_file_size(&h));
    }
    if (p) {
        disk_hdr_encode(&h, p);
        for (uint32_t i = 0; i < h.n_chunks; i++)
            memcpy(p + h.chunks[i].off, src[i], h.chunks[i].stored_len);
        *out_len = (size_t)disk_file_size(&h);
    }
    free(packed);
    free(scratch);
    free(src);
    free(h.chunks);
    return p;
}

enum disk_check disk_blob_decode(const void *buf, size_t n, const struct kv_disk_layout *layout, const char *ns,
                                 const char *name, size_t max_data, ZSTD_DCtx *dctx, const void **data,
                                 size_t *data_len, void **owned, char why[DISK_WHY_LEN])
{
    const uint8_t *p = buf;
    struct disk_hdr h;
    *owned = NULL;
    enum disk_check st = disk_hdr_decode(buf, n, n, &h, why);
    if (st != DISK_VALID)
        return st;
    const struct kv_disk_layout *l = &h.layout;
    bool packed = false;
    if (l->fingerprint != layout->fingerprint || l->dtype != layout->dtype || l->block_tokens != layout->block_tokens ||
        l->n_layers != layout->n_layers || l->n_kv_heads != layout->n_kv_heads || l->head_dim != layout->head_dim) {
        disk_hdr_release(&h);
        FAIL(DISK_FOREIGN, "written for another model or layout (fingerprint %016llx)",
             (unsigned long long)h.layout.fingerprint);
    }
    if (strcmp(h.ns, ns) || strcmp(h.name, name)) {
        disk_hdr_release(&h);
        FAIL(DISK_CORRUPT, "holds %s/%s, not %s/%s", h.ns, h.name, ns, name);
    }
    if (h.meta_len) {
        disk_hdr_release(&h);
        FAIL(DISK_CORRUPT, "a meta where none belongs");
    }
    if (h.data_len > max_data) {
        disk_hdr_release(&h);
        FAIL(DISK_CORRUPT, "%llu bytes of data, more than the %zu expected", (unsigned long long)h.data_len, max_data);
    }
    for (uint32_t i = 0; i < h.n_chunks; i++) {
        const struct disk_chunk *c = &h.chunks[i];
        packed = packed || c->codec != DISK_CODEC_RAW;
        if (XXH3_64bits(p + c->off, c->stored_len) != c->sum) {
            disk_hdr_release(&h);
            FAIL(DISK_CORRUPT, "chunk %u checksum mismatch", i);
        }
    }
    *data_len = (size_t)h.data_len;
    if (!packed) {
        /* every chunk but the last holds DISK_CHUNK bytes, a multiple of
         * the alignment: raw data is contiguous from the first chunk on */
        *data = h.n_chunks ? p + h.chunks[0].off : p + n;
        disk_hdr_release(&h);
        return DISK_VALID;
    }
    uint8_t *out = malloc((size_t)h.data_len), *scratch = malloc(h.chunks[0].raw_len);
    uint32_t bad = h.n_chunks;
    for (uint32_t i = 0; out && scratch && i < h.n_chunks && bad == h.n_chunks; i++) {
        const struct disk_chunk *c = &h.chunks[i];
        uint8_t *to = out + (size_t)i * DISK_CHUNK;
        if (c->codec == DISK_CODEC_RAW)
            memcpy(to, p + c->off, c->raw_len);
        else if (!disk_chunk_unpack(dctx, c->codec, p + c->off, c->stored_len, scratch, to, c->raw_len))
            bad = i;
    }
    free(scratch);
    disk_hdr_release(&h);
    if (!out || !scratch) {
        free(out);
        FAIL(DISK_NOMEM, "out of memory for %llu bytes of decompressed data", (unsigned long long)*data_len);
    }
    if (bad != h.n_chunks) {
        free(out);
        FAIL(DISK_CORRUPT, "chunk %u does not decompress to its length", bad);
    }
    *data = *owned = out;
    return DISK_VALID;
}

size_t disk_chunk_pack(ZSTD_CCtx *cctx, enum disk_codec codec, const uint8_t *raw, size_t len, uint8_t *scratch,
                       uint8_t *out)
{
    if (len < 2)
        return 0;
    disk_shuffle(scratch, raw, len, disk_codec_elem(codec));
    size_t r = ZSTD_compressCCtx(cctx, out, len - 1, scratch, len, 1);
    return ZSTD_isError(r) ? 0 : r;
}

bool disk_chunk_unpack(ZSTD_DCtx *dctx, enum disk_codec codec, const uint8_t *in, size_t stored, uint8_t *scratch,
                       uint8_t *out, size_t raw_len)
{
    if (ZSTD_decompressDCtx(dctx, scratch, raw_len, in, stored) != raw_len)
        return false;
    disk_unshuffle(out, scratch, raw_len, disk_codec_elem(codec));
    return true;
}

enum disk_codec disk_codec_for(uint32_t dtype)
{
    return dtype <= BE_BF16 && be_dtype_size((enum be_dtype)dtype) == 4 ? DISK_CODEC_SHUF4_ZSTD
                                                                        : DISK_CODEC_SHUF2_ZSTD;
}

size_t disk_codec_elem(enum disk_codec c)
{
    return c == DISK_CODEC_SHUF4_ZSTD ? 4 : 2;
}

void disk_shuffle(uint8_t *out, const uint8_t *in, size_t n, size_t es)
{
    size_t k = n / es;
    if (es == 2) { /* the common case: 16 elements a step where SSE2 is there (every x86-64) */
        uint8_t *lo = out, *hi = out + k;
        size_t i = 0;
#ifdef __SSE2__
        const __m128i mask = _mm_set1_epi16(0xff);
        for (; i + 16 <= k; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(in + 2 * i));
            __m128i b = _mm_loadu_si128((const __m128i *)(in + 2 * i + 16));
            _mm_storeu_si128((__m128i *)(lo + i), _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask)));
            _mm_storeu_si128((__m128i *)(hi + i), _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
        }
#endif
        for (; i < k; i++) {
            lo[i] = in[2 * i];
            hi[i] = in[2 * i + 1];
        }
    } else {
        for (size_t i = 0; i < k; i++)
            for (size_t b = 0; b < es; b++)
                out[b * k + i] = in[i * es + b];
    }
    memcpy(out + k * es, in + k * es, n - k * es);
}

void disk_unshuffle(uint8_t *out, const uint8_t *in, size_t n, size_t es)
{
    size_t k = n / es;
    if (es == 2) {
        const uint8_t *lo = in, *hi = in + k;
        size_t i = 0;
#ifdef __SSE2__
        for (; i + 16 <= k; i += 16) {
            __m128i l = _mm_loadu_si128((const __m128i *)(lo + i)), h = _mm_loadu_si128((const __m128i *)(hi + i));
            _mm_storeu_si128((__m128i *)(out + 2 * i), _mm_unpacklo_epi8(l, h));
            _mm_storeu_si128((__m128i *)(out + 2 * i + 16), _mm_unpackhi_epi8(l, h));
        }
#endif
        for (; i < k; i++) {
            out[2 * i] = lo[i];
            out[2 * i + 1] = hi[i];
        }
    } else {
        for (size_t i = 0; i < k; i++)
            for (size_t b = 0; b < es; b++)
                out[i * es + b] = in[b * k + i];
    }
    memcpy(out + k * es, in + k * es, n - k * es);
}
