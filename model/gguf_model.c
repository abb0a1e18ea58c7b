/* gguf_model.c - a GGUF file as the Hugging Face directory it stands for:
 * its metadata as config.json's fields (then parsed by config.c's one
 * parser), its tensors under the Hugging Face names (then bound by
 * safetensors.c's one binder), its vocabulary as a tokenizer.json (then
 * loaded by the text layer's one loader).
 *
 * Architectures: llama (Llama, Mistral and the others llama.cpp converts
 * as "llama"), qwen2, qwen3, gemma2, gemma3, phi3 and gpt2, each read as
 * llama.cpp reads it (its defaults for absent keys).  llama.cpp's
 * converter permutes a llama file's q and k rows per head from Hugging
 * Face's rotate-half pairs to interleaved ones; the rows are put back here
 * (an owned copy of each), so the forward pass and every KV format stay
 * the Hugging Face ones.  What else the converter changed (Gemma's norms
 * stored as 1 + w, GPT-2's projections transposed) the binder knows
 * (model_files_bind's gguf).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "model/gguf.h"
#include "util/q6k.h"
#include "util/q8.h"

/* GGUF's tensor names and the Hugging Face ones the binder knows. */
struct name_map {
    const char *gguf, *hf;
};

enum family { FAM_LLAMA, FAM_GEMMA, FAM_PHI3, FAM_GPT2 };

static const struct name_map TOP_NAMES[] = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
}, LAYER_NAMES[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_output.bias", "self_attn.o_proj.bias"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
    {NULL, NULL},
},
/* Gemma 2/3: four norms per layer (the MLP's input one is ffn_norm) */
GEMMA_LAYER[] = {
    {"post_attention_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_norm.weight", "pre_feedforward_layernorm.weight"},
    {"post_ffw_norm.weight", "post_feedforward_layernorm.weight"},
    {NULL, NULL},
},
/* Phi-3: the fused projections stay fused; ffn_up is gate then up */
PHI3_LAYER[] = {
    {"attn_qkv.weight", "self_attn.qkv_proj.weight"},
    {"ffn_up.weight", "mlp.gate_up_proj.weight"},
    {NULL, NULL},
},
GPT2_TOP[] = {
    {"token_embd.weight", "transformer.wte.weight"},
    {"position_embd.weight", "transformer.wpe.weight"},
    {"output_norm.weight", "transformer.ln_f.weight"},
    {"output_norm.bias", "transformer.ln_f.bias"},
    {"output.weight", "lm_head.weight"},
}, GPT2_LAYER[] = {
    {"attn_norm.weight", "ln_1.weight"},
    {"attn_norm.bias", "ln_1.bias"},
    {"attn_qkv.weight", "attn.c_attn.weight"},
    {"attn_qkv.bias", "attn.c_attn.bias"},
    {"attn_output.weight", "attn.c_proj.weight"},
    {"attn_output.bias", "attn.c_proj.bias"},
    {"ffn_norm.weight", "ln_2.weight"},
    {"ffn_norm.bias", "ln_2.bias"},
    {"ffn_up.weight", "mlp.c_fc.weight"},
    {"ffn_up.bias", "mlp.c_fc.bias"},
    {"ffn_down.weight", "mlp.c_proj.weight"},
    {"ffn_down.bias", "mlp.c_proj.bias"},
    {NULL, NULL},
};

struct gguf_arch {
    const char *name;  /* general.architecture */
    const char *hf;    /* the config.json class it maps to */
    enum family fam;
    bool permuted;     /* q/k rows interleaved by llama.cpp's converter */
    const struct name_map *top;
    size_t n_top;
    const char *layer_prefix;         /* the Hugging Face name of block N */
    const struct name_map *layer[2];  /* searched in order, NULL-ended */
};

