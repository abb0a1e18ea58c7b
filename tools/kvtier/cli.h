/* cli.h - what the kvtier CLI's commands share (tools/kvtier.c has main
 * and the one-shot commands; chat.c and top.c the interactive ones).  All
 * talk to kvtierd through libkvtier-client but quantize.c, which converts
 * model files without it. */
#ifndef KVTIER_TOOLS_CLI_H
#define KVTIER_TOOLS_CLI_H

#include <jansson.h>
#include <stdbool.h>

#include "client/kvtier/client.h"

enum { EXIT_DAEMON = 1, EXIT_USAGE = 2, EXIT_UNREACHABLE = 3, EXIT_PROTO = 4 };

extern kvtier_client *cli;  /* the connection every command uses */
extern bool cli_json;       /* --json */

/* Prints the client's last error; returns the exit code for st. */
int cli_fail(enum kvtier_status st);
/* One JSON call; *out (out may be NULL) gets the 2xx reply.  While the
 * daemon loads its model it waits (cli_wait_loading) and asks again.
 * Returns an exit code, the error printed. */
int cli_call(const char *method, const char *path, json_t *body, json_t **out);
/* Waits with a progress bar while kvtierd says it is loading.  Returns 0
 * once it is ready after a wait, -1 when it was not loading at all, or an
 * exit code (printed) when it failed or went away. */
int cli_wait_loading(void);
void cli_nap_ms(long ms);

/* Generation options of generate and chat (-n, -t, --seed, --stop,
 * --session, --system); false on a usage error (printed). */
struct cli_gen {
    struct kvtier_params p;
    const char *stops[16];
    const char *system;
};
bool cli_gen_opts(int argc, char **argv, struct cli_gen *o);
/* A kvtier_token_fn that prints each piece; ud is a bool that says
 * whether the output so far ends with a newline. */
bool cli_print_piece(void *ud, const char *text, size_t len);

int cmd_chat(int argc, char **argv);
int cmd_top(int argc, char **argv);
int cmd_quantize(int argc, char **argv);
extern const char cli_chat_usage[], cli_top_usage[], cli_quantize_usage[];

#endif
