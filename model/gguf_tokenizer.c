/* gguf_tokenizer.c - a GGUF file's vocabulary as the tokenizer.json and
 * tokenizer_config.json Hugging Face would write for it, loaded by the
 * text layer's one loader (tokenizer_load_json).
 *
 * tokenizer.ggml.model "gpt2": byte-level BPE; the tokens are already in
 * GPT-2's byte alphabet and the merges are "a b" strings, as in
 * tokenizer.json.  The split regex is named by tokenizer.ggml.pre; PRE
 * below holds the ones llama.cpp names, as their tokenizer.json files
 * write them.
 * tokenizer.ggml.model "llama": SentencePiece BPE with scores, as
 * transformers' LlamaConverter writes it: "▁" for spaces (and one in front
 * of the text unless add_space_prefix is false), <0xNN> byte fallback,
 * and merges made from the scores: every split of a token into two tokens
 * is a merge, the higher the token's score the earlier.
 * Control tokens (token_type 3) become special added tokens, user-defined
 * ones (4) plain added tokens, the unknown token (2) both a special added
 * token and the vocabulary's unk_token, as in transformers' Llama files;
 * the other types are the model's vocabulary.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/generate.h"
#include "model/gguf.h"

enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };

static const struct pre {
    const char *name;
    const char *regex;
    bool ignore_merges; /* a word that is a token is one token, merges or not (Llama 3) */
    bool nfc;           /* the text is NFC-normalised first (Qwen's tokenizer.json) */
} PRE[] = {
    {"gpt-2", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+", false, false},
    {"llama-bpe",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     true, false},
    {"qwen2",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     false, true},
};

const char *gguf_pre_name(const char *regex, bool ignore_merges, bool nfc)
{
    for (size_t i = 0; i < sizeof PRE / sizeof PRE[0]; i++)
        if (!strcmp(regex, PRE[i].regex) && ignore_merges == PRE[i].ignore_merges && nfc == PRE[i].nfc)
            return PRE[i].name;
    return NULL;
}

/* What reading the vocabulary shares. */
struct vocab {
    const struct gguf *g;
    char *err;
    uint64_t n;
    struct gguf_str *tok; /* [n] */
    int32_t *type;        /* [n] */
    float *score;         /* [n] or NULL */
};

static enum model_status oom(const struct vocab *v)
{
    return model_errf(v->err, MODEL_ENOMEM, "%s: out of memory building the tokenizer", v->g->name);
}

static json_t *jstr(const struct gguf_str s)
{
    return json_stringn(s.p, s.n);
}

static enum model_status read_vocab(struct vocab *v)
{
    const struct gguf_kv *toks, *types, *scores;
    enum model_status st;
    if ((st = gguf_get_arr(v->g, "tokenizer.ggml.tokens", true, GGUF_STR, &toks, v->err)) ||
        (st = gguf_get_arr(v->g, "tokenizer.ggml.token_type", false, GGUF_I32, &types, v->err)) ||
        (st = gguf_get_arr(v->g, "tokenizer.ggml.scores", false, GGUF_F32, &scores, v->err)))
        return st;
    v->n = toks->n;
    if (v->n == 0 || v->n > (1 << 22))
        return model_errf(v->err, MODEL_EFORMAT, "%s: tokenizer.ggml.tokens holds %llu tokens (1 to %d)", v->g->name,
                          (unsigned long long)v->n, 1 << 22);
    if ((types && types->n != v->n) || (scores && scores->n != v->n))
        return model_errf(v->err, MODEL_EFORMAT, "%s: tokenizer.ggml.%s has %llu entries for %llu tokens", v->g->name,
                          types && types->n != v->n ? "token_type" : "scores",
                          (unsigned long long)(types && types->n != v->n ? types->n : scores->n),
                          (unsigned long long)v->n);
    v->tok = malloc(v->n * sizeof *v->tok);
    v->type = malloc(v->n * sizeof *v->type);
    v->score = scores ? malloc(v->n * sizeof *v->score) : NULL;
    if (!v->tok || !v->type || (scores && !v->score))
        return oom(v);
    const uint8_t *p = toks->val;
    for (uint64_t i = 0; i < v->n; i++) {
        v->tok[i] = gguf_next_str(&p);
        if (types)
            memcpy(&v->type[i], types->val + 4 * i, 4);
        else
            v->type[i] = TT_NORMAL;
        if (scores)
            memcpy(&v->score[i], scores->val + 4 * i, 4);
        if (!v->tok[i].n || memchr(v->tok[i].p, '\0', v->tok[i].n))
            return model_errf(v->err, MODEL_EFORMAT, "%s: tokenizer.ggml.tokens[%llu] is empty or holds a NUL byte",
                              v->g->name, (unsigned long long)i);
    }
    return MODEL_OK;
}

/* model.vocab and added_tokens. */
static enum model_status build_vocab(const struct vocab *v, json_t *vocab, json_t *added)
{
    for (uint64_t i = 0; i < v->n; i++) {
        const struct gguf_str t = v->tok[i];
        /* the unknown token is matched in text as llama.cpp's special
         * tokens are, and is the vocabulary's unk_token besides */
        if (v->type[i] == TT_CONTROL || v->type[i] == TT_USER || v->type[i] == TT_UNKNOWN) {
            json_t *a = json_pack("{s:I, s:o, s:b, s:b, s:b, s:b, s:b}", "id", (json_int_t)i, "content", jstr(t),
                                  "special", v->type[i] != TT_USER, "lstrip", 0, "rstrip", 0, "single_word", 0,
                                  "normalized", 0);
            if (!a)
                return json_stringn(t.p, t.n) ? oom(v)
                                              : model_errf(v->err, MODEL_EFORMAT,
                                                           "%s: tokenizer.ggml.tokens[%llu] is not valid UTF-8",
                                                           v->g->name, (unsigned long long)i);
            if (json_array_append_new(added, a))
                return oom(v);
            if (v->type[i] != TT_UNKNOWN)
                continue;
        }
        if (json_object_getn(vocab, t.p, t.n))
            return model_errf(v->err, MODEL_EFORMAT, "%s: tokenizer.ggml.tokens[%llu] \"%.*s\" appears twice",
                              v->g->name, (unsigned long long)i, (int)(t.n > 64 ? 64 : t.n), t.p);
        json_t *id = json_integer((json_int_t)i);
        if (!id || json_object_setn_new(vocab, t.p, t.n, id))
            return json_stringn(t.p, t.n) ? oom(v)
                                          : model_errf(v->err, MODEL_EFORMAT,
                                                       "%s: tokenizer.ggml.tokens[%llu] is not valid UTF-8",
                                                       v->g->name, (unsigned long long)i);
    }
    return MODEL_OK;
}

/* ---- SentencePiece: merges from scores ------------------------------------ */

#define MAX_PIECE 256 /* bytes of a token spm_merges splits */

struct merge {
    float score;
    int32_t merged, left, right;
};

static int merge_cmp(const void *a, const void *b)
{
    const struct merge *x = a, *y = b;
    if (x->score != y->score)
        return x->score > y->score ? -1 : 1;
    if (x->merged != y->merged)
        return x->merged < y->merged ? -1 : 1;
    return (x->left > y->left) - (x->left < y->left);
}

static enum model_status spm_merges(const struct vocab *v, json_t *vocab, json_t *merges)
{
    size_t n = 0, cap = 0;
    struct merge *m = NULL;
    enum model_status st = MODEL_OK;
    for (uint64_t i = 0; i < v->n && st == MODEL_OK; i++) {
        const struct gguf_str t = v->tok[i];
        /* SentencePiece's pieces are at most 16 characters; the bound keeps
         * a hostile file's one huge token from costing its length squared */
        if ((v->type[i] != TT_NORMAL && v->type[i] != TT_USER) || t.n > MAX_PIECE)
            continue;
        for (uint64_t k = 1; k < t.n; k++) {
            if (((unsigned char)t.p[k] & 0xC0) == 0x80) /* inside a character */
                continue;
            json_t *l = json_object_getn(vocab, t.p, k), *r = json_object_getn(vocab, t.p + k, t.n - k);
            if (!l || !r)
                continue;
            if (n == cap) {
                cap = cap ? 2 * cap : 1024;
                struct merge *p = realloc(m, cap * sizeof *m);
                if (!p) {
                    st = oom(v);
                    break;
                }
                m = p;
            }
            m[n++] = (struct merge){v->score[i], (int32_t)i, (int32_t)json_integer_value(l),
                                    (int32_t)json_integer_value(r)};
        }
    }
    if (st == MODEL_OK && n) /* m is NULL without merges */
        qsort(m, n, sizeof *m, merge_cmp);
    for (size_t i = 0; i < n && st == MODEL_OK; i++) {
        const struct gguf_str a = v->tok[m[i].left], b = v->tok[m[i].right];
        json_t *pair = json_pack("[s%, s%]", a.p, (size_t)a.n, b.p, (size_t)b.n);
        if (!pair || json_array_append_new(merges, pair))
            st = oom(v);
    }
    free(m);
    return st;
}

/* ---- the two files ------------------------------------------------------- */

static const struct pre *find_pre(const struct gguf *g, struct gguf_str name)
{
    for (size_t i = 0; i < sizeof PRE / sizeof PRE[0]; i++)
        if (name.n == strlen(PRE[i].name) && !memcmp(name.p, PRE[i].name, name.n))
            return &PRE[i];
    (void)g;
    return NULL;
}

static enum model_status tokenizer_json(const struct vocab *v, bool spm, json_t *root, char *err)
{
    const struct gguf *g = v->g;
    json_t *vocab = json_object(), *added = json_array(), *merges = json_array();
    json_t *bpe = json_pack("{s:s, s:o, s:o}", "type", "BPE", "vocab", vocab, "merges", merges);
    enum model_status st = bpe && added && !json_object_set_new(root, "added_tokens", added) ? MODEL_OK : oom(v);
    if (st == MODEL_OK && json_object_set_new(root, "model", bpe))
        st = oom(v);
    if (st == MODEL_OK)
        st = build_vocab(v, vocab, added);
    if (st != MODEL_OK)
        return st;
    if (spm) {
        bool prefix = true;
        if ((st = gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", false, &prefix, err)) ||
            (st = spm_merges(v, vocab, merges)))
            return st;
        int64_t unk = -1;
        if ((st = gguf_get_int(g, "tokenizer.ggml.unknown_token_id", false, 0, (int64_t)v->n - 1, &unk, err)))
            return st;
        for (uint64_t i = 0; unk < 0 && i < v->n; i++)
            if (v->type[i] == TT_UNKNOWN)
                unk = (int64_t)i;
        json_t *norm = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}]}", "type", "Sequence", "normalizers", "type",
                                 "Replace", "pattern", "String", " ", "content", "\xe2\x96\x81");
        json_t *dec = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}]}", "type", "Sequence", "decoders",
                                "type", "Replace", "pattern", "String", "\xe2\x96\x81", "content", " ", "type",
                                "ByteFallback", "type", "Fuse");
        if (!norm || !dec || json_object_set_new(root, "normalizer", norm) ||
            json_object_set_new(root, "decoder", dec))
            return oom(v);
        /* HF's Llama tokenizers: the Prepend normaliser and the decoder's
         * Strip of the space it becomes */
        if (prefix && (json_array_insert_new(json_object_get(norm, "normalizers"), 0,
                                             json_pack("{s:s, s:s}", "type", "Prepend", "prepend", "\xe2\x96\x81")) ||
                       json_array_append_new(json_object_get(dec, "decoders"),
                                             json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", " ",
                                                       "start", 1, "stop", 0))))
            return oom(v);
        if (st == MODEL_OK && (json_object_set_new(bpe, "byte_fallback", json_true()) ||
                               json_object_set_new(bpe, "fuse_unk", json_true()) ||
                               (unk >= 0 && json_object_set_new(bpe, "unk_token", jstr(v->tok[unk])))))
            st = oom(v);
        return st;
    }
    struct gguf_str pre_name;
    const struct gguf_kv *gm;
    if ((st = gguf_get_str(g, "tokenizer.ggml.pre", true, &pre_name, err)) ||
        (st = gguf_get_arr(g, "tokenizer.ggml.merges", true, GGUF_STR, &gm, err)))
        return st;
    const struct pre *pre = find_pre(g, pre_name);
    if (!pre)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: tokenizer.ggml.pre \"%.*s\" is not supported (gpt-2, llama-bpe, qwen2)",
                          g->name, (int)(pre_name.n > 64 ? 64 : pre_name.n), pre_name.p);
    const uint8_t *p = gm->val;
    for (uint64_t i = 0; i < gm->n && st == MODEL_OK; i++) {
        json_t *s = jstr(gguf_next_str(&p));
        if (!s || json_array_append_new(merges, s))
            st = model_errf(err, MODEL_EFORMAT, "%s: tokenizer.ggml.merges[%llu] is not valid UTF-8", g->name,
                            (unsigned long long)i);
    }
    json_t *pt = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}", "type", "Sequence",
                           "pretokenizers", "type", "Split", "pattern", "Regex", pre->regex, "behavior", "Isolated",
                           "invert", 0, "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 0);
    json_t *dec = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 1, "trim_offsets", 1,
                            "use_regex", 1);
    if (st == MODEL_OK && pre->nfc && json_object_set_new(root, "normalizer", json_pack("{s:s}", "type", "NFC")))
        st = oom(v);
    if (st == MODEL_OK && (!pt || !dec || json_object_set(root, "pre_tokenizer", pt) ||
                           json_object_set(root, "decoder", dec) ||
                           json_object_set_new(bpe, "ignore_merges", json_boolean(pre->ignore_merges))))
        st = oom(v);
    json_decref(pt);
    json_decref(dec);
    return st;
}