#define N(a) (sizeof a / sizeof a[0])
static const struct gguf_arch ARCHS[] = {
    {"llama", "LlamaForCausalLM", FAM_LLAMA, true, TOP_NAMES, N(TOP_NAMES), "model.layers", {LAYER_NAMES, NULL}},
    {"qwen2", "Qwen2ForCausalLM", FAM_LLAMA, false, TOP_NAMES, N(TOP_NAMES), "model.layers", {LAYER_NAMES, NULL}},
    {"qwen3", "Qwen3ForCausalLM", FAM_LLAMA, false, TOP_NAMES, N(TOP_NAMES), "model.layers", {LAYER_NAMES, NULL}},
    {"gemma2", "Gemma2ForCausalLM", FAM_GEMMA, false, TOP_NAMES, N(TOP_NAMES), "model.layers",
     {GEMMA_LAYER, LAYER_NAMES}},
    {"gemma3", "Gemma3ForCausalLM", FAM_GEMMA, false, TOP_NAMES, N(TOP_NAMES), "model.layers",
     {GEMMA_LAYER, LAYER_NAMES}},
    {"phi3", "Phi3ForCausalLM", FAM_PHI3, false, TOP_NAMES, N(TOP_NAMES), "model.layers", {PHI3_LAYER, LAYER_NAMES}},
    {"gpt2", "GPT2LMHeadModel", FAM_GPT2, false, GPT2_TOP, N(GPT2_TOP), "transformer.h", {GPT2_LAYER, NULL}},
};

#define HF_NAME_MAX 96

/* The Hugging Face name of a GGUF tensor of architecture ai into out;
 * false for a tensor the binder does not read (it is then left alone, as
 * extra safetensors tensors are). */
static bool hf_name(const struct gguf_arch *ai, const char *name, char out[HF_NAME_MAX])
{
    for (size_t i = 0; i < ai->n_top; i++)
        if (!strcmp(name, ai->top[i].gguf))
            return snprintf(out, HF_NAME_MAX, "%s", ai->top[i].hf) < HF_NAME_MAX;
    if (strncmp(name, "blk.", 4) != 0 || name[4] < '0' || name[4] > '9')
        return false;
    char *end;
    long l = strtol(name + 4, &end, 10);
    if (*end != '.' || l > 1 << 20)
        return false;
    for (int t = 0; t < 2 && ai->layer[t]; t++)
        for (const struct name_map *m = ai->layer[t]; m->gguf; m++)
            if (!strcmp(end + 1, m->gguf)) {
                int n = snprintf(out, HF_NAME_MAX, "%s.%ld.%s", ai->layer_prefix, l, m->hf);
                return n > 0 && n < HF_NAME_MAX;
            }
    return false;
}

static enum model_status find_arch(const struct gguf *g, const struct gguf_arch **out, char *err)
{
    struct gguf_str a;
    enum model_status st = gguf_get_str(g, "general.architecture", true, &a, err);
    if (st != MODEL_OK)
        return st;
    for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++)
        if (a.n == strlen(ARCHS[i].name) && !memcmp(a.p, ARCHS[i].name, a.n)) {
            *out = &ARCHS[i];
            return MODEL_OK;
        }
    return model_errf(err, MODEL_EUNSUPPORTED,
                      "%s: general.architecture \"%.*s\" is not supported (llama, qwen2, qwen3, gemma2, gemma3, "
                      "phi3, gpt2)", g->name,
                      (int)(a.n > 64 ? 64 : a.n), a.p);
}

/* ---- config --------------------------------------------------------------- */

/* {arch}.suffix as an integer of config.json's key, when present. */
static enum model_status put_int(const struct gguf *g, json_t *root, const char *arch, const char *suffix,
                                 const char *key, bool required, int64_t *out, char *err)
{
    char name[128];
    snprintf(name, sizeof name, "%s.%s", arch, suffix);
    int64_t v = -1;
    enum model_status st = gguf_get_int(g, name, required, 1, INT32_MAX, &v, err);
    if (st == MODEL_OK && v >= 0 && key && json_object_set_new(root, key, json_integer(v)))
        st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    if (out)
        *out = v;
    return st;
}

static enum model_status put_float(const struct gguf *g, json_t *root, const char *arch, const char *suffix,
                                   const char *key, bool required, char *err)
{
    char name[128];
    snprintf(name, sizeof name, "%s.%s", arch, suffix);
    double v = -1.0;
    enum model_status st = gguf_get_float(g, name, required, &v, err);
    if (st == MODEL_OK && gguf_find(g, name) && json_object_set_new(root, key, json_real(v)))
        st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    return st;
}

/* A token id of the tokenizer.ggml metadata, or -1 when absent. */
static enum model_status token_key(const struct gguf *g, const char *key, int64_t vocab, int64_t *out, char *err)
{
    *out = -1;
    return gguf_get_int(g, key, false, 0, vocab - 1, out, err);
}

static enum model_status set(json_t *root, const char *key, json_t *v, const struct gguf *g, char *err)
{
    if (!v || json_object_set_new(root, key, v))
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    return MODEL_OK;
}

