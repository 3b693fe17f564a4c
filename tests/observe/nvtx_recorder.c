/*
 * A minimal NVTX v3 tool ("injection library") that records ranges the way a profiler sees them.
 *
 * Any NVTX v3 client in the process (the `nvtx` Python package, torch.cuda.nvtx, ...) loads the library
 * named by NVTX_INJECTION64_PATH on its first NVTX call and calls InitializeInjectionNvtx2(). We fill the
 * CORE and CORE2 callback tables and append one line per event to the file named by NVTX_RECORDER_OUT:
 *
 *     <os thread id> \t <event> \t <domain> \t <argb color or -> \t <message or range id>
 *
 * events: push, pop, start (message, id in the 6th column), end (id), mark, domain, string.
 * Each line is one write(2) on an O_APPEND descriptor, so lines from different threads never interleave
 * and nothing is lost when the process exits through sys.exit() or a signal after the event.
 *
 * Build: cc -shared -fPIC -O2 -I<folder containing nvtx3/> nvtx_recorder.c -o librecorder.so -lpthread
 */
#define NVTX_NO_IMPL
#include "nvtx3/nvToolsExt.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <wchar.h>

static int g_fd = -1;
static unsigned long long g_next_range_id = 1; /* atomically incremented */

/* A domain handle and a registered string handle both point at a heap copy of their name. */
static const char *domain_name(nvtxDomainHandle_t d) { return d ? (const char *)d : "-"; }

static void emit(const char *event, const char *domain, const nvtxEventAttributes_t *attr,
                 const char *message, unsigned long long id) {
    char line[1024];
    char color[16] = "-";
    char wide_buf[512];
    const char *msg = message ? message : "";
    if (attr) {
        if (attr->colorType == NVTX_COLOR_ARGB) snprintf(color, sizeof color, "%08x", attr->color);
        switch (attr->messageType) {
            case NVTX_MESSAGE_TYPE_ASCII:
                msg = attr->message.ascii ? attr->message.ascii : "";
                break;
            case NVTX_MESSAGE_TYPE_REGISTERED:
                msg = attr->message.registered ? (const char *)attr->message.registered : "";
                break;
            case NVTX_MESSAGE_TYPE_UNICODE:
                if (attr->message.unicode &&
                    wcstombs(wide_buf, attr->message.unicode, sizeof wide_buf - 1) != (size_t)-1) {
                    wide_buf[sizeof wide_buf - 1] = 0;
                    msg = wide_buf;
                } else {
                    msg = "<unicode>";
                }
                break;
            default:
                msg = "";
        }
    }
    if (g_fd < 0) return;
    long tid = syscall(SYS_gettid);
    int n = snprintf(line, sizeof line, "%ld\t%s\t%s\t%s\t%s\t%llu\n", tid, event, domain, color, msg, id);
    if (n > (int)sizeof line - 1) {
        n = (int)sizeof line - 1;
        line[n - 1] = '\n';
    }
    if (n > 0) {
        ssize_t ignored = write(g_fd, line, (size_t)n);
        (void)ignored;
    }
}

/* ---- core (default domain) ---- */
static void NVTX_API markEx(const nvtxEventAttributes_t *a) { emit("mark", "-", a, NULL, 0); }
static void NVTX_API markA(const char *m) { emit("mark", "-", NULL, m, 0); }
static nvtxRangeId_t NVTX_API rangeStartEx(const nvtxEventAttributes_t *a) {
    unsigned long long id = __atomic_fetch_add(&g_next_range_id, 1, __ATOMIC_RELAXED);
    emit("start", "-", a, NULL, id);
    return id;
}
static nvtxRangeId_t NVTX_API rangeStartA(const char *m) {
    unsigned long long id = __atomic_fetch_add(&g_next_range_id, 1, __ATOMIC_RELAXED);
    emit("start", "-", NULL, m, id);
    return id;
}
static void NVTX_API rangeEnd(nvtxRangeId_t id) { emit("end", "-", NULL, NULL, id); }
static int NVTX_API rangePushEx(const nvtxEventAttributes_t *a) { emit("push", "-", a, NULL, 0); return 0; }
static int NVTX_API rangePushA(const char *m) { emit("push", "-", NULL, m, 0); return 0; }
static int NVTX_API rangePop(void) { emit("pop", "-", NULL, NULL, 0); return 0; }
static void NVTX_API nameOsThreadA(uint32_t tid, const char *name) { (void)tid; emit("thread_name", "-", NULL, name, 0); }

