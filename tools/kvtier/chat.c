/* chat.c - `kvtier chat`: one session for the whole conversation, so each
 * turn reuses the KV of the ones before.  On a terminal the prompt has
 * line editing and a history file (libedit); Ctrl-C during a reply cancels
 * it (the stream is closed, which makes kvtierd cancel the generation),
 * Ctrl-C twice at the prompt or Ctrl-D ends the chat, and the session is
 * deleted on the way out.  Without a terminal lines are read from stdin. */
#include <errno.h>
#include <histedit.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/kvtier/cli.h"

const char cli_chat_usage[] =
    "usage: kvtier chat [--system TEXT] [-n N] [-t T] [--seed S] [--stop STR]\n"
    "  an interactive chat in one session; each reply streams to stdout\n"
    "  --system TEXT        the system prompt\n"
    "  -n, --max-tokens N   tokens per reply (default 256)\n"
    "  -t, --temperature T  sampling temperature (default 0.8)\n"
    "at the prompt: /undo drops the last turn, /reset starts a new session, /bye quits;\n"
    "Ctrl-C cancels a reply, Ctrl-C twice or Ctrl-D quits (the session is deleted).\n"
    "History: $XDG_STATE_HOME/kvtier/history (default ~/.local/state/kvtier/history).\n";

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
    kvtier_cancel(cli); /* sets a flag: async-signal-safe */
}

/* ---- the prompt --------------------------------------------------------- */

struct prompt {
    EditLine *el; /* NULL: not a terminal, lines come from getline */
    History *hist;
    char path[PATH_MAX];
    char *line; /* getline's buffer */
    size_t cap;
};

static char *prompt_text(EditLine *el)
{
    (void)el;
    return "> ";
}

/* $XDG_STATE_HOME/kvtier/history or ~/.local/state/kvtier/history, its
 * directories made; "" when neither variable gives a place. */
static void history_path(char *out, size_t cap)
{
    const char *state = getenv("XDG_STATE_HOME"), *home = getenv("HOME");
    char dir[PATH_MAX];
    int n = state && *state ? snprintf(dir, sizeof(dir), "%s/kvtier", state)
            : home && *home ? snprintf(dir, sizeof(dir), "%s/.local/state/kvtier", home)
                            : -1;
    out[0] = '\0';
    if (n <= 0 || (size_t)n >= sizeof(dir))
        return;
    for (char *p = dir + 1; *p; p++) { /* mkdir -p */
        if (*p != '/')
            continue;
        *p = '\0';
        mkdir(dir, 0700);
        *p = '/';
    }
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return;
    if ((size_t)snprintf(out, cap, "%s/history", dir) >= cap)
        out[0] = '\0';
}

static bool prompt_open(struct prompt *p)
{
    *p = (struct prompt){0};
    if (!isatty(STDIN_FILENO) || !isatty(STDOUT_FILENO))
        return true;
    HistEvent ev;
    if (!(p->el = el_init("kvtier", stdin, stdout, stderr)) || !(p->hist = history_init())) {
        if (p->el)
            el_end(p->el);
        p->el = NULL;
        return false;
    }
    history(p->hist, &ev, H_SETSIZE, 1000);
    history(p->hist, &ev, H_SETUNIQUE, 1);
    history_path(p->path, sizeof(p->path));
    if (p->path[0])
        history(p->hist, &ev, H_LOAD, p->path); /* none yet is fine */
    el_set(p->el, EL_EDITOR, "emacs");
    el_set(p->el, EL_PROMPT, prompt_text);
    el_set(p->el, EL_HIST, history, p->hist);
    el_source(p->el, NULL); /* the user's ~/.editrc */
    return true;
}

static void prompt_close(struct prompt *p)
{
    if (p->el)
        el_end(p->el);
    if (p->hist)
        history_end(p->hist);
    free(p->line);
}

enum got { GOT_LINE, GOT_EOF, GOT_INTERRUPT };