/* tokenizer_config.json: the special tokens by their text, add_bos_token,
 * add_eos_token, chat_template. */
static enum model_status tokenizer_config(const struct vocab *v, bool spm, json_t *cfg, char *err)
{
    const struct gguf *g = v->g;
    static const char *const ids[] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"};
    static const char *const keys[] = {"bos_token", "eos_token"};
    enum model_status st;
    for (int i = 0; i < 2; i++) {
        int64_t id = -1;
        if ((st = gguf_get_int(g, ids[i], false, 0, (int64_t)v->n - 1, &id, err)))
            return st;
        if (id >= 0 && json_object_set_new(cfg, keys[i], jstr(v->tok[id])))
            return oom(v);
    }
    /* llama.cpp's defaults: BOS for SentencePiece vocabularies, none for BPE */
    bool add_bos = spm, add_eos = false;
    struct gguf_str tpl = {NULL, 0};
    if ((st = gguf_get_bool(g, "tokenizer.ggml.add_bos_token", false, &add_bos, err)) ||
        (st = gguf_get_bool(g, "tokenizer.ggml.add_eos_token", false, &add_eos, err)) ||
        (st = gguf_get_str(g, "tokenizer.chat_template", false, &tpl, err)))
        return st;
    if (json_object_set_new(cfg, "add_bos_token", json_boolean(add_bos)) ||
        json_object_set_new(cfg, "add_eos_token", json_boolean(add_eos)))
        return oom(v);
    if (tpl.p && json_object_set_new(cfg, "chat_template", jstr(tpl)))
        return model_errf(err, MODEL_EFORMAT, "%s: tokenizer.chat_template is not valid UTF-8", g->name);
    return MODEL_OK;
}

