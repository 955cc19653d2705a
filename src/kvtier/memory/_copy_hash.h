/* Copy and hash in one pass: the kernel behind kvtier.memory._stream_copy.copy_hash.
 *
 * The pieces are one stream of bytes, cut into blocks of `block` bytes (the last one may be
 * shorter); each block's xxh3-64 digest is written to `digests`, in order. Where the pieces
 * have destinations, the bytes are copied there too, each stretch hashed right after its copy,
 * while the copy's reads have left it in L1: the bytes cross the memory bus once for both.
 * Pieces of `stream_min` bytes and more are copied with streaming stores, smaller ones with
 * memcpy (they are read again soon).
 *
 *   pieces   |--- piece 0 ---|------ piece 1 ------|- 2 -|
 *   blocks   |--- block 0 ------|--- block 1 ------|- 2 -|   digests[0..2]
 *   stripes  |||||||||||||||||||||||||||||||||||||||||||||   copy 1 KiB, accumulate it
 *
 * A block whose source is contiguous (a chunk sent whole; a page served, even into strided
 * rows) goes through xxh3's stripe loop 1 KiB at a time (kvt_block_stripes); one gathered
 * from rows apart (a chunk cut from a longer KV tensor) through xxh3's streaming state,
 * 16 KiB at a time (kvt_block_steps).
 *
 * Without the GIL: the caller has taken every buffer first. Either way the result is xxh3-64
 * of each block, as python xxhash computes it (the tests compare them byte for byte).
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

/* Streaming-store copy without the closing fence (callers fence once, at their end); inline,
 * so that each instruction-set build interleaves it with its hashing. */
#if defined(__SSE2__)
#include <emmintrin.h>
#define STREAMING 1

static inline void kvt_copy_streaming(char *dst, const char *src, size_t n) {
    /* Streaming stores need a 16-byte aligned destination: copy the head plainly. */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}

static inline void kvt_store_fence(void) { _mm_sfence(); }
#else
#define STREAMING 0
static inline void kvt_copy_streaming(char *dst, const char *src, size_t n) {
    memcpy(dst, src, n);
}
static inline void kvt_store_fence(void) {}
#endif

/* Where the copy stands in the pieces: piece p, `off` bytes into it (source and destination
 * of a piece have the same length, so one cursor serves both). */
typedef struct {
    const kvt_piece *pieces;
    size_t p, off, stream_min, pieces_count;
} kvt_cursor;

/* Move the cursor n bytes on, copying nothing. */
static inline void kvt_skip(kvt_cursor *c, size_t n) {
    while (n) {
        size_t take = c->pieces[c->p].len - c->off;
        if (take == 0) {
            c->p++;
            c->off = 0;
            continue;
        }
        take = n < take ? n : take;
        c->off += take;
        n -= take;
    }
}

/* Copy n bytes from src to the destination at the cursor (across pieces), and move on. */
static inline void kvt_copy_out(kvt_cursor *c, const char *src, size_t n) {
    while (n) {
        const kvt_piece *piece = &c->pieces[c->p];
        size_t take = piece->len - c->off;
        if (take == 0) {
            c->p++;
            c->off = 0;
            continue;
        }
        take = n < take ? n : take;
        if (piece->len >= c->stream_min) {
            kvt_copy_streaming(piece->dst + c->off, src, take);
        } else {
            memcpy(piece->dst + c->off, src, take);
        }
        c->off += take;
        src += take;
        n -= take;
    }
}

#ifdef KVT_X86_ISAS
KVT_HIDDEN size_t kvt_copy_hash_avx2(const kvt_piece *, size_t, size_t, size_t, uint64_t *);
KVT_HIDDEN size_t kvt_copy_hash_avx512(const kvt_piece *, size_t, size_t, size_t, uint64_t *);
#endif
#endif /* KVT_COPY_HASH_DECLS */

#if defined(KVT_COPY_HASH_NAME) && defined(KVT_HAVE_XXHASH)
#define XXH_INLINE_ALL
#include <xxhash.h>

/* A block whose source is contiguous is hashed by xxh3's own stripe loop, driven from here:
 * each 1 KiB of it (xxh3's 16 stripes between two scrambles) is copied, then accumulated
 * while still in L1, so the core's copy of the next KiB overlaps the hashing of this one and
 * a copy that hashes costs about what a bare streaming copy does (one thread, 32 MiB chunks
 * into /dev/shm, per second of CPU time at load 13-15 on 2 cores: 12.9-13.8 GB against
 * 13.4-14.7 for the bare copy and 9.4-10.3 for 16 KiB copied then hashed). This uses
 * xxhash.h's internal stripe functions (the same ones XXH3_64bits runs, so the digests are
 * xxh3's; the tests compare them with python xxhash); a header without them gets the
 * step loop below for every block. */
