/* grammar.c - JSON schemas as byte-level pushdown automata, and the
 * vocabulary mask they give.
 *
 * A schema compiles into nodes.  A node is a set of JSON types with the
 * details of each (object properties, array items, string lengths), or a
 * set of literal texts (enum, const), or a forced function call.  anyOf
 * merges alternatives of different types into one node, so that the first
 * byte of a value always decides which alternative it follows: the
 * automaton stays deterministic and its state is a stack of small frames.
 */
#include "text/grammar.h"
#include "text/tokenizer_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { T_OBJ = 1, T_ARR = 2, T_STR = 4, T_NUM = 8, T_INT = 16, T_BOOL = 32, T_NULL = 64, T_ALL = 127 };

/* Numbers are bounded so that a document always ends: digits before the
 * point (integers stay exact in a double), after it, and in the exponent
 * (every number stays a finite double, which every JSON reader takes). */
#define INT_DIGITS 15
#define FRAC_DIGITS 15
#define EXP_DIGITS 2
#define MAX_NODES 4096
#define MAX_SCHEMA_DEPTH 32
#define BIG ((size_t)1 << 40) /* saturates the minimum lengths */

struct node {
    uint8_t types;
    bool calls;             /* a forced function call: props are the tools */
    int n_lits;             /* > 0: the value is one of these literal texts */
    uint32_t lit0;
    int n_props;
    uint32_t prop0;
    uint64_t required;
    int32_t additional;     /* node of other keys' values; -1: none allowed */
    int32_t items;
    uint32_t min_items, max_items, min_len, max_len;
    size_t minlen;          /* bytes of the shortest value */
    int nest;               /* frames the shortest value needs: 1 for a scalar */
};

struct text {
    char *s;
    size_t len;
    int32_t child; /* props: the value's node */
};

struct gram {
    struct node *nodes;
    int n_nodes, cap_nodes;
    struct text *props, *lits;
    uint32_t n_props, cap_props, n_lits, cap_lits;
    int root;
};

/* the literals every grammar has, at these indices */
enum { LIT_TRUE, LIT_FALSE, LIT_NULL };

enum { K_VALUE, K_OBJ, K_ARR, K_STR, K_NUM, K_LIT, K_CALL };
enum { O_FIRST, O_KEY, O_COLON, O_AFTER, O_NEXT };
enum { A_FIRST, A_AFTER, A_NEXT };
enum { S_CHAR, S_ESC, S_HEX, S_UTF8 };
enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };
enum { C_PREFIX, C_AFTER };

/* ---- compiling ---------------------------------------------------------- */

static size_t sat_add(size_t a, size_t b)
{
    return a + b > BIG ? BIG : a + b;
}

static size_t sat_mul(size_t a, size_t b)
{
    return a && b > BIG / a ? BIG : a * b;
}

static int new_node(gram *g)
{
    if (g->n_nodes == MAX_NODES)
        return -1;
    if (g->n_nodes == g->cap_nodes) {
        int cap = g->cap_nodes ? g->cap_nodes * 2 : 16;
        struct node *p = realloc(g->nodes, (size_t)cap * sizeof(*p));
        if (!p)
            return -1;
        g->nodes = p;
        g->cap_nodes = cap;
    }
    g->nodes[g->n_nodes] = (struct node){.types = T_ALL, .additional = 0, .items = 0, .max_items = UINT32_MAX,
                                         .max_len = UINT32_MAX, .nest = 1};
    return g->n_nodes++;
}

static bool add_text(struct text **arr, uint32_t *n, uint32_t *cap, const char *s, size_t len, int32_t child)
{
    if (*n == UINT16_MAX)
        return false; /* frames index them with 16 bits */
    if (*n == *cap) {
        uint32_t c = *cap ? *cap * 2 : 16;
        struct text *p = realloc(*arr, c * sizeof(*p));
        if (!p)
            return false;
        *arr = p;
        *cap = c;
    }
    char *copy = malloc(len + 1);
    if (!copy)
        return false;
    memcpy(copy, s, len);
    copy[len] = '\0';
    (*arr)[(*n)++] = (struct text){copy, len, child};
    return true;
}

struct cctx {
    gram *g;
    const char **bad_key;
    char *err;
    char path[256]; /* JSON pointer of the schema being compiled */
};

static enum text_status cfail(struct cctx *c, enum text_status st, const char *what)
{
    return text_errf(c->err, st, "response schema at \"%s\": %s", c->path[0] ? c->path : "/", what);
}

/* Why new_node failed: the client's schema is too large (a 400), or
 * memory ran out. */
static enum text_status node_fail(struct cctx *c)
{
    if (c->g->n_nodes < MAX_NODES)
        return cfail(c, TEXT_ENOMEM, "out of memory for the grammar");
    char what[80];
    snprintf(what, sizeof(what), "the schema needs more than %d nodes, kvtier's limit", MAX_NODES);
    return cfail(c, TEXT_EUNSUPPORTED, what);
}

static enum text_status compile(struct cctx *c, const json_t *sch, int depth, int *out);

/* Compiles sub at path + "/" + seg, restoring the path after. */
static enum text_status compile_at(struct cctx *c, const json_t *sub, const char *seg, int depth, int *out)
{
    size_t n = strlen(c->path);
    snprintf(c->path + n, sizeof(c->path) - n, "/%s", seg);
    enum text_status st = compile(c, sub, depth + 1, out);
    if (st == TEXT_OK)
        c->path[n] = '\0';
    return st;
}

static enum text_status get_count(struct cctx *c, const json_t *v, const char *key, uint32_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT32_MAX - 1)
        return cfail(c, TEXT_EINVAL, key);
    *out = (uint32_t)json_integer_value(v);
    return TEXT_OK;
}

static enum text_status parse_types(struct cctx *c, const json_t *v, uint8_t *types)
{
    static const struct {
        const char *name;
        uint8_t bit;
    } names[] = {{"object", T_OBJ}, {"array", T_ARR}, {"string", T_STR}, {"number", T_NUM | T_INT},
                 {"integer", T_INT}, {"boolean", T_BOOL}, {"null", T_NULL}};
    *types = 0;
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_is_array(v) ? json_array_get(v, i) : v;
        size_t k = 0;
        while (k < sizeof(names) / sizeof(names[0]) &&
               !(json_is_string(e) && !strcmp(json_string_value(e), names[k].name)))
            k++;
        if (k == sizeof(names) / sizeof(names[0]))
            return cfail(c, TEXT_EINVAL, "type must be object, array, string, number, integer, boolean or null");
        *types |= names[k].bit;
    }
    if (!*types)
        return cfail(c, TEXT_EINVAL, "type is an empty list");
    return TEXT_OK;
}

