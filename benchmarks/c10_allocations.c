/* Counts the tensor allocations torch's CPU allocator makes: c10::alloc_cpu's calls to posix_memalign, told from
 * other callers (oneDNN's descriptors, ...) by the library their return address lies in. The profiler misses a
 * block an op allocates and frees before it returns (an out= variant made up from the functional op, which copies
 * its result into out); this does not. Loaded with LD_PRELOAD by benchmarks/memory_plan.py (Linux, glibc). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

static int (*real_posix_memalign)(void **, size_t, size_t);
/* the caches below may race between allocating threads: at worst a call site is looked up twice */
static void *c10_site;                 /* c10::alloc_cpu's one call site, once seen */
static void *other_sites[64];          /* call sites known not to be c10's */
static int n_other_sites;
static long allocations;

static int is_c10(void *site) {
    if (site == c10_site) return 1;
    for (int i = 0; i < n_other_sites; i++)
        if (other_sites[i] == site) return 0;
    Dl_info info;
    if (dladdr(site, &info) && info.dli_fname && strstr(info.dli_fname, "libc10.")) {
        c10_site = site;
        return 1;
    }
    if (n_other_sites < 64) other_sites[n_other_sites++] = site;
    return 0;
}

int posix_memalign(void **out, size_t alignment, size_t size) {
    if (!real_posix_memalign) real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    if (is_c10(__builtin_return_address(0))) __atomic_add_fetch(&allocations, 1, __ATOMIC_RELAXED);
    return real_posix_memalign(out, alignment, size);
}

long c10_allocations(void) { return allocations; }
