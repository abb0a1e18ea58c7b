/* config.c - config.json (+ generation_config.json) of a Hugging Face model
 * directory, read field by field with the defaults of the matching
 * transformers config class, and checked before anything is sized by it.
 * Also this layer's error strings and the loader's shared helpers.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "model/gguf.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "util/file.h"

/* ---- errors and helpers shared with safetensors.c ------------------------ */

const char *model_strerror(enum model_status st)
{
    switch (st) {
    case MODEL_OK: return "ok";
    case MODEL_ENOENT: return "required file missing";
    case MODEL_EFORMAT: return "malformed file";
    case MODEL_ECONFIG: return "bad config field";
    case MODEL_EUNSUPPORTED: return "not supported";
    case MODEL_ENOMEM: return "out of host memory";
    case MODEL_EDEVMEM: return "out of device memory";
    case MODEL_EIO: return "I/O error";
    case MODEL_EINVAL: return "invalid argument";
    case MODEL_EKVFULL: return "KV cache full";
    case MODEL_EBACKEND: return "backend failure";
    }
    return "unknown model status";
}

enum model_status model_errf(char *err, enum model_status st, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, MODEL_ERR_LEN, fmt, ap);
        va_end(ap);
    }
    return st;
}

enum model_status model_path(char path[PATH_MAX], const char *dir, const char *name, char *err)
{
    int n = snprintf(path, PATH_MAX, "%s/%s", dir, name);
    if (n < 0 || n >= PATH_MAX)
        return model_errf(err, MODEL_EINVAL, "%s/%s: path too long", dir, name);
    return MODEL_OK;
}

/* JSON side files (config, generation config, shard index) are kilobytes;
 * the cap keeps a wrong file from being parsed into gigabytes of tree. */
#define JSON_FILE_MAX ((off_t)64 << 20)

enum model_status model_json_load(const char *dir, const char *name, bool optional, json_t **out, char *err)
{
    char path[PATH_MAX];
    enum model_status st = model_path(path, dir, name, err);
    *out = NULL;
    if (st != MODEL_OK)
        return st;
    struct stat sb;
    int fd = file_open_regular(path, &sb);
    if (fd == FILE_NOT_REGULAR)
        return model_errf(err, MODEL_EFORMAT, "%s: not a regular file", name);
    if (fd < 0) {
        if (errno == ENOENT)
            return optional ? MODEL_OK : model_errf(err, MODEL_ENOENT, "%s: missing in %s", name, dir);
        return model_errf(err, MODEL_EIO, "%s: %s", path, strerror(errno));
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return model_errf(err, MODEL_ENOMEM, "%s: %s", path, strerror(errno));
    }
    if (sb.st_size > JSON_FILE_MAX) {
        st = model_errf(err, MODEL_EFORMAT, "%s: %lld bytes, more than a JSON side file may be",
                        name, (long long)sb.st_size);
    } else {
        json_error_t je;
        json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
        if (!root) {
            st = json_error_code(&je) == json_error_out_of_memory
                     ? model_errf(err, MODEL_ENOMEM, "%s: out of memory parsing it", name)
                     : model_errf(err, MODEL_EFORMAT, "%s: line %d column %d: %s", name, je.line, je.column,
                                  je.text);
        } else if (!json_is_object(root)) {
            json_decref(root);
            st = model_errf(err, MODEL_EFORMAT, "%s: not a JSON object", name);
        } else {
            *out = root;
        }
    }
    fclose(f);
    return st;
}

/* ---- typed field access ------------------------------------------------ */

/* One JSON object being read, and the file its messages name. */
struct jctx {
    json_t *obj;
    const char *file;
    const char *prefix; /* "" or "rope_scaling." for nested objects */
    char *err;
};

/* A JSON null means "not set" in these files, as Python's None does in the
 * transformers config classes. */
static json_t *field(const struct jctx *c, const char *key)
{
    json_t *v = json_object_get(c->obj, key);
    return json_is_null(v) ? NULL : v;
}

static enum model_status missing(const struct jctx *c, const char *key)
{
    return model_errf(c->err, MODEL_ECONFIG, "%s: missing field %s%s", c->file, c->prefix, key);
}

enum kind { K_INT, K_NUM, K_BOOL, K_STR };

static bool is_kind(const json_t *v, enum kind k)
{
    switch (k) {
    case K_INT: return json_is_integer(v);
    case K_NUM: return json_is_number(v);
    case K_BOOL: return json_is_boolean(v);
    case K_STR: return json_is_string(v);
    }
    return false;
}

/* *v = the value of key, NULL when it is absent (an error if required); an
 * error when it is not of kind k. */
static enum model_status typed(const struct jctx *c, const char *key, enum kind k, bool required, json_t **v)
{
    static const char *const KIND_NAME[] = {"an integer", "a number", "true or false", "a string"};
    *v = field(c, key);
    if (!*v)
        return required ? missing(c, key) : MODEL_OK;
    if (!is_kind(*v, k))
        return model_errf(c->err, MODEL_ECONFIG, "%s: %s%s must be %s", c->file, c->prefix, key, KIND_NAME[k]);
    return MODEL_OK;
}

/* An integer field in [lo, hi]; absent means def when !required.  A default
 * is checked too: many are derived from other fields (hidden_size /
 * num_attention_heads), so the kernels' limits hold whichever way the value
 * came. */
