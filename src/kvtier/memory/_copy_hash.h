/* Copy and hash in one pass: the kernel behind kvtier.memory._stream_copy.copy_hash.
 *
 * The pieces are one stream of bytes, cut into blocks of `block` bytes (the last one may be
 * shorter); each block's xxh3-64 digest is written to `digests`, in order. Where a piece has a
 * destination, its bytes are copied there too, KVT_STEP bytes at a time, each step hashed right
 * after its copy, while the copy's reads have left it in the core's cache: the bytes cross the
 * memory bus once for both. Pieces of `stream_min` bytes and more are copied with streaming
 * stores (kvt_copy_streaming), smaller ones with memcpy (they are read again soon).
 *
 *   pieces   |--- piece 0 ---|------ piece 1 ------|- 2 -|
 *   blocks   |--- block 0 ------|--- block 1 ------|- 2 -|   digests[0..2]
 *   steps    |..|..|..|..|.|..|..|..|..|..|..|..|.|..|.|   copy, then hash, each step
 *
 * Without the GIL: the caller has taken every buffer first. The result equals hashing each
 * block whole (xxh3's streaming state is defined to give the one-shot digest), so it agrees
 * with python xxhash byte for byte.
 *
 * xxh3 is vectorised for one instruction set at compile time; this header is included once
 * per set (KVT_COPY_HASH_NAME names that copy of the kernel): the default build in
 * _stream_copy.c, and AVX2 and AVX-512 builds in _copy_hash_avx2.c / _copy_hash_avx512.c,
 * which _stream_copy.c picks from at import by what the CPU supports. xxhash.h comes from the
 * system (Debian: libxxhash-dev); without it none of this is compiled and kvtier hashes in
 * Python.
 */
#ifndef KVT_COPY_HASH_DECLS
#define KVT_COPY_HASH_DECLS
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__has_include)
#if __has_include(<xxhash.h>)
#define KVT_HAVE_XXHASH 1
#endif
#endif

/* GCC's `#pragma GCC target` also defines __AVX2__ / __AVX512F__, which xxhash.h reads to
 * pick its vector code; other compilers get the default build only. */
#if defined(KVT_HAVE_XXHASH) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KVT_X86_ISAS 1
#endif

#define KVT_HIDDEN __attribute__((visibility("hidden")))

typedef struct {
    char *dst; /* NULL: hash only */
    const char *src;
    size_t len;
} kvt_piece;

typedef size_t (*kvt_copy_hash_fn)(const kvt_piece *pieces, size_t count, size_t block,
                                   size_t stream_min, uint64_t *digests);

/* Streaming-store copy without the closing fence (the kernel fences once, at its end). */
KVT_HIDDEN void kvt_copy_streaming(char *dst, const char *src, size_t n);
KVT_HIDDEN void kvt_store_fence(void);

#ifdef KVT_X86_ISAS
KVT_HIDDEN size_t kvt_copy_hash_avx2(const kvt_piece *, size_t, size_t, size_t, uint64_t *);
KVT_HIDDEN size_t kvt_copy_hash_avx512(const kvt_piece *, size_t, size_t, size_t, uint64_t *);
#endif
#endif /* KVT_COPY_HASH_DECLS */

#if defined(KVT_COPY_HASH_NAME) && defined(KVT_HAVE_XXHASH)
#define XXH_INLINE_ALL
#include <xxhash.h>

/* 16 KiB: a step is copied, then hashed while it is still in L1 (48 KiB on the project's
 * hosts). One thread's CPU time per byte measured within noise for steps of 4 KiB to 1 MiB on
 * a shared, loaded host (a 1 MiB step still hashes from the 2 MiB L2); a step well inside
 * L1 does not depend on the L2 of the next machine. */
#define KVT_STEP ((size_t)16 << 10)

KVT_HIDDEN size_t KVT_COPY_HASH_NAME(const kvt_piece *pieces, size_t count, size_t block,
                                     size_t stream_min, uint64_t *digests) {
    XXH3_state_t state; /* the type carries its 64-byte alignment */
    size_t fill = 0, n = 0;
    int streamed = 0;
    XXH3_64bits_reset(&state);
    for (size_t p = 0; p < count; p++) {
        char *dst = pieces[p].dst;
        const char *src = pieces[p].src;
        size_t left = pieces[p].len;
        int stream = dst != NULL && left >= stream_min;
        streamed |= stream;
        while (left) {
            size_t take = left < KVT_STEP ? left : KVT_STEP;
            if (take > block - fill) {
                take = block - fill;
            }
            if (dst != NULL) {
                if (stream) {
                    kvt_copy_streaming(dst, src, take);
                } else {
                    memcpy(dst, src, take);
                }
                dst += take;
            }
            XXH3_64bits_update(&state, src, take);
            src += take;
            left -= take;
            fill += take;
            if (fill == block) {
                digests[n++] = XXH3_64bits_digest(&state);
                XXH3_64bits_reset(&state);
                fill = 0;
            }
        }
    }
    if (fill) {
        digests[n++] = XXH3_64bits_digest(&state);
    }
    if (streamed) {
        kvt_store_fence(); /* every streamed byte is visible before the caller reports it */
    }
    return n;
}
#endif