/* The token ids, the vocabulary size, the embedding's dtype and the tie. */
static enum model_status vocab_json(const struct gguf *g, json_t *root, char *err)
{
    const struct gguf_tensor *embd = gguf_tensor(g, "token_embd.weight");
    if (!embd)
        return model_errf(err, MODEL_EFORMAT, "%s: missing tensor token_embd.weight", g->name);
    const struct gguf_kv *tokens;
    enum model_status st;
    if ((st = gguf_get_arr(g, "tokenizer.ggml.tokens", false, GGUF_STR, &tokens, err)))
        return st;
    int64_t vocab = (int64_t)embd->ne[1];
    /* the embedding's dtype, or f32 for the f32 copy a quantized one
     * becomes (gguf_files_open) */
    const char *dtype = embd->type->dt.be == BE_F16 ? "float16" : embd->type->dt.be == BE_BF16 ? "bfloat16" : "float32";
    if ((st = set(root, "vocab_size", json_integer(vocab), g, err)) ||
        (st = set(root, "torch_dtype", json_string(dtype), g, err)) ||
        (st = set(root, "tie_word_embeddings", json_boolean(!gguf_tensor(g, "output.weight")), g, err)))
        return st;

    int64_t bos, eos, eot, pad;
    if ((st = token_key(g, "tokenizer.ggml.bos_token_id", vocab, &bos, err)) ||
        (st = token_key(g, "tokenizer.ggml.eos_token_id", vocab, &eos, err)) ||
        (st = token_key(g, "tokenizer.ggml.eot_token_id", vocab, &eot, err)) ||
        (st = token_key(g, "tokenizer.ggml.padding_token_id", vocab, &pad, err)))
        return st;
    json_t *eos_ids = json_array();
    if (!eos_ids)
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    /* generation ends at the end-of-turn token too, as llama.cpp's does */
    if ((eos >= 0 && json_array_append_new(eos_ids, json_integer(eos))) ||
        (eot >= 0 && eot != eos && json_array_append_new(eos_ids, json_integer(eot))))
        st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    if (st == MODEL_OK)
        st = set(root, "eos_token_id", eos_ids, g, err);
    else
        json_decref(eos_ids);
    if (st == MODEL_OK && bos >= 0)
        st = set(root, "bos_token_id", json_integer(bos), g, err);
    if (st == MODEL_OK && pad >= 0)
        st = set(root, "pad_token_id", json_integer(pad), g, err);
    return st;
}

/* {arch}.suffix as a float, or def when absent. */
static enum model_status arch_float(const struct gguf *g, const char *arch, const char *suffix, double def,
                                    double *out, char *err)
{
    char name[128];
    snprintf(name, sizeof name, "%s.%s", arch, suffix);
    *out = def;
    return gguf_get_float(g, name, false, out, err);
}

/* GPT2Config's names (config.c's read_gpt2): no RoPE, LayerNorm. */
static enum model_status gpt2_json(const struct gguf *g, json_t *root, char *err)
{
    enum model_status st;
    int64_t heads, kv_heads = -1;
    if ((st = put_int(g, root, "gpt2", "embedding_length", "n_embd", true, NULL, err)) ||
        (st = put_int(g, root, "gpt2", "feed_forward_length", "n_inner", true, NULL, err)) ||
        (st = put_int(g, root, "gpt2", "block_count", "n_layer", true, NULL, err)) ||
        (st = put_int(g, root, "gpt2", "attention.head_count", "n_head", true, &heads, err)) ||
        (st = put_int(g, root, "gpt2", "attention.head_count_kv", NULL, false, &kv_heads, err)) ||
        (st = put_int(g, root, "gpt2", "context_length", "n_positions", true, NULL, err)) ||
        (st = put_float(g, root, "gpt2", "attention.layer_norm_epsilon", "layer_norm_epsilon", true, err)))
        return st;
    if (kv_heads >= 0 && kv_heads != heads)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: gpt2.attention.head_count_kv %lld differs from head_count %lld",
                          g->name, (long long)kv_heads, (long long)heads);
    return vocab_json(g, root, err);
}