static enum model_status get_int(const struct jctx *c, const char *key, bool required, long long def, long long lo,
                                 long long hi, int *out)
{
    json_t *v;
    enum model_status st = typed(c, key, K_INT, required, &v);
    if (st != MODEL_OK)
        return st;
    long long x = v ? json_integer_value(v) : def;
    if (x < lo || x > hi)
        return model_errf(c->err, MODEL_ECONFIG, "%s: %s%s=%lld%s out of range [%lld, %lld]", c->file, c->prefix,
                          key, x, v ? "" : " (its default, from the fields it derives from)", lo, hi);
    *out = (int)x;
    return MODEL_OK;
}

/* A number in (lo, hi]; absent means def when !required. */
static enum model_status get_num(const struct jctx *c, const char *key, bool required, double def, double lo,
                                 double hi, float *out)
{
    json_t *v;
    enum model_status st = typed(c, key, K_NUM, required, &v);
    *out = (float)def;
    if (st != MODEL_OK || !v)
        return st;
    double x = json_number_value(v);
    /* checked as the float the model reads too: 1e-300 would be 0 */
    if (!(x > lo && x <= hi && (float)x > lo))
        return model_errf(c->err, MODEL_ECONFIG, "%s: %s%s=%g out of range (%g, %g] as a 32-bit float", c->file,
                          c->prefix, key, x, lo, hi);
    *out = (float)x;
    return MODEL_OK;
}

static enum model_status get_bool(const struct jctx *c, const char *key, bool def, bool *out)
{
    json_t *v;
    enum model_status st = typed(c, key, K_BOOL, false, &v);
    *out = v ? json_is_true(v) : def;
    return st;
}

/* An optional string field; *out = NULL when absent. */
static enum model_status get_str(const struct jctx *c, const char *key, const char **out)
{
    json_t *v;
    enum model_status st = typed(c, key, K_STR, false, &v);
    *out = json_string_value(v);
    return st;
}

/* ---- architectures ------------------------------------------------------ */

enum window_rule {
    WINDOW_NONE,    /* Llama: no sliding window */
    WINDOW_ALL,     /* Mistral, Phi-3: every layer slides when sliding_window is set */
    WINDOW_QWEN,    /* Qwen2/3: use_sliding_window, max_window_layers, layer_types */
    WINDOW_PATTERN, /* Gemma 2/3: layer_types, else every pattern-th layer full, the others slide */
};

/* The defaults of each transformers config class (configuration_*.py). */
static const struct arch_info {
    const char *name;
    enum model_arch arch;
    int32_t bos, eos;        /* class defaults; -1 = None */
    int head_dim;            /* default head_dim; 0 = hidden_size / heads */
    bool has_bias_field;     /* reads attention_bias (else fixed by the class) */
    bool qkv_bias;           /* q/k/v bias regardless of attention_bias (Qwen2) */
    bool qk_norm;
    enum window_rule window;
    int window_pattern;      /* WINDOW_PATTERN: the default period */
    bool tie;                /* tie_word_embeddings default */
    double rope_theta;       /* rope_theta default */
    int window_default;      /* WINDOW_ALL: sliding_window when absent (null is none) */
} ARCHS[] = {
    {"LlamaForCausalLM", ARCH_LLAMA, 1, 2, 0, true, false, false, WINDOW_NONE, 0, false, 10000.0, 0},
    {"MistralForCausalLM", ARCH_MISTRAL, 1, 2, 0, false, false, false, WINDOW_ALL, 0, false, 10000.0, 4096},
    {"Qwen2ForCausalLM", ARCH_QWEN2, -1, -1, 0, false, true, false, WINDOW_QWEN, 0, false, 10000.0, 0},
    {"Qwen3ForCausalLM", ARCH_QWEN3, -1, -1, 128, true, false, true, WINDOW_QWEN, 0, false, 10000.0, 0},
    {"Gemma2ForCausalLM", ARCH_GEMMA2, 2, 1, 256, true, false, false, WINDOW_PATTERN, 2, true, 10000.0, 0},
    {"Gemma3ForCausalLM", ARCH_GEMMA3, 2, 1, 256, true, false, true, WINDOW_PATTERN, 6, true, 1000000.0, 0},
    {"Phi3ForCausalLM", ARCH_PHI3, 1, 32000, 0, false, false, false, WINDOW_ALL, 0, false, 10000.0, 0},
    /* read by read_gpt2: its config names every field differently */
    {"GPT2LMHeadModel", ARCH_GPT2, 50256, 50256, 0, false, true, false, WINDOW_NONE, 0, true, 10000.0, 0},
    /* read by read_mamba: no attention at all */
    {"MambaForCausalLM", ARCH_MAMBA, 0, 0, 0, false, false, false, WINDOW_NONE, 0, true, 10000.0, 0},
};

static bool is_gemma(enum model_arch a)
{
    return a == ARCH_GEMMA2 || a == ARCH_GEMMA3;
}

static enum model_status read_arch(const struct jctx *c, const struct arch_info **out)
{
    json_t *a = field(c, "architectures");
    if (!a)
        return missing(c, "architectures");
    json_t *a0 = json_array_get(a, 0);
    if (!json_is_string(a0))
        return model_errf(c->err, MODEL_ECONFIG, "%s: architectures must be a non-empty list of strings", c->file);
    const char *name = json_string_value(a0);
    for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++) {
        if (strcmp(name, ARCHS[i].name) == 0) {
            *out = &ARCHS[i];
            return MODEL_OK;
        }
    }
    return model_errf(c->err, MODEL_EUNSUPPORTED,
                      "%s: architectures[0]=\"%s\" is not supported (Llama, Mistral, Qwen2, Qwen3, Gemma2, "
                      "Gemma3, Phi3, Mamba ForCausalLM, GPT2LMHeadModel; T5 and BART encoder-decoder models "
                      "run with kvtierd or kvtier-encdec, not this tool)",
                      c->file, name);
}