enum model_status gguf_tokenizer_load(const char *path, tokenizer **out, char *err)
{
    struct gguf *g;
    *out = NULL;
    enum model_status st = gguf_open(path, &g, err);
    if (st != MODEL_OK)
        return st;
    struct vocab v = {.g = g, .err = err};
    struct gguf_str kind;
    json_t *root = json_object(), *cfg = json_object();
    char *text = NULL;
    bool spm = false;
    if ((st = gguf_get_str(g, "tokenizer.ggml.model", true, &kind, err)) == MODEL_OK) {
        spm = kind.n == 5 && !memcmp(kind.p, "llama", 5);
        if (!spm && !(kind.n == 4 && !memcmp(kind.p, "gpt2", 4)))
            st = model_errf(err, MODEL_EUNSUPPORTED, "%s: tokenizer.ggml.model \"%.*s\" is not supported (llama, gpt2)",
                            path, (int)(kind.n > 32 ? 32 : kind.n), kind.p);
    }
    if (st == MODEL_OK && (!root || !cfg))
        st = oom(&v);
    if (st == MODEL_OK)
        st = read_vocab(&v);
    if (st == MODEL_OK && spm && !v.score)
        st = model_errf(err, MODEL_EFORMAT, "%s: tokenizer.ggml.scores is missing (SentencePiece merges need them)",
                        path);
    if (st == MODEL_OK)
        st = tokenizer_json(&v, spm, root, err);
    if (st == MODEL_OK)
        st = tokenizer_config(&v, spm, cfg, err);
    if (st == MODEL_OK && !(text = json_dumps(root, JSON_COMPACT)))
        st = oom(&v);
    if (st == MODEL_OK) {
        char name[PATH_MAX + 32];
        snprintf(name, sizeof name, "%s (tokenizer metadata as tokenizer.json)", path);
        st = model_from_text(tokenizer_load_json(name, text, strlen(text), cfg, out, err));
    }
    free(text);
    json_decref(root);
    json_decref(cfg);
    free(v.tok);
    free(v.type);
    free(v.score);
    gguf_close(g);
    return st;
}
