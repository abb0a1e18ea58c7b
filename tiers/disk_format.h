/* disk_format.h - the on-disk form of a disk-tier object (tiers/disk.c has
 * the table of every field): encoding and checking the header and chunk
 * table, and the byte shuffle of the compressed codecs.  Pure functions,
 * no I/O, so that the fuzz harness reaches the parser directly. */
#ifndef KVTIER_TIERS_DISK_FORMAT_H
#define KVTIER_TIERS_DISK_FORMAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <zstd.h>

#include "tiers/disk.h"

#define DISK_MAGIC "KVTDISK\0"
#define DISK_VERSION 1u
#define DISK_ALIGN ((size_t)4096)          /* O_DIRECT's unit: every section starts and ends on it */
#define DISK_CHUNK ((size_t)1 << 20)       /* raw bytes per chunk */
#define DISK_FIXED_LEN ((size_t)224)       /* the header before the chunk table */
#define DISK_ENTRY_LEN ((size_t)32)        /* one chunk table entry */
#define DISK_MAX_META ((size_t)16 << 20)
#define DISK_MAX_DATA ((uint64_t)1 << 40)  /* 2^20 chunks: a 32 MiB table */
#define DISK_NAME_MAX 64
#define DISK_WHY_LEN 256

enum disk_codec {
    DISK_CODEC_RAW = 0,
    DISK_CODEC_SHUF2_ZSTD = 1, /* bytes of each 16-bit element split into 2 planes, then zstd */
    DISK_CODEC_SHUF4_ZSTD = 2, /* the same over 32-bit elements */
};

struct disk_chunk {
    uint64_t off;      /* file offset, DISK_ALIGN-aligned */
    uint32_t raw_len;  /* bytes of data it holds */
    uint32_t stored_len;
    uint32_t codec;    /* enum disk_codec */
    uint64_t sum;      /* xxh3 of the stored bytes */
};

struct disk_hdr {
    uint32_t version, hdr_len;
    struct kv_disk_layout layout;
    char ns[DISK_NAME_MAX + 1], name[DISK_NAME_MAX + 1];
    uint64_t meta_off, meta_len, meta_sum, data_len;
    uint32_t chunk_size, n_chunks;
    struct disk_chunk *chunks; /* [n_chunks], malloc'd by disk_hdr_decode */
};

enum disk_check {
    DISK_VALID = 0,
    DISK_CORRUPT = 1, /* fails a check: quarantine */
    DISK_FOREIGN = 2, /* another format version or layout: leave it */
    DISK_NOMEM = 3,
};

static inline uint64_t disk_align(uint64_t n)
{
    return (n + DISK_ALIGN - 1) & ~(uint64_t)(DISK_ALIGN - 1);
}

/* Whether s is a name the tier accepts: [A-Za-z0-9_-]{1,64}. */
bool disk_name_ok(const char *s);
/* Bytes of a header with n chunks (checksum included, before padding). */
size_t disk_hdr_size(uint32_t n_chunks);
/* Chunks of data_len bytes. */
uint32_t disk_n_chunks(uint64_t data_len);
/* File offsets the writer and the checker agree on: the meta follows the
 * padded header, the first chunk the padded meta. */
uint64_t disk_meta_off(uint32_t n_chunks);
uint64_t disk_data_off(uint32_t n_chunks, uint64_t meta_len);
/* The file size the header describes. */
uint64_t disk_file_size(const struct disk_hdr *h);

/* Writes the header h (chunks filled, hdr_len set by it) to out[0 ..
 * disk_hdr_size) with its checksum. */
void disk_hdr_encode(struct disk_hdr *h, void *out);

/* From the first n bytes of a file: the header's total length, so that the
 * caller knows how much to read.  DISK_CORRUPT / DISK_FOREIGN with why. */
enum disk_check disk_hdr_peek(const void *buf, size_t n, uint32_t *hdr_len, char why[DISK_WHY_LEN]);
/* Checks and decodes a whole header of a file of file_size bytes: every
 * field in range, offsets exactly where the writer puts them, the file
 * exactly as long as they say.  On DISK_VALID h->chunks is allocated
 * (disk_hdr_release); on anything else nothing is and why says what failed. */
enum disk_check disk_hdr_decode(const void *buf, size_t n, uint64_t file_size, struct disk_hdr *h,
                                char why[DISK_WHY_LEN]);
void disk_hdr_release(struct disk_hdr *h);

/* The element size of a dtype's byte shuffle, and the codec using it. */
enum disk_codec disk_codec_for(uint32_t dtype);
size_t disk_codec_elem(enum disk_codec c);
/* out[b * k + i] = in[i * es + b] for the k = n / es whole elements; the
 * n % es tail bytes are copied as they are. */
void disk_shuffle(uint8_t *out, const uint8_t *in, size_t n, size_t es);
void disk_unshuffle(uint8_t *out, const uint8_t *in, size_t n, size_t es);

/* An object with an empty meta as one buffer, byte for byte the file the
 * tier would write: what the remote tier stores as a value.  With cctx
 * each chunk is shuffled and compressed (disk_codec_for the layout's
 * dtype) where that makes it smaller, raw otherwise; NULL: raw chunks.
 * NULL without memory. */
void *disk_blob_encode(const struct kv_disk_layout *layout, const char *ns, const char *name, const void *data,
                       size_t data_len, ZSTD_CCtx *cctx, size_t *out_len);
/* Checks such a buffer as a file is checked (header, offsets, size, every
 * chunk's checksum of its stored bytes) and that it was written for
 * layout, ns and name, holding at most max_data bytes: DISK_FOREIGN for
 * another layout or format, DISK_CORRUPT for anything else (a compressed
 * chunk that does not decompress to its length included), with why;
 * DISK_NOMEM.  On DISK_VALID *data points at the data: inside buf when
 * every chunk is raw (*owned NULL), else in *owned, a new buffer the
 * caller frees, decompressed with dctx. */
enum disk_check disk_blob_decode(const void *buf, size_t n, const struct kv_disk_layout *layout, const char *ns,
                                 const char *name, size_t max_data, ZSTD_DCtx *dctx, const void **data,
                                 size_t *data_len, void **owned, char why[DISK_WHY_LEN]);

/* One chunk's codec, shared by the disk tier and the blobs: raw[0, len)
 * shuffled (into scratch, len bytes) and compressed into out (len - 1
 * bytes at most); its stored length, or 0 when that is not smaller (the
 * chunk is stored raw). */
size_t disk_chunk_pack(ZSTD_CCtx *cctx, enum disk_codec codec, const uint8_t *raw, size_t len, uint8_t *scratch,
                       uint8_t *out);
/* The reverse: false when in[0, stored) does not decompress to exactly
 * raw_len bytes. */
bool disk_chunk_unpack(ZSTD_DCtx *dctx, enum disk_codec codec, const uint8_t *in, size_t stored, uint8_t *scratch,
                       uint8_t *out, size_t raw_len);

#endif