/* rope_factors_long.weight or _short as a list of n floats. */
static enum model_status rope_factors(const struct gguf *g, const char *name, int64_t n, json_t **out, char *err)
{
    const struct gguf_tensor *t = gguf_tensor(g, name);
    if (!t)
        return model_errf(err, MODEL_EFORMAT, "%s: missing tensor %s (longrope needs both factor tensors)", g->name,
                          name);
    if (t->type->dt.be != BE_F32 || t->n_dims != 1 || (int64_t)t->ne[0] != n)
        return model_errf(err, MODEL_EFORMAT, "%s: tensor %s must be %lld F32 values (rope.dimension_count / 2)",
                          g->name, name, (long long)n);
    const uint8_t *p = g->map + g->data_off + t->offset;
    json_t *a = json_array();
    for (int64_t i = 0; a && i < n; i++) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        if (json_array_append_new(a, json_real(f))) {
            json_decref(a);
            a = NULL;
        }
    }
    if (!a)
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    *out = a;
    return MODEL_OK;
}

/* Phi-3: partial rotation, longrope as two factor tensors, a window
 * (llama.cpp ignores it; transformers applies it, and so does kvtier). */
static enum model_status phi3_json(const struct gguf *g, json_t *root, int64_t head_dim, int64_t rot, char *err)
{
    enum model_status st;
    int64_t window = 0;
    if ((st = gguf_get_int(g, "phi3.attention.sliding_window", false, 0, INT32_MAX, &window, err)) ||
        (st = set(root, "sliding_window", window > 0 ? json_integer(window) : json_null(), g, err)) ||
        (st = put_int(g, root, "phi3", "rope.scaling.original_context_length", "original_max_position_embeddings",
                      false, NULL, err)))
        return st;
    if (rot <= 0)
        rot = head_dim;
    /* config.c takes int(head_dim * factor), with the factor a float */
    float prf = (float)((double)rot / (double)head_dim);
    if (rot % 2 || (int64_t)((double)head_dim * prf) != rot)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: phi3.rope.dimension_count %lld of head size %lld is not supported",
                          g->name, (long long)rot, (long long)head_dim);
    if ((st = set(root, "partial_rotary_factor", json_real(prf), g, err)))
        return st;
    if (!gguf_tensor(g, "rope_factors_long.weight") && !gguf_tensor(g, "rope_factors_short.weight"))
        return MODEL_OK;
    double attn;
    json_t *lf = NULL, *sf = NULL, *rs = NULL;
    if ((st = arch_float(g, "phi3", "rope.scaling.attn_factor", 1.0, &attn, err)) ||
        (st = rope_factors(g, "rope_factors_long.weight", rot / 2, &lf, err)) ||
        (st = rope_factors(g, "rope_factors_short.weight", rot / 2, &sf, err)) ||
        !(rs = json_pack("{s:s, s:o, s:o, s:f}", "type", "longrope", "long_factor", lf, "short_factor", sf,
                         "attention_factor", attn))) {
        if (st == MODEL_OK) /* json_pack released both lists */
            return model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
        json_decref(lf);
        json_decref(sf);
        return st;
    }
    return set(root, "rope_scaling", rs, g, err);
}

/* Gemma 2/3 as llama.cpp runs them: the layers' windows from
 * sliding_window and its period (every period-th layer global), the
 * attention scale 1/sqrt(head_dim) but for the 27B shapes (46 and 62
 * layers: 1/sqrt(hidden / heads)), Gemma 2's soft caps 50 and 30 unless
 * given (0: none), Gemma 3's sliding layers' RoPE base 10000 unless
 * given.  Norms hold 1 + w (the binder knows). */