/* ---- sizes --------------------------------------------------------------- */

/* Upper bounds well above every released checkpoint; they keep every
 * product the loader forms (vocab * hidden, heads * head_dim) inside int
 * rows/cols and size_t. */
#define MAX_HIDDEN (1 << 16)
#define MAX_FFN (1 << 20)
#define MAX_LAYERS 1024
#define MAX_HEADS 1024
#define MAX_QDIM (1 << 17)
#define MAX_VOCAB (1 << 24)
#define MAX_POS (1 << 24)

static enum model_status read_sizes(const struct jctx *c, const struct arch_info *ai, struct model_config *cfg)
{
    enum model_status st;
    if ((st = get_int(c, "vocab_size", true, 0, 1, MAX_VOCAB, &cfg->vocab_size)) ||
        (st = get_int(c, "hidden_size", true, 0, 1, MAX_HIDDEN, &cfg->hidden_size)) ||
        (st = get_int(c, "intermediate_size", true, 0, 1, MAX_FFN, &cfg->intermediate_size)) ||
        (st = get_int(c, "num_hidden_layers", true, 0, 1, MAX_LAYERS, &cfg->n_layers)) ||
        (st = get_int(c, "num_attention_heads", true, 0, 1, MAX_HEADS, &cfg->n_heads)) ||
        (st = get_int(c, "num_key_value_heads", false, cfg->n_heads, 1, MAX_HEADS, &cfg->n_kv_heads)) ||
        (st = get_int(c, "max_position_embeddings", true, 0, 1, MAX_POS, &cfg->max_position_embeddings)))
        return st;
    if (cfg->n_heads % cfg->n_kv_heads != 0)
        return model_errf(c->err, MODEL_ECONFIG, "%s: num_key_value_heads=%d does not divide num_attention_heads=%d",
                          c->file, cfg->n_kv_heads, cfg->n_heads);
    if (!field(c, "head_dim") && !ai->head_dim && cfg->hidden_size % cfg->n_heads != 0)
        return model_errf(c->err, MODEL_ECONFIG,
                          "%s: no head_dim and num_attention_heads=%d does not divide hidden_size=%d", c->file,
                          cfg->n_heads, cfg->hidden_size);
    int def_hd = ai->head_dim ? ai->head_dim : cfg->hidden_size / cfg->n_heads;
    if ((st = get_int(c, "head_dim", false, def_hd, 1, MODEL_MAX_HEAD_DIM, &cfg->head_dim)))
        return st;
    /* RoPE rotates pairs of dimensions. */
    if (cfg->head_dim % 2 != 0)
        return model_errf(c->err, MODEL_ECONFIG, "%s: head_dim=%d is odd (RoPE needs pairs)", c->file,
                          cfg->head_dim);
    if ((long long)cfg->n_heads * cfg->head_dim > MAX_QDIM)
        return model_errf(c->err, MODEL_ECONFIG, "%s: num_attention_heads=%d * head_dim=%d exceeds %d", c->file,
                          cfg->n_heads, cfg->head_dim, MAX_QDIM);
    return MODEL_OK;
}

/* ---- RoPE ----------------------------------------------------------------- */

/* A list of n factors of longrope, each in (0, 1e6]. */
static enum model_status read_factors(const struct jctx *r, const char *key, int n, float *out)
{
    json_t *v = field(r, key);
    if (!v)
        return missing(r, key);
    if (!json_is_array(v) || json_array_size(v) != (size_t)n)
        return model_errf(r->err, MODEL_ECONFIG, "%s: %s%s must be a list of %d numbers (rotated dimensions / 2)",
                          r->file, r->prefix, key, n);
    for (int i = 0; i < n; i++) {
        json_t *x = json_array_get(v, (size_t)i);
        double d = json_number_value(x);
        if (!json_is_number(x) || !(d > 0.0 && d <= 1e6))
            return model_errf(r->err, MODEL_ECONFIG, "%s: %s%s[%d] must be a number in (0, 1e6]", r->file, r->prefix,
                              key, i);
        if (out)
            out[i] = (float)d;
    }
    return MODEL_OK;
}

/* Phi-3's longrope as transformers computes it: inv_freq divided by
 * short_factor, or by long_factor in a forward call that reaches past
 * original_max_position_embeddings, and cos and sin multiplied
 * by attention_factor, by default sqrt(1 + ln(s) / ln(original)) with
 * s = max_position_embeddings / original_max_position_embeddings. */
static enum model_status read_longrope(const struct jctx *c, const struct jctx *r, struct model_config *cfg)
{
    enum model_status st;
    int half = cfg->rot_dim / 2;
    /* at least 2: the default attention factor divides by its log */
    if ((st = get_int(c, "original_max_position_embeddings", false, 4096, 2, MAX_POS, &cfg->rope_original_max_pos)))
        return st;
    cfg->rope_scaling = ROPE_SCALING_LONGROPE;
    /* one allocation: model_config_release frees rope_short_factor only */
    cfg->rope_short_factor = malloc((size_t)half * 2 * sizeof *cfg->rope_short_factor);
    if (!cfg->rope_short_factor)
        return model_errf(c->err, MODEL_ENOMEM, "%s: out of memory for %d rope factors", c->file, 2 * half);
    cfg->rope_long_factor = cfg->rope_short_factor + half;
    if ((st = read_factors(r, "short_factor", half, cfg->rope_short_factor)) ||
        (st = read_factors(r, "long_factor", half, cfg->rope_long_factor)))
        return st;
    double s = (double)cfg->max_position_embeddings / cfg->rope_original_max_pos;
    double def = s <= 1.0 ? 1.0 : sqrt(1.0 + log(s) / log((double)cfg->rope_original_max_pos));
    float a;
    if ((st = get_num(r, "attention_factor", false, def, 0.0, 1e3, &a)))
        return st;
    cfg->rope_attn_factor = a;
    return MODEL_OK;
}