/* ---- core2 (domains) ---- */
static void NVTX_API domainMarkEx(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
    emit("mark", domain_name(d), a, NULL, 0);
}
static nvtxRangeId_t NVTX_API domainRangeStartEx(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
    unsigned long long id = __atomic_fetch_add(&g_next_range_id, 1, __ATOMIC_RELAXED);
    emit("start", domain_name(d), a, NULL, id);
    return id;
}
static void NVTX_API domainRangeEnd(nvtxDomainHandle_t d, nvtxRangeId_t id) {
    emit("end", domain_name(d), NULL, NULL, id);
}
static int NVTX_API domainRangePushEx(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
    emit("push", domain_name(d), a, NULL, 0);
    return 0;
}
static int NVTX_API domainRangePop(nvtxDomainHandle_t d) {
    emit("pop", domain_name(d), NULL, NULL, 0);
    return 0;
}
static nvtxStringHandle_t NVTX_API domainRegisterStringA(nvtxDomainHandle_t d, const char *s) {
    emit("string", domain_name(d), NULL, s, 0);
    return (nvtxStringHandle_t)strdup(s ? s : "");
}
static nvtxDomainHandle_t NVTX_API domainCreateA(const char *name) {
    emit("domain", name ? name : "", NULL, NULL, 0);
    return (nvtxDomainHandle_t)strdup(name ? name : "");
}
static void NVTX_API domainDestroy(nvtxDomainHandle_t d) { (void)d; /* handles may still be in use */ }
static void NVTX_API domainNameCategoryA(nvtxDomainHandle_t d, uint32_t c, const char *name) {
    (void)c;
    emit("category", domain_name(d), NULL, name, 0);
}
static void NVTX_API initialize(const void *reserved) { (void)reserved; }

static int fill(const NvtxExportTableCallbacks *cb, NvtxCallbackModule module, const unsigned *ids,
                NvtxFunctionPointer *fns, unsigned count) {
    NvtxFunctionTable table = 0;
    unsigned int size = 0;
    if (!cb->GetModuleFunctionTable(module, &table, &size) || !table) return 0;
    for (unsigned i = 0; i < count; ++i)
        if (ids[i] < size && table[ids[i]]) *table[ids[i]] = fns[i];
    return 1;
}

#define FP(f) ((NvtxFunctionPointer)(f))

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t getExportTable) {
    const char *path = getenv("NVTX_RECORDER_OUT");
    if (path && *path) g_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const NvtxExportTableCallbacks *cb =
        (const NvtxExportTableCallbacks *)getExportTable(NVTX_ETID_CALLBACKS);
    if (!cb || cb->struct_size < sizeof(NvtxExportTableCallbacks)) return 0;

    unsigned core_ids[] = {NVTX_CBID_CORE_MarkEx,     NVTX_CBID_CORE_MarkA,       NVTX_CBID_CORE_RangeStartEx,
                           NVTX_CBID_CORE_RangeStartA, NVTX_CBID_CORE_RangeEnd,    NVTX_CBID_CORE_RangePushEx,
                           NVTX_CBID_CORE_RangePushA,  NVTX_CBID_CORE_RangePop,    NVTX_CBID_CORE_NameOsThreadA};
    NvtxFunctionPointer core_fns[] = {FP(markEx),     FP(markA),     FP(rangeStartEx),
                                      FP(rangeStartA), FP(rangeEnd),  FP(rangePushEx),
                                      FP(rangePushA),  FP(rangePop),  FP(nameOsThreadA)};
    unsigned core2_ids[] = {NVTX_CBID_CORE2_DomainMarkEx,       NVTX_CBID_CORE2_DomainRangeStartEx,
                            NVTX_CBID_CORE2_DomainRangeEnd,     NVTX_CBID_CORE2_DomainRangePushEx,
                            NVTX_CBID_CORE2_DomainRangePop,     NVTX_CBID_CORE2_DomainRegisterStringA,
                            NVTX_CBID_CORE2_DomainCreateA,      NVTX_CBID_CORE2_DomainDestroy,
                            NVTX_CBID_CORE2_DomainNameCategoryA, NVTX_CBID_CORE2_Initialize};
    NvtxFunctionPointer core2_fns[] = {FP(domainMarkEx),    FP(domainRangeStartEx),   FP(domainRangeEnd),
                                       FP(domainRangePushEx), FP(domainRangePop),     FP(domainRegisterStringA),
                                       FP(domainCreateA),     FP(domainDestroy),      FP(domainNameCategoryA),
                                       FP(initialize)};
    if (!fill(cb, NVTX_CB_MODULE_CORE, core_ids, core_fns, sizeof core_ids / sizeof core_ids[0])) return 0;
    if (!fill(cb, NVTX_CB_MODULE_CORE2, core2_ids, core2_fns, sizeof core2_ids / sizeof core2_ids[0])) return 0;
    emit("init", "-", NULL, "recorder", 0);
    return 1;
}
