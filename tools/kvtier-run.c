/* kvtier-run - loads a Hugging Face model directory and streams a
 * completion to stdout, without the daemon.
 *
 *   kvtier-run -m DIR -p "text" [-n N] [sampling options]
 *   kvtier-run -m DIR --ids 1,2,3 -n N --greedy --dump FILE [--no-cache]
 *   kvtier-run -m DIR --ids 1,2,3 -n N --num-beams B [--num-return R] [--length-penalty L]
 *              [--early-stopping true|false|never] [--min-new N] [--no-repeat-ngram N]
 *              [--num-beam-groups G --diversity-penalty D]
 *
 * --checkpoint-interval N: a state-space model's tokens between the
 * state's checkpoints (kvtierd's option; default 256): the prefill is cut
 * at each multiple.  A transformer has no checkpoints and ignores it.
 *
 * Beam search prints one line per returned hypothesis, best first:
 * "beam I score S eos 0|1 ids A,B,C" (the generated ids); each one's text
 * and the search's KV figures go to stderr (not with --quiet).
 *
 * --dump writes what the reference tests compare (little-endian): "KVTL",
 * int32 n_prompt, int32 n_gen, int32 vocab, int32 tokens[n_prompt+n_gen],
 * float32 logits[n_gen][vocab], row i being the logits that chose
 * generated token i.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/args.h"
#include "model/beam.h"
#include "model/runtime.h"
#include "util/version.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier-run -m DIR (-p TEXT | --ids 1,2,3) [-n N] [--greedy | --temp T] [--top-k K]\n"
               "       [--top-p P] [--min-p P] [--rep-pen R] [--seed S] [--stop STR]... [--ignore-eos]\n"
               "       [--no-cache] [--kv-dtype auto|f32|bf16|f16] [--weights auto|q8_0|q4_k] [--threads N] [--dump FILE]\n"
               "       [--checkpoint-interval N] [--cache dynamic|static|offloaded|offloaded_static] [--quiet]\n"
               "       [--num-beams B [--num-return R] [--length-penalty L] [--early-stopping true|false|never]\n"
               "        [--min-new N] [--no-repeat-ngram N] [--num-beam-groups G --diversity-penalty D]]\n");
}

/* The strategies a generation can take by name alone: quantized needs its
 * own parameters, which kvtier-run has no options for. */
static bool parse_strategy(const char *name, enum kv_strategy *out)
{
    for (enum kv_strategy st = KV_DYNAMIC; st <= KV_OFFLOADED_STATIC; st++)
        if (!strcmp(name, kv_strategy_name(st))) {
            *out = st;
            return true;
        }
    return false;
}

/* Logits rows kept in memory until the dump is written. */
struct dump {
    float *rows;
    size_t n, cap; /* in rows */
    bool failed;
};

static void dump_logits(void *ud, const float *logits, int vocab)
{
    struct dump *d = ud;
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 64;
        float *p = realloc(d->rows, cap * (size_t)vocab * sizeof(float));
        if (!p) {
            d->failed = true;
            return;
        }
        d->rows = p;
        d->cap = cap;
    }
    memcpy(d->rows + d->n++ * (size_t)vocab, logits, (size_t)vocab * sizeof(float));
}

static bool print_text(void *ud, const char *text, size_t len)
{
    (void)ud;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return true;
}

static int parse_ids(const char *s, struct tok_ids *out)
{
    while (*s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < 0 || v > INT32_MAX)
            return -1;
        if (tok_ids_push(out, (int32_t)v) != TEXT_OK)
            return -1;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return -1;
    }
    return 0;
}

static bool write_dump(const char *path, const struct gen_seq *gs, int vocab, const struct dump *d)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return false;
    int32_t hdr[4] = {0, (int32_t)gs->n_prompt, gs->gen, vocab};
    memcpy(hdr, "KVTL", 4);
    size_t cells = d->n * (size_t)vocab;
    bool ok = !d->failed && d->n == (size_t)gs->gen && fwrite(hdr, 4, 4, f) == 4 &&
              fwrite(gs->toks, 4, gs->n_toks, f) == gs->n_toks && fwrite(d->rows, 4, cells, f) == cells;
    return fclose(f) == 0 && ok;
}