/* transformers 5 gives Gemma 3 one rope_parameters object per layer type;
 * the sliding layers' must be unscaled, and their rope_theta is what 4.x
 * called rope_local_base_freq.  *rs becomes the full-attention object. */
static enum model_status read_rope_per_type(const struct jctx *c, const struct arch_info *ai, json_t **rs,
                                            struct model_config *cfg)
{
    json_t *full = json_object_get(*rs, "full_attention"), *local = json_object_get(*rs, "sliding_attention");
    if (!full && !local)
        return MODEL_OK;
    if (ai->arch != ARCH_GEMMA3)
        return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: rope_parameters per layer type is not supported for %s",
                          c->file, ai->name);
    if (!json_is_object(full) || !json_is_object(local))
        return model_errf(c->err, MODEL_ECONFIG,
                          "%s: rope_parameters must hold full_attention and sliding_attention objects", c->file);
    struct jctx l = {.obj = local, .file = c->file, .prefix = "rope_parameters.sliding_attention.", .err = c->err};
    const char *type;
    enum model_status st = get_str(&l, "rope_type", &type);
    if (st == MODEL_OK && type && strcmp(type, "default") != 0)
        return model_errf(c->err, MODEL_EUNSUPPORTED,
                          "%s: rope_parameters.sliding_attention.rope_type \"%s\" is not supported (default)", c->file,
                          type);
    if (st == MODEL_OK)
        st = get_num(&l, "rope_theta", false, cfg->rope_local_theta, 0.0, 1e12, &cfg->rope_local_theta);
    *rs = full;
    return st;
}

/* rope_scaling (transformers <= 4.x) or rope_parameters (5.x).  Only the types whose inv_freq we compute are let
 * through; anything else would silently produce wrong positions.  Gemma 3's
 * scaling is its global layers'; its sliding layers rotate unscaled with
 * rope_local_base_freq. */
static enum model_status read_rope(const struct jctx *c, const struct arch_info *ai, struct model_config *cfg)
{
    enum model_status st;
    json_t *rs = field(c, "rope_scaling");
    const char *rs_key = "rope_scaling";
    if (!rs) {
        rs = field(c, "rope_parameters");
        rs_key = "rope_parameters";
    }
    if (rs && !json_is_object(rs))
        return model_errf(c->err, MODEL_ECONFIG, "%s: %s must be an object", c->file, rs_key);
    if (ai->arch == ARCH_GEMMA3 &&
        (st = get_num(c, "rope_local_base_freq", false, 10000.0, 0.0, 1e12, &cfg->rope_local_theta)))
        return st;
    /* Phi-3 rotates the first head_dim * partial_rotary_factor dimensions
     * (int() of the product, as transformers takes it) */
    cfg->rot_dim = cfg->head_dim;
    cfg->rope_attn_factor = 1.0f;
    if (ai->arch == ARCH_PHI3) {
        float prf;
        if ((st = get_num(c, "partial_rotary_factor", false, 1.0, 0.0, 1.0, &prf)))
            return st;
        cfg->rot_dim = (int)((double)cfg->head_dim * prf);
        if (cfg->rot_dim < 2 || cfg->rot_dim % 2)
            return model_errf(c->err, MODEL_ECONFIG,
                              "%s: partial_rotary_factor=%g rotates %d of head_dim=%d dimensions (an even number >= 2 "
                              "needed)",
                              c->file, prf, cfg->rot_dim, cfg->head_dim);
    }
    json_t *outer = rs;
    if (rs && !strcmp(rs_key, "rope_parameters") && (st = read_rope_per_type(c, ai, &rs, cfg)))
        return st;

    char prefix[48];
    snprintf(prefix, sizeof prefix, "%s.%s", rs_key, rs != outer ? "full_attention." : "");
    struct jctx r = {.obj = rs, .file = c->file, .prefix = prefix, .err = c->err};
    /* transformers 5 folds rope_theta into rope_parameters, which wins. */
    if ((st = get_num(c, "rope_theta", false, ai->rope_theta, 0.0, 1e12, &cfg->rope_theta)) ||
        (st = get_num(&r, "rope_theta", false, cfg->rope_theta, 0.0, 1e12, &cfg->rope_theta)))
        return st;

    cfg->rope_scaling = ROPE_SCALING_NONE;
    cfg->rope_factor = 1.0f;
    if (!rs)
        return MODEL_OK;
    const char *type;
    if ((st = get_str(&r, "rope_type", &type)))
        return st;
    if (!type && (st = get_str(&r, "type", &type)))
        return st;
    if (!type || strcmp(type, "default") == 0)
        return MODEL_OK;
    if (strcmp(type, "linear") == 0) {
        cfg->rope_scaling = ROPE_SCALING_LINEAR;
        return get_num(&r, "factor", true, 0, 0.0, 1e6, &cfg->rope_factor);
    }
    if (ai->arch == ARCH_PHI3 && (strcmp(type, "longrope") == 0 || strcmp(type, "su") == 0))
        return read_longrope(c, &r, cfg);
    if (strcmp(type, "llama3") == 0) {
        cfg->rope_scaling = ROPE_SCALING_LLAMA3;
        if ((st = get_num(&r, "factor", true, 0, 0.0, 1e6, &cfg->rope_factor)) ||
            (st = get_num(&r, "low_freq_factor", true, 0, 0.0, 1e6, &cfg->rope_low_freq_factor)) ||
            (st = get_num(&r, "high_freq_factor", true, 0, 0.0, 1e6, &cfg->rope_high_freq_factor)) ||
            (st = get_int(&r, "original_max_position_embeddings", true, 0, 1, MAX_POS, &cfg->rope_original_max_pos)))
            return st;
        /* llama3 scaling divides by high_freq_factor - low_freq_factor. */
        if (cfg->rope_high_freq_factor <= cfg->rope_low_freq_factor)
            return model_errf(c->err, MODEL_ECONFIG, "%s: %s.high_freq_factor=%g must exceed low_freq_factor=%g",
                              c->file, rs_key, cfg->rope_high_freq_factor, cfg->rope_low_freq_factor);
        return MODEL_OK;
    }
    return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: %s type \"%s\" is not supported (default, linear, llama3%s)",
                      c->file, rs_key, type, ai->arch == ARCH_PHI3 ? ", longrope" : "");
}

