/*
 * Loads a Windows build of the native library (bitsplit.dll) the way Python's cffi does (LoadLibrary,
 * then each function by name) and calls the functions that need no model: the kernel policy's
 * families on this CPU, the cap, the drafter's family, and each family's multiply step timed in
 * registers (bitsplit_family_peak), so that the CPU detection, the policy and every family's
 * instructions run as Windows code. Built and run under wine by native/tests/cross_build.sh
 * --target windows, beside a stand-in ggml-base.dll whose functions end the process if called.
 *
 *   win_smoke DLL
 * Prints `win_smoke: PASS: N families (names); cap ...` and exits 0, or a FAIL line and exits 1.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <windows.h>

typedef int (*families_fn)(const char ** names, int max);
typedef const char * (*name_fn)(void);
typedef double (*peak_fn)(const char * family, double seconds);

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: win_smoke DLL\n");
        return 2;
    }
    HMODULE lib = LoadLibraryA(argv[1]);
    if (lib == NULL) {
        printf("win_smoke: FAIL: LoadLibrary(%s): Windows error %lu\n", argv[1], (unsigned long)GetLastError());
        return 1;
    }
    families_fn families = (families_fn)(void (*)(void))GetProcAddress(lib, "bitsplit_kernel_families");
    name_fn max_isa = (name_fn)(void (*)(void))GetProcAddress(lib, "bitsplit_max_isa");
    name_fn draft = (name_fn)(void (*)(void))GetProcAddress(lib, "bitsplit_draft_kernel");
    peak_fn peak = (peak_fn)(void (*)(void))GetProcAddress(lib, "bitsplit_family_peak");
    if (!families || !max_isa || !draft || !peak) {
        printf("win_smoke: FAIL: %s does not export the API's functions\n", argv[1]);
        return 1;
    }
    const char * names[32];
    const int n = families(names, 32);
    if (n < 1 || n > 32) {
        printf("win_smoke: FAIL: %d kernel families\n", n);
        return 1;
    }
    /* under wine on Linux the tile state is not granted (Linux hands it out only to a process that asks
     * with arch_prctl, which a Windows program does not): amx-bf16's step would fault, so it is listed
     * but not run there (on Windows itself it runs) */
    HMODULE ntdll = GetModuleHandleA("ntdll.dll");
    const bool wine = ntdll != NULL && GetProcAddress(ntdll, "wine_get_version") != NULL;
    char list[512] = "";
    bool ok = true;
    for (int i = 0; i < n; i++) {
        if (wine && strcmp(names[i], "amx-bf16") == 0) {
            strncat(list, i ? ", amx-bf16 (not run under wine)" : "amx-bf16 (not run under wine)",
                    sizeof(list) - strlen(list) - 1);
            continue;
        }
        double p = strcmp(names[i], "generic") == 0 ? 0.0 : peak(names[i], 0.05);
        char one[96];
        snprintf(one, sizeof(one), "%s%s %.1f G/s", i ? ", " : "", names[i], p / 1e9);
        strncat(list, one, sizeof(list) - strlen(list) - 1);
        /* a family the policy lists runs here, so its step has a peak (the portable family has none) */
        if (strcmp(names[i], "generic") != 0 && !(p > 0.0)) ok = false;
    }
    printf("win_smoke: %s: %d families (%s per core); cap %s; drafter family '%s'\n", ok ? "PASS" : "FAIL", n, list,
           max_isa(), draft());
    FreeLibrary(lib);
    return ok ? 0 : 1;
}
