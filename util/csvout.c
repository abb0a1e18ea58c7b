/* csvout.c - benchmark CSV files (csvout.h). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "util/csvout.h"

/* The first "model name" of /proc/cpuinfo, or "unknown CPU". */
static void cpu_name(char *out, size_t cap)
{
    snprintf(out, cap, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof(line), f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) || !colon)
            continue;
        colon += 1 + (colon[1] == ' ');
        colon[strcspn(colon, "\n")] = 0;
        snprintf(out, cap, "%s", colon);
        break;
    }
    fclose(f);
}

FILE *csv_open(const char *path, int argc, char *const *argv, const char *header)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return NULL;
    fputs("# command:", f);
    for (int i = 0; i < argc; i++)
        fprintf(f, " %s", argv[i]);
    char cpu[256], date[64] = "unknown date";
    cpu_name(cpu, sizeof(cpu));
    double load[1] = {-1};
    time_t now = time(NULL);
    struct tm tm;
    if (gmtime_r(&now, &tm))
        strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", &tm);
    if (getloadavg(load, 1) != 1)
        load[0] = -1;
    fprintf(f, "\n# machine: %s, %ld online CPUs\n# date: %s, load average %.2f\n%s\n", cpu,
            sysconf(_SC_NPROCESSORS_ONLN), date, load[0], header);
    if (ferror(f)) {
        int e = errno;
        fclose(f);
        errno = e;
        return NULL;
    }
    return f;
}

bool csv_close(FILE *f)
{
    bool failed = ferror(f);
    if (fclose(f) != 0)
        return false;
    if (failed)
        errno = EIO;
    return !failed;
}
