/* Runs a namespace machine's command as a user other than root.
 *
 * bwrap sets the machine up as root (in the machine's user namespace) and cannot switch users
 * after that; this program, statically linked so that it needs nothing from the image, is what
 * bwrap runs instead: it reaches the sandbox as an inherited descriptor, which it closes first,
 * then sets the supplementary groups, the group and the user, and executes the command.
 *
 *     stepexec SELF_FD UID GID GROUPS -- ARGV...     (GROUPS: comma-separated ids, or "-")
 *
 * Exit status 125: it could not switch; 126/127: the command could not be run (as a shell). */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_GROUPS 256

static unsigned long number(const char *text, const char *what) {
    char *end = NULL;
    errno = 0;
    unsigned long value = strtoul(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || value > 0xfffffffeUL) {
        fprintf(stderr, "fleet: stepexec: %s %s is not a number\n", what, text);
        exit(125);
    }
    return value;
}

int main(int argc, char **argv) {
    if (argc < 7 || strcmp(argv[5], "--") != 0) {
        fputs("fleet: stepexec: usage: stepexec SELF_FD UID GID GROUPS -- ARGV...\n", stderr);
        return 125;
    }
    close((int)number(argv[1], "descriptor"));
    uid_t uid = (uid_t)number(argv[2], "uid");
    gid_t gid = (gid_t)number(argv[3], "gid");
    gid_t groups[MAX_GROUPS];
    size_t count = 0;
    if (strcmp(argv[4], "-") != 0) {
        char *list = strdup(argv[4]);
        for (char *item = strtok(list, ","); item != NULL; item = strtok(NULL, ",")) {
            if (count == MAX_GROUPS) {
                fputs("fleet: stepexec: too many groups\n", stderr);
                return 125;
            }
            groups[count++] = (gid_t)number(item, "group");
        }
    }
    if (setgroups(count, groups) != 0 || setgid(gid) != 0 || setuid(uid) != 0) {
        fprintf(stderr, "fleet: cannot become uid %u gid %u: %s\n", uid, gid, strerror(errno));
        return 125;
    }
    execvp(argv[6], &argv[6]);
    fprintf(stderr, "fleet: cannot run %s: %s\n", argv[6], strerror(errno));
    return errno == ENOENT ? 127 : 126;
}
