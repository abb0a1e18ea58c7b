/* jinja.h - the subset of Jinja that chat templates use: parse a template
 * once into a tree, render it many times over JSON variables.
 *
 * It follows the whitespace rules of transformers' chat templates
 * (trim_blocks and lstrip_blocks on, one trailing newline of the template
 * dropped) and prints values as @huggingface/jinja does (true/false, JSON
 * for lists and mappings), so a template renders the same bytes here as
 * there.  Supported: text, {{ }}, comments, `-` whitespace control, if/elif/
 * else, for (with a filter, else, tuple targets, loop.index/index0/revindex/
 * first/last/length/previtem/nextitem), break/continue, set (names,
 * attributes, tuples, blocks), macros with defaults and keyword arguments,
 * filter blocks, generation markers (dropped), the usual filters, tests and
 * string/mapping methods (upper and lower as JavaScript's: text/casemap.h),
 * namespace(), range(), raise_exception() and strftime_now().
 *
 * Rendering is bounded: output bytes, nesting depth and evaluation steps
 * each have a limit, past which it fails with TEXT_EINVAL; a template that
 * loops forever or builds a huge string cannot take the daemon down.
 * Errors name the line and column of the template.
 */
#ifndef KVTIER_TEXT_JINJA_H
#define KVTIER_TEXT_JINJA_H

#include <jansson.h>
#include <stddef.h>
#include <time.h>

#include "text/status.h"

typedef struct jinja_tpl jinja_tpl;

/* Templates longer than this are refused (the largest real ones are ~20 KiB). */
#define JINJA_MAX_SOURCE (1u << 20)

struct jinja_opts {
    size_t max_output;       /* bytes; 0 = JINJA_DEFAULT_OUTPUT */
    unsigned long max_steps; /* evaluated nodes; 0 = JINJA_DEFAULT_STEPS */
    time_t now;              /* what strftime_now() formats (local time) */
};
#define JINJA_DEFAULT_OUTPUT (16u << 20)
#define JINJA_DEFAULT_STEPS 5000000ul

/* Parses src[0..len).  TEXT_EFORMAT with "line L, column C: ..." in err
 * for a syntax error, TEXT_EINVAL for a template over the size limit. */
enum text_status jinja_parse(const char *src, size_t len, jinja_tpl **out, char *err);
void jinja_free(jinja_tpl *t);

/* Renders t with the members of vars (a JSON object; NULL = none) as its
 * variables.  *out is malloc'd and NUL-terminated at *len.  Errors:
 * TEXT_EINVAL for a runtime error (raise_exception's message, a type error,
 * a limit), TEXT_ENOMEM; err says which, with the line and column. */
enum text_status jinja_render(const jinja_tpl *t, const json_t *vars, const struct jinja_opts *opts, char **out,
                              size_t *len, char *err);

#endif