/* The next line without its newline in *out (valid until the next call). */
static enum got prompt_read(struct prompt *p, const char **out)
{
    if (!p->el) {
        ssize_t n = getline(&p->line, &p->cap, stdin);
        if (n < 0)
            return interrupted ? GOT_INTERRUPT : GOT_EOF;
        while (n && (p->line[n - 1] == '\n' || p->line[n - 1] == '\r'))
            p->line[--n] = '\0';
        *out = p->line;
        return GOT_LINE;
    }
    int n = 0;
    const char *l = el_gets(p->el, &n);
    if (interrupted) {
        el_reset(p->el);
        return GOT_INTERRUPT;
    }
    if (!l || n <= 0)
        return GOT_EOF;
    free(p->line);
    if (!(p->line = strdup(l)))
        return GOT_EOF;
    size_t len = strlen(p->line);
    while (len && (p->line[len - 1] == '\n' || p->line[len - 1] == '\r'))
        p->line[--len] = '\0';
    if (len) {
        HistEvent ev;
        history(p->hist, &ev, H_ENTER, p->line);
        if (p->path[0])
            history(p->hist, &ev, H_SAVE, p->path);
    }
    *out = p->line;
    return GOT_LINE;
}

/* ---- the conversation --------------------------------------------------- */

struct convo {
    char id[KVTIER_SESSION_ID_MAX + 1];
    struct kvtier_message *msgs; /* role and content strings are malloc'd */
    size_t n, cap;
    long long *turns; /* the session's length in tokens before each turn */
    size_t n_turns, cap_turns;
    const char *system;
};

static bool convo_add(struct convo *c, const char *role, const char *content, size_t len)
{
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 16;
        struct kvtier_message *m = realloc(c->msgs, cap * sizeof(*m));
        if (!m)
            return false;
        c->msgs = m, c->cap = cap;
    }
    char *text = strndup(content, len);
    if (!text)
        return false;
    c->msgs[c->n++] = (struct kvtier_message){.role = role, .content = text};
    return true;
}

static void convo_drop(struct convo *c, size_t keep)
{
    while (c->n > keep)
        free((char *)c->msgs[--c->n].content);
}

/* A new session; waits while the model loads.  Returns an exit code. */
static int session_new(struct convo *c)
{
    enum kvtier_status st;
    int w = 0;
    while ((st = kvtier_session_create(cli, c->system, c->id)) == KVTIER_ELOADING && (w = cli_wait_loading()) == 0)
        ;
    convo_drop(c, 0);
    c->n_turns = 0;
    if (st == KVTIER_OK && c->system && !convo_add(c, "system", c->system, strlen(c->system))) {
        fprintf(stderr, "kvtier: out of memory\n");
        return EXIT_DAEMON;
    }
    return st == KVTIER_OK ? 0 : w > 0 ? w : cli_fail(st);
}

static void session_end(struct convo *c)
{
    /* a reply just cancelled keeps the session busy for a moment */
    for (int i = 0; i < 50 && c->id[0]; i++) {
        enum kvtier_status st = kvtier_session_delete(cli, c->id);
        if (st != KVTIER_EHTTP || kvtier_http_status(cli) != 409)
            break;
        cli_nap_ms(100);
    }
    c->id[0] = '\0';
}

/* Tokens the session holds, or -1 (printed). */
static long long session_tokens(const char *id)
{
    char path[96];
    snprintf(path, sizeof(path), "/v1/sessions/%s", id);
    json_t *r = NULL;
    long long n = cli_call("GET", path, NULL, &r) ? -1 : (long long)json_integer_value(json_object_get(r, "tokens"));
    json_decref(r);
    return n;
}

/* /undo: crops the session back to where the last turn started and drops
 * the turn from the conversation. */
static int chat_undo(struct convo *c)
{
    if (!c->n_turns) {
        fprintf(stderr, "nothing to undo\n");
        return 0;
    }
    long long before = c->turns[c->n_turns - 1], now = session_tokens(c->id);
    if (now < 0)
        return EXIT_DAEMON;
    char path[96];
    snprintf(path, sizeof(path), "/v1/sessions/%s/crop", c->id);
    json_t *b = json_pack("{s:I}", "n", (json_int_t)(before - now));
    int rc = b ? cli_call("POST", path, b, NULL) : EXIT_DAEMON;
    json_decref(b);
    if (rc)
        return rc;
    c->n_turns--;
    convo_drop(c, c->n >= 2 ? c->n - 2 : 0); /* the question and its answer */
    fprintf(stderr, "undone: %lld tokens dropped\n", now - before);
    return 0;
}

/* One turn: line goes to the model, the reply streams out.  Returns an
 * exit code; a reply cancelled with Ctrl-C is not an error. */