static enum text_status compile_lits(struct cctx *c, const json_t *vals, struct node *nd)
{
    gram *g = c->g;
    size_t n = json_array_size(vals);
    if (!n || n > GRAM_MAX_LITS)
        return cfail(c, TEXT_EINVAL, "enum must have 1 to 64 values");
    nd->lit0 = g->n_lits;
    for (size_t i = 0; i < n; i++) {
        char *s = json_dumps(json_array_get(vals, i), JSON_COMPACT | JSON_ENCODE_ANY);
        bool ok = s && add_text(&g->lits, &g->n_lits, &g->cap_lits, s, strlen(s), -1);
        free(s);
        if (!ok && g->n_lits < UINT16_MAX)
            return cfail(c, TEXT_ENOMEM, "out of memory");
        if (!ok) {
            char what[96];
            snprintf(what, sizeof(what), "the schema has more than %d enum and const values in all, kvtier's limit",
                     UINT16_MAX);
            return cfail(c, TEXT_EUNSUPPORTED, what);
        }
    }
    nd->n_lits = (int)n;
    return TEXT_OK;
}

static enum text_status compile_props(struct cctx *c, const json_t *props, const json_t *req, int depth, int self)
{
    gram *g = c->g;
    if (!json_is_object(props))
        return cfail(c, TEXT_EINVAL, "properties must be an object");
    if (json_object_size(props) > GRAM_MAX_PROPS)
        return cfail(c, TEXT_EUNSUPPORTED, "more than 64 properties");
    /* the children first: compiling them adds props of their own */
    int kids[GRAM_MAX_PROPS];
    const char *key;
    json_t *v;
    int n = 0;
    json_object_foreach((json_t *)props, key, v)
    {
        char seg[96];
        snprintf(seg, sizeof(seg), "properties/%.80s", key);
        enum text_status st = compile_at(c, v, seg, depth, &kids[n++]);
        if (st != TEXT_OK)
            return st;
    }
    g->nodes[self].prop0 = g->n_props;
    n = 0;
    json_object_foreach((json_t *)props, key, v)
    {
        json_t *name = json_string(key);
        char *enc = name ? json_dumps(name, JSON_ENCODE_ANY) : NULL;
        json_decref(name);
        /* the key as the output spells it, without its quotes */
        bool ok = enc && add_text(&g->props, &g->n_props, &g->cap_props, enc + 1, strlen(enc) - 2, kids[n++]);
        free(enc);
        if (!ok)
            return cfail(c, TEXT_ENOMEM, "out of memory");
    }
    g->nodes[self].n_props = n;
    if (!req)
        return TEXT_OK;
    if (!json_is_array(req))
        return cfail(c, TEXT_EINVAL, "required must be an array of property names");
    for (size_t i = 0; i < json_array_size(req); i++) {
        const char *r = json_string_value(json_array_get(req, i));
        int k = 0;
        json_object_foreach((json_t *)props, key, v)
        {
            if (r && !strcmp(r, key))
                break;
            k++;
        }
        if (k == n)
            return cfail(c, TEXT_EUNSUPPORTED, "required names a key that is not in properties");
        g->nodes[self].required |= (uint64_t)1 << k;
    }
    return TEXT_OK;
}

/* anyOf: the alternatives' types must not overlap, so that a value's first
 * byte picks one. */
static enum text_status compile_any_of(struct cctx *c, const json_t *alts, int depth, int self)
{
    if (!json_is_array(alts) || !json_array_size(alts))
        return cfail(c, TEXT_EINVAL, "anyOf must be a non-empty array");
    uint8_t seen = 0;
    c->g->nodes[self].types = 0;
    for (size_t i = 0; i < json_array_size(alts); i++) {
        char seg[32];
        snprintf(seg, sizeof(seg), "anyOf/%zu", i);
        int k;
        enum text_status st = compile_at(c, json_array_get(alts, i), seg, depth, &k);
        if (st != TEXT_OK)
            return st;
        struct node alt = c->g->nodes[k], *nd = &c->g->nodes[self];
        uint8_t t = alt.types & (T_NUM | T_INT) ? (uint8_t)(alt.types | T_NUM | T_INT) : alt.types;
        if (alt.n_lits || (seen & t))
            return cfail(c, TEXT_EUNSUPPORTED, "anyOf alternatives must be of different types, without enum or "
                         "const");
        seen |= t;
        nd->types |= alt.types;
        if (alt.types & T_OBJ) {
            nd->n_props = alt.n_props, nd->prop0 = alt.prop0, nd->required = alt.required;
            nd->additional = alt.additional;
        }
        if (alt.types & T_ARR)
            nd->items = alt.items, nd->min_items = alt.min_items, nd->max_items = alt.max_items;
        if (alt.types & T_STR)
            nd->min_len = alt.min_len, nd->max_len = alt.max_len;
    }
    return TEXT_OK;
}

static size_t obj_min(const gram *g, const struct node *nd)
{
    size_t n = 2, k = 0;
    for (int i = 0; i < nd->n_props; i++) {
        if (!(nd->required >> i & 1))
            continue;
        const struct text *p = &g->props[nd->prop0 + (uint32_t)i];
        n = sat_add(n, sat_add(p->len + 4, g->nodes[p->child].minlen));
        k++;
    }
    return k ? n - 1 : n;
}

/* Frames an object of nd needs at least: its own and its deepest required
 * value's. */
static int obj_nest(const gram *g, const struct node *nd)
{
    int d = 0;
    for (int i = 0; i < nd->n_props; i++)
        if ((nd->required >> i & 1) && g->nodes[g->props[nd->prop0 + (uint32_t)i].child].nest > d)
            d = g->nodes[g->props[nd->prop0 + (uint32_t)i].child].nest;
    return 1 + d;
}

static int arr_nest(const gram *g, const struct node *nd)
{
    return nd->min_items ? 1 + g->nodes[nd->items].nest : 1;
}

/* Whether a value of node fits in the frames from slot on.  The output
 * nests at most GRAM_DEPTH frames, so a value is only begun where its
 * shortest completion fits: otherwise gram_min_close would count bytes
 * that no sequence of steps can write. */
static bool room(const gram *g, int slot, int node)
{
    return slot + g->nodes[node].nest <= GRAM_DEPTH;
}

/* Keeps the shorter of two candidate values, the shallower of equals. */
static void shorter(size_t *len, int *nest, size_t l, int d)
{
    if (l < *len || (l == *len && d < *nest))
        *len = l, *nest = d;
}

