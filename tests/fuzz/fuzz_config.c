/* fuzz_config.c - config.json and generation_config.json of a model
 * directory (model_config_load), and config.json as an encoder-decoder
 * model's (encdec_config_load).  The input is config.json, then
 * optionally a NUL and generation_config.json; both are written to a
 * scratch directory, since the loader reads a directory.
 *
 * Invariants: an error has a message naming the file; an accepted config
 * is one the rest of the loader can size things by: every dimension in
 * range, head_dim even (but GPT-2's: no RoPE), num_attention_heads a multiple of
 * num_key_value_heads, one window per layer (none wider than
 * sliding_window), special token ids inside the vocabulary; a Mamba config
 * has no attention and its state and convolution inside the kernels' bounds.
 * An accepted encoder-decoder config has every size in range, heads no
 * wider than the kernels take, T5's buckets a usable log range, and its
 * start and end tokens inside the vocabulary. */
#include <math.h>

#include "model/encdec.h"
#include "model/model.h"
#include "tests/fuzz/fuzz_util.h"

/* Mamba has no attention: a state of ssm_state per channel, a convolution
 * of ssm_conv taps, x_proj's dt rows no wider than the inner width. */
static void check_mamba(const struct model_config *c)
{
    FUZZ_CHECK(c->n_heads == 0 && c->n_kv_heads == 0 && c->head_dim == 0 && c->rot_dim == 0, "attention %d/%d/%d/%d",
               c->n_heads, c->n_kv_heads, c->head_dim, c->rot_dim);
    FUZZ_CHECK(c->ssm_state >= 1 && c->ssm_state <= BE_SSM_MAX_STATE, "ssm_state %d", c->ssm_state);
    FUZZ_CHECK(c->ssm_conv >= 1 && c->ssm_conv <= BE_SSM_MAX_CONV, "ssm_conv %d", c->ssm_conv);
    FUZZ_CHECK(c->ssm_dt_rank >= 1 && c->ssm_dt_rank <= c->intermediate_size, "ssm_dt_rank %d of %d",
               c->ssm_dt_rank, c->intermediate_size);
    FUZZ_CHECK(c->attn_scale == 0.0f, "attn_scale %g", c->attn_scale);
}

static void check_attention(const struct model_config *c)
{
    FUZZ_CHECK(c->n_heads >= 1 && c->n_kv_heads >= 1 && c->n_heads % c->n_kv_heads == 0, "heads %d / %d",
               c->n_heads, c->n_kv_heads);
    /* RoPE rotates pairs; GPT-2 has none */
    FUZZ_CHECK(c->head_dim >= 2 && (c->learned_pos || c->head_dim % 2 == 0) && c->head_dim <= 1024, "head_dim %d",
               c->head_dim);
    FUZZ_CHECK((long long)c->n_heads * c->head_dim <= 1 << 17, "q dim %d * %d", c->n_heads, c->head_dim);
    FUZZ_CHECK(isfinite(c->rope_theta) && c->rope_theta > 0, "rope_theta %g", c->rope_theta);
    FUZZ_CHECK(isfinite(c->rope_factor) && c->rope_factor > 0, "rope_factor %g", c->rope_factor);
    if (c->rope_scaling == ROPE_SCALING_LLAMA3)
        FUZZ_CHECK(c->rope_high_freq_factor > c->rope_low_freq_factor && c->rope_original_max_pos >= 1,
                   "llama3 rope %g %g %d", c->rope_low_freq_factor, c->rope_high_freq_factor,
                   c->rope_original_max_pos);
    if (c->rope_scaling == ROPE_SCALING_LONGROPE)
        FUZZ_CHECK(c->rope_short_factor && c->rope_long_factor && c->rope_original_max_pos >= 1,
                   "longrope without its factors");
    FUZZ_CHECK(c->learned_pos ? c->rot_dim == 0 : c->rot_dim >= 2 && c->rot_dim % 2 == 0 && c->rot_dim <= c->head_dim,
               "rot_dim %d of %d", c->rot_dim, c->head_dim);
    FUZZ_CHECK(isfinite(c->rope_attn_factor) && c->rope_attn_factor > 0, "rope_attn_factor %g", c->rope_attn_factor);
    FUZZ_CHECK(isfinite(c->rope_local_theta) && c->rope_local_theta >= 0, "rope_local_theta %g", c->rope_local_theta);
    FUZZ_CHECK(isfinite(c->attn_scale) && c->attn_scale > 0, "attn_scale %g", c->attn_scale);
    FUZZ_CHECK(isfinite(c->attn_softcap) && c->attn_softcap >= 0 && isfinite(c->final_softcap) &&
                   c->final_softcap >= 0,
               "soft caps %g %g", c->attn_softcap, c->final_softcap);
    FUZZ_CHECK(isfinite(c->embed_scale) && c->embed_scale >= 0, "embed_scale %g", c->embed_scale);
    FUZZ_CHECK(c->sliding_window >= 0, "sliding_window %d", c->sliding_window);
    for (int i = 0; i < c->n_layers; i++)
        FUZZ_CHECK(c->layer_window[i] == 0 || c->layer_window[i] == c->sliding_window, "layer_window[%d] = %d", i,
                   c->layer_window[i]);
}

