/* A namespace machine's resident command server: what a session's calls run through.
 *
 * Started once in the machine, the way any command is (its namespaces, cgroup, system-call
 * filter and overlay), it then runs each command the agent sends over an inherited
 * SOCK_SEQPACKET socket: a fork, a new session, the three descriptors the agent passed as
 * stdin, stdout and stderr, the directory, the user, the environment, and exec. A command
 * costs a fork and an exec instead of a whole sandbox set up again. Statically linked and
 * executed through an inherited descriptor, so it needs nothing from the image.
 *
 *     sessiond SOCKET_FD SELF_FD     (the socket inherited; its own descriptor closed)
 *     sessiond --connect PATH        (a warm parent's child: it connects to the agent)
 *
 * Messages are NUL-separated fields. The agent sends
 *     "R" SEQ UID GID GROUPS CWD NENV ENV... ARGV...   with 3 descriptors: runs a command
 *     "K" PID                                          kills the command's process group
 * and hears
 *     "P" SEQ PID      the command started          "E" SEQ ERRNO   it could not be forked
 *     "X" PID STATUS   it ended (a waitpid status)
 * GROUPS is a comma-separated list, or "-". When the agent's end closes, the server exits.
 * In the command's process, exit status 125: it could not become the user; 126: it could not
 * enter CWD or run the command; 127: no such command. */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_MESSAGE (256 * 1024)
#define MAX_FIELDS 16384
#define MAX_GROUPS 256
#define MAX_JOBS 4096

extern char **environ;

static int sock = -1;
static pid_t jobs[MAX_JOBS];
static char message[MAX_MESSAGE + 1];
static char *fields[MAX_FIELDS + 1];

static void say(const char *format, ...) {
    char line[128];
    va_list args;
    va_start(args, format);
    int n = vsnprintf(line, sizeof line, format, args);
    va_end(args);
    for (int i = 0; i < n; i++) {
        if (line[i] == ' ') {
            line[i] = '\0';
        }
    }
    if (send(sock, line, (size_t)n + 1, MSG_NOSIGNAL) < 0 && errno != EINTR) {
        _exit(0); /* the agent is gone */
    }
}

static long number(const char *text, int *ok) {
    char *end = NULL;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || value < 0) {
        *ok = 0;
    }
    return value;
}

static void close_from(int low) {
    if (syscall(SYS_close_range, (unsigned)low, ~0U, 0) != 0) {
        for (int fd = low; fd < 65536; fd++) {
            close(fd);
        }
    }
}

static void child(char **env, char **argv, const char *cwd, uid_t uid, gid_t gid, char *groups,
                  const int *fds) {
    sigset_t all;
    sigemptyset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    signal(SIGPIPE, SIG_DFL);
    setsid();
    for (int i = 0; i < 3; i++) {
        if (fds[i] != i && dup2(fds[i], i) < 0) {
            _exit(126);
        }
    }
    close_from(3);
    if (uid != 0 || gid != 0 || strcmp(groups, "-") != 0) {
        gid_t list[MAX_GROUPS];
        size_t count = 0;
        if (strcmp(groups, "-") != 0) {
            for (char *item = strtok(groups, ","); item != NULL; item = strtok(NULL, ",")) {
                int ok = 1;
                if (count == MAX_GROUPS) {
                    break;
                }
                list[count++] = (gid_t)number(item, &ok);
            }
        }
        if (setgroups(count, list) != 0 || setgid(gid) != 0 || setuid(uid) != 0) {
            dprintf(2, "fleet: cannot become uid %u gid %u: %s\n", uid, gid, strerror(errno));
            _exit(125);
        }
    }
    if (chdir(cwd) != 0) {
        dprintf(2, "fleet: cannot enter %s: %s\n", cwd, strerror(errno));
        _exit(126);
    }
    environ = env; /* execvp looks PATH up here */
    execvp(argv[0], argv);
    int error = errno;
    dprintf(2, "fleet: cannot run %s: %s\n", argv[0], strerror(error));
    _exit(error == ENOENT ? 127 : 126);
}

static char *envp[MAX_FIELDS + 1];