static void set_minlen(gram *g, int i)
{
    struct node *nd = &g->nodes[i];
    size_t m = BIG;
    int d = 1;
    if (nd->n_lits) {
        for (int k = 0; k < nd->n_lits; k++)
            shorter(&m, &d, g->lits[nd->lit0 + (uint32_t)k].len, 1);
    } else if (nd->calls) {
        for (int k = 0; k < nd->n_props; k++) {
            const struct text *p = &g->props[nd->prop0 + (uint32_t)k];
            shorter(&m, &d, sat_add(p->len + 1, g->nodes[p->child].minlen), 1 + g->nodes[p->child].nest);
        }
    } else {
        if (nd->types & (T_NUM | T_INT))
            shorter(&m, &d, 1, 1);
        if (nd->types & T_ARR)
            shorter(&m, &d,
                    nd->min_items ? sat_mul(nd->min_items, sat_add(g->nodes[nd->items].minlen, 1)) + 1 : 2,
                    arr_nest(g, nd));
        if (nd->types & T_STR)
            shorter(&m, &d, sat_add(nd->min_len, 2), 1);
        if (nd->types & (T_BOOL | T_NULL))
            shorter(&m, &d, 4, 1);
        if (nd->types & T_OBJ)
            shorter(&m, &d, obj_min(g, nd), obj_nest(g, nd));
    }
    nd->minlen = m;
    nd->nest = d;
}

static bool is_ignored(const char *k)
{
    static const char *const ign[] = {"title", "description", "$schema", "$comment", "default", "examples"};
    for (size_t i = 0; i < sizeof(ign) / sizeof(ign[0]); i++)
        if (!strcmp(k, ign[i]))
            return true;
    return false;
}

static enum text_status compile(struct cctx *c, const json_t *sch, int depth, int *out)
{
    gram *g = c->g;
    if (depth > MAX_SCHEMA_DEPTH)
        return cfail(c, TEXT_EUNSUPPORTED, "the schema nests more than 32 levels");
    if (json_is_true(sch) || (json_is_object(sch) && !json_object_size(sch))) {
        *out = 0; /* any value */
        return TEXT_OK;
    }
    if (!json_is_object(sch))
        return cfail(c, TEXT_EINVAL, "a schema must be an object");
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)sch, key, v)
    {
        static const char *const known[] = {"type", "properties", "required", "additionalProperties", "items",
                                            "minItems", "maxItems", "minLength", "maxLength", "enum", "const",
                                            "anyOf"};
        size_t k = 0;
        while (k < sizeof(known) / sizeof(known[0]) && strcmp(known[k], key))
            k++;
        if (k == sizeof(known) / sizeof(known[0]) && !is_ignored(key)) {
            *c->bad_key = key;
            char what[128];
            snprintf(what, sizeof(what), "the keyword \"%.64s\" is not supported", key);
            return cfail(c, TEXT_EUNSUPPORTED, what);
        }
    }
    int self = new_node(g);
    if (self < 0)
        return node_fail(c);
    enum text_status st = TEXT_OK;
    const json_t *e = json_object_get(sch, "enum"), *k = json_object_get(sch, "const");
    if (e || k) {
        if (e && !json_is_array(e))
            return cfail(c, TEXT_EINVAL, "enum must be an array");
        json_t *one = k ? json_pack("[O]", k) : NULL;
        if (k && !one)
            return cfail(c, TEXT_ENOMEM, "out of memory");
        st = compile_lits(c, e ? e : one, &g->nodes[self]);
        json_decref(one);
        if (st == TEXT_OK)
            set_minlen(g, self);
        *out = self;
        return st;
    }
    if (json_object_get(sch, "anyOf")) {
        if ((st = compile_any_of(c, json_object_get(sch, "anyOf"), depth, self)) != TEXT_OK)
            return st;
    } else if ((v = json_object_get(sch, "type"))) {
        if ((st = parse_types(c, v, &g->nodes[self].types)) != TEXT_OK)
            return st;
    } else if (json_object_get(sch, "properties") || json_object_get(sch, "required") ||
               json_object_get(sch, "additionalProperties")) {
        g->nodes[self].types = T_OBJ;
    } else if (json_object_get(sch, "items") || json_object_get(sch, "minItems") || json_object_get(sch, "maxItems")) {
        g->nodes[self].types = T_ARR;
    } else if (json_object_get(sch, "minLength") || json_object_get(sch, "maxLength")) {
        g->nodes[self].types = T_STR;
    }
    const json_t *props = json_object_get(sch, "properties"), *req = json_object_get(sch, "required");
    if (props || req) {
        json_t *none = props ? NULL : json_object();
        st = compile_props(c, props ? props : none, req, depth, self);
        json_decref(none);
        if (st != TEXT_OK)
            return st;
    }
    if ((v = json_object_get(sch, "additionalProperties"))) {
        int a = -1;
        if (!json_is_false(v) && (st = compile_at(c, v, "additionalProperties", depth, &a)) != TEXT_OK)
            return st;
        g->nodes[self].additional = a;
    }
    if ((v = json_object_get(sch, "items"))) {
        int it;
        if ((st = compile_at(c, v, "items", depth, &it)) != TEXT_OK)
            return st;
        g->nodes[self].items = it;
    }
    struct node *nd = &g->nodes[self];
    if ((v = json_object_get(sch, "minItems")) && (st = get_count(c, v, "minItems", &nd->min_items)) != TEXT_OK)
        return st;
    if ((v = json_object_get(sch, "maxItems")) && (st = get_count(c, v, "maxItems", &nd->max_items)) != TEXT_OK)
        return st;
    if ((v = json_object_get(sch, "minLength")) && (st = get_count(c, v, "minLength", &nd->min_len)) != TEXT_OK)
        return st;
    if ((v = json_object_get(sch, "maxLength")) && (st = get_count(c, v, "maxLength", &nd->max_len)) != TEXT_OK)
        return st;
    if (nd->min_items > nd->max_items || nd->min_len > nd->max_len)
        return cfail(c, TEXT_EINVAL, "a minimum is above its maximum");
    set_minlen(g, self);
    if (nd->minlen >= BIG)
        return cfail(c, TEXT_EINVAL, "no value can match the schema, or its shortest one is too long");
    *out = self;
    return TEXT_OK;
}

static enum text_status gram_new(gram **out, char *err)
{
    gram *g = calloc(1, sizeof(*g));
    int any = g ? new_node(g) : -1;
    bool ok = any == 0 && add_text(&g->lits, &g->n_lits, &g->cap_lits, "true", 4, -1) &&
              add_text(&g->lits, &g->n_lits, &g->cap_lits, "false", 5, -1) &&
              add_text(&g->lits, &g->n_lits, &g->cap_lits, "null", 4, -1);
    if (!ok) {
        gram_free(g);
        return text_errf(err, TEXT_ENOMEM, "out of memory for a grammar");
    }
    g->nodes[0].minlen = 1;
    *out = g;
    return TEXT_OK;
}