static int chat_turn(struct convo *c, const struct cli_gen *o, const char *line)
{
    long long held = session_tokens(c->id);
    if (held < 0)
        return EXIT_DAEMON;
    if (c->n_turns == c->cap_turns) {
        size_t cap = c->cap_turns ? 2 * c->cap_turns : 16;
        long long *t = realloc(c->turns, cap * sizeof(*t));
        if (!t) {
            fprintf(stderr, "kvtier: out of memory\n");
            return EXIT_DAEMON;
        }
        c->turns = t, c->cap_turns = cap;
    }
    if (!convo_add(c, "user", line, strlen(line))) {
        fprintf(stderr, "kvtier: out of memory\n");
        return EXIT_DAEMON;
    }
    c->turns[c->n_turns++] = held;
    struct kvtier_params p = o->p;
    p.session = c->id;
    bool ends_nl = true;
    struct kvtier_result res;
    enum kvtier_status st;
    int w = 0;
    interrupted = 0;
    for (int busy = 0;; busy++) {
        st = kvtier_chat(cli, c->msgs, c->n, &p, cli_print_piece, &ends_nl, &res);
        if (st == KVTIER_ELOADING && (w = cli_wait_loading()) == 0)
            continue;
        /* the reply cancelled a moment ago may still hold the session */
        if (st == KVTIER_EHTTP && kvtier_http_status(cli) == 409 && busy < 50 && !interrupted) {
            cli_nap_ms(100);
            continue;
        }
        break;
    }
    bool cancelled = st == KVTIER_ECANCELLED;
    if (!ends_nl || cancelled)
        putchar('\n');
    if (cancelled)
        fprintf(stderr, "(reply cancelled)\n");
    fflush(stdout);
    if (st == KVTIER_OK && cli_json)
        fprintf(stderr,
                "{\"prompt_tokens\":%lld,\"completion_tokens\":%lld,\"total_tokens\":%lld,"
                "\"prompt_tokens_details\":{\"cached_tokens\":%lld}}\n",
                res.prompt_tokens, res.completion_tokens, res.prompt_tokens + res.completion_tokens,
                res.cached_tokens);
    int rc = st == KVTIER_OK || cancelled ? 0 : w > 0 ? w : cli_fail(st);
    /* what was shown of the reply is the conversation, also when cut short */
    if (!rc && !convo_add(c, "assistant", res.text ? res.text : "", res.len)) {
        fprintf(stderr, "kvtier: out of memory\n");
        rc = EXIT_DAEMON;
    }
    kvtier_result_free(&res);
    interrupted = 0;
    return rc;
}

int cmd_chat(int argc, char **argv)
{
    struct cli_gen o = {.p = {.max_tokens = 256, .temperature = 0.8}};
    if (!cli_gen_opts(argc, argv, &o) || optind != argc || o.p.session) {
        fputs(cli_chat_usage, stderr);
        return EXIT_USAGE;
    }
    struct convo c = {.system = o.system};
    int rc = session_new(&c);
    if (rc)
        return rc;
    struct prompt pr;
    if (!prompt_open(&pr)) {
        fprintf(stderr, "kvtier: cannot set up line editing\n");
        session_end(&c);
        return EXIT_DAEMON;
    }
    /* no SA_RESTART: a read at the prompt returns, so Ctrl-C is seen there */
    struct sigaction sa = {.sa_handler = on_sigint}, old;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old);
    if (pr.el)
        fprintf(stderr, "session %s. /undo drops the last turn, /reset starts over; "
                        "Ctrl-C cancels a reply, Ctrl-D quits.\n", c.id);
    bool last_was_interrupt = false;
    for (;;) {
        const char *line;
        interrupted = 0;
        enum got g = prompt_read(&pr, &line);
        if (g == GOT_EOF) {
            if (pr.el)
                fputc('\n', stderr);
            break;
        }
        if (g == GOT_INTERRUPT) {
            if (last_was_interrupt || !pr.el) {
                fputc('\n', stderr);
                break;
            }
            fprintf(stderr, "\n(Ctrl-C again or Ctrl-D to quit)\n");
            last_was_interrupt = true;
            continue;
        }
        last_was_interrupt = false;
        if (!*line)
            continue;
        if (!strcmp(line, "/bye"))
            break;
        if (!strcmp(line, "/undo")) {
            if ((rc = chat_undo(&c)))
                break;
            continue;
        }
        if (!strcmp(line, "/reset")) {
            session_end(&c);
            if ((rc = session_new(&c)))
                break;
            if (pr.el)
                fprintf(stderr, "new session %s\n", c.id);
            continue;
        }
        if ((rc = chat_turn(&c, &o, line)))
            break;
    }
    sigaction(SIGINT, &old, NULL);
    prompt_close(&pr);
    session_end(&c);
    convo_drop(&c, 0);
    free(c.msgs);
    free(c.turns);
    return rc;
}