/* ---- features ----------------------------------------------------------- */

static enum model_status read_dtype(const struct jctx *c, const char *def, struct model_config *cfg);

static enum model_status refuse_quantized(const struct jctx *c)
{
    if (field(c, "quantization_config"))
        return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: quantization_config: quantized checkpoints are not supported",
                          c->file);
    return MODEL_OK;
}

static enum model_status read_features(const struct jctx *c, const struct arch_info *ai, struct model_config *cfg)
{
    enum model_status st;
    if ((st = refuse_quantized(c)))
        return st;
    /* Gemma's MLP reads hidden_activation (its configs carry a hidden_act
     * too, which the model never reads). */
    const char *act_key = is_gemma(ai->arch) ? "hidden_activation" : "hidden_act";
    const char *act_want = is_gemma(ai->arch) ? "gelu_pytorch_tanh" : "silu";
    const char *act;
    if ((st = get_str(c, act_key, &act)))
        return st;
    if (act && strcmp(act, act_want) != 0)
        return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: %s=\"%s\" is not supported (%s)", c->file, act_key, act,
                          act_want);
    cfg->act = is_gemma(ai->arch) ? ACT_GELU_TANH : ACT_SILU;
    bool mlp_bias = false;
    if ((st = get_bool(c, "mlp_bias", false, &mlp_bias)))
        return st;
    if (mlp_bias)
        return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: mlp_bias=true is not supported", c->file);

    /* Llama, Mistral and Qwen default tie_word_embeddings to false, Gemma
     * to true (PretrainedConfig's own default is true). */
    if ((st = get_bool(c, "tie_word_embeddings", ai->tie, &cfg->tie_word_embeddings)))
        return st;
    cfg->attention_bias = ai->qkv_bias;
    if (ai->has_bias_field && (st = get_bool(c, "attention_bias", false, &cfg->attention_bias)))
        return st;
    /* Qwen2's q/k/v bias is fixed by the class and leaves o_proj bare;
     * attention_bias biases o_proj too. */
    cfg->o_bias = ai->has_bias_field && cfg->attention_bias;
    cfg->qk_norm = ai->qk_norm;
    cfg->fused_qkv = cfg->fused_gate_up = ai->arch == ARCH_PHI3;
    if ((st = get_num(c, "rms_norm_eps", true, 0, 0.0, 1.0, &cfg->rms_norm_eps)))
        return st;
    return read_dtype(c, NULL, cfg);
}

/* torch_dtype; def (GPT-2's checkpoints predate the field: "float32") or
 * required when def is NULL. */
static enum model_status read_dtype(const struct jctx *c, const char *def, struct model_config *cfg)
{
    enum model_status st;
    /* transformers 5 writes "dtype", older releases "torch_dtype". */
    const char *key = field(c, "dtype") ? "dtype" : "torch_dtype";
    const char *dt;
    if ((st = get_str(c, key, &dt)))
        return st;
    if (!dt)
        dt = def;
    if (!dt)
        return missing(c, "torch_dtype");
    static const struct {
        const char *name;
        enum be_dtype dt;
    } DTYPES[] = {{"float32", BE_F32}, {"float16", BE_F16}, {"bfloat16", BE_BF16}};
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++) {
        if (strcmp(dt, DTYPES[i].name) == 0) {
            cfg->dtype = DTYPES[i].dt;
            return MODEL_OK;
        }
    }
    return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: %s=\"%s\" is not supported (float32, float16, bfloat16)",
                      c->file, key, dt);
}

/* ---- Gemma ------------------------------------------------------------------ */

/* A soft cap: absent is the class default, null none (0). */
static enum model_status read_softcap(const struct jctx *c, const char *key, double def, float *out)
{
    if (json_is_null(json_object_get(c->obj, key))) {
        *out = 0.0f;
        return MODEL_OK;
    }
    return get_num(c, key, false, def, 0.0, 1e6, out);
}

/* The attention scale, the embedding scale and the soft caps: Gemma's;
 * the other families scale by 1/sqrt(head_dim) and cap nothing. */
static enum model_status read_scales(const struct jctx *c, const struct arch_info *ai, struct model_config *cfg)
{
    enum model_status st;
    cfg->attn_scale = ai->arch == ARCH_MAMBA ? 0.0f : 1.0f / sqrtf((float)cfg->head_dim);
    if (!is_gemma(ai->arch))
        return MODEL_OK;
    cfg->norm_plus_one = true;
    cfg->sandwich_norms = true;
    /* hidden_size ** 0.5 in Python; the forward pass rounds it to the
     * activation type as the reference does to the embeddings' dtype */
    cfg->embed_scale = (float)sqrt((double)cfg->hidden_size);
    float qpas;
    bool g2 = ai->arch == ARCH_GEMMA2;
    if ((st = get_num(c, "query_pre_attn_scalar", false, 256.0, 0.0, 1e9, &qpas)) ||
        (st = read_softcap(c, "attn_logit_softcapping", g2 ? 50.0 : 0.0, &cfg->attn_softcap)) ||
        (st = read_softcap(c, "final_logit_softcapping", g2 ? 30.0 : 0.0, &cfg->final_softcap)))
        return st;
    cfg->attn_scale = (float)(1.0 / sqrt((double)qpas));
    return MODEL_OK;
}