static enum model_status gemma_json(const struct gguf *g, json_t *root, const char *a, int64_t layers, int64_t dim,
                                    int64_t heads, int64_t head_dim, double theta, char *err)
{
    bool g2 = !strcmp(a, "gemma2");
    char key[128];
    enum model_status st;
    int64_t window = g2 ? 4096 : 0, period = g2 ? 2 : 6;
    snprintf(key, sizeof key, "%s.attention.sliding_window", a);
    if ((st = gguf_get_int(g, key, false, 0, INT32_MAX, &window, err)))
        return st;
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", a);
    const struct gguf_kv *pat = gguf_find(g, key);
    if (pat && pat->type == GGUF_ARR)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: %s as a per-layer array is not supported (a period)", g->name,
                          key);
    if ((st = gguf_get_int(g, key, false, 0, INT32_MAX, &period, err)))
        return st;
    json_t *types = json_array();
    for (int64_t i = 0; types && i < layers; i++) {
        bool sliding = window > 0 && (period == 0 || i % period < period - 1);
        if (json_array_append_new(types, json_string(sliding ? "sliding_attention" : "full_attention"))) {
            json_decref(types);
            types = NULL;
        }
    }
    /* a window with no sliding layer still needs a value */
    if ((st = set(root, "layer_types", types, g, err)) ||
        (st = set(root, "sliding_window", json_integer(window > 0 ? window : 4096), g, err)) ||
        (st = set(root, "hidden_activation", json_string("gelu_pytorch_tanh"), g, err)))
        return st;
    bool big = layers == (g2 ? 46 : 62);
    if (big && dim % heads)
        return model_errf(err, MODEL_ECONFIG, "%s: %s.attention.head_count %lld does not divide embedding_length %lld",
                          g->name, a, (long long)heads, (long long)dim);
    if ((st = set(root, "query_pre_attn_scalar", json_integer(big ? dim / heads : head_dim), g, err)))
        return st;
    double attn_cap = g2 ? 50.0 : 0.0, final_cap = g2 ? 30.0 : 0.0, swa_theta = g2 ? theta : 10000.0;
    if ((g2 && (st = arch_float(g, a, "attn_logit_softcapping", attn_cap, &attn_cap, err))) ||
        (st = arch_float(g, a, "final_logit_softcapping", final_cap, &final_cap, err)) ||
        (st = arch_float(g, a, "rope.freq_base_swa", swa_theta, &swa_theta, err)) ||
        (st = set(root, "attn_logit_softcapping", attn_cap > 0 ? json_real(attn_cap) : json_null(), g, err)) ||
        (st = set(root, "final_logit_softcapping", final_cap > 0 ? json_real(final_cap) : json_null(), g, err)))
        return st;
    if (!g2)
        return set(root, "rope_local_base_freq", json_real(swa_theta), g, err);
    if (swa_theta != theta)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: gemma2.rope.freq_base_swa %g differs from rope.freq_base %g",
                          g->name, swa_theta, theta);
    return MODEL_OK;
}

/* The config.json this file's metadata stands for. */
static enum model_status config_json(const struct gguf *g, json_t *root, char *err)
{
    const struct gguf_arch *ai;
    enum model_status st = find_arch(g, &ai, err);
    if (st != MODEL_OK)
        return st;
    if ((st = set(root, "architectures", json_pack("[s]", ai->hf), g, err)))
        return st;
    if (ai->fam == FAM_GPT2)
        return gpt2_json(g, root, err);
    const char *a = ai->name;
    int64_t dim, heads, layers, key_len = -1, value_len = -1, rot = -1;
    /* llama.cpp's rope.freq_base default, whatever the class's */
    double theta;
    if ((st = put_int(g, root, a, "embedding_length", "hidden_size", true, &dim, err)) ||
        (st = put_int(g, root, a, "feed_forward_length", "intermediate_size", true, NULL, err)) ||
        (st = put_int(g, root, a, "block_count", "num_hidden_layers", true, &layers, err)) ||
        (st = put_int(g, root, a, "attention.head_count", "num_attention_heads", true, &heads, err)) ||
        (st = put_int(g, root, a, "attention.head_count_kv", "num_key_value_heads", false, NULL, err)) ||
        (st = put_int(g, root, a, "context_length", "max_position_embeddings", true, NULL, err)) ||
        (st = put_int(g, root, a, "attention.key_length", NULL, false, &key_len, err)) ||
        (st = put_int(g, root, a, "attention.value_length", NULL, false, &value_len, err)) ||
        (st = put_int(g, root, a, "rope.dimension_count", NULL, false, &rot, err)) ||
        (st = put_float(g, root, a, "attention.layer_norm_rms_epsilon", "rms_norm_eps", true, err)) ||
        (st = arch_float(g, a, "rope.freq_base", 10000.0, &theta, err)) ||
        (st = set(root, "rope_theta", json_real(theta), g, err)))
        return st;
    /* head_dim always explicit: Qwen3's class default (128) is no GGUF's */
    int64_t head_dim = key_len > 0 ? key_len : dim / heads;
    if (key_len < 0 && dim % heads)
        return model_errf(err, MODEL_ECONFIG, "%s: %s.attention.head_count %lld does not divide embedding_length %lld",
                          g->name, a, (long long)heads, (long long)dim);
    if (value_len > 0 && value_len != head_dim)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: %s.attention.value_length %lld differs from the key length %lld",
                          g->name, a, (long long)value_len, (long long)head_dim);
    if (ai->fam != FAM_PHI3 && rot > 0 && rot != head_dim)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: %s.rope.dimension_count %lld: partial rotation of %lld is not supported",
                          g->name, a, (long long)rot, (long long)head_dim);
    if ((st = set(root, "head_dim", json_integer(head_dim), g, err)))
        return st;

    char key[128];
    struct gguf_str scaling = {"none", 4};
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if ((st = gguf_get_str(g, key, false, &scaling, err)))
        return st;
    if (scaling.n == 6 && !memcmp(scaling.p, "linear", 6)) {
        double factor;
        snprintf(key, sizeof key, "%s.rope.scaling.factor", a);
        if ((st = gguf_get_float(g, key, true, &factor, err)) ||
            (st = set(root, "rope_scaling", json_pack("{s:s, s:f}", "rope_type", "linear", "factor", factor), g, err)))
            return st;
    } else if (!(scaling.n == 4 && !memcmp(scaling.p, "none", 4))) {
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: %s \"%.*s\" is not supported (none, linear)", g->name, key,
                          (int)(scaling.n > 32 ? 32 : scaling.n), scaling.p);
    }
    /* Llama 3.1's frequency scaling travels as a tensor of per-dimension
     * factors, not as the parameters the forward pass computes them from */
    if (gguf_tensor(g, "rope_freqs.weight"))
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: rope_freqs.weight (llama3 RoPE scaling factors) is not supported",
                          g->name);

    bool bias = gguf_tensor(g, "blk.0.attn_q.bias") != NULL;
    if ((ai->fam != FAM_GEMMA && (st = set(root, "hidden_act", json_string("silu"), g, err))) ||
        (strcmp(a, "qwen2") && (st = set(root, "attention_bias", json_boolean(bias), g, err))))
        return st;
    if (ai->fam == FAM_GEMMA && (st = gemma_json(g, root, a, layers, dim, heads, head_dim, theta, err)))
        return st;
    if (ai->fam == FAM_PHI3 && (st = phi3_json(g, root, head_dim, rot, err)))
        return st;
    return vocab_json(g, root, err);
}

