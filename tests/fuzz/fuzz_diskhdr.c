/* fuzz_diskhdr.c - the disk tier's header and chunk-table parser
 * (disk_hdr_peek, disk_hdr_decode in tiers/disk_format.c).  The input is
 * a mode byte, the file size (8 bytes, little-endian) and the header's
 * bytes.  Mode bit 0 recomputes the trailing header checksum first, so
 * that mutations reach the checks behind it.
 *
 * Invariants: a rejected header has a message and allocates nothing; an
 * accepted one re-encodes to exactly its input bytes, describes a file of
 * exactly the given size, and its sections are 4 KiB-aligned. */
#include <xxhash.h>

#include "tiers/disk_format.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 9 || size > (64 << 20))
        return 0;
    uint8_t mode = data[0];
    uint64_t file_size = 0;
    for (int i = 0; i < 8; i++)
        file_size |= (uint64_t)data[1 + i] << (8 * i);
    size_t n = size - 9;
    uint8_t *buf = malloc(n ? n : 1);
    FUZZ_CHECK(buf, "malloc");
    memcpy(buf, data + 9, n);
    if ((mode & 1) && n >= DISK_FIXED_LEN) {
        uint32_t len = (uint32_t)buf[12] | (uint32_t)buf[13] << 8 | (uint32_t)buf[14] << 16 | (uint32_t)buf[15] << 24;
        if (len >= 8 && len <= n) {
            uint64_t sum = XXH3_64bits(buf, len - 8);
            for (int i = 0; i < 8; i++)
                buf[len - 8 + i] = (uint8_t)(sum >> (8 * i));
        }
    }

    char why[DISK_WHY_LEN];
    why[0] = '\0';
    uint32_t hdr_len = 0;
    enum disk_check pk = disk_hdr_peek(buf, n, &hdr_len, why);
    FUZZ_CHECK(pk == DISK_VALID || pk == DISK_CORRUPT || pk == DISK_FOREIGN, "peek status %d", pk);
    FUZZ_CHECK(pk == DISK_VALID || why[0], "peek rejected without a message");

    struct disk_hdr h = {0};
    why[0] = '\0';
    enum disk_check st = disk_hdr_decode(buf, n, file_size, &h, why);
    if (getenv("KVTIER_FUZZ_VERBOSE"))
        fprintf(stderr, "status %d: %s\n", st, st ? why : "ok");
    if (st != DISK_VALID) {
        FUZZ_CHECK(st == DISK_CORRUPT || st == DISK_FOREIGN || st == DISK_NOMEM, "status %d", st);
        FUZZ_CHECK(why[0], "rejected without a message");
        FUZZ_CHECK(!h.chunks, "a chunk table left after a rejection");
        free(buf);
        return 0;
    }
    FUZZ_CHECK(pk == DISK_VALID && h.hdr_len == hdr_len, "decode accepted what peek did not");
    FUZZ_CHECK(h.hdr_len == disk_hdr_size(h.n_chunks) && h.hdr_len <= n, "header size %u", h.hdr_len);
    FUZZ_CHECK(disk_file_size(&h) == file_size, "file size %llu, header says %llu", (unsigned long long)file_size,
               (unsigned long long)disk_file_size(&h));
    FUZZ_CHECK(h.meta_off % DISK_ALIGN == 0 && h.meta_off >= h.hdr_len, "meta offset %llu",
               (unsigned long long)h.meta_off);
    uint64_t raw = 0;
    for (uint32_t i = 0; i < h.n_chunks; i++) {
        const struct disk_chunk *c = &h.chunks[i];
        FUZZ_CHECK(c->off % DISK_ALIGN == 0 && c->off >= h.meta_off + h.meta_len, "chunk %u offset", i);
        FUZZ_CHECK(c->stored_len <= c->raw_len && c->raw_len <= DISK_CHUNK, "chunk %u lengths", i);
        raw += c->raw_len;
    }
    FUZZ_CHECK(raw == h.data_len, "chunks hold %llu bytes of %llu", (unsigned long long)raw,
               (unsigned long long)h.data_len);
    uint8_t *again = malloc(h.hdr_len);
    FUZZ_CHECK(again, "malloc");
    uint32_t len = h.hdr_len;
    disk_hdr_encode(&h, again);
    FUZZ_CHECK(h.hdr_len == len && memcmp(again, buf, len) == 0, "does not re-encode to the same bytes");
    free(again);
    disk_hdr_release(&h);
    free(buf);
    return 0;
}