enum text_status gram_compile(const json_t *schema, gram **out, const char **bad_key, char *err)
{
    *out = NULL;
    *bad_key = NULL;
    gram *g;
    enum text_status st = gram_new(&g, err);
    if (st != TEXT_OK)
        return st;
    struct cctx c = {.g = g, .bad_key = bad_key, .err = err};
    if (schema) {
        st = compile(&c, schema, 0, &g->root);
    } else if ((g->root = new_node(g)) < 0) {
        st = node_fail(&c);
    } else {
        g->nodes[g->root].types = T_OBJ; /* json_object: any object */
        g->nodes[g->root].minlen = 2;
    }
    if (st == TEXT_OK && g->nodes[g->root].nest > GRAM_DEPTH)
        st = cfail(&c, TEXT_EUNSUPPORTED, "its shortest value nests deeper than 24 levels");
    if (st != TEXT_OK) {
        gram_free(g);
        return st;
    }
    *out = g;
    return TEXT_OK;
}

enum text_status gram_compile_calls(const char *const *names, const json_t *const *params, int n, gram **out,
                                    const char **bad_key, char *err)
{
    *out = NULL;
    *bad_key = NULL;
    if (n < 1 || n > GRAM_MAX_PROPS)
        return text_errf(err, TEXT_EUNSUPPORTED, "a forced call chooses among 1 to 64 tools");
    gram *g;
    enum text_status st = gram_new(&g, err);
    if (st != TEXT_OK)
        return st;
    struct cctx c = {.g = g, .bad_key = bad_key, .err = err};
    int kids[GRAM_MAX_PROPS];
    for (int i = 0; i < n && st == TEXT_OK; i++) {
        snprintf(c.path, sizeof(c.path), "tools/%d/function/parameters", i);
        if (!params[i]) {
            kids[i] = new_node(g);
            if (kids[i] < 0)
                st = node_fail(&c);
            else
                g->nodes[kids[i]].types = T_OBJ, g->nodes[kids[i]].minlen = 2;
        } else if ((st = compile(&c, params[i], 0, &kids[i])) == TEXT_OK) {
            /* a call's arguments are a JSON object whatever else the schema
             * allows ({} allows anything): the object part of it, if any */
            struct node *nd = &g->nodes[kids[i]];
            nd->types &= T_OBJ;
            if (nd->n_lits || !nd->types)
                st = cfail(&c, TEXT_EINVAL, "a call's arguments are a JSON object, which this schema does not allow");
            else
                set_minlen(g, kids[i]);
            if (st == TEXT_OK && g->nodes[kids[i]].nest > GRAM_DEPTH - 1)
                st = cfail(&c, TEXT_EUNSUPPORTED, "its shortest value nests deeper than 23 levels");
        }
    }
    int root = st == TEXT_OK ? new_node(g) : -1;
    if (st == TEXT_OK && root < 0)
        st = node_fail(&c);
    if (st == TEXT_OK) {
        g->nodes[root].calls = true;
        g->nodes[root].prop0 = g->n_props;
        g->nodes[root].n_props = n;
    }
    for (int i = 0; i < n && st == TEXT_OK; i++) {
        json_t *name = json_string(names[i]);
        char *enc = name ? json_dumps(name, JSON_ENCODE_ANY) : NULL;
        json_decref(name);
        char *pre = enc ? malloc(strlen(enc) + 32) : NULL;
        if (pre)
            sprintf(pre, "{\"name\":%s,\"arguments\":", enc);
        if (!pre || !add_text(&g->props, &g->n_props, &g->cap_props, pre, strlen(pre), kids[i]))
            st = text_errf(err, TEXT_ENOMEM, "out of memory for a grammar");
        free(pre);
        free(enc);
    }
    if (st != TEXT_OK) {
        gram_free(g);
        return st;
    }
    set_minlen(g, root);
    g->root = root;
    *out = g;
    return TEXT_OK;
}

void gram_free(gram *g)
{
    if (!g)
        return;
    for (uint32_t i = 0; i < g->n_props; i++)
        free(g->props[i].s);
    for (uint32_t i = 0; i < g->n_lits; i++)
        free(g->lits[i].s);
    free(g->props);
    free(g->lits);
    free(g->nodes);
    free(g);
}

/* ---- running ------------------------------------------------------------ */

void gram_start(const gram *g, struct gram_state *s)
{
    s->g = g;
    s->depth = 1;
    s->ws = 0;
    s->f[0] = (struct gram_frame){.node = (uint16_t)g->root, .kind = K_VALUE};
}

