/* kvtier-encdec - greedy decoding of an encoder-decoder model (T5, BART)
 * over token ids, without the daemon: what the encoder-decoder oracle test
 * compares with tools/torchref.py.
 *
 *   kvtier-encdec -m DIR --enc 5,6,7 [--dec 0] -n N [--kv-dtype auto|f32|bf16|f16]
 *                 [--strategy dynamic|static|offloaded|quantized] [--cross-host] [--dump FILE] [--check K]
 *   kvtier-encdec -m DIR --enc-len L -n N --bench R
 *
 * --dec: the decoder's prompt (default: decoder_start_token_id).  Generates
 * N tokens greedily (EOS does not stop it).  --dump writes (little-endian)
 * "KVED", int32 n_gen, int32 vocab, int32 tokens[n_gen], float32
 * logits[n_gen][vocab], row i the logits that chose token i.  --check K:
 * afterwards, (1) crops the self-attention cache by K tokens and decodes
 * them again, (2) forks both caches K tokens before the end and decodes the
 * rest on the fork, (3) decodes afresh on a second self-attention cache
 * over the same cross-attention cache (the encoder not run again): each
 * must give the same tokens; prints "crop ok", "fork ok", "reuse ok".
 *
 * quantized: quanto, 8 bits, groups of 8 channels per token (they divide
 * every case's head_dim), a residual of 8 tokens; T5's attention reads
 * its position bias from the quantized blocks as from dense ones.
 * --device-mem BYTES: the device budget (K/M/G suffixes); a step that
 * runs out continues with the caches in the host tier.
 * --cross-host: once the encoder has run, the cross-attention cache moves
 * to the host tier as a device OOM would move it (kv_seq_offload).
 *
 * --bench R (with --enc-len L: an encoder input of L ids, i * 7919 mod
 * vocab): R rounds, each one generation of N tokens over the session's
 * cross-attention cache (encoded once, before the rounds) and one that
 * encodes the input again first, alternating; prints the median of each
 * and the KV bytes: the cross cache's, and both tiers' (streaming slots
 * included) at the end of a reusing generation.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/encdec.h"
#include "tiers/quant.h"
#include "util/args.h"
#include "util/clock.h"
#include "util/median.h"
#include "util/argmax.h"

#define MAX_IDS 8192

struct run {
    encdec *m;
    int vocab;
    float *logits; /* [n][vocab] */
    int32_t *toks; /* [n] */
};

/* Feeds prompt[0, np) to self, then greedy tokens out[from, n) (each fed
 * but the last); rows of logits from from.  Returns 0 or the failure. */
static enum model_status greedy(struct run *r, kv_seq *self, kv_seq *cross, const int32_t *prompt, int np, int from,
                                int n, int32_t *out, float *rows)
{
    enum model_status st = encdec_decode(r->m, self, cross, prompt, np, rows + (size_t)from * r->vocab);
    for (int i = from; st == MODEL_OK && i < n; i++) {
        out[i] = argmax_f32(rows + (size_t)i * r->vocab, r->vocab);
        if (i + 1 < n)
            st = encdec_decode(r->m, self, cross, &out[i], 1, rows + (size_t)(i + 1) * r->vocab);
    }
    return st;
}

/* One generation of n tokens on a fresh self cache over cross; with
 * encode, cross is emptied and the input encoded again first.  Seconds,
 * and the store's figures at the generation's end (both caches held). */
static enum model_status bench_once(struct run *r, kv_store *store, const struct kv_seq_params *sp, kv_seq **cross,
                                    const int32_t *enc, int n_enc, const int32_t *dec, int n_dec, int n,
                                    bool encode, bool cross_host, int32_t *out, float *rows, double *secs,
                                    struct kv_store_stats *ks)
{
    double t0 = clock_s();
    enum model_status st = MODEL_OK;
    if (encode) {
        kv_seq_free(*cross);
        *cross = NULL;
        struct kv_seq_params cp = {.no_prefix_cache = true};
        st = kv_seq_create(store, &cp, cross) == TIER_OK ? encdec_encode(r->m, *cross, enc, n_enc) : MODEL_ENOMEM;
        if (st == MODEL_OK && cross_host)
            st = kv_seq_offload(*cross, KV_FALLBACK_OOM) == TIER_OK ? MODEL_OK : MODEL_ENOMEM;
    }
    kv_seq *self = NULL;
    if (st == MODEL_OK)
        st = kv_seq_create(store, sp, &self) == TIER_OK ? MODEL_OK : MODEL_ENOMEM;
    if (st == MODEL_OK)
        st = greedy(r, self, *cross, dec, n_dec, 0, n, out, rows);
    *ks = kv_store_stats(store);
    kv_seq_free(self);
    *secs = clock_s() - t0;
    return st;
}