/* ---- GPT-2 ------------------------------------------------------------------ */

/* A boolean GPT-2 option that must keep its GPT2Config default. */
static enum model_status gpt2_fixed(const struct jctx *c, const char *key, bool def)
{
    bool v;
    enum model_status st = get_bool(c, key, def, &v);
    if (st == MODEL_OK && v != def)
        return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: %s=%s is not supported", c->file, key,
                          v ? "true" : "false");
    return st;
}

/* GPT2Config's fields and defaults (n_embd, n_layer, n_head, n_positions,
 * n_inner = 4 * n_embd, layer_norm_epsilon 1e-5, gelu_new, tied head).
 * Learned positions, LayerNorm with biases, biased projections and an
 * ungated MLP; no RoPE. */
static enum model_status read_gpt2(const struct jctx *c, struct model_config *cfg)
{
    enum model_status st;
    if ((st = refuse_quantized(c)))
        return st;
    if ((st = get_int(c, "vocab_size", false, 50257, 1, MAX_VOCAB, &cfg->vocab_size)) ||
        (st = get_int(c, "n_embd", false, 768, 1, MAX_HIDDEN, &cfg->hidden_size)) ||
        (st = get_int(c, "n_layer", false, 12, 1, MAX_LAYERS, &cfg->n_layers)) ||
        (st = get_int(c, "n_head", false, 12, 1, MAX_HEADS, &cfg->n_heads)) ||
        (st = get_int(c, "n_positions", false, 1024, 1, MAX_POS, &cfg->max_position_embeddings)))
        return st;
    if (cfg->hidden_size % cfg->n_heads != 0)
        return model_errf(c->err, MODEL_ECONFIG, "%s: n_head=%d does not divide n_embd=%d", c->file, cfg->n_heads,
                          cfg->hidden_size);
    if ((st = get_int(c, "n_inner", false, 4LL * cfg->hidden_size, 1, MAX_FFN, &cfg->intermediate_size)))
        return st;
    cfg->n_kv_heads = cfg->n_heads;
    cfg->head_dim = cfg->hidden_size / cfg->n_heads;
    if (cfg->head_dim < 2 || cfg->head_dim > MODEL_MAX_HEAD_DIM)
        return model_errf(c->err, MODEL_ECONFIG, "%s: n_embd / n_head = %d out of range [2, %d]", c->file,
                          cfg->head_dim, MODEL_MAX_HEAD_DIM);
    const char *act;
    if ((st = get_str(c, "activation_function", &act)))
        return st;
    if (act && strcmp(act, "gelu_new") != 0)
        return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: activation_function=\"%s\" is not supported (gelu_new)",
                          c->file, act);
    if ((st = gpt2_fixed(c, "scale_attn_weights", true)) ||
        (st = gpt2_fixed(c, "scale_attn_by_inverse_layer_idx", false)) ||
        (st = gpt2_fixed(c, "reorder_and_upcast_attn", false)) || (st = gpt2_fixed(c, "add_cross_attention", false)) ||
        (st = get_bool(c, "tie_word_embeddings", true, &cfg->tie_word_embeddings)) ||
        (st = get_num(c, "layer_norm_epsilon", false, 1e-5, 0.0, 1.0, &cfg->rms_norm_eps)))
        return st;
    cfg->act = ACT_GELU_TANH;
    cfg->layer_norm = true;
    cfg->learned_pos = true;
    cfg->ungated_mlp = true;
    cfg->attention_bias = cfg->o_bias = true;
    /* no RoPE (rot_dim 0, any head_dim); the fields stay valid numbers */
    cfg->rope_theta = 10000.0f;
    cfg->rope_factor = 1.0f;
    cfg->rot_dim = 0;
    cfg->rope_attn_factor = 1.0f;
    return read_dtype(c, "float32", cfg);
}

/* ---- Mamba ------------------------------------------------------------------ */

/* MambaConfig's fields and defaults: hidden_size 768, state_size 16,
 * num_hidden_layers 32, conv_kernel 4, expand 2, intermediate_size =
 * expand * hidden_size, time_step_rank "auto" = ceil(hidden_size / 16),
 * layer_norm_epsilon 1e-5, use_bias false, use_conv_bias true, silu, tied
 * head.  residual_in_fp32 changes nothing here: the residual stream is
 * kept in f32 wherever activations are (caps.act_dtype f32 on the CPU). */
