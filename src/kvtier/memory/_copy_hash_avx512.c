/* The copy-and-hash kernel (_copy_hash.h) with xxh3 vectorised for AVX-512; _stream_copy.c
 * calls it only on a CPU that has AVX-512. */
#include "_copy_hash.h"

#ifdef KVT_X86_ISAS
#pragma GCC target("avx512f")
#define KVT_COPY_HASH_NAME kvt_copy_hash_avx512
#include "_copy_hash.h"
#if XXH_VECTOR != XXH_AVX512
#error "xxhash.h did not pick its AVX-512 code under #pragma GCC target(\"avx512f\")"
#endif
#else
typedef int kvt_no_avx512; /* not x86-64 with GCC, or no xxhash.h: the default build only */
#endif