static void run(size_t size, const int *fds) {
    size_t count = 0;
    message[size] = '\0';
    for (size_t at = 0; at < size && count < MAX_FIELDS; at += strlen(message + at) + 1) {
        fields[count++] = message + at;
    }
    fields[count] = NULL;
    int ok = count >= 8;
    long seq = ok ? number(fields[1], &ok) : 0;
    long uid = ok ? number(fields[2], &ok) : 0;
    long gid = ok ? number(fields[3], &ok) : 0;
    long nenv = ok ? number(fields[6], &ok) : 0;
    if (!ok || 7 + (size_t)nenv >= count) {
        say("E %ld %d", seq, EINVAL);
        return;
    }
    for (long i = 0; i < nenv; i++) {
        envp[i] = fields[7 + i];
    }
    envp[nenv] = NULL;
    int slot = -1;
    for (int i = 0; i < MAX_JOBS; i++) {
        if (jobs[i] == 0) {
            slot = i;
            break;
        }
    }
    pid_t pid = slot < 0 ? -1 : fork();
    if (pid == 0) {
        child(envp, &fields[7 + nenv], fields[5], (uid_t)uid, (gid_t)gid, fields[4], fds);
    }
    if (pid < 0) {
        say("E %ld %d", seq, slot < 0 ? EAGAIN : errno);
        return;
    }
    jobs[slot] = pid;
    say("P %ld %d", seq, (int)pid);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_JOBS; i++) {
            if (jobs[i] == pid) {
                jobs[i] = 0;
                say("X %d %d", (int)pid, status);
                break;
            }
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fputs("fleet: sessiond: usage: sessiond SOCKET_FD SELF_FD | --connect PATH\n", stderr);
        return 2;
    }
    if (strcmp(argv[1], "--connect") == 0) {
        struct sockaddr_un to = {.sun_family = AF_UNIX};
        if (strlen(argv[2]) >= sizeof to.sun_path) {
            fputs("fleet: sessiond: socket path too long\n", stderr);
            return 2;
        }
        strcpy(to.sun_path, argv[2]);
        sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (sock < 0 || connect(sock, (struct sockaddr *)&to, sizeof to) != 0) {
            perror("fleet: sessiond: connect");
            return 2;
        }
    } else {
        int ok = 1;
        sock = (int)number(argv[1], &ok);
        int self = (int)number(argv[2], &ok);
        if (!ok) {
            fputs("fleet: sessiond: descriptors must be numbers\n", stderr);
            return 2;
        }
        close(self);
    }
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); /* a command's orphans are reaped here */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    int children = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (children < 0) {
        perror("fleet: sessiond: signalfd");
        return 2;
    }
    struct pollfd wait_on[2] = {{sock, POLLIN, 0}, {children, POLLIN, 0}};
    for (;;) {
        if (poll(wait_on, 2, -1) < 0) {
            if (errno == EINTR) {
                continue;
            }
            return 2;
        }
        if (wait_on[1].revents) {
            struct signalfd_siginfo info;
            while (read(children, &info, sizeof info) == sizeof info) {
            }
            reap();
        }
        if (!wait_on[0].revents) {
            continue;
        }
        union {
            struct cmsghdr align;
            char space[CMSG_SPACE(3 * sizeof(int))];
        } control;
        struct iovec io = {message, MAX_MESSAGE};
        struct msghdr header = {0};
        header.msg_iov = &io;
        header.msg_iovlen = 1;
        header.msg_control = control.space;
        header.msg_controllen = sizeof control.space;
        ssize_t size = recvmsg(sock, &header, MSG_CMSG_CLOEXEC);
        if (size < 0) {
            if (errno == EINTR || errno == EAGAIN) {
                continue;
            }
            return 0;
        }
        if (size == 0) {
            return 0; /* the agent closed its end: the machine is being deleted */
        }
        int fds[3] = {-1, -1, -1};
        int nfds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&header); c != NULL; c = CMSG_NXTHDR(&header, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                memcpy(fds, CMSG_DATA(c), (size_t)(nfds < 3 ? nfds : 3) * sizeof(int));
            }
        }
        if (message[0] == 'R' && nfds == 3 && !(header.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
            run((size_t)size, fds);
        } else if (message[0] == 'K') {
            message[size] = '\0';
            int valid = 1;
            long pid = number(message + 2, &valid);
            for (int i = 0; valid && pid > 0 && i < MAX_JOBS; i++) {
                if (jobs[i] == (pid_t)pid) {
                    kill(-(pid_t)pid, SIGKILL);
                    kill((pid_t)pid, SIGKILL);
                }
            }
        }
        for (int i = 0; i < 3 && i < nfds; i++) {
            close(fds[i]);
        }
    }
}