static bool is_ws(unsigned char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

/* A byte an unknown object key may hold: printable ASCII without the
 * quote and the backslash, so no key escapes into a known one. */
static bool plain_key(unsigned char c)
{
    return c >= 0x20 && c < 0x7f && c != '"' && c != '\\';
}

static bool push(struct gram_state *s, int node)
{
    if (!room(s->g, s->depth, node))
        return false;
    s->f[s->depth++] = (struct gram_frame){.node = (uint16_t)node, .kind = K_VALUE};
    return true;
}

static uint64_t lit_mask(const gram *g, uint32_t base, int n, uint32_t off, unsigned char c, uint64_t m)
{
    uint64_t out = 0;
    for (int i = 0; i < n; i++) {
        const struct text *t = &g->lits[base + (uint32_t)i];
        if ((m >> i & 1) && off < t->len && (unsigned char)t->s[off] == c)
            out |= (uint64_t)1 << i;
    }
    return out;
}

/* Turns the value frame f into the value that byte c starts. */
static bool start_value(struct gram_state *s, struct gram_frame *f, unsigned char c)
{
    const gram *g = s->g;
    const struct node *nd = &g->nodes[f->node];
    if (nd->n_lits || nd->calls) {
        uint32_t base = nd->n_lits ? nd->lit0 : 0;
        uint64_t all = nd->n_lits ? (nd->n_lits == 64 ? UINT64_MAX : ((uint64_t)1 << nd->n_lits) - 1)
                                  : (nd->n_props == 64 ? UINT64_MAX : ((uint64_t)1 << nd->n_props) - 1);
        uint64_t m = 0;
        if (nd->n_lits) {
            m = lit_mask(g, base, nd->n_lits, 0, c, all);
        } else {
            for (int i = 0; i < nd->n_props; i++)
                if ((unsigned char)g->props[nd->prop0 + (uint32_t)i].s[0] == c)
                    m |= (uint64_t)1 << i;
        }
        if (!m)
            return false;
        *f = (struct gram_frame){.node = f->node,
                                 .kind = (uint8_t)(nd->n_lits ? K_LIT : K_CALL),
                                 .child = (uint16_t)base,
                                 .a = (uint8_t)nd->n_lits,
                                 .n = 1,
                                 .m = m};
        return true;
    }
    uint16_t node = f->node;
    int slot = s->depth - 1;
    if (c == '{' && (nd->types & T_OBJ) && slot + obj_nest(g, nd) <= GRAM_DEPTH) {
        *f = (struct gram_frame){.node = node, .kind = K_OBJ, .phase = O_FIRST};
    } else if (c == '[' && (nd->types & T_ARR) && slot + arr_nest(g, nd) <= GRAM_DEPTH) {
        *f = (struct gram_frame){.node = node, .kind = K_ARR, .phase = A_FIRST};
    } else if (c == '"' && (nd->types & T_STR)) {
        *f = (struct gram_frame){.node = node, .kind = K_STR, .phase = S_CHAR};
    } else if ((c == '-' || (c >= '0' && c <= '9')) && (nd->types & (T_NUM | T_INT))) {
        *f = (struct gram_frame){.node = node,
                                 .kind = K_NUM,
                                 .phase = c == '-' ? N_MINUS : c == '0' ? N_ZERO : N_INT,
                                 .n = c == '-' ? 0 : 1};
    } else if ((c == 't' || c == 'f') && (nd->types & T_BOOL)) {
        *f = (struct gram_frame){.node = node, .kind = K_LIT, .child = c == 't' ? LIT_TRUE : LIT_FALSE, .a = 1,
                                 .n = 1, .m = 1};
    } else if (c == 'n' && (nd->types & T_NULL)) {
        *f = (struct gram_frame){.node = node, .kind = K_LIT, .child = LIT_NULL, .a = 1, .n = 1, .m = 1};
    } else {
        return false;
    }
    return true;
}

/* -1: c does not continue the number (it may end it); 1: consumed; 0: refused */
static int num_step(struct gram_frame *f, bool integer, unsigned char c)
{
    bool digit = c >= '0' && c <= '9';
    switch (f->phase) {
    case N_MINUS:
        if (!digit)
            return 0;
        f->phase = c == '0' ? N_ZERO : N_INT;
        f->n = 1;
        return 1;
    case N_ZERO:
    case N_INT:
        if (digit && f->phase == N_INT && f->n < INT_DIGITS) {
            f->n++;
            return 1;
        }
        if (!integer && c == '.') {
            f->phase = N_DOT;
            return 1;
        }
        if (!integer && (c == 'e' || c == 'E')) {
            f->phase = N_E;
            return 1;
        }
        return -1;
    case N_DOT:
        if (!digit)
            return 0;
        f->phase = N_FRAC;
        f->n = 1;
        return 1;
    case N_FRAC:
        if (digit && f->n < FRAC_DIGITS) {
            f->n++;
            return 1;
        }
        if (c == 'e' || c == 'E') {
            f->phase = N_E;
            return 1;
        }
        return -1;
    case N_E:
        if (c == '+' || c == '-') {
            f->phase = N_ESIGN;
            return 1;
        }
        /* fall through */
    case N_ESIGN:
        if (!digit)
            return 0;
        f->phase = N_EXP;
        f->n = 1;
        return 1;
    case N_EXP:
        if (digit && f->n < EXP_DIGITS) {
            f->n++;
            return 1;
        }
        return -1;
    }
    return 0;
}

static bool num_accepts(const struct gram_frame *f)
{
    return f->phase == N_ZERO || f->phase == N_INT || f->phase == N_FRAC || f->phase == N_EXP;
}

static bool lit_exact(const gram *g, const struct gram_frame *f)
{
    for (int i = 0; i < f->a; i++)
        if ((f->m >> i & 1) && g->lits[f->child + i].len == f->n)
            return true;
    return false;
}

static int hexval(unsigned char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                                                                       : -1;
}

static bool str_step(struct gram_frame *f, const struct node *nd, unsigned char c)
{
    switch (f->phase) {
    case S_ESC:
        if (c == 'u') {
            f->phase = S_HEX;
            f->a = 0;
            return true;
        }
        if (!strchr("\"\\/bfnrt", c) || !c)
            return false;
        f->phase = S_CHAR;
        return true;
    case S_HEX: {
        int h = hexval(c);
        /* no surrogates: a lone one is not a character */
        if (h < 0 || (f->a == 1 && f->b == 0xd && h >= 8))
            return false;
        if (f->a == 0)
            f->b = (uint8_t)h;
        if (++f->a == 4)
            f->phase = S_CHAR;
        return true;
    }
    case S_UTF8: {
        unsigned lo = 0x80, hi = 0xBF;
        if (f->b == 0xE0)
            lo = 0xA0;
        else if (f->b == 0xED)
            hi = 0x9F;
        else if (f->b == 0xF0)
            lo = 0x90;
        else if (f->b == 0xF4)
            hi = 0x8F;
        if (c < lo || c > hi)
            return false;
        f->b = 0;
        if (--f->a == 0)
            f->phase = S_CHAR;
        return true;
    }
    }
    if (c == '"')
        return f->n >= nd->min_len;
    if (c < 0x20 || f->n >= nd->max_len)
        return false;
    if (c == '\\') {
        f->phase = S_ESC;
    } else if (c >= 0x80) {
        if (c >= 0xC2 && c <= 0xDF)
            f->a = 1;
        else if (c >= 0xE0 && c <= 0xEF)
            f->a = 2;
        else if (c >= 0xF0 && c <= 0xF4)
            f->a = 3;
        else
            return false;
        f->b = c;
        f->phase = S_UTF8;
    }
    f->n++;
    return true;
}

static uint64_t unseen_mask(const struct node *nd, uint64_t seen)
{
    uint64_t all = nd->n_props == 64 ? UINT64_MAX : ((uint64_t)1 << nd->n_props) - 1;
    return all & ~seen;
}

/* The known keys whose values fit from slot on. */
static uint64_t fit_mask(const gram *g, const struct node *nd, int slot)
{
    uint64_t m = 0;
    for (int i = 0; i < nd->n_props; i++)
        if (room(g, slot, g->props[nd->prop0 + (uint32_t)i].child))
            m |= (uint64_t)1 << i;
    return m;
}

/* Whether an unknown key's value fits from slot on. */
static bool free_fits(const gram *g, const struct node *nd, int slot)
{
    return nd->additional >= 0 && room(g, slot, nd->additional);
}

/* Whether another key may follow in object frame f, its values from slot on. */
static bool key_possible(const gram *g, const struct node *nd, const struct gram_frame *f, int slot)
{
    return free_fits(g, nd, slot) || (unseen_mask(nd, f->m) & fit_mask(g, nd, slot));
}

static bool obj_key_start(const gram *g, const struct node *nd, struct gram_frame *f, int slot)
{
    if (!key_possible(g, nd, f, slot))
        return false;
    f->phase = O_KEY;
    f->n = 0;
    f->a = free_fits(g, nd, slot); /* could still be an unknown key */
    /* with unknown keys allowed every known name is followed, so that one
     * already seen, or one whose value does not fit, is refused by name */
    f->m2 = f->a ? unseen_mask(nd, 0) : unseen_mask(nd, f->m) & fit_mask(g, nd, slot);
    return true;
}

/* Whether a known key's spelling in f goes on with a quote: the quote is
 * then its escaped \" (a spelling holds a quote only after a backslash
 * that starts an escape, so no other candidate can end there). */
static bool quote_in_key(const gram *g, const struct node *nd, const struct gram_frame *f)
{
    for (int i = 0; i < nd->n_props; i++) {
        const struct text *p = &g->props[nd->prop0 + (uint32_t)i];
        if ((f->m2 >> i & 1) && f->n < p->len && p->s[f->n] == '"')
            return true;
    }
    return false;
}

static bool obj_step(struct gram_state *s, struct gram_frame *f, unsigned char c)
{
    const gram *g = s->g;
    const struct node *nd = &g->nodes[f->node];
    if (f->phase == O_KEY) {
        if (c == '"' && !quote_in_key(g, nd, f)) {
            uint64_t exact = 0;
            for (int i = 0; i < nd->n_props; i++)
                if ((f->m2 >> i & 1) && g->props[nd->prop0 + (uint32_t)i].len == f->n)
                    exact |= (uint64_t)1 << i;
            if (exact & f->m)
                return false; /* a known key twice */
            if (exact & ~fit_mask(g, nd, s->depth))
                return false; /* its value would nest too deep */
            if (exact) {
                int i = __builtin_ctzll(exact);
                f->m |= exact;
                f->child = (uint16_t)g->props[nd->prop0 + (uint32_t)i].child;
            } else if (f->a) {
                f->child = (uint16_t)nd->additional;
            } else {
                return false;
            }
            f->phase = O_COLON;
            return true;
        }
        uint64_t nm = 0;
        for (int i = 0; i < nd->n_props; i++) {
            const struct text *p = &g->props[nd->prop0 + (uint32_t)i];
            if ((f->m2 >> i & 1) && f->n < p->len && (unsigned char)p->s[f->n] == c)
                nm |= (uint64_t)1 << i;
        }
        bool free_ok = f->a && plain_key(c);
        if (!nm && !free_ok)
            return false;
        f->m2 = nm;
        f->a = free_ok;
        f->n++;
        return true;
    }
    if (is_ws(c)) {
        if (s->ws >= GRAM_MAX_WS)
            return false;
        s->ws++;
        return true;
    }
    switch (f->phase) {
    case O_FIRST:
        if (c == '}' && !nd->required) {
            s->depth--;
            return true;
        }
        return c == '"' && obj_key_start(g, nd, f, s->depth);
    case O_NEXT:
        return c == '"' && obj_key_start(g, nd, f, s->depth);
    case O_COLON:
        if (c != ':')
            return false;
        f->phase = O_AFTER;
        return push(s, f->child);
    case O_AFTER:
        if (c == '}' && (nd->required & ~f->m) == 0) {
            s->depth--;
            return true;
        }
        if (c == ',' && key_possible(g, nd, f, s->depth)) {
            f->phase = O_NEXT;
            return true;
        }
        return false;
    }
    return false;
}

/* The step, in place; false leaves s in some state the caller discards. */
static bool step(struct gram_state *s, unsigned char c)
{
    const gram *g = s->g;
    for (;;) {
        if (s->depth == 0)
            return false;
        struct gram_frame *f = &s->f[s->depth - 1];
        const struct node *nd = &g->nodes[f->node];
        bool ws = is_ws(c);
        switch (f->kind) {
        case K_VALUE:
            if (ws) {
                /* none before the document: it would only delay it */
                if (s->ws >= GRAM_MAX_WS || s->depth == 1)
                    return false;
                s->ws++;
                return true;
            }
            s->ws = 0;
            return start_value(s, f, c);
        case K_OBJ:
            if (!ws || f->phase == O_KEY)
                s->ws = 0;
            return obj_step(s, f, c);
        case K_ARR:
            if (ws) {
                if (s->ws >= GRAM_MAX_WS)
                    return false;
                s->ws++;
                return true;
            }
            s->ws = 0;
            if (f->phase == A_AFTER) {
                if (c == ']' && f->n >= nd->min_items) {
                    s->depth--;
                    return true;
                }
                if (c == ',' && f->n < nd->max_items && room(g, s->depth, nd->items)) {
                    f->phase = A_NEXT;
                    return true;
                }
                return false;
            }
            if (f->phase == A_FIRST && c == ']') {
                if (nd->min_items)
                    return false;
                s->depth--;
                return true;
            }
            if (f->n >= nd->max_items)
                return false;
            f->n++;
            f->phase = A_AFTER;
            if (!push(s, nd->items))
                return false;
            continue; /* c starts the item */
        case K_STR:
            {
                bool closing = f->phase == S_CHAR && c == '"';
                s->ws = 0;
                if (!str_step(f, nd, c))
                    return false;
                if (closing)
                    s->depth--;
                return true;
            }
        case K_NUM: {
            int r = num_step(f, !(nd->types & T_NUM), c);
            if (r > 0) {
                s->ws = 0;
                return true;
            }
            if (r == 0 || !num_accepts(f))
                return false;
            s->depth--; /* c ends the number: its parent reads it */
            continue;
        }
        case K_LIT: {
            uint64_t m = lit_mask(g, f->child, f->a, f->n, c, f->m);
            if (m) {
                s->ws = 0;
                f->m = m;
                f->n++;
                return true;
            }
            if (!lit_exact(g, f))
                return false;
            s->depth--;
            continue;
        }
        case K_CALL:
            if (f->phase == C_AFTER) {
                if (ws) {
                    if (s->ws >= GRAM_MAX_WS)
                        return false;
                    s->ws++;
                    return true;
                }
                if (c != '}')
                    return false;
                s->depth--;
                return true;
            }
            s->ws = 0;
            {
                uint64_t m = 0;
                int done = -1;
                for (int i = 0; i < nd->n_props; i++) {
                    const struct text *p = &g->props[nd->prop0 + (uint32_t)i];
                    if ((f->m >> i & 1) && f->n < p->len && (unsigned char)p->s[f->n] == c) {
                        m |= (uint64_t)1 << i;
                        if (f->n + 1 == p->len)
                            done = i;
                    }
                }
                if (!m)
                    return false;
                f->m = m;
                f->n++;
                if (done >= 0) { /* the names differ before the prefix ends: one is left */
                    f->phase = C_AFTER;
                    return push(s, g->props[nd->prop0 + (uint32_t)done].child);
                }
                return true;
            }
        }
        return false;
    }
}

static void copy_state(struct gram_state *dst, const struct gram_state *src)
{
    dst->g = src->g;
    dst->depth = src->depth;
    dst->ws = src->ws;
    memcpy(dst->f, src->f, (size_t)src->depth * sizeof(src->f[0]));
}

bool gram_step(struct gram_state *s, unsigned char c)
{
    struct gram_state t;
    copy_state(&t, s);
    if (!step(&t, c))
        return false;
    copy_state(s, &t);
    return true;
}

bool gram_feed(struct gram_state *s, const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!step(s, (unsigned char)p[i]))
            return false;
    return true;
}

