/* Cuts a namespace machine's capability bounding set down to the capabilities it keeps, then
 * runs its command.
 *
 * bwrap leaves the bounding set whole while it keeps only a few capabilities in the others; this
 * program, statically linked so that it needs nothing from the image, is what bwrap runs
 * instead: it reaches the sandbox as an inherited descriptor, which it closes first, drops every
 * capability outside KEEP from the bounding set (CAP_SETPCAP, which it needs for that, is one
 * a machine keeps), and executes the command.
 *
 *     capbound SELF_FD KEEP -- ARGV...     (KEEP: the kept capabilities, a hexadecimal mask)
 *
 * Exit status 125: it could not drop them; 126/127: the command could not be run (as a shell). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static unsigned long long number(const char *text, int base, const char *what) {
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, base);
    if (errno != 0 || end == text || *end != '\0') {
        fprintf(stderr, "fleet: capbound: %s %s is not a number\n", what, text);
        exit(125);
    }
    return value;
}

int main(int argc, char **argv) {
    if (argc < 5 || strcmp(argv[3], "--") != 0) {
        fputs("fleet: capbound: usage: capbound SELF_FD KEEP -- ARGV...\n", stderr);
        return 125;
    }
    close((int)number(argv[1], 10, "descriptor"));
    unsigned long long keep = number(argv[2], 16, "mask");
    for (int cap = 0; cap < 64; cap++) {
        if (keep & (1ULL << cap)) {
            continue;
        }
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
            if (errno == EINVAL) {
                break; /* past the last capability this kernel has */
            }
            fprintf(stderr, "fleet: capbound: cannot drop capability %d: %s\n", cap,
                    strerror(errno));
            return 125;
        }
    }
    execvp(argv[4], &argv[4]);
    fprintf(stderr, "fleet: cannot run %s: %s\n", argv[4], strerror(errno));
    return errno == ENOENT ? 127 : 126;
}