enum model_status gguf_config_load(const char *path, struct model_config *cfg, char *err)
{
    struct gguf *g;
    memset(cfg, 0, sizeof *cfg);
    enum model_status st = gguf_open(path, &g, err);
    if (st != MODEL_OK)
        return st;
    json_t *root = json_object();
    st = root ? config_json(g, root, err) : model_errf(err, MODEL_ENOMEM, "%s: out of memory", path);
    char label[PATH_MAX + 32];
    snprintf(label, sizeof label, "%s (metadata as config.json)", path);
    if (st == MODEL_OK)
        st = model_config_parse(root, NULL, label, cfg, err);
    json_decref(root);
    gguf_close(g);
    return st;
}

/* ---- weights -------------------------------------------------------------- */

/* Puts back Hugging Face's row order of a llama file's q or k projection
 * (and bias): llama.cpp's converter moved row h*hd + j*hd/2 + i of each
 * head of hd rows to h*hd + 2i + j. */
static void unpermute_rows(const char *src, char *dst, int rows, size_t row_bytes, int heads)
{
    int hd = rows / heads;
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < 2; j++)
            for (int i = 0; i < hd / 2; i++)
                memcpy(dst + (size_t)(h * hd + j * hd / 2 + i) * row_bytes,
                       src + (size_t)(h * hd + 2 * i + j) * row_bytes, row_bytes);
}

static enum model_status unpermute_mat(model_files *mf, struct model_mat *m, int heads, char *err)
{
    size_t row_bytes = be_row_bytes(m->dtype, (size_t)m->cols);
    char *dst = malloc((size_t)m->rows * row_bytes);
    if (!dst)
        return model_errf(err, MODEL_ENOMEM, "out of memory reordering %d rows of q/k", m->rows);
    unpermute_rows(m->data, dst, m->rows, row_bytes, heads);
    m->data = dst;
    return model_files_keep(mf, dst, err);
}

static enum model_status unpermute_vec(const float *v, int n, int heads, char *err)
{
    float *tmp = malloc((size_t)n * sizeof *tmp);
    if (!tmp)
        return model_errf(err, MODEL_ENOMEM, "out of memory reordering a q/k bias");
    unpermute_rows((const char *)v, (char *)tmp, n, sizeof *tmp, heads);
    memcpy((float *)v, tmp, (size_t)n * sizeof *tmp); /* the binder's own f32 copy */
    free(tmp);
    return MODEL_OK;
}