static enum model_status read_mamba(const struct jctx *c, struct model_config *cfg)
{
    enum model_status st;
    int expand;
    if ((st = refuse_quantized(c)))
        return st;
    if ((st = get_int(c, "vocab_size", false, 50280, 1, MAX_VOCAB, &cfg->vocab_size)) ||
        (st = get_int(c, "hidden_size", false, 768, 1, MAX_HIDDEN, &cfg->hidden_size)) ||
        (st = get_int(c, "num_hidden_layers", false, 32, 1, MAX_LAYERS, &cfg->n_layers)) ||
        (st = get_int(c, "state_size", false, 16, 1, BE_SSM_MAX_STATE, &cfg->ssm_state)) ||
        (st = get_int(c, "conv_kernel", false, 4, 1, BE_SSM_MAX_CONV, &cfg->ssm_conv)) ||
        (st = get_int(c, "expand", false, 2, 1, 64, &expand)) ||
        (st = get_int(c, "intermediate_size", false, (long long)expand * cfg->hidden_size, 1, MAX_FFN,
                      &cfg->intermediate_size)))
        return st;
    json_t *rank = field(c, "time_step_rank");
    if (json_is_string(rank) && strcmp(json_string_value(rank), "auto") == 0)
        cfg->ssm_dt_rank = (cfg->hidden_size + 15) / 16;
    else if ((st = get_int(c, "time_step_rank", false, (cfg->hidden_size + 15) / 16, 1, MAX_HIDDEN, &cfg->ssm_dt_rank)))
        return st;
    /* the run state holds x_proj's three parts in buffers of these widths */
    if (cfg->ssm_dt_rank > cfg->intermediate_size)
        return model_errf(c->err, MODEL_ECONFIG, "%s: time_step_rank=%d exceeds intermediate_size=%d", c->file,
                          cfg->ssm_dt_rank, cfg->intermediate_size);
    const char *act;
    if ((st = get_str(c, "hidden_act", &act)))
        return st;
    if (act && strcmp(act, "silu") != 0)
        return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: hidden_act=\"%s\" is not supported (silu)", c->file, act);
    bool fp32_residual;
    if ((st = get_bool(c, "use_bias", false, &cfg->ssm_bias)) ||
        (st = get_bool(c, "use_conv_bias", true, &cfg->ssm_conv_bias)) ||
        (st = get_bool(c, "residual_in_fp32", true, &fp32_residual)) ||
        (st = get_bool(c, "tie_word_embeddings", true, &cfg->tie_word_embeddings)) ||
        (st = get_num(c, "layer_norm_epsilon", false, 1e-5, 0.0, 1.0, &cfg->rms_norm_eps)))
        return st;
    cfg->act = ACT_SILU;
    /* a state has no positions: any length up to the store's */
    cfg->max_position_embeddings = MAX_POS;
    cfg->rope_theta = 10000.0f;
    cfg->rope_factor = 1.0f;
    cfg->rope_attn_factor = 1.0f;
    return read_dtype(c, NULL, cfg);
}

/* ---- sliding windows ----------------------------------------------------- */

/* sliding_window as the config classes read it: absent is the class default
 * def (Mistral, Qwen: 4096, Phi-3: none), null is "no window". */
static enum model_status read_window_size(const struct jctx *c, int def, int *out)
{
    json_t *v = json_object_get(c->obj, "sliding_window");
    if (json_is_null(v) || (!v && def == 0)) {
        *out = 0;
        return MODEL_OK;
    }
    return get_int(c, "sliding_window", false, def, 1, INT32_MAX, out);
}

/* Fills cfg->layer_window as transformers decides each layer's attention:
 * Mistral slides on every layer; Qwen2/3 keep sliding_window only with
 * use_sliding_window, derive layer_types from max_window_layers unless the
 * config lists them, and give a "sliding_attention" layer no window when
 * sliding_window ended up unset; Gemma 2/3 make every pattern-th layer
 * (Gemma 2: 2, Gemma 3: sliding_window_pattern, default 6) full and the
 * others sliding unless layer_types lists them. */
static enum model_status read_windows(const struct jctx *c, const struct arch_info *ai, struct model_config *cfg)
{
    enum model_status st;
    int window = 0, max_window_layers = 0;
    bool use_sw = false;
    json_t *types = NULL;
    if (ai->window == WINDOW_ALL && (st = read_window_size(c, ai->window_default, &window)))
        return st;
    int pattern = ai->window_pattern;
    if (ai->window == WINDOW_PATTERN) {
        /* every Gemma layer type needs its window: null would leave the
         * sliding layers' mask undefined */
        if ((st = get_int(c, "sliding_window", false, 4096, 1, INT32_MAX, &window)))
            return st;
        if (!field(c, "sliding_window") && json_is_null(json_object_get(c->obj, "sliding_window")))
            return model_errf(c->err, MODEL_ECONFIG, "%s: sliding_window must be set for %s", c->file, ai->name);
        if (ai->arch == ARCH_GEMMA3 &&
            (st = get_int(c, "sliding_window_pattern", false, pattern, 1, INT32_MAX, &pattern)))
            return st;
    }
    if (ai->window == WINDOW_QWEN || ai->window == WINDOW_PATTERN) {
        types = field(c, "layer_types");
        if (types && (!json_is_array(types) || json_array_size(types) != (size_t)cfg->n_layers))
            return model_errf(c->err, MODEL_ECONFIG, "%s: layer_types must be a list of num_hidden_layers=%d strings",
                              c->file, cfg->n_layers);
    }
    if (ai->window == WINDOW_QWEN) {
        if ((st = get_bool(c, "use_sliding_window", false, &use_sw)) || (use_sw && (st = read_window_size(c, 4096, &window))) ||
            (st = get_int(c, "max_window_layers", false, 28, 0, INT32_MAX, &max_window_layers)))
            return st;
    }
    cfg->sliding_window = window;
    cfg->layer_window = calloc((size_t)cfg->n_layers, sizeof *cfg->layer_window);
    if (!cfg->layer_window)
        return model_errf(c->err, MODEL_ENOMEM, "%s: out of memory for %d layer windows", c->file, cfg->n_layers);
    for (int i = 0; i < cfg->n_layers; i++) {
        bool sliding = ai->window == WINDOW_ALL || (ai->window == WINDOW_QWEN && i >= max_window_layers) ||
                       (ai->window == WINDOW_PATTERN && (i + 1) % pattern != 0);
        if (types) {
            const char *t = json_string_value(json_array_get(types, (size_t)i));
            if (!t || (strcmp(t, "full_attention") != 0 && strcmp(t, "sliding_attention") != 0))
                return model_errf(c->err, MODEL_ECONFIG,
                                  "%s: layer_types[%d] must be \"full_attention\" or \"sliding_attention\"", c->file,
                                  i);
            sliding = strcmp(t, "sliding_attention") == 0;
        }
        cfg->layer_window[i] = sliding ? window : 0;
    }
    return MODEL_OK;
}

