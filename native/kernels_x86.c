/* x86-64 kernel families (AVX-512 BF16, AMX BF16), chosen at run time by CPU feature. */
#include "bs_internal.h"
#include "bitsplit.h"

static bool unavailable(void) { return false; }
static bool never(const bs_job * job) { (void)job; return false; }

const bs_kernel_family bs_family_avx512_bf16 = { "avx512-bf16", unavailable, never, NULL, NULL, NULL };
const bs_kernel_family bs_family_amx_bf16 = { "amx-bf16", unavailable, never, NULL, NULL, NULL };