static void check_config(const struct model_config *c)
{
    FUZZ_CHECK(c->arch_name && c->arch_name[0], "no architecture name");
    FUZZ_CHECK(c->vocab_size >= 1 && c->vocab_size <= 1 << 24, "vocab_size %d", c->vocab_size);
    FUZZ_CHECK(c->hidden_size >= 1 && c->hidden_size <= 1 << 16, "hidden_size %d", c->hidden_size);
    FUZZ_CHECK(c->intermediate_size >= 1 && c->intermediate_size <= 1 << 20, "intermediate_size %d",
               c->intermediate_size);
    FUZZ_CHECK(c->n_layers >= 1 && c->n_layers <= 1024, "n_layers %d", c->n_layers);
    FUZZ_CHECK(c->max_position_embeddings >= 1, "max_position_embeddings %d", c->max_position_embeddings);
    FUZZ_CHECK(isfinite(c->rms_norm_eps) && c->rms_norm_eps > 0 && c->rms_norm_eps <= 1, "rms_norm_eps %g",
               c->rms_norm_eps);
    FUZZ_CHECK(c->dtype == BE_F32 || c->dtype == BE_F16 || c->dtype == BE_BF16, "dtype %d", (int)c->dtype);
    FUZZ_CHECK(c->layer_window, "no layer windows");
    if (c->arch == ARCH_MAMBA)
        check_mamba(c);
    else
        check_attention(c);
    FUZZ_CHECK(c->bos_token_id >= -1 && c->bos_token_id < c->vocab_size, "bos %d", c->bos_token_id);
    FUZZ_CHECK(c->pad_token_id >= -1 && c->pad_token_id < c->vocab_size, "pad %d", c->pad_token_id);
    FUZZ_CHECK(c->n_eos >= 0 && c->n_eos <= MODEL_MAX_EOS, "n_eos %d", c->n_eos);
    for (int i = 0; i < c->n_eos; i++)
        FUZZ_CHECK(c->eos_token_ids[i] >= 0 && c->eos_token_ids[i] < c->vocab_size, "eos[%d] = %d", i,
                   c->eos_token_ids[i]);
}

static void check_encdec(const struct encdec_config *c)
{
    FUZZ_CHECK(c->arch_name && c->arch_name[0], "no architecture name");
    FUZZ_CHECK(c->vocab_size >= 1 && c->d_model >= 1 && c->d_model <= 1 << 16 && c->ffn >= 1, "sizes %d %d %d",
               c->vocab_size, c->d_model, c->ffn);
    FUZZ_CHECK(c->n_heads >= 1 && c->head_dim >= 1 && c->head_dim <= MODEL_MAX_HEAD_DIM, "heads %d x %d",
               c->n_heads, c->head_dim);
    FUZZ_CHECK(c->n_enc_layers >= 1 && c->n_enc_layers <= 1024 && c->n_dec_layers >= 1 && c->n_dec_layers <= 1024,
               "layers %d %d", c->n_enc_layers, c->n_dec_layers);
    FUZZ_CHECK(isfinite(c->eps) && c->eps > 0 && c->eps < 1, "eps %g", c->eps);
    FUZZ_CHECK(c->dtype == BE_F32 || c->dtype == BE_F16 || c->dtype == BE_BF16, "dtype %d", (int)c->dtype);
    FUZZ_CHECK(c->decoder_start_token_id >= 0 && c->decoder_start_token_id < c->vocab_size &&
                   c->eos_token_id >= 0 && c->eos_token_id < c->vocab_size,
               "start %d eos %d of %d", c->decoder_start_token_id, c->eos_token_id, c->vocab_size);
    if (c->bart)
        FUZZ_CHECK(c->max_positions >= 1 && c->head_dim * c->n_heads == c->d_model, "bart positions %d, %d x %d",
                   c->max_positions, c->n_heads, c->head_dim);
    else
        FUZZ_CHECK(c->num_buckets >= 4 && c->max_distance > c->num_buckets / 2, "buckets %d distance %d",
                   c->num_buckets, c->max_distance);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 1 << 16)
        return 0;
    const char *dir = fuzz_dir("config");
    fuzz_write_pair(dir, data, size, "config.json", "generation_config.json");

    struct model_config c;
    char err[MODEL_ERR_LEN];
    err[0] = '\0';
    enum model_status st = model_config_load(dir, &c, err);
    if (getenv("KVTIER_FUZZ_VERBOSE")) /* say what each input did */
        fprintf(stderr, "status %d: %s\n", st, st ? err : "ok");
    if (st == MODEL_OK) {
        check_config(&c);
    } else {
        FUZZ_CHECK(st == MODEL_EFORMAT || st == MODEL_ECONFIG || st == MODEL_EUNSUPPORTED || st == MODEL_ENOMEM,
                   "status %d (%s)", st, err);
        FUZZ_CHECK(strstr(err, "config.json"), "message \"%s\" does not name the file", err);
        FUZZ_CHECK(!c.layer_window, "layer windows left after an error");
    }
    model_config_release(&c);

    struct encdec_config e;
    err[0] = '\0';
    st = encdec_config_load(dir, &e, err);
    if (st == MODEL_OK)
        check_encdec(&e);
    else
        FUZZ_CHECK((st == MODEL_EFORMAT || st == MODEL_ECONFIG || st == MODEL_EUNSUPPORTED || st == MODEL_ENOMEM) &&
                       strstr(err, "config.json"),
                   "encdec status %d (%s)", st, err);
    return 0;
}