/* --bench: session reuse against re-encoding, alternating rounds. */
static enum model_status bench(struct run *r, kv_store *store, const struct kv_seq_params *sp, kv_seq **cross,
                               const int32_t *enc, int n_enc, const int32_t *dec, int n_dec, int n, int rounds,
                               bool cross_host, int32_t *out, float *rows)
{
    double *t = calloc(2 * (size_t)rounds, sizeof(double)), enc_s = clock_s();
    if (!t)
        return MODEL_ENOMEM;
    enum model_status st = encdec_encode(r->m, *cross, enc, n_enc);
    enc_s = clock_s() - enc_s;
    if (st == MODEL_OK && cross_host)
        st = kv_seq_offload(*cross, KV_FALLBACK_OOM) == TIER_OK ? MODEL_OK : MODEL_ENOMEM;
    size_t cross_bytes = kv_seq_bytes(*cross);
    struct kv_store_stats ks = {0}, ks_again;
    for (int i = 0; i < rounds && st == MODEL_OK; i++) {
        st = bench_once(r, store, sp, cross, enc, n_enc, dec, n_dec, n, false, cross_host, out, rows, &t[i], &ks);
        if (st == MODEL_OK)
            st = bench_once(r, store, sp, cross, enc, n_enc, dec, n_dec, n, true, cross_host, out, rows,
                            &t[rounds + i], &ks_again);
    }
    if (st == MODEL_OK) {
        qsort(t, (size_t)rounds, sizeof(double), median_cmp_double);
        qsort(t + rounds, (size_t)rounds, sizeof(double), median_cmp_double);
        double reuse = t[rounds / 2], again = t[rounds + rounds / 2];
        printf("encoder input %d tokens, %d generated per generation, %d rounds (medians)\n", n_enc, n, rounds);
        printf("first encode           %8.3f s\n", enc_s);
        printf("session reuse          %8.3f s per generation, %8.1f tokens/s\n", reuse, n / reuse);
        printf("re-encoding each time  %8.3f s per generation, %8.1f tokens/s\n", again, n / again);
        printf("ratio                  %8.2fx\n", again / reuse);
        printf("cross-attention KV     %8.2f MiB (written once, read every step; %s tier)\n",
               cross_bytes / 1048576.0, cross_host ? "host" : "device");
        printf("KV at a generation's end: device %.2f MiB (of which streaming slots %.2f), host %.2f MiB\n",
               ks.dev_bytes / 1048576.0, ks.slot_bytes / 1048576.0, ks.host_bytes / 1048576.0);
    }
    free(t);
    return st;
}