static enum model_status unpermute(model_files *mf, const struct model_config *c, struct model_weights *w, char *err)
{
    enum model_status st = MODEL_OK;
    for (int l = 0; l < c->n_layers && st == MODEL_OK; l++) {
        struct model_layer *L = &w->layers[l];
        if ((st = unpermute_mat(mf, &L->wq, c->n_heads, err)) || (st = unpermute_mat(mf, &L->wk, c->n_kv_heads, err)))
            break;
        if (L->bq && ((st = unpermute_vec(L->bq, c->n_heads * c->head_dim, c->n_heads, err)) ||
                      (st = unpermute_vec(L->bk, c->n_kv_heads * c->head_dim, c->n_kv_heads, err))))
            break;
    }
    return st;
}

/* be_embed reads float tables only: a quantized token_embd becomes an f32
 * copy (exact for Q8_0: an f16 scale times a small integer), the dtype
 * config_json gave the model; lm_head keeps the quantized rows. */
static enum model_status embed_f32(model_files *mf, struct model_weights *w, char *err)
{
    const struct gguf_type *t = gguf_block_type((int)w->tok_embed.dtype);
    if (!t)
        return MODEL_OK;
    size_t n = (size_t)w->tok_embed.rows * (size_t)w->tok_embed.cols;
    float *dst = malloc(n * sizeof *dst);
    if (!dst)
        return model_errf(err, MODEL_ENOMEM, "out of memory for the f32 copy of token_embd.weight (%zu bytes)",
                          n * sizeof *dst);
    t->to_f32(w->tok_embed.data, dst, n);
    w->tok_embed.data = dst;
    w->tok_embed.dtype = BE_F32;
    return model_files_keep(mf, dst, err);
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const struct st_tensor *)a)->name, ((const struct st_tensor *)b)->name);
}

/* mf's one file: g's map (moved there) and its tensors under their
 * Hugging Face names, in names[]. */
static enum model_status adopt(model_files *mf, struct gguf *g, const struct gguf_arch *ai, char *names, char *err)
{
    struct st_file *f = &mf->files[0];
    mf->n_files = 1;
    if (!(f->name = strdup(g->name)) || !(f->tensors = calloc(g->n_t ? g->n_t : 1, sizeof *f->tensors)))
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    f->map = g->map;
    f->map_size = g->size;
    g->map = NULL;
    f->data = f->map + g->data_off;
    f->data_size = f->map_size - g->data_off;
    for (uint64_t i = 0; i < g->n_t; i++) {
        const struct gguf_tensor *t = &g->t[i];
        char *name = names + i * HF_NAME_MAX;
        if (t->type->id == GGML_TYPE_Q6_K || !hf_name(ai, t->name, name))
            continue;
        struct st_tensor *s = &f->tensors[f->n_tensors++];
        *s = (struct st_tensor){.name = name, .dtype = &t->type->dt, .rank = t->n_dims, .begin = t->offset,
                                .end = t->offset + t->bytes};
        for (int d = 0; d < t->n_dims; d++) /* ggml's ne[0] is the row */
            s->shape[d] = t->ne[t->n_dims - 1 - d];
    }
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, by_name);
    return MODEL_OK;
}

/* No kernel reads Q6_K (llama.cpp's Q4_K_M files keep the output head and
 * some ffn_down and attn_v matrices so): each such tensor becomes Q8_0 at
 * load, row by row through f32, in mf's second table (after adopt filled
 * the first), whose data is one owned buffer.  8.5 bits a weight instead of 6.56, and a second rounding
 * (Q8_0's, at most half a step of max|x| / 127 per 32 elements) of values
 * rounded once already. */
