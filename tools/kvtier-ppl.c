/* kvtier-ppl - token-level perplexity of a text file, computed by kvtier.
 *
 *   kvtier-ppl -m DIR -f FILE [--window N] [--threads N] [--kv-dtype auto|f32|bf16|f16]
 *              [--weights auto|q8_0|q4_k]
 *
 * The windowing is the one tools/train.py records in metrics.json (so the two
 * numbers are comparable): FILE is encoded without special tokens, the ids
 * are cut into consecutive chunks of N tokens (default 512, the last chunk
 * may be shorter), and each chunk c is fed to a fresh KV sequence as
 * [BOS] + c[:-1] in one forward pass with all logits; the logits at position
 * i predict c[i].  Log-softmax and the sum of log-likelihoods are in double.
 *
 * Prints one line on stdout:
 *   perplexity P tokens N windows W seconds S
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/args.h"
#include "util/clock.h"
#include "model/generate.h"
#include "model/runtime.h"
#include "util/version.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier-ppl -m DIR -f FILE [--window N] [--threads N] [--kv-dtype auto|f32|bf16|f16]\n"
               "                  [--weights auto|q8_0|q4_k]\n");
}

/* Reads a whole file into a NUL-terminated malloc'd buffer. */
static char *read_text(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvtier-ppl: %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1)
            break;
        char *p = realloc(buf, cap * 2);
        if (!p) {
            free(buf);
            buf = NULL;
        } else {
            buf = p;
            cap *= 2;
        }
    }
    bool bad = !buf || ferror(f);
    fclose(f);
    if (bad) {
        fprintf(stderr, "kvtier-ppl: %s: %s\n", path, buf ? "read error" : "out of memory");
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

/* Scores one chunk c[0..n) as [bos] + c[:-1] in a fresh sequence; adds the
 * summed NLL to *nll.  in and logits are scratch of window and
 * window*vocab elements. */
static enum model_status score_chunk(model *m, kv_store *store, int32_t bos, const int32_t *c, int n, int32_t *in,
                                     float *logits, double *nll, char *err)
{
    int vocab = model_get_config(m)->vocab_size;
    kv_seq *seq = NULL;
    enum tier_status ts = kv_seq_create(store, &(struct kv_seq_params){KV_DYNAMIC}, &seq);
    if (ts != TIER_OK) {
        snprintf(err, MODEL_ERR_LEN, "kv_seq_create: %s", tier_strerror(ts));
        return MODEL_ENOMEM;
    }
    in[0] = bos;
    memcpy(in + 1, c, (size_t)(n - 1) * sizeof(*in));
    struct fw_seq fs = {.kv = seq, .tokens = in, .n_tokens = n, .logits = logits, .want_all_logits = true};
    enum model_status st = model_forward(m, &fs, 1);
    if (st != MODEL_OK)
        snprintf(err, MODEL_ERR_LEN, "model_forward: %s", model_strerror(st));
    for (int i = 0; st == MODEL_OK && i < n; i++)
        *nll += gen_log_sum_exp(logits + (size_t)i * vocab, vocab) - logits[(size_t)i * vocab + (size_t)c[i]];
    kv_seq_free(seq);
    return st;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-ppl"))
        return 0;
    const char *dir = NULL, *path = NULL;
    int window = 512;
    struct runtime_params rp = {0};
    enum { O_WINDOW = 256, O_THREADS, O_KVDTYPE, O_WEIGHTS };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"file", required_argument, 0, 'f'},
        {"window", required_argument, 0, O_WINDOW}, {"threads", required_argument, 0, O_THREADS},
        {"kv-dtype", required_argument, 0, O_KVDTYPE}, {"weights", required_argument, 0, O_WEIGHTS},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "m:f:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': dir = optarg; break;
        case 'f': path = optarg; break;
        case O_WINDOW:
        case O_THREADS:
            if (!args_int(optarg, c == O_WINDOW ? 2 : 0, c == O_WINDOW ? 1 << 20 : 1024,
                          c == O_WINDOW ? &window : &rp.be.n_threads)) {
                fprintf(stderr, "kvtier-ppl: invalid value '%s' for --%s\n", optarg, c == O_WINDOW ? "window" : "threads");
                return 2;
            }
            break;
        case O_KVDTYPE:
            if (!model_kv_dtype_parse(optarg, &rp.model.kv_dtype)) {
                fprintf(stderr, "kvtier-ppl: invalid value '%s' for --kv-dtype\n", optarg);
                return 2;
            }
            break;
        case O_WEIGHTS:
            if (!model_weights_parse(optarg, &rp.model.weights)) {
                fprintf(stderr, "kvtier-ppl: invalid value '%s' for --weights\n", optarg);
                return 2;
            }
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!dir || !path || optind != argc) {
        usage(stderr);
        return 2;
    }

    char err[MODEL_ERR_LEN] = "";
    struct runtime rt = {0};
    struct tok_ids ids = {0};
    int32_t *in = NULL;
    float *logits = NULL;
    int rc = 1;
    size_t len = 0;
    char *text = read_text(path, &len);
    if (!text)
        return 1;
    /* Activations for a whole window, so each window is one forward chunk. */
    rp.model.max_batch_tokens = (int)window;
    enum model_status st = runtime_open(dir, &rp, &rt, err);
    if (st == MODEL_OK)
        st = model_from_text(tokenizer_encode(rt.tok, text, len, false, &ids, err));
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-ppl: %s: %s\n", model_strerror(st), err);
        goto out;
    }
    fprintf(stderr, "kvtier-ppl: KV cache %s\n", be_dtype_name(kv_store_dtype(rt.store)));
    model *m = rt.m;
    tokenizer *tok = rt.tok;
    const struct model_config *cfg = model_get_config(m);
    int32_t bos = tokenizer_bos_id(tok) >= 0 ? tokenizer_bos_id(tok) : cfg->bos_token_id;
    if (bos < 0 || ids.n == 0 || window > cfg->max_position_embeddings) {
        fprintf(stderr, "kvtier-ppl: %s\n",
                bos < 0      ? "the tokenizer and config.json name no BOS token to start each window with"
                : ids.n == 0 ? "the file encodes to no tokens"
                             : "--window is longer than max_position_embeddings");
        goto out;
    }
    in = malloc((size_t)window * sizeof(*in));
    logits = malloc((size_t)window * (size_t)cfg->vocab_size * sizeof(*logits));
    if (!in || !logits) {
        fprintf(stderr, "kvtier-ppl: out of memory\n");
        goto out;
    }

    double t0 = clock_s();
    double nll = 0;
    size_t n_windows = 0;
    for (size_t s = 0; s < ids.n; s += (size_t)window, n_windows++) {
        int n = (int)(ids.n - s < (size_t)window ? ids.n - s : (size_t)window);
        st = score_chunk(m, rt.store, bos, ids.ids + s, n, in, logits, &nll, err);
        if (st != MODEL_OK) {
            fprintf(stderr, "kvtier-ppl: window %zu: %s\n", n_windows, err);
            goto out;
        }
    }
    printf("perplexity %.4f tokens %zu windows %zu seconds %.2f\n", exp(nll / (double)ids.n), ids.n, n_windows,
           clock_s() - t0);
    rc = 0;
out:
    free(logits);
    free(in);
    free(ids.ids);
    runtime_close(&rt);
    free(text);
    return rc;
}