static bool same(const char *what, const int32_t *a, const int32_t *b, int n)
{
    for (int i = 0; i < n; i++)
        if (a[i] != b[i]) {
            fprintf(stderr, "kvtier-encdec: %s: token %d is %d, the fresh run's %d\n", what, i, b[i], a[i]);
            return false;
        }
    printf("%s ok\n", what);
    return true;
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"enc", required_argument, 0, 'e'}, {"dec", required_argument, 0, 'd'},
        {"kv-dtype", required_argument, 0, 'k'}, {"strategy", required_argument, 0, 's'},
        {"dump", required_argument, 0, 'o'}, {"check", required_argument, 0, 'c'},
        {"enc-len", required_argument, 0, 'L'}, {"bench", required_argument, 0, 'b'},
        {"cross-host", no_argument, 0, 'H'}, {"device-mem", required_argument, 0, 'D'}, {0, 0, 0, 0}};
    const char *dir = NULL, *dump = NULL, *strategy = "dynamic";
    static int enc[MAX_IDS], dec[MAX_IDS];
    int n_enc = 0, n_dec = 0, n = 8, check = 0, enc_len = 0, rounds = 0, c;
    bool cross_host = false;
    size_t device_mem = 0;
    struct model_params mp = {0};
    while ((c = getopt_long(argc, argv, "m:n:", opts, NULL)) != -1) {
        switch (c) {
        case 'm': dir = optarg; break;
        case 'e': if (!args_int_list(optarg, 0, 1 << 30, enc, MAX_IDS, &n_enc)) return args_invalid(argv[0], opts, c, optarg); break;
        case 'd': if (!args_int_list(optarg, 0, 1 << 30, dec, MAX_IDS, &n_dec)) return args_invalid(argv[0], opts, c, optarg); break;
        case 'n': if (!args_int(optarg, 1, MAX_IDS, &n)) return args_invalid(argv[0], opts, c, optarg); break;
        case 'c': if (!args_int(optarg, 1, MAX_IDS, &check)) return args_invalid(argv[0], opts, c, optarg); break;
        case 'k': if (!model_kv_dtype_parse(optarg, &mp.kv_dtype)) return args_invalid(argv[0], opts, c, optarg); break;
        case 'L': if (!args_int(optarg, 1, MAX_IDS, &enc_len)) return args_invalid(argv[0], opts, c, optarg); break;
        case 'b': if (!args_int(optarg, 1, 1000, &rounds)) return args_invalid(argv[0], opts, c, optarg); break;
        case 's': strategy = optarg; break;
        case 'H': cross_host = true; break;
        case 'D': if (!args_size(optarg, &device_mem)) return args_invalid(argv[0], opts, c, optarg); break;
        case 'o': dump = optarg; break;
        default:
            fprintf(stderr, "usage: kvtier-encdec -m DIR --enc IDS [--dec IDS] [-n N] [--kv-dtype T] "
                            "[--strategy dynamic|static|offloaded] [--dump FILE] [--check K]\n");
            return 2;
        }
    }
    struct kv_seq_params sp = {.no_prefix_cache = true};
    if (!strcmp(strategy, "static"))
        sp = (struct kv_seq_params){.strategy = KV_STATIC, .max_cache_len = n_dec + n + 16, .no_prefix_cache = true};
    else if (!strcmp(strategy, "offloaded"))
        sp.strategy = KV_OFFLOADED;
    else if (!strcmp(strategy, "quantized")) {
        sp.strategy = KV_QUANTIZED;
        sp.quant = kv_quant_defaults(KVQ_QUANTO);
        sp.quant.nbits = 8;
        sp.quant.q_group_size = 8;
        sp.quant.residual_length = 8;
    } else if (strcmp(strategy, "dynamic"))
        return args_invalid(argv[0], opts, 's', strategy);
    if (!dir || (!n_enc && !enc_len) || check >= n) {
        fprintf(stderr, "kvtier-encdec: -m and --enc (or --enc-len) are required, --check below -n\n");
        return 2;
    }
    char err[MODEL_ERR_LEN];
    be_backend *be = NULL;
    encdec *m = NULL;
    kv_store *store = NULL;
    kv_seq *self = NULL, *cross = NULL, *self2 = NULL, *fork_self = NULL, *fork_cross = NULL;
    int rc = 1;
    if (be_open("cpu", &(struct be_params){.device_mem = device_mem}, &be) != BE_OK) {
        fprintf(stderr, "kvtier-encdec: cannot open the cpu backend\n");
        return 1;
    }
    enum model_status st = encdec_load(dir, be, &mp, &m, err);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-encdec: %s: %s\n", model_strerror(st), err);
        be_free(be);
        return 1;
    }
    const struct encdec_config *cfg = encdec_get_config(m);
    if (!n_dec)
        dec[n_dec++] = cfg->decoder_start_token_id;
    if (enc_len) {
        n_enc = enc_len;
        for (int i = 0; i < n_enc; i++)
            enc[i] = (int)((int64_t)i * 7919 % cfg->vocab_size);
    }
    struct kv_geom g = encdec_kv_geom(m);
    struct run r = {.m = m, .vocab = cfg->vocab_size};
    r.logits = malloc((size_t)n * (size_t)r.vocab * sizeof(float));
    r.toks = calloc((size_t)n, sizeof(int32_t));
    int32_t *again = calloc((size_t)n, sizeof(int32_t));
    float *rows = malloc((size_t)n * (size_t)r.vocab * sizeof(float));
    struct kv_seq_params cp = {.no_prefix_cache = true}; /* the cross cache: dynamic, on the device */
    if (!r.logits || !r.toks || !again || !rows || kv_store_open(be, &g, &(struct kv_store_params){0}, &store)) {
        fprintf(stderr, "kvtier-encdec: out of memory\n");
        goto out;
    }
    if (kv_seq_create(store, &cp, &cross) != TIER_OK || kv_seq_create(store, &sp, &self) != TIER_OK) {
        fprintf(stderr, "kvtier-encdec: %s\n", kv_store_errmsg(store));
        goto out;
    }
    if (rounds) {
        st = bench(&r, store, &sp, &cross, (const int32_t *)enc, n_enc, (const int32_t *)dec, n_dec, n, rounds,
                   cross_host, r.toks, r.logits);
        rc = st == MODEL_OK ? 0 : 1;
        goto out;
    }
    st = encdec_encode(m, cross, (const int32_t *)enc, n_enc);
    if (st == MODEL_OK && cross_host)
        st = kv_seq_offload(cross, KV_FALLBACK_OOM) == TIER_OK ? MODEL_OK : MODEL_ENOMEM;
    if (st == MODEL_OK)
        st = greedy(&r, self, cross, (const int32_t *)dec, n_dec, 0, n, r.toks, r.logits);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-encdec: %s (%s)\n", model_strerror(st), kv_store_errmsg(store));
        goto out;
    }
    struct kv_seq_stats xs = kv_seq_stats(cross);
    struct kv_seq_stats ss = kv_seq_stats(self);
    fprintf(stderr, "cross-attention cache: %lld tokens, device %zu bytes, host %zu bytes, streamed through the "
            "device slots in %llu steps%s\n", (long long)kv_seq_length(cross), xs.dev_bytes, xs.host_bytes,
            (unsigned long long)xs.xfer.steps,
            xs.fallback == KV_FALLBACK_OOM ? ", moved to the host tier by a device OOM" : "");
    fprintf(stderr, "self-attention cache: %lld tokens, device %zu bytes, host %zu bytes%s\n",
            (long long)kv_seq_length(self), ss.dev_bytes, ss.host_bytes,
            ss.fallback == KV_FALLBACK_OOM ? ", moved to the host tier by a device OOM" : "");
    for (int i = 0; i < n; i++)
        printf("%s%d", i ? "," : "", r.toks[i]);
    printf("\n");
    if (check) {
        /* self holds the prompt and toks[0, n - 1): keep up to toks[n - 1 - check) */
        memcpy(again, r.toks, (size_t)n * sizeof(int32_t));
        int from = n - check;
        st = kv_seq_crop(self, -(int64_t)check) == TIER_OK ? MODEL_OK : MODEL_EINVAL;
        if (st != MODEL_OK)
            fprintf(stderr, "kvtier-encdec: crop: %s\n", kv_store_errmsg(store));
        if (st == MODEL_OK)
            st = greedy(&r, self, cross, &r.toks[from - 1], 1, from, n, again, rows);
        if (st != MODEL_OK || !same("crop", r.toks, again, n))
            goto out;
        /* the fork: self now again at n - 1 tokens; crop back, fork, go on */
        if (kv_seq_crop(self, -(int64_t)check) != TIER_OK || kv_seq_fork(self, &fork_self) != TIER_OK ||
            kv_seq_fork(cross, &fork_cross) != TIER_OK)
            goto out;
        memcpy(again, r.toks, (size_t)n * sizeof(int32_t));
        st = greedy(&r, fork_self, fork_cross, &r.toks[from - 1], 1, from, n, again, rows);
        if (st != MODEL_OK || !same("fork", r.toks, again, n))
            goto out;
        /* a second generation over the same encoder output */
        if (kv_seq_create(store, &sp, &self2) != TIER_OK)
            goto out;
        st = greedy(&r, self2, cross, (const int32_t *)dec, n_dec, 0, n, again, rows);
        if (st != MODEL_OK || !same("reuse", r.toks, again, n))
            goto out;
    }
    if (dump) {
        FILE *f = fopen(dump, "wb");
        int32_t head[2] = {n, r.vocab};
        bool ok = f && fwrite("KVED", 1, 4, f) == 4 && fwrite(head, sizeof head, 1, f) == 1 &&
                  fwrite(r.toks, sizeof(int32_t), (size_t)n, f) == (size_t)n &&
                  fwrite(r.logits, sizeof(float) * (size_t)r.vocab, (size_t)n, f) == (size_t)n;
        if (f && fclose(f))
            ok = false;
        if (!ok) {
            fprintf(stderr, "kvtier-encdec: cannot write %s\n", dump);
            goto out;
        }
    }
    rc = 0;
out:
    if (st != MODEL_OK && rc)
        fprintf(stderr, "kvtier-encdec: %s\n", model_strerror(st));
    kv_seq_free(self2);
    kv_seq_free(fork_self);
    kv_seq_free(fork_cross);
    kv_seq_free(self);
    kv_seq_free(cross);
    kv_store_free(store);
    free(r.logits);
    free(r.toks);
    free(again);
    free(rows);
    encdec_free(m);
    be_free(be);
    return rc;
}