bool gram_complete(const struct gram_state *s)
{
    return s->depth == 0;
}

bool gram_can_end(const struct gram_state *s)
{
    if (s->depth == 0)
        return true;
    if (s->depth > 1)
        return false;
    const struct gram_frame *f = &s->f[0];
    return (f->kind == K_NUM && num_accepts(f)) || (f->kind == K_LIT && lit_exact(s->g, f));
}

/* Bytes of ",\"key\":value" for each required key in mask. */
static size_t req_cost(const gram *g, const struct node *nd, uint64_t mask)
{
    size_t n = 0;
    for (int i = 0; i < nd->n_props; i++) {
        if (!(mask >> i & 1))
            continue;
        const struct text *p = &g->props[nd->prop0 + (uint32_t)i];
        n = sat_add(n, sat_add(p->len + 4, g->nodes[p->child].minlen));
    }
    return n;
}

/* f's frame is at slot - 1: its values go from slot on. */
static size_t obj_close(const gram *g, const struct gram_frame *f, int slot)
{
    const struct node *nd = &g->nodes[f->node];
    uint64_t rem = nd->required & ~f->m;
    size_t rc = req_cost(g, nd, rem);
    switch (f->phase) {
    case O_FIRST:
        return rem ? rc : 1; /* rc - 1 (no first comma) + 1 ('}') */
    case O_AFTER:
        return sat_add(rc, 1);
    case O_COLON:
        return sat_add(sat_add(rc, 2), g->nodes[f->child].minlen);
    case O_NEXT: {
        if (rem)
            return rc;
        size_t best = free_fits(g, nd, slot) ? sat_add(3, g->nodes[nd->additional].minlen) : BIG;
        uint64_t un = unseen_mask(nd, f->m) & fit_mask(g, nd, slot);
        for (int i = 0; i < nd->n_props; i++) {
            if (!(un >> i & 1))
                continue;
            const struct text *p = &g->props[nd->prop0 + (uint32_t)i];
            size_t x = sat_add(p->len + 3, g->nodes[p->child].minlen);
            best = x < best ? x : best;
        }
        return sat_add(best, 1);
    }
    case O_KEY: {
        size_t best = BIG;
        bool exact_here = false;
        for (int i = 0; i < nd->n_props; i++) {
            if (!(f->m2 >> i & 1))
                continue;
            const struct text *p = &g->props[nd->prop0 + (uint32_t)i];
            exact_here |= p->len == f->n;
            if ((f->m >> i & 1) || !room(g, slot, p->child))
                continue;
            size_t x = sat_add(sat_add(p->len - f->n + 3, g->nodes[p->child].minlen),
                               req_cost(g, nd, rem & ~((uint64_t)1 << i)));
            best = x < best ? x : best;
        }
        if (f->a) {
            size_t x = sat_add(sat_add(3 + exact_here, g->nodes[nd->additional].minlen), rc);
            best = x < best ? x : best;
        }
        return best;
    }
    }
    return BIG;
}

