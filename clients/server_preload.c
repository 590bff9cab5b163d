/* Loaded into tritonserver and its stubs with LD_PRELOAD by clients/server_preload.py, which says
 * why. Two things Triton 2.51 does not let us do otherwise:
 *
 * - POSIX shared memory is private to the server's user from the moment it exists: shm_open
 *   creates with group and other bits cleared, and an fchmod of a /dev/shm object cannot add
 *   them back (the Python backend's regions, made through Boost, are created 0644 and then
 *   fchmod'ed to 0644 whatever the umask).
 * - The admin key stays off the command line: an argument holding KEY_PLACEHOLDER has it replaced
 *   by the value of KEY_ENV before tritonserver's main parses its arguments (argv is rewritten,
 *   not the string area /proc/<pid>/cmdline shows), and the variable is erased and unset, so that
 *   the stubs do not inherit it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define KEY_PLACEHOLDER "@EASEL_ADMIN_KEY@"
#define KEY_ENV "EASEL_SERVER_ADMIN_KEY"
#define PRIVATE_BITS 0700

static int is_shared_memory(int fd)
{
  char link[64], target[512];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return 0;
  target[n] = 0;
  return strncmp(target, "/dev/shm/", 9) == 0;
}

int shm_open(const char* name, int oflag, mode_t mode)
{
  static int (*real)(const char*, int, mode_t);
  if (!real) real = (int (*)(const char*, int, mode_t))dlsym(RTLD_NEXT, "shm_open");
  if (!real) { /* (older C libraries keep it in librt, loaded by whoever calls it) */
    errno = ENOSYS;
    return -1;
  }
  return real(name, oflag, mode & PRIVATE_BITS);
}

int fchmod(int fd, mode_t mode)
{
  static int (*real)(int, mode_t);
  if (!real) real = (int (*)(int, mode_t))dlsym(RTLD_NEXT, "fchmod");
  if (!real) {
    errno = ENOSYS;
    return -1;
  }
  if (is_shared_memory(fd)) mode &= PRIVATE_BITS;
  return real(fd, mode);
}

__attribute__((constructor)) static void substitute_key(int argc, char** argv, char** envp)
{
  (void)envp;
  char* key = getenv(KEY_ENV);
  if (!key) return;
  size_t placeholder = strlen(KEY_PLACEHOLDER), key_len = strlen(key);
  for (int i = 1; i < argc; i++) {
    char* at = strstr(argv[i], KEY_PLACEHOLDER);
    if (!at) continue;
    size_t size = strlen(argv[i]) - placeholder + key_len + 1;
    char* arg = malloc(size);
    if (!arg) abort();
    snprintf(arg, size, "%.*s%s%s", (int)(at - argv[i]), argv[i], key, at + placeholder);
    argv[i] = arg;
  }
  memset(key, 'x', key_len); /* (the initial environment block is what /proc/<pid>/environ shows) */
  unsetenv(KEY_ENV);
}
