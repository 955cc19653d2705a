/* The copy-and-hash kernel (_copy_hash.h) with xxh3 vectorised for AVX2; _stream_copy.c
 * calls it only on a CPU that has AVX2. */
#include "_copy_hash.h"

#ifdef KVT_X86_ISAS
#pragma GCC target("avx2")
#define KVT_COPY_HASH_NAME kvt_copy_hash_avx2
#include "_copy_hash.h"
#if XXH_VECTOR != XXH_AVX2
#error "xxhash.h did not pick its AVX2 code under #pragma GCC target(\"avx2\")"
#endif
#else
typedef int kvt_no_avx2; /* not x86-64 with GCC, or no xxhash.h: the default build only */
#endif
