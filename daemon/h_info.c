/* h_info.c - what the daemon says about itself: /health (200 once the
 * model is loaded, 503 while loading (with the load's progress), failed,
 * stalled or draining), /v1/models, and
 * /metrics in Prometheus text format. */
#include <stdio.h>
#include <stdlib.h>

#include "daemon/http.h"

enum MHD_Result h_health(struct req *r, const char *arg)
{
    (void)arg;
    char msg[256];
    enum engine_state st = engine_state(r->srv->eng, msg, sizeof(msg));
    if (st == ENGINE_READY && !r->srv->ready)
        st = ENGINE_LOADING; /* until the loop has seen it (need_ready) */
    if (st == ENGINE_READY && !r->srv->draining && !r->srv->stalled)
        return reply_json(r, 200, json_pack("{s:s}", "status", "ok"));
    if (st == ENGINE_READY && !r->srv->draining) {
        snprintf(msg, sizeof(msg), "work is waiting and the engine has completed no step for %d s (--stall-timeout)",
                 r->srv->cfg->stall_timeout_s);
        st = ENGINE_FAILED;
    }
    if (st == ENGINE_LOADING) {
        struct engine_load l = engine_load_progress(r->srv->eng);
        return reply_json(r, 503, json_pack("{s:s,s:{s:s,s:I,s:I,s:f},s:{s:i,s:s,s:s}}", "status", "loading",
                                            "loading", "phase", l.phase, "bytes_done", (json_int_t)l.bytes_done,
                                            "bytes_total", (json_int_t)l.bytes_total, "seconds", l.seconds, "error",
                                            "code", 503, "message", "Loading model", "type", "unavailable_error"));
    }
    const char *what = r->srv->stalled && !r->srv->draining ? "stalled" : st == ENGINE_FAILED ? "failed" : "draining";
    return reply_json(r, 503, json_pack("{s:s,s:{s:i,s:s,s:s}}", "status", what, "error", "code", 503, "message",
                                        st == ENGINE_FAILED ? msg : "Shutting down", "type", "unavailable_error"));
}

/* The served model as OpenAI's model object. */
static json_t *model_obj(const struct server *s)
{
    engine *e = s->eng;
    const struct model_config *mc = engine_model_config(e);
    return json_pack("{s:s,s:s,s:I,s:s,s:{s:i,s:i,s:i,s:i,s:s,s:s}}", "id", engine_model_id(e), "object", "model",
                     "created", (json_int_t)s->started, "owned_by", "kvtier", "meta", "n_vocab", mc->vocab_size,
                     "n_ctx_train", mc->max_position_embeddings, "n_ctx", engine_context(e), "n_embd",
                     mc->hidden_size, "architecture", mc->arch_name, "chat_template",
                     chat_tpl_kind(engine_chat_template(e)));
}

enum MHD_Result h_models(struct req *r, const char *arg)
{
    (void)arg;
    json_t *m = model_obj(r->srv);
    return reply_json(r, 200, m ? json_pack("{s:s,s:[o]}", "object", "list", "data", m) : NULL);
}

/* GET /v1/models/{id}: the model under any name it answers to (its
 * aliases, ipc_check_model), always reported under its id. */
enum MHD_Result h_model(struct req *r, const char *arg)
{
    struct ipc_limits lim = limits(r->srv);
    json_t *name = json_string_nocheck(arg); /* a URL segment may be any bytes: the message quotes them */
    struct ipc_error e;
    enum ipc_status st = name ? ipc_check_model(name, &lim, &e) : IPC_ENOMEM;
    json_decref(name);
    if (!name)
        return MHD_NO;
    if (st != IPC_OK)
        return reply_error(r, &e);
    return reply_json(r, 200, model_obj(r->srv));
}