static enum model_status adopt_q6k(model_files *mf, const struct gguf *g, const struct gguf_arch *ai, char *names,
                                   char *err)
{
    uint64_t bytes = 0, n = 0, cols_max = 0;
    for (uint64_t i = 0; i < g->n_t; i++) {
        const struct gguf_tensor *t = &g->t[i];
        if (t->type->id != GGML_TYPE_Q6_K || !hf_name(ai, t->name, names + i * HF_NAME_MAX))
            continue;
        /* 34 bytes per 32 elements is less than 210 per 256 plus one row's
         * worth: no overflow where the file's own size did not */
        bytes += t->bytes / t->type->block_bytes * (Q6_K_BLOCK / Q8_0_BLOCK) * sizeof(struct q8_0_block);
        cols_max = t->ne[0] > cols_max ? t->ne[0] : cols_max;
        n++;
    }
    if (!n)
        return MODEL_OK;
    struct st_file *f = &mf->files[mf->n_files++];
    size_t nl = strlen(g->name) + sizeof " (Q6_K as Q8_0)";
    uint8_t *buf = malloc(bytes);
    float *row = malloc(cols_max * sizeof *row);
    if (!(f->name = malloc(nl)) || !(f->tensors = calloc(n, sizeof *f->tensors)) || !buf || !row) {
        free(buf);
        free(row);
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory requantizing %llu Q6_K tensors (%llu bytes)", g->name,
                          (unsigned long long)n, (unsigned long long)bytes);
    }
    snprintf(f->name, nl, "%s (Q6_K as Q8_0)", g->name);
    f->data = buf;
    f->data_size = bytes;
    enum model_status st = model_files_keep(mf, buf, err);
    const struct st_dtype *q8 = &gguf_block_type(BE_Q8_0)->dt;
    uint64_t off = 0;
    for (uint64_t i = 0; i < g->n_t && st == MODEL_OK; i++) {
        const struct gguf_tensor *t = &g->t[i];
        char *name = names + i * HF_NAME_MAX;
        if (t->type->id != GGML_TYPE_Q6_K || !hf_name(ai, t->name, name))
            continue;
        size_t cols = (size_t)t->ne[0], rows = (size_t)(t->bytes / t->type->block_bytes / (cols / Q6_K_BLOCK));
        size_t in_row = cols / Q6_K_BLOCK * sizeof(struct q6_k_block), out_row = cols / Q8_0_BLOCK * sizeof(struct q8_0_block);
        const uint8_t *src = mf->files[0].data + t->offset; /* adopt moved g's map there */
        for (size_t r = 0; r < rows && st == MODEL_OK; r++) {
            q6_k_dequantize((const struct q6_k_block *)(src + r * in_row), row, cols);
            if (!q8_0_quantize(row, (struct q8_0_block *)(buf + off + r * out_row), cols))
                st = model_errf(err, MODEL_EFORMAT, "%s: tensor %s has a non-finite value in row %zu", g->name,
                                t->name, r);
        }
        struct st_tensor *s = &f->tensors[f->n_tensors++];
        *s = (struct st_tensor){.name = name, .dtype = q8, .rank = t->n_dims, .begin = off, .end = off + rows * out_row};
        for (int d = 0; d < t->n_dims; d++)
            s->shape[d] = t->ne[t->n_dims - 1 - d];
        off += rows * out_row;
    }
    free(row);
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, by_name);
    return st;
}

enum model_status gguf_files_open(const char *path, const struct model_config *cfg, model_files **out,
                                  struct model_weights *w, char *err)
{
    *out = NULL;
    memset(w, 0, sizeof *w);
    struct gguf *g;
    const struct gguf_arch *ai = NULL;
    enum model_status st = gguf_open(path, &g, err);
    if (st != MODEL_OK)
        return st;
    model_files *mf = calloc(1, sizeof *mf);
    char *names = malloc((g->n_t ? g->n_t : 1) * HF_NAME_MAX);
    if (!mf || !names || !(mf->files = calloc(2, sizeof *mf->files)))
        st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", path);
    if (st == MODEL_OK)
        st = find_arch(g, &ai, err);
    if (st == MODEL_OK) /* what changes when any tensor's name, type, shape or offset does */
        w->header_hash = XXH3_64bits(g->map, g->data_off);
    uint64_t hash = w->header_hash;
    if (st == MODEL_OK)
        st = adopt(mf, g, ai, names, err);
    if (st == MODEL_OK)
        st = adopt_q6k(mf, g, ai, names, err);
    if (st == MODEL_OK)
        st = model_files_bind(mf, cfg, true, w, err);
    w->header_hash = hash;
    if (st == MODEL_OK && ai->permuted)
        st = unpermute(mf, cfg, w, err);
    if (st == MODEL_OK)
        st = embed_f32(mf, w, err);
    if (mf && mf->files)
        model_files_drop_tables(mf);
    free(names);
    gguf_close(g);
    if (st != MODEL_OK) {
        memset(w, 0, sizeof *w);
        model_files_close(mf);
        return st;
    }
    *out = mf;
    return MODEL_OK;
}