/* Beam search over the prompt; prints the hypotheses (see the top). */
static bool run_beams(struct runtime *rt, const struct tok_ids *prompt, const struct gen_params *gp,
                      struct beam_params *bp, bool quiet)
{
    const struct model_config *c = model_get_config(rt->m);
    int32_t eos[MODEL_MAX_EOS + 1];
    bp->eos = eos;
    bp->n_eos = gp->ignore_eos ? 0 : gen_eos_ids(c, rt->tok, eos);
    bp->max_new = gp->max_new_tokens;
    char err[MODEL_ERR_LEN] = "";
    beam_search *b = NULL;
    struct beam_kv_stats ks;
    enum model_status st = beam_generate(rt->m, rt->store, gp->kv, prompt->ids, prompt->n, bp, &b, &ks, err);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-run: %s\n", err);
        return false;
    }
    for (int i = 0; i < beam_results(b); i++) {
        struct beam_hyp h = beam_result(b, i);
        printf("beam %d score %.9g eos %d ids ", i, (double)h.score, h.eos);
        for (int t = 0; t < h.n_gen; t++)
            printf(t ? ",%d" : "%d", h.toks[t]);
        putchar('\n');
        char *text = NULL;
        size_t len = 0;
        if (!quiet && tokenizer_decode(rt->tok, h.toks, (size_t)h.n_gen, true, &text, &len) == TEXT_OK)
            fprintf(stderr, "[beam %d: %.*s]\n", i, (int)len, text);
        free(text);
    }
    if (!quiet)
        fprintf(stderr, "[beam search: %d steps, KV bytes copied %llu, a whole-cache reorder each step: %llu]\n",
                ks.steps, (unsigned long long)ks.copied_bytes, (unsigned long long)ks.whole_reorder_bytes);
    beam_free(b);
    return fflush(stdout) == 0;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-run"))
        return 0;
    const char *dir = NULL, *text = NULL, *ids_arg = NULL, *dump_path = NULL;
    const char *stops[16];
    struct gen_params gp;
    gen_params_default(&gp);
    gp.max_new_tokens = 64;
    gp.stops = stops;
    struct runtime_params rp = {0};
    struct kv_seq_params kp = {0};
    bool quiet = false;
    struct beam_params bp = {.num_return = 1, .length_penalty = 1};
    enum { O_IDS = 256, O_GREEDY, O_TEMP, O_TOPK, O_TOPP, O_MINP, O_REP, O_SEED, O_STOP, O_IGN, O_NOCACHE,
           O_THREADS, O_DUMP, O_QUIET, O_KVDTYPE, O_BEAMS, O_NRET, O_LENPEN, O_EARLY, O_MINNEW, O_NGRAM,
           O_GROUPS, O_DIVERSITY, O_WEIGHTS, O_CKPT, O_CACHE };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"prompt", required_argument, 0, 'p'},
        {"max-new", required_argument, 0, 'n'}, {"ids", required_argument, 0, O_IDS},
        {"greedy", no_argument, 0, O_GREEDY}, {"temp", required_argument, 0, O_TEMP},
        {"top-k", required_argument, 0, O_TOPK}, {"top-p", required_argument, 0, O_TOPP},
        {"min-p", required_argument, 0, O_MINP}, {"rep-pen", required_argument, 0, O_REP},
        {"seed", required_argument, 0, O_SEED}, {"stop", required_argument, 0, O_STOP},
        {"ignore-eos", no_argument, 0, O_IGN}, {"no-cache", no_argument, 0, O_NOCACHE},
        {"threads", required_argument, 0, O_THREADS}, {"dump", required_argument, 0, O_DUMP},
        {"quiet", no_argument, 0, O_QUIET}, {"kv-dtype", required_argument, 0, O_KVDTYPE},
        {"num-beams", required_argument, 0, O_BEAMS}, {"num-return", required_argument, 0, O_NRET},
        {"length-penalty", required_argument, 0, O_LENPEN}, {"early-stopping", required_argument, 0, O_EARLY},
        {"min-new", required_argument, 0, O_MINNEW}, {"no-repeat-ngram", required_argument, 0, O_NGRAM},
        {"num-beam-groups", required_argument, 0, O_GROUPS}, {"diversity-penalty", required_argument, 0, O_DIVERSITY},
        {"weights", required_argument, 0, O_WEIGHTS}, {"checkpoint-interval", required_argument, 0, O_CKPT},
        {"cache", required_argument, 0, O_CACHE},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    int c, li = -1;
    while ((c = getopt_long(argc, argv, "m:p:n:h", opts, &li)) != -1) {
        bool ok = true;
        switch (c) {
        case 'm': dir = optarg; break;
        case 'p': text = optarg; break;
        case 'n': ok = args_int(optarg, 1, 1 << 24, &gp.max_new_tokens); break;
        case O_IDS: ids_arg = optarg; break;
        case O_GREEDY: gp.sampling.temperature = 0; break;
        case O_TEMP: ok = args_float(optarg, 0, 100, &gp.sampling.temperature); break;
        case O_TOPK: ok = args_int(optarg, 0, 1 << 24, &gp.sampling.top_k); break;
        case O_TOPP: ok = args_float(optarg, 0, 1, &gp.sampling.top_p) && gp.sampling.top_p > 0; break;
        case O_MINP: ok = args_float(optarg, 0, 1, &gp.sampling.min_p); break;
        case O_REP: ok = args_float(optarg, 0, 100, &gp.sampling.repetition_penalty) && gp.sampling.repetition_penalty > 0; break;
        case O_SEED: ok = args_u64(optarg, &gp.sampling.seed); break;
        case O_STOP:
            if (gp.n_stops == (int)(sizeof(stops) / sizeof(stops[0]))) {
                fprintf(stderr, "kvtier-run: at most 16 --stop strings\n");
                return 2;
            }
            stops[gp.n_stops++] = optarg;
            break;
        case O_IGN: gp.ignore_eos = true; break;
        case O_NOCACHE: gp.use_cache = false; break;
        case O_THREADS: ok = args_int(optarg, 0, 1024, &rp.be.n_threads); break;
        case O_DUMP: dump_path = optarg; break;
        case O_QUIET: quiet = true; break;
        case O_KVDTYPE: ok = model_kv_dtype_parse(optarg, &rp.model.kv_dtype); break;
        case O_WEIGHTS: ok = model_weights_parse(optarg, &rp.model.weights); break;
        case O_CKPT: ok = args_int(optarg, 1, 1 << 24, &rp.kv.checkpoint_interval); break;
        case O_CACHE: ok = parse_strategy(optarg, &kp.strategy); break;
        case O_BEAMS: ok = args_int(optarg, 2, BEAM_MAX_BEAMS, &bp.num_beams); break;
        case O_NRET: ok = args_int(optarg, 1, BEAM_MAX_BEAMS, &bp.num_return); break;
        case O_LENPEN: ok = args_float(optarg, -100, 100, &bp.length_penalty); break;
        case O_EARLY:
            ok = !strcmp(optarg, "true") || !strcmp(optarg, "false") || !strcmp(optarg, "never");
            bp.early_stopping = !strcmp(optarg, "true") ? BEAM_EARLY_TRUE
                                : !strcmp(optarg, "never") ? BEAM_EARLY_NEVER : BEAM_EARLY_FALSE;
            break;
        case O_MINNEW: ok = args_int(optarg, 0, 1 << 24, &bp.min_new); break;
        case O_NGRAM: ok = args_int(optarg, 0, 1 << 24, &bp.no_repeat_ngram); break;
        case O_GROUPS: ok = args_int(optarg, 1, BEAM_MAX_BEAMS, &bp.num_groups); break;
        case O_DIVERSITY: ok = args_float(optarg, 0, 1000, &bp.diversity_penalty); break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (!ok) {
            fprintf(stderr, "kvtier-run: invalid value '%s' for %s%s\n", optarg, li >= 0 ? "--" : "-",
                    li >= 0 ? opts[li].name : (const char[]){(char)c, 0});
            return 2;
        }
        li = -1;
    }
    if (!dir || (!text == !ids_arg)) {
        usage(stderr);
        return 2;
    }

    char err[MODEL_ERR_LEN] = "";
    struct runtime rt;
    struct tok_ids prompt = {0};
    struct gen_result res = {0};
    struct dump d = {0};
    int rc = 1;
    enum model_status st = runtime_open(dir, &rp, &rt, err);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-run: %s: %s\n", model_strerror(st), err);
        return 1;
    }
    if (!quiet)
        fprintf(stderr, "[KV cache %s, weights %s]\n", be_dtype_name(kv_store_dtype(rt.store)),
                be_dtype_name(model_get_weights(rt.m)->layers[0].wq.dtype)); /* the layer matrices: Q8_0 too */
    if (ids_arg ? parse_ids(ids_arg, &prompt) != 0
                : tokenizer_encode(rt.tok, text, strlen(text), true, &prompt, err) != TEXT_OK) {
        fprintf(stderr, "kvtier-run: bad prompt: %s\n", ids_arg ? "--ids wants comma-separated token ids" : err);
        goto out;
    }
    /* a static strategy's capacity: the prompt and every token asked for */
    if (kp.strategy == KV_STATIC || kp.strategy == KV_OFFLOADED_STATIC)
        kp.max_cache_len = (int64_t)prompt.n + gp.max_new_tokens;
    gp.kv = &kp;
    if (bp.num_beams) {
        rc = run_beams(&rt, &prompt, &gp, &bp, quiet) ? 0 : 1;
        goto out;
    }
    if (dump_path) {
        gp.on_logits = dump_logits;
        gp.logits_ud = &d;
    }
    st = generate(rt.m, rt.tok, rt.store, prompt.ids, prompt.n, &gp, quiet ? NULL : print_text, NULL, &res, err);
    if (!quiet)
        putchar('\n');
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-run: %s\n", err);
        goto out;
    }
    if (dump_path && !write_dump(dump_path, &res.seq, model_get_config(rt.m)->vocab_size, &d)) {
        fprintf(stderr, "kvtier-run: writing %s failed\n", dump_path);
        goto out;
    }
    if (!quiet)
        fprintf(stderr, "[%zu prompt tokens, %d generated, prefill %.1f ms, decode %.1f ms (%.2f tok/s)]\n",
                prompt.n, res.seq.gen, res.prefill_ms, res.decode_ms,
                res.decode_ms > 0 ? res.seq.gen * 1e3 / res.decode_ms : 0.0);
    rc = 0;
out:
    free(d.rows);
    gen_seq_free(&res.seq);
    free(prompt.ids);
    runtime_close(&rt);
    return rc;
}