static void metric(struct jw *w, const char *name, const char *type, const char *help, const char *labels, double v)
{
    if (help)
        jw_fmt(w, "# HELP kvtier_%s %s\n# TYPE kvtier_%s %s\n", name, help, name, type);
    jw_fmt(w, "kvtier_%s%s %.17g\n", name, labels ? labels : "", v);
}

/* A Prometheus histogram: cumulative buckets, +Inf equal to _count. */
static void histogram(struct jw *w, const char *name, const char *help, const struct hist *h)
{
    struct hist_snapshot s;
    hist_snapshot(h, &s);
    jw_fmt(w, "# HELP kvtier_%s %s\n# TYPE kvtier_%s histogram\n", name, help, name);
    for (int i = 0; i < s.n_bounds; i++)
        jw_fmt(w, "kvtier_%s_bucket{le=\"%g\"} %llu\n", name, s.bounds[i], (unsigned long long)s.cum[i]);
    jw_fmt(w, "kvtier_%s_bucket{le=\"+Inf\"} %llu\nkvtier_%s_sum %.17g\nkvtier_%s_count %llu\n", name,
           (unsigned long long)s.count, name, s.sum, name, (unsigned long long)s.count);
}

enum MHD_Result h_metrics(struct req *r, const char *arg)
{
    (void)arg;
    struct server *s = r->srv;
    struct engine_stats st = engine_get_stats(s->eng);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
    struct jw w;
    jw_dynamic(&w);
    metric(&w, "requests_total", "counter", "Generation and session requests accepted.", NULL, (double)st.requests);
    metric(&w, "http_requests_total", "counter", "HTTP requests received.", NULL, (double)s->http_requests);
    metric(&w, "connections_refused_total", "counter", "Connections refused (peer credentials or limits).", NULL,
           (double)s->refused);
    metric(&w, "connections_timed_out_total", "counter",
           "Connections closed for a slow request head or body (--header-timeout, --body-rate).", NULL,
           (double)s->timed_out);
    metric(&w, "prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", NULL, (double)st.prompt_tokens);
    metric(&w, "prompt_cached_tokens_total", "counter", "Prompt tokens reused from a session's KV cache.", NULL,
           (double)st.cached_tokens);
    metric(&w, "generation_tokens_total", "counter", "Tokens generated.", NULL, (double)st.gen_tokens);
    metric(&w, "forward_steps_total", "counter", "Batched forward passes.", NULL, (double)st.steps);
    metric(&w, "requests_running", "gauge", "Sequences being generated.", NULL, st.running);
    metric(&w, "requests_waiting", "gauge", "Requests queued for admission.", NULL, st.queued);
    metric(&w, "sessions", "gauge", "Open sessions.", NULL, st.sessions);
    metric(&w, "connections", "gauge", "Open client connections.", NULL, di ? di->num_connections : 0);
    metric(&w, "kv_cache_bytes", "gauge", "KV cache bytes resident per tier.", "{tier=\"device\"}",
           (double)st.kv_dev_bytes);
    metric(&w, "kv_cache_bytes", "gauge", NULL, "{tier=\"host\"}", (double)st.kv_host_bytes);
    metric(&w, "kv_cache_bytes", "gauge", NULL, "{tier=\"disk\"}", (double)st.disk.used);
    metric(&w, "kv_host_budget_bytes", "gauge", "Bytes the host tier may take (--host-mem; 0: unlimited).", NULL,
           (double)st.kv_host_budget);
    metric(&w, "disk_budget_bytes", "gauge", "Bytes the disk tier may take (--disk-mem).", NULL,
           (double)st.disk.budget);
    metric(&w, "disk_files", "gauge", "Objects in the disk tier.", NULL, (double)st.disk.files);
    jw_lit(&w, "# HELP kvtier_session_spills_total Sessions written to the disk tier, by reason.\n"
               "# TYPE kvtier_session_spills_total counter\n");
    for (int k = 0; k < ENGINE_N_SPILL_WHY; k++)
        jw_fmt(&w, "kvtier_session_spills_total{reason=\"%s\"} %llu\n", engine_spill_why_name((enum engine_spill_why)k),
               (unsigned long long)st.spills[k]);
    metric(&w, "session_restores_total", "counter", "Sessions read back from the disk tier.", NULL,
           (double)st.restores);
    metric(&w, "session_restore_early_layers_total", "counter",
           "Layers of restoring sessions that a step computed on before the rest of the read was in.", NULL,
           (double)st.restore_early_layers);
    metric(&w, "disk_errors_total", "counter",
           "Spills and restores that failed (disk full, I/O error, corrupt file); the KV stayed or was recomputed.",
           NULL, (double)st.disk_errors);
    metric(&w, "disk_quarantined_total", "counter", "Files moved to the quarantine directory as corrupt.", NULL,
           (double)st.disk.quarantined);
    metric(&w, "disk_bytes_total", "counter", "Bytes written to and read from disk (as stored).",
           "{op=\"write\"}", (double)st.disk.bytes_written);
    metric(&w, "disk_bytes_total", "counter", NULL, "{op=\"read\"}", (double)st.disk.bytes_read);
    metric(&w, "disk_compression_ratio", "gauge", "Raw over stored bytes of the chunks compressed so far.", NULL,
           st.disk.stored_compressed ? (double)st.disk.raw_compressed / (double)st.disk.stored_compressed : 1.0);
    metric(&w, "disk_compress_seconds_total", "counter",
           "Seconds the disk tier spent byte-shuffling and compressing chunks (what compression cost).", NULL,
           st.disk.compress_s);
    metric(&w, "disk_op_seconds_total", "counter", "Seconds the disk tier's writes and reads took, end to end.",
           "{op=\"write\"}", st.disk.write_s);
    metric(&w, "disk_op_seconds_total", "counter", NULL, "{op=\"read\"}", st.disk.read_s);
    metric(&w, "prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the automatic prefix cache.", NULL,
           (double)st.prefix_hit_tokens);
    metric(&w, "prefix_cache_blocks", "gauge", "Token blocks in the prefix cache.", NULL, (double)st.prefix_entries);
    metric(&w, "prefix_cache_evictions_total", "counter", "Unreferenced prefix-cache blocks freed for room.", NULL,
           (double)st.prefix_evictions);
    metric(&w, "prefix_disk_blocks_total", "counter", "Prefix-cache blocks written to and read back from the disk tier.",
           "{op=\"write\"}", (double)st.prefix_disk_written);
    metric(&w, "prefix_disk_blocks_total", "counter", NULL, "{op=\"read\"}", (double)st.prefix_disk_read);
    metric(&w, "prefix_disk_hits_total", "counter", "Requests whose prompt went on with prefix-cache blocks from disk.",
           NULL, (double)st.prefix_disk_hits);
    metric(&w, "encoder_disk_caches_total", "counter",
           "Encoder-cache cross-attention caches written to and read back from the disk tier.", "{op=\"write\"}",
           (double)st.encoder_disk_written);
    metric(&w, "encoder_disk_caches_total", "counter", NULL, "{op=\"read\"}", (double)st.encoder_disk_read);
    if (st.remote_on) {
        const struct kv_remote_stats *rs = &st.remote;
        metric(&w, "remote_lookups_total", "counter", "Prompt chains looked up in the remote tier.", NULL,
               (double)rs->lookups);
        metric(&w, "remote_blocks_total", "counter",
               "Prefix-cache blocks found in the remote tier (hit), lookups that stopped at a block it lacked "
               "(miss), blocks published to it.",
               "{result=\"hit\"}", (double)rs->hit_blocks);
        metric(&w, "remote_blocks_total", "counter", NULL, "{result=\"miss\"}", (double)rs->miss_lookups);
        metric(&w, "remote_blocks_total", "counter", NULL, "{result=\"published\"}", (double)rs->published);
        metric(&w, "remote_hits_total", "counter", "Requests whose prompt went on with blocks from the remote tier.",
               NULL, (double)st.remote_hits);
        metric(&w, "remote_bytes_total", "counter", "Bytes of values fetched from and published to the remote tier.",
               "{dir=\"in\"}", (double)rs->bytes_in);
        metric(&w, "remote_bytes_total", "counter", NULL, "{dir=\"out\"}", (double)rs->bytes_out);
        metric(&w, "remote_lookup_seconds_total", "counter", "Seconds the remote lookups took, end to end.", NULL,
               rs->fetch_ms / 1e3);
        jw_lit(&w, "# HELP kvtier_remote_errors_total Remote tier failures by kind (each one a miss or a block not "
                   "published).\n# TYPE kvtier_remote_errors_total counter\n");
        for (int k = 0; k < KV_REMOTE_N_ERR; k++)
            jw_fmt(&w, "kvtier_remote_errors_total{kind=\"%s\"} %llu\n", kv_remote_err_name((enum kv_remote_err)k),
                   (unsigned long long)(rs->errors[k] + (k == KV_REMOTE_E_CORRUPT ? st.remote_refused : 0)));
    }
    metric(&w, "device_memory_bytes", "gauge", "Device memory budget (--device-mem) and bytes in use.",
           "{kind=\"budget\"}", (double)st.dev_budget);
    metric(&w, "device_memory_bytes", "gauge", NULL, "{kind=\"used\"}", (double)st.dev_used);
    metric(&w, "kv_fallbacks_total", "counter",
           "Sequences moved to the host tier because the device tier could not hold them, by reason.",
           "{reason=\"oom\"}", (double)st.kv_fallbacks_oom);
    metric(&w, "kv_fallbacks_total", "counter", NULL, "{reason=\"sized\"}",
           (double)(st.kv_fallbacks - st.kv_fallbacks_oom));
    const struct engine_hists *hs = engine_hists(s->eng);
    histogram(&w, "queue_wait_seconds", "Time from submission to admission, per admitted job.", &hs->queue_wait);
    histogram(&w, "time_to_first_token_seconds", "Time from submission to the first generated token, per request.",
              &hs->ttft);
    histogram(&w, "inter_token_latency_seconds", "Time between consecutive tokens of one choice, per token.",
              &hs->inter_token);
    histogram(&w, "prefill_time_per_token_seconds",
              "Admission to first token over the prompt tokens computed (not cached), per request.",
              &hs->prefill_token);
    histogram(&w, "decode_time_per_token_seconds",
              "First token to the end over the tokens generated after the first, per request.", &hs->decode_token);
    jw_lit(&w, "# HELP kvtier_errors_total Error replies by kind.\n# TYPE kvtier_errors_total counter\n");
    for (int k = IPC_EINVAL; k < IPC_N_STATUS; k++)
        if (k != IPC_EPROTO && k != IPC_EIO) /* the client's own kinds */
            jw_fmt(&w, "kvtier_errors_total{kind=\"%s\"} %llu\n", ipc_status_name((enum ipc_status)k),
                   (unsigned long long)st.errors[k]);
    metric(&w, "process_start_time_seconds", "gauge", "Start time of kvtierd (Unix seconds).", NULL,
           (double)s->started);
    struct engine_load l = engine_load_progress(s->eng);
    metric(&w, "model_load_bytes", "gauge", "Bytes of the model's files read into memory at load, and their total.",
           "{kind=\"done\"}", (double)l.bytes_done);
    metric(&w, "model_load_bytes", "gauge", NULL, "{kind=\"total\"}", (double)l.bytes_total);
    metric(&w, "model_load_seconds", "gauge", "Seconds the load took, warm-up included (so far, while loading).",
           NULL, l.seconds);
    if (w.failed) {
        free(w.p);
        return MHD_NO;
    }
    return queue(r, 200, w.p, w.n, "text/plain; version=0.0.4; charset=utf-8");
}

