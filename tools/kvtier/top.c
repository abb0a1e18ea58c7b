/* top.c - `kvtier top`: a live view of kvtierd, redrawn every -d seconds
 * from what the daemon already publishes: /v1/sessions (each session's KV
 * bytes per tier and strategy), /v1/requests (queued and running
 * generations), /metrics (tier totals, budgets, spills and restores).
 * Tokens per second are the change in tokens between two polls.  On a
 * terminal it is an ncurses screen (q quits); otherwise one frame is
 * printed as text. */
#include <curses.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tools/kvtier/cli.h"
#include "util/clock.h"

const char cli_top_usage[] =
    "usage: kvtier top [-d SECONDS] [-n FRAMES]\n"
    "  a live view of kvtierd: per session and per request the KV bytes on the device,\n"
    "  in host memory and on disk, the strategy, tokens/s and state; the queue; each\n"
    "  tier's total against its budget; restores and how much of them overlapped compute\n"
    "  -d SECONDS  time between updates (0.2-60, default 1)\n"
    "  -n FRAMES   stop after FRAMES updates (default: until q)\n"
    "without a terminal it prints one frame and exits.\n";

/* tokens at the previous poll, per session id or request id */
struct seen {
    char key[KVTIER_SESSION_ID_MAX + 8];
    long long tokens;
};

struct view {
    struct seen *prev, *cur;
    size_t n_prev, n_cur, cap_cur;
    double t_prev, t_cur;
    char **lines;
    size_t n_lines, cap_lines;
};

static void add_line(struct view *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_line(struct view *v, const char *fmt, ...)
{
    if (v->n_lines == v->cap_lines) {
        size_t cap = v->cap_lines ? 2 * v->cap_lines : 64;
        char **l = realloc(v->lines, cap * sizeof(*l));
        if (!l)
            return;
        v->lines = l, v->cap_lines = cap;
    }
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(&v->lines[v->n_lines], fmt, ap) >= 0)
        v->n_lines++;
    va_end(ap);
}

static void clear_lines(struct view *v)
{
    for (size_t i = 0; i < v->n_lines; i++)
        free(v->lines[i]);
    v->n_lines = 0;
}

/* Tokens per second of key since the last poll, or -1 when it is new. */
static double rate(struct view *v, const char *key, long long tokens)
{
    if (v->n_cur == v->cap_cur) {
        size_t cap = v->cap_cur ? 2 * v->cap_cur : 32;
        struct seen *s = realloc(v->cur, cap * sizeof(*s));
        if (!s)
            return -1;
        v->cur = s, v->cap_cur = cap;
    }
    struct seen *s = &v->cur[v->n_cur++];
    snprintf(s->key, sizeof(s->key), "%s", key);
    s->tokens = tokens;
    for (size_t i = 0; i < v->n_prev; i++)
        if (!strcmp(v->prev[i].key, key) && v->t_cur > v->t_prev && tokens >= v->prev[i].tokens)
            return (double)(tokens - v->prev[i].tokens) / (v->t_cur - v->t_prev);
    return -1;
}

static const char *human(double b, char *buf, size_t cap)
{
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (b >= 1024 && u < 4)
        b /= 1024, u++;
    snprintf(buf, cap, u ? "%.1f %s" : "%.0f %s", b, unit[u]);
    return buf;
}

/* The value of the sample "kvtier_NAME" in a Prometheus text page, or -1
 * when absent.  NAME with its labels picks that series; NAME alone sums
 * all its series (spills and fallbacks are counted by reason). */
static double metric(const char *page, const char *name)
{
    size_t n = strlen(name);
    double sum = -1; /* a labelled metric (reason="...") counts all its series */
    for (const char *p = page; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, "kvtier_", 7) || strncmp(p + 7, name, n) || (p[7 + n] != ' ' && p[7 + n] != '{'))
            continue;
        const char *v = p[7 + n] == ' ' ? p + 7 + n : strchr(p + 7 + n, '}');
        if (v)
            sum = (sum < 0 ? 0 : sum) + strtod(v + 1, NULL);
    }
    return sum;
}

static void tier_line(struct view *v, const char *tier, double used, double budget, const char *what)
{
    char a[32], b[32];
    int width = 20, fill = budget > 0 && used >= 0 ? (int)(width * (used > budget ? 1 : used / budget)) : 0;
    add_line(v, "%-7s %11s of %-11s [%.*s%*s] %s", tier, used >= 0 ? human(used, a, sizeof(a)) : "-",
             budget > 0 ? human(budget, b, sizeof(b)) : "unlimited", fill, "####################", width - fill, "",
             what);
}

/* Reads everything and lays out one frame in v->lines.  Fails only when
 * /health has no answer; the caller reports it (after leaving curses). */