/* ---- special tokens ------------------------------------------------------ */

static enum model_status token_id(const struct jctx *c, const char *key, json_t *v, int vocab, int32_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= vocab)
        return model_errf(c->err, MODEL_ECONFIG, "%s: %s must be a token id in [0, vocab_size=%d)", c->file, key,
                          vocab);
    *out = (int32_t)json_integer_value(v);
    return MODEL_OK;
}

/* bos/pad/eos ids present in this file replace the ones already in cfg, the
 * way generation_config.json replaces config.json's in transformers. */
static enum model_status read_tokens(const struct jctx *c, struct model_config *cfg)
{
    enum model_status st;
    json_t *v;
    if ((v = field(c, "bos_token_id")) && (st = token_id(c, "bos_token_id", v, cfg->vocab_size, &cfg->bos_token_id)))
        return st;
    if ((v = field(c, "pad_token_id")) && (st = token_id(c, "pad_token_id", v, cfg->vocab_size, &cfg->pad_token_id)))
        return st;
    if (!(v = field(c, "eos_token_id")))
        return MODEL_OK;
    if (!json_is_array(v)) {
        cfg->n_eos = 1;
        return token_id(c, "eos_token_id", v, cfg->vocab_size, &cfg->eos_token_ids[0]);
    }
    if (json_array_size(v) > MODEL_MAX_EOS)
        return model_errf(c->err, MODEL_ECONFIG, "%s: eos_token_id lists %zu ids, more than %d", c->file,
                          json_array_size(v), MODEL_MAX_EOS);
    cfg->n_eos = (int)json_array_size(v);
    for (int i = 0; i < cfg->n_eos; i++)
        if ((st = token_id(c, "eos_token_id", json_array_get(v, (size_t)i), cfg->vocab_size, &cfg->eos_token_ids[i])))
            return st;
    return MODEL_OK;
}

static void default_tokens(const struct arch_info *ai, struct model_config *cfg)
{
    cfg->bos_token_id = ai->bos < cfg->vocab_size ? ai->bos : -1;
    cfg->pad_token_id = -1;
    cfg->n_eos = 0;
    if (ai->eos >= 0 && ai->eos < cfg->vocab_size)
        cfg->eos_token_ids[cfg->n_eos++] = ai->eos;
}

/* ---- the whole config ----------------------------------------------------- */

static enum model_status parse_config(json_t *root, const char *dir, const char *file, struct model_config *cfg,
                                      char *err)
{
    struct jctx c = {.obj = root, .file = file, .prefix = "", .err = err};
    const struct arch_info *ai = NULL;
    enum model_status st;
    if ((st = read_arch(&c, &ai)))
        return st;
    cfg->arch = ai->arch;
    cfg->arch_name = ai->name;
    cfg->rope_layout = BE_ROPE_NEOX;
    if (ai->arch == ARCH_GPT2)
        st = read_gpt2(&c, cfg);
    else if (ai->arch == ARCH_MAMBA)
        st = read_mamba(&c, cfg);
    else if ((st = read_sizes(&c, ai, cfg)) || (st = read_rope(&c, ai, cfg)))
        ;
    else
        st = read_features(&c, ai, cfg);
    if (st || (st = read_windows(&c, ai, cfg)) || (st = read_scales(&c, ai, cfg)))
        return st;
    default_tokens(ai, cfg);
    if ((st = read_tokens(&c, cfg)))
        return st;

    json_t *gen;
    if (!dir || (st = model_json_load(dir, "generation_config.json", true, &gen, err)) || !gen)
        return st;
    struct jctx g = {.obj = gen, .file = "generation_config.json", .prefix = "", .err = err};
    st = read_tokens(&g, cfg);
    json_decref(gen);
    return st;
}

enum model_status model_config_parse(json_t *root, const char *dir, const char *file, struct model_config *cfg,
                                     char *err)
{
    memset(cfg, 0, sizeof *cfg);
    enum model_status st = parse_config(root, dir, file, cfg, err);
    if (st == MODEL_OK) {
        char *canon = json_dumps(root, JSON_SORT_KEYS | JSON_COMPACT);
        if (!canon)
            st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", file);
        else
            cfg->config_hash = XXH3_64bits(canon, strlen(canon));
        free(canon);
    }
    if (st != MODEL_OK)
        model_config_release(cfg);
    return st;
}

enum model_status model_config_load(const char *dir, struct model_config *cfg, char *err)
{
    memset(cfg, 0, sizeof *cfg);
    if (model_is_gguf(dir))
        return gguf_config_load(dir, cfg, err);
    json_t *root;
    enum model_status st = model_json_load(dir, "config.json", false, &root, err);
    if (st != MODEL_OK)
        return st;
    st = model_config_parse(root, dir, "config.json", cfg, err);
    json_decref(root);
    return st;
}

void model_config_release(struct model_config *cfg)
{
    if (!cfg)
        return;
    free(cfg->layer_window);
    cfg->layer_window = NULL;
    free(cfg->rope_short_factor);
    cfg->rope_short_factor = NULL;
    cfg->rope_long_factor = NULL;
}