size_t gram_min_close(const struct gram_state *s)
{
    const gram *g = s->g;
    size_t total = 0;
    for (int d = 0; d < s->depth; d++) {
        const struct gram_frame *f = &s->f[d];
        const struct node *nd = &g->nodes[f->node];
        size_t x = 0;
        switch (f->kind) {
        case K_VALUE:
            x = nd->minlen;
            break;
        case K_OBJ:
            x = obj_close(g, f, d + 1);
            break;
        case K_ARR: {
            size_t item = sat_add(g->nodes[nd->items].minlen, 1);
            if (f->phase == A_FIRST)
                x = nd->min_items ? sat_mul(nd->min_items, item) : 1;
            else if (f->phase == A_AFTER)
                x = sat_add(sat_mul(nd->min_items > f->n ? nd->min_items - f->n : 0, item), 1);
            else
                x = sat_mul(nd->min_items > f->n ? nd->min_items - f->n : 1, item);
            break;
        }
        case K_STR:
            x = (f->phase == S_ESC ? 1 : f->phase == S_HEX ? 4 - f->a : f->phase == S_UTF8 ? f->a : 0) + 1 +
                (nd->min_len > f->n ? nd->min_len - f->n : 0);
            break;
        case K_NUM:
            x = num_accepts(f) ? 0 : 1;
            break;
        case K_LIT:
            x = BIG;
            for (int i = 0; i < f->a; i++) {
                const struct text *t = &g->lits[f->child + i];
                if ((f->m >> i & 1) && t->len - f->n < x)
                    x = t->len - f->n;
            }
            break;
        case K_CALL:
            if (f->phase == C_AFTER) {
                x = 1;
                break;
            }
            x = BIG;
            for (int i = 0; i < nd->n_props; i++) {
                const struct text *p = &g->props[nd->prop0 + (uint32_t)i];
                size_t y = sat_add(p->len - f->n + 1, g->nodes[p->child].minlen);
                if ((f->m >> i & 1) && y < x)
                    x = y;
            }
            break;
        }
        total = sat_add(total, x);
    }
    return total;
}

/* ---- the vocabulary ----------------------------------------------------- */

struct tnode {
    uint32_t child, sib; /* 0: none (the root is never a child) */
    int32_t tok;         /* first token whose bytes end here, -1: none */
    unsigned char byte;
};

/* The tokens' bytes as tries: all of them, and those that are not plain
 * string text.  A plain token (printable ASCII but the quote and the
 * backslash, and whole UTF-8 characters) adds its characters to a string
 * and changes nothing else, so inside a string the mask takes the plain
 * ones by their character count and walks only the smaller trie. */
struct gram_vocab {
    struct tnode *all, *rest;
    int32_t *tok_next;     /* [vocab] further tokens with the same bytes */
    int32_t *plain;        /* the plain tokens */
    uint32_t *plain_chars; /* their characters */
    size_t n_plain, max_len;
};

struct tok_ref {
    const char *p;
    size_t len;
    int32_t id;
};

static int by_bytes(const void *a, const void *b)
{
    const struct tok_ref *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, n);
    if (c)
        return c;
    return x->len < y->len ? -1 : x->len > y->len ? 1 : x->id - y->id;
}

/* The characters of p[0, n) when it is plain string text, else 0. */
static uint32_t plain_chars(const char *p, size_t n)
{
    uint32_t chars = 0;
    for (size_t i = 0; i < n; chars++) {
        unsigned char c = (unsigned char)p[i];
        uint32_t cp;
        size_t k = c < 0x80 ? (c >= 0x20 && c != '"' && c != '\\' && c != 0x7f ? 1 : 0)
                            : tok_utf8_next((const unsigned char *)p + i, n - i, &cp);
        if (!k)
            return 0;
        i += k;
    }
    return chars;
}

void gram_vocab_free(gram_vocab *v)
{
    if (!v)
        return;
    free(v->all);
    free(v->rest);
    free(v->tok_next);
    free(v->plain);
    free(v->plain_chars);
    free(v);
}

/* A trie over refs[0, n) (sorted by bytes) into t, which has room for 1 +
 * their bytes; path and last are scratch of max_len + 1 and that room. */