static enum kvtier_status poll_frame(struct view *v, double interval)
{
    json_t *sess = NULL, *reqs = NULL;
    struct kvtier_reply m = {0};
    struct kvtier_health h;
    enum kvtier_status st = kvtier_health(cli, &h);
    if (st != KVTIER_OK)
        return st;
    clear_lines(v);
    /* the previous poll's counts become the base of this one's rates */
    free(v->prev);
    v->prev = v->cur, v->n_prev = v->n_cur, v->t_prev = v->t_cur;
    v->cur = NULL, v->n_cur = v->cap_cur = 0;
    v->t_cur = clock_s();
    kvtier_request(cli, "GET", "/metrics", NULL, 0, &m);
    const char *page = m.status == 200 ? m.body : "";
    struct kvtier_reply r;
    if (kvtier_request(cli, "GET", "/v1/sessions", NULL, 0, &r) == KVTIER_OK) {
        if (r.status == 200)
            sess = json_loadb(r.body, r.len, 0, NULL);
        kvtier_reply_free(&r);
    }
    if (kvtier_request(cli, "GET", "/v1/requests", NULL, 0, &r) == KVTIER_OK) {
        if (r.status == 200) /* a daemon without the endpoint shows no request table */
            reqs = json_loadb(r.body, r.len, 0, NULL);
        kvtier_reply_free(&r);
    }
    time_t now = time(NULL);
    char clock_text[16];
    strftime(clock_text, sizeof(clock_text), "%H:%M:%S", localtime(&now));
    add_line(v, "kvtierd %s  %s  sessions %.0f  running %.0f  queued %.0f   %s, every %.1f s (q quits)",
             kvtier_socket(cli), h.status, metric(page, "sessions"), metric(page, "requests_running"),
             metric(page, "requests_waiting"), clock_text, interval);
    if (!h.ready && h.total_bytes > 0)
        add_line(v, "loading the model: %.0f%%", 100.0 * (double)h.loaded_bytes / (double)h.total_bytes);
    add_line(v, "%s", "");
    add_line(v, "%-7s %11s    %-11s %-22s %s", "TIER", "USED", "BUDGET", "", "");
    char a[32];
    double kv_dev = metric(page, "kv_cache_bytes{tier=\"device\"}");
    char what[64];
    snprintf(what, sizeof(what), "KV %s", kv_dev >= 0 ? human(kv_dev, a, sizeof(a)) : "-");
    tier_line(v, "device", metric(page, "device_memory_bytes{kind=\"used\"}"),
              metric(page, "device_memory_bytes{kind=\"budget\"}"), what);
    tier_line(v, "host", metric(page, "kv_cache_bytes{tier=\"host\"}"), metric(page, "kv_host_budget_bytes"), "KV");
    double files = metric(page, "disk_files");
    snprintf(what, sizeof(what), "%.0f files", files > 0 ? files : 0);
    tier_line(v, "disk", metric(page, "kv_cache_bytes{tier=\"disk\"}"), metric(page, "disk_budget_bytes"), what);
    add_line(v, "spills %.0f  restores %.0f  restore overlap: %.0f layers computed before their read ended  "
                "fallbacks %.0f",
             metric(page, "session_spills_total"), metric(page, "session_restores_total"),
             metric(page, "session_restore_early_layers_total"), metric(page, "kv_fallbacks_total"));
    add_line(v, "%s", "");
    add_line(v, "%-24s %8s %10s %10s %10s %-12s %7s %s", "SESSION", "TOKENS", "DEVICE", "HOST", "DISK", "STRATEGY",
             "TOK/S", "STATE");
    size_t i;
    json_t *s;
    json_array_foreach(json_object_get(sess, "data"), i, s)
    {
        const char *id = json_string_value(json_object_get(s, "id"));
        const json_t *b = json_object_get(s, "bytes");
        long long toks = json_integer_value(json_object_get(s, "tokens"));
        double rt = rate(v, id ? id : "", toks);
        char d[32], ho[32], di[32], tps[16] = "-";
        if (rt >= 0)
            snprintf(tps, sizeof(tps), "%.1f", rt);
        const char *fb = json_string_value(json_object_get(s, "fallback"));
        add_line(v, "%-24.24s %8lld %10s %10s %10s %-12.12s %7s %s%s%s", id ? id : "?", toks,
                 human((double)json_integer_value(json_object_get(b, "device")), d, sizeof(d)),
                 human((double)json_integer_value(json_object_get(b, "host")), ho, sizeof(ho)),
                 human((double)json_integer_value(json_object_get(b, "disk")), di, sizeof(di)),
                 json_string_value(json_object_get(s, "strategy")) ? json_string_value(json_object_get(s, "strategy"))
                                                                   : "-",
                 tps, json_is_true(json_object_get(s, "busy")) ? "busy" : "idle", fb ? ", " : "", fb ? fb : "");
    }
    if (!json_array_size(json_object_get(sess, "data")))
        add_line(v, "(no sessions)");
    if (reqs) {
        add_line(v, "%s", "");
        add_line(v, "%-8s %-15s %-24s %8s %13s %7s %10s %10s %10s %7s %s", "REQUEST", "STATE", "SESSION", "PROMPT",
                 "GENERATED/MAX", "TOK/S", "DEVICE", "HOST", "DISK", "OVERLAP", "STRATEGY");
        json_array_foreach(json_object_get(reqs, "data"), i, s)
        {
            char key[32], gm[32], tps[16] = "-", d[32], ho[32], di[32], ov[16] = "-";
            long long gen = json_integer_value(json_object_get(s, "generated_tokens"));
            snprintf(key, sizeof(key), "req-%lld", (long long)json_integer_value(json_object_get(s, "id")));
            double rt = rate(v, key, gen);
            if (rt >= 0)
                snprintf(tps, sizeof(tps), "%.1f", rt);
            snprintf(gm, sizeof(gm), "%lld/%lld", gen, (long long)json_integer_value(json_object_get(s, "max_tokens")));
            const char *sid = json_string_value(json_object_get(s, "session"));
            const json_t *b = json_object_get(s, "bytes"), *o = json_object_get(s, "overlap");
            if (json_is_number(o)) /* known once a step streamed the request's KV */
                snprintf(ov, sizeof(ov), "%.0f%%", json_number_value(o) * 100);
            add_line(v, "%-8lld %-15.15s %-24.24s %8lld %13s %7s %10s %10s %10s %7s %s",
                     (long long)json_integer_value(json_object_get(s, "id")),
                     json_string_value(json_object_get(s, "state")) ? json_string_value(json_object_get(s, "state"))
                                                                    : "?",
                     sid ? sid : "-", (long long)json_integer_value(json_object_get(s, "prompt_tokens")), gm, tps,
                     human((double)json_integer_value(json_object_get(b, "device")), d, sizeof(d)),
                     human((double)json_integer_value(json_object_get(b, "host")), ho, sizeof(ho)),
                     human((double)json_integer_value(json_object_get(b, "disk")), di, sizeof(di)), ov,
                     json_string_value(json_object_get(s, "strategy")) ? json_string_value(json_object_get(s, "strategy"))
                                                                       : "-");
        }
        if (!json_array_size(json_object_get(reqs, "data")))
            add_line(v, "(no requests)");
    }
    json_decref(sess);
    json_decref(reqs);
    kvtier_reply_free(&m);
    return KVTIER_OK;
}