#if defined(XXH3_accumulate_512) && defined(XXH3_scrambleAcc) && defined(XXH3_INIT_ACC) \
    && defined(XXH_SECRET_DEFAULT_SIZE) && defined(XXH_STRIPE_LEN) && defined(XXH3_MIDSIZE_MAX) \
    && defined(XXH_PRIME64_1) && XXH_VERSION_NUMBER >= 800 && XXH_VERSION_NUMBER < 900
#define KVT_STRIPE_LOOP 1

static uint64_t kvt_block_stripes(const char *src, size_t len, kvt_cursor *out) {
    XXH_ALIGN(64) xxh_u64 acc[8] = XXH3_INIT_ACC;
    const xxh_u8 *secret = XXH3_kSecret;
    size_t const per = (XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN) / 8; /* stripes a scramble */
    size_t const span = XXH_STRIPE_LEN * per;
    size_t const spans = (len - 1) / span; /* the last stripe is always hashed apart */
    for (size_t n = 0; n < spans; n++) {
        const char *at = src + n * span;
        if (out != NULL) {
            kvt_copy_out(out, at, span);
        }
        for (size_t s = 0; s < per; s++) {
            XXH3_accumulate_512(acc, at + s * XXH_STRIPE_LEN, secret + s * 8);
        }
        XXH3_scrambleAcc(acc, secret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN);
    }
    const char *rest = src + spans * span;
    size_t const stripes = ((len - 1) - spans * span) / XXH_STRIPE_LEN;
    if (out != NULL) {
        kvt_copy_out(out, rest, len - spans * span);
    }
    for (size_t s = 0; s < stripes; s++) {
        XXH3_accumulate_512(acc, rest + s * XXH_STRIPE_LEN, secret + s * 8);
    }
    /* xxh3's last stripe and merge: secret offsets 7 and 11, length times PRIME64_1 */
    XXH3_accumulate_512(acc, src + len - XXH_STRIPE_LEN,
                        secret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN - 7);
    return XXH3_mergeAccs(acc, secret + 11, (xxh_u64)len * XXH_PRIME64_1);
}
#endif

/* 16 KiB: where a block's source is in pieces (a strided chunk a sender cuts from a longer
 * KV tensor), a step is copied, then hashed by xxh3's streaming state while in L1. */
#define KVT_STEP ((size_t)16 << 10)

static uint64_t kvt_block_steps(kvt_cursor *at, size_t len, int copy) {
    XXH3_state_t state; /* the type carries its 64-byte alignment */
    XXH3_64bits_reset(&state);
    while (len) {
        const kvt_piece *piece = &at->pieces[at->p];
        size_t take = piece->len - at->off;
        if (take == 0) {
            at->p++;
            at->off = 0;
            continue;
        }
        take = take < KVT_STEP ? take : KVT_STEP;
        take = take < len ? take : len;
        const char *src = piece->src + at->off;
        if (copy) {
            kvt_copy_out(at, src, take); /* moves the cursor */
        } else {
            kvt_skip(at, take);
        }
        XXH3_64bits_update(&state, src, take);
        len -= take;
    }
    return XXH3_64bits_digest(&state);
}

/* The source of the next len bytes at the cursor, if contiguous in memory (in one piece, or
 * pieces that follow each other: a page served into a strided view); else NULL. */
static const char *kvt_contiguous(const kvt_cursor *at, size_t len) {
    size_t p = at->p, off = at->off;
    while (p < at->pieces_count && at->pieces[p].len == off) {
        p++, off = 0;
    }
    const char *start = at->pieces[p].src + off;
    const char *end = start;
    for (; len; p++, off = 0) {
        size_t take = at->pieces[p].len - off;
        take = take < len ? take : len;
        if (at->pieces[p].src + off != end) {
            return NULL;
        }
        end += take;
        len -= take;
    }
    return start;
}

KVT_HIDDEN size_t KVT_COPY_HASH_NAME(const kvt_piece *pieces, size_t count, size_t block,
                                     size_t stream_min, uint64_t *digests) {
    size_t total = 0, n = 0;
    int copy = count > 0 && pieces[0].dst != NULL; /* all pieces have one, or none does */
    for (size_t p = 0; p < count; p++) {
        total += pieces[p].len;
    }
    kvt_cursor at = {pieces, 0, 0, stream_min, count};
    for (size_t start = 0; start < total; start += block) {
        size_t len = total - start < block ? total - start : block;
#ifdef KVT_STRIPE_LOOP
        const char *src = len > XXH3_MIDSIZE_MAX ? kvt_contiguous(&at, len) : NULL;
        if (src != NULL) {
            if (copy) {
                digests[n++] = kvt_block_stripes(src, len, &at); /* moves the cursor */
            } else {
                digests[n++] = XXH3_64bits(src, len);
                kvt_skip(&at, len);
            }
            continue;
        }
#endif
        digests[n++] = kvt_block_steps(&at, len, copy);
    }
    if (copy) {
        kvt_store_fence(); /* every streamed byte is visible before the caller reports it */
    }
    return n;
}
#endif
