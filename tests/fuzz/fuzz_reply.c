/* fuzz_reply.c - the kvtier client's reader of kvtierd's HTTP replies
 * (ipc_read_reply, the reply half of ipc_call, reading the input from a
 * memfd: status line, headers, Content-Length / chunked /
 * close-delimited bodies, Server-Sent Events), which is what a confused or
 * hostile peer on the socket controls.
 *
 * Invariants: an error is EPROTO, EIO or ENOMEM with a message; a reply has
 * a 2xx-9xx status and a NUL-terminated body no longer than the input and
 * IPC_MAX_REPLY; an event-stream reply read with a callback has an empty
 * body, and every event is NUL-terminated at its length; once the callback
 * says stop, no further event arrives. */
#include <sys/mman.h>
#include <unistd.h>

#include "ipc/httpc.h"
#include "tests/fuzz/fuzz_util.h"

struct events {
    size_t n, stop_after, total;
    bool stopped;
};

static bool on_event(void *ud, const char *data, size_t len)
{
    struct events *ev = ud;
    FUZZ_CHECK(!ev->stopped, "an event after the callback said stop");
    FUZZ_CHECK(data[len] == '\0' && strlen(data) == len, "event %zu is not NUL-terminated at its length", ev->n);
    ev->total += len;
    if (++ev->n == ev->stop_after)
        ev->stopped = true;
    return !ev->stopped;
}

static void check(enum ipc_status st, const struct ipc_reply *r, const struct ipc_error *e, size_t size)
{
    if (st != IPC_OK) {
        FUZZ_CHECK(st == IPC_EPROTO || st == IPC_EIO || st == IPC_ENOMEM, "status %d", st);
        FUZZ_CHECK(e->msg[0], "error %d without a message", st);
        return;
    }
    FUZZ_CHECK(r->status >= 200 && r->status <= 999, "HTTP status %d", r->status);
    FUZZ_CHECK(r->body && r->body[r->len] == '\0', "body not NUL-terminated");
    FUZZ_CHECK(r->len <= size && r->len <= IPC_MAX_REPLY, "body of %zu bytes from %zu", r->len, size);
}

/* The reply as the socket would deliver it, then EOF. */
static enum ipc_status read_reply(const uint8_t *data, size_t size, ipc_event_fn on_event, void *ud,
                                  struct ipc_reply *r, struct ipc_error *e)
{
    int fd = memfd_create("reply", MFD_CLOEXEC);
    FUZZ_CHECK(fd >= 0, "memfd_create");
    FUZZ_CHECK(write(fd, data, size) == (ssize_t)size && lseek(fd, 0, SEEK_SET) == 0, "writing the memfd");
    enum ipc_status st = ipc_read_reply(fd, on_event, ud, r, e);
    close(fd);
    return st;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct ipc_reply r;
    struct ipc_error e;
    enum ipc_status st = read_reply(data, size, NULL, NULL, &r, &e);
    check(st, &r, &e, size);
    ipc_reply_free(&r);

    /* with a callback that stops after a number of events the input picks */
    struct events ev = {.stop_after = size % 4};
    st = read_reply(data, size, on_event, &ev, &r, &e);
    check(st, &r, &e, size);
    FUZZ_CHECK(ev.total <= size, "events carry %zu bytes from %zu", ev.total, size);
    if (st == IPC_OK && ev.n)
        FUZZ_CHECK(r.len == 0 && r.body[0] == '\0', "an event stream left a body of %zu bytes", r.len);
    ipc_reply_free(&r);
    ipc_reply_free(&r); /* documented: accepts a zeroed (freed) reply */
    return 0;
}