int cmd_top(int argc, char **argv)
{
    double interval = 1.0;
    long frames = 0;
    int c;
    optind = 1;
    while ((c = getopt(argc, argv, "d:n:")) != -1) {
        char *end = NULL;
        if (c == 'd')
            interval = strtod(optarg, &end);
        else if (c == 'n')
            frames = strtol(optarg, &end, 10);
        if (c == '?' || !end || *end || !(interval >= 0.2 && interval <= 60) || frames < 0) {
            fputs(cli_top_usage, stderr);
            return EXIT_USAGE;
        }
    }
    if (optind != argc) {
        fputs(cli_top_usage, stderr);
        return EXIT_USAGE;
    }
    struct view v = {0};
    enum kvtier_status st = KVTIER_OK;
    SCREEN *scr = isatty(STDOUT_FILENO) && isatty(STDIN_FILENO) ? newterm(NULL, stdout, stdin) : NULL;
    if (!scr) {
        if ((st = poll_frame(&v, interval)) == KVTIER_OK)
            for (size_t i = 0; i < v.n_lines; i++)
                printf("%s\n", v.lines[i]);
    } else {
        cbreak();
        noecho();
        curs_set(0);
        keypad(stdscr, TRUE);
        timeout((int)(interval * 1000));
        for (long f = 0; !frames || f < frames; f++) {
            if ((st = poll_frame(&v, interval)) != KVTIER_OK)
                break;
            erase();
            int rows = LINES, cols = COLS;
            for (size_t i = 0; i < v.n_lines && (int)i < rows; i++) {
                if (i == 0 || !strncmp(v.lines[i], "TIER", 4) || !strncmp(v.lines[i], "SESSION ", 8) ||
                    !strncmp(v.lines[i], "REQUEST ", 8))
                    attron(A_BOLD);
                mvaddnstr((int)i, 0, v.lines[i], cols);
                attroff(A_BOLD);
            }
            refresh();
            int ch = getch();
            if (ch == 'q' || ch == 'Q')
                break;
        }
        endwin();
        delscreen(scr);
    }
    clear_lines(&v);
    free(v.lines);
    free(v.prev);
    free(v.cur);
    return st == KVTIER_OK ? 0 : cli_fail(st);
}