static void trie_build(struct tnode *t, const struct tok_ref *refs, size_t n, int32_t *tok_next, uint32_t *path,
                       uint32_t *last)
{
    t[0] = (struct tnode){.tok = -1};
    uint32_t used = 1;
    path[0] = 0;
    last[0] = 0;
    const struct tok_ref *prev = NULL;
    for (size_t i = 0; i < n; i++) {
        const struct tok_ref *r = &refs[i];
        size_t k = 0; /* bytes shared with the previous token: their nodes exist */
        while (prev && k < prev->len && k < r->len && prev->p[k] == r->p[k])
            k++;
        for (size_t d = k; d < r->len; d++) {
            uint32_t id = used++, parent = path[d];
            t[id] = (struct tnode){.tok = -1, .byte = (unsigned char)r->p[d]};
            last[id] = 0;
            if (last[parent])
                t[last[parent]].sib = id;
            else
                t[parent].child = id;
            last[parent] = id;
            path[d + 1] = id;
        }
        struct tnode *end = &t[path[r->len]];
        tok_next[r->id] = end->tok; /* same bytes: chained (alike in both tries) */
        end->tok = r->id;
        prev = r;
    }
}

enum text_status gram_vocab_create(const tokenizer *t, gram_vocab **out)
{
    *out = NULL;
    int V = tokenizer_vocab_size(t);
    gram_vocab *v = calloc(1, sizeof(*v));
    struct tok_ref *refs = V > 0 ? malloc((size_t)V * sizeof(*refs)) : NULL;
    size_t n = 0, total = 1;
    if (v && refs) {
        v->tok_next = malloc((size_t)V * sizeof(*v->tok_next));
        v->plain = malloc((size_t)V * sizeof(*v->plain));
        v->plain_chars = malloc((size_t)V * sizeof(*v->plain_chars));
        for (int32_t id = 0; id < V && v->plain && v->plain_chars; id++) {
            size_t len;
            bool special;
            const char *p = tokenizer_token_bytes(t, id, &len, &special);
            if (!p || !len || special)
                continue;
            refs[n++] = (struct tok_ref){p, len, id};
            total += len;
            v->max_len = len > v->max_len ? len : v->max_len;
            uint32_t chars = plain_chars(p, len);
            if (chars) {
                v->plain[v->n_plain] = id;
                v->plain_chars[v->n_plain++] = chars;
            }
        }
        if (total <= UINT32_MAX) {
            v->all = malloc(total * sizeof(*v->all));
            v->rest = malloc(total * sizeof(*v->rest));
        }
    }
    uint32_t *path = v ? malloc((v->max_len + 1) * sizeof(*path)) : NULL;
    uint32_t *last = v ? malloc(total * sizeof(*last)) : NULL;
    if (!v || !refs || !v->tok_next || !v->plain || !v->plain_chars || !v->all || !v->rest || !path || !last) {
        free(refs);
        free(path);
        free(last);
        gram_vocab_free(v);
        return TEXT_ENOMEM;
    }
    qsort(refs, n, sizeof(*refs), by_bytes);
    trie_build(v->all, refs, n, v->tok_next, path, last);
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (!plain_chars(refs[i].p, refs[i].len))
            refs[m++] = refs[i];
    trie_build(v->rest, refs, m, v->tok_next, path, last);
    free(refs);
    free(path);
    free(last);
    *out = v;
    return TEXT_OK;
}

size_t gram_vocab_depth(const gram_vocab *v)
{
    return v->max_len + 1;
}

struct mask_walk {
    const gram_vocab *v;
    const struct tnode *t;   /* the trie walked */
    struct gram_state *st; /* [max_len + 1] */
    bool *allow;
    int n_allow;
    size_t budget; /* bytes the rest may need at most; SIZE_MAX: any */
    int count;
};

static void allow_tok(struct mask_walk *w, int32_t first)
{
    for (int32_t id = first; id >= 0; id = w->v->tok_next[id]) {
        if (id < w->n_allow) { /* a tokenizer may know ids the model has no logits for */
            w->allow[id] = true;
            w->count++;
        }
    }
}

static void walk(struct mask_walk *w, uint32_t node, size_t d)
{
    for (uint32_t c = w->t[node].child; c; c = w->t[c].sib) {
        struct gram_state *s = &w->st[d + 1];
        copy_state(s, &w->st[d]);
        if (!step(s, w->t[c].byte))
            continue;
        if (w->t[c].tok >= 0 && (w->budget == SIZE_MAX || gram_min_close(s) <= w->budget))
            allow_tok(w, w->t[c].tok);
        walk(w, c, d + 1);
    }
}

/* Inside a string: the plain tokens that fit its maxLength and the budget
 * (they only shorten what minLength still needs), then the trie of the
 * others. */
static void mask_in_string(struct mask_walk *w, const struct gram_state *s)
{
    const struct gram_frame *f = &s->f[s->depth - 1];
    const struct node *nd = &s->g->nodes[f->node];
    size_t base = gram_min_close(s), want = nd->min_len > f->n ? nd->min_len - f->n : 0;
    for (size_t i = 0; i < w->v->n_plain; i++) {
        uint32_t ch = w->v->plain_chars[i];
        if ((uint64_t)f->n + ch > nd->max_len)
            continue;
        if (w->budget != SIZE_MAX && base - (ch < want ? ch : want) > w->budget)
            continue;
        int32_t id = w->v->plain[i];
        if (id < w->n_allow) {
            w->allow[id] = true;
            w->count++;
        }
    }
    w->t = w->v->rest;
    walk(w, 0, 0);
}

int gram_mask(const gram_vocab *v, const struct gram_state *s, int budget, const int32_t *eos, int n_eos,
              bool *allow, int n_allow, struct gram_state *scratch)
{
    struct mask_walk w = {v, v->all, scratch, allow, n_allow, budget > 0 ? (size_t)budget - 1 : SIZE_MAX, 0};
    bool in_string = s->depth && s->f[s->depth - 1].kind == K_STR && s->f[s->depth - 1].phase == S_CHAR;
    for (int pass = 0; pass < 2; pass++) {
        memset(allow, 0, (size_t)n_allow * sizeof(*allow));
        w.count = 0;
        copy_state(&scratch[0], s);
        if (in_string) {
            mask_in_string(&w, s);
        } else {
            w.t = v->all;
            walk(&w, 0, 0);
        }
        if (w.count || w.budget == SIZE_MAX)
            break;
        w.budget = SIZE_MAX; /* nothing fits: the grammar alone decides, the length limit cuts */
    }
    if (gram_can_end(s)) {
        for (int i = 0; i < n_eos; i++) {
            if (eos[i] >= 0 && eos[i] < n_allow && !allow[eos[i]]) {
                allow[eos[i]] = true;
                w.count++;
            }
        }
    }
    return w.count;
}
