/* toolcall.h - the model's tool calls read back from its text, for the
 * chat reply's tool_calls.
 *
 * Two formats: Hermes/Qwen (<tool_call>{"name": ..., "arguments": {...}}
 * </tool_call> blocks after optional content) and Llama 3.1+ (the whole
 * reply is one or more JSON objects {"name": ..., "parameters": {...}},
 * separated by ';', after an optional <|python_tag|>).  A forced call (the
 * grammar's {"name": ..., "arguments": ...}) reads as the Llama format.
 * Text that does not parse as calls of the known tools is content: a model
 * that writes a malformed call has answered in prose.
 */
#ifndef KVTIER_IPC_TOOLCALL_H
#define KVTIER_IPC_TOOLCALL_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "ipc/status.h"

enum ipc_tool_format { IPC_TOOLFMT_HERMES = 0, IPC_TOOLFMT_LLAMA };

struct ipc_tool_call {
    char *name;
    char *arguments; /* a JSON object's text, compact */
};

struct ipc_tool_calls {
    struct ipc_tool_call *calls;
    size_t n;           /* 0: the text is content */
    size_t content_len; /* text[0, content_len) is content before the calls */
};

/* tools: the request's tools array (names are checked against it).  The
 * only error is IPC_ENOMEM; out is then empty. */
enum ipc_status ipc_tool_calls_parse(const char *text, size_t len, enum ipc_tool_format fmt, const json_t *tools,
                                     struct ipc_tool_calls *out);
void ipc_tool_calls_free(struct ipc_tool_calls *c); /* accepts a zeroed one */

#endif
