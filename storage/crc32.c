/* CRC-32 (the zlib/gzip/PNG CRC: reflected polynomial 0xEDB88320) with carry-less multiplication.

   Why: a checked read of a chunk pack spends most of its CPU in the payload's crc32. Python's
   zlib.crc32 (the system zlib's table/braid code) runs at ~3 GB/s on the VMs measured here, which is
   slower than their disk; folding 64 bytes per step with PCLMULQDQ runs at memory speed
   (docs/benchmarks.md, "Chunk packs"). The result is zlib.crc32's, bit for bit, so the on-disk format
   does not change; storage/native.py falls back to zlib where this file builds without PCLMUL.

   Method: the folding scheme of Gopal et al., "Fast CRC Computation for Generic Polynomials Using
   PCLMULQDQ Instruction" (Intel, 2009): four 128-bit accumulators fold 64 bytes per step with the
   constants x^(4*128+32) mod P and x^(4*128-32) mod P (bit-reflected), are folded into one, then
   reduced 128 -> 64 -> 32 bits and finished by a Barrett reduction. The constants are those of the
   reflected CRC-32 polynomial as published with that paper; they are checked here against a
   bytewise table on every length in the tests (tests/storage/test_native.py). */

#include <stddef.h>
#include <stdint.h>

static uint32_t table[256];
static int table_ready;

static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[n] = c;
    }
    table_ready = 1;
}

/* bytewise, on the running (not inverted) register */
static uint32_t crc_bytes(uint32_t c, const uint8_t *p, size_t n) {
    if (!table_ready) make_table();
    while (n--) c = table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__PCLMUL__) && defined(__SSE4_1__)
#include <immintrin.h>

int crc32_fast(void) { return 1; }

/* fold n bytes (n >= 64, a multiple of 16) into the running register c */
static uint32_t crc_fold(uint32_t c, const uint8_t *p, size_t n) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x1F7011641LL, 0x1DB710641LL);
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);

    __m128i x1 = _mm_loadu_si128((const __m128i *)p);
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)c));
    p += 64;
    n -= 64;
    while (n >= 64) {
        __m128i h1 = _mm_clmulepi64_si128(x1, k1k2, 0x11), l1 = _mm_clmulepi64_si128(x1, k1k2, 0x00);
        __m128i h2 = _mm_clmulepi64_si128(x2, k1k2, 0x11), l2 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
        __m128i h3 = _mm_clmulepi64_si128(x3, k1k2, 0x11), l3 = _mm_clmulepi64_si128(x3, k1k2, 0x00);
        __m128i h4 = _mm_clmulepi64_si128(x4, k1k2, 0x11), l4 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
        x1 = _mm_xor_si128(_mm_xor_si128(h1, l1), _mm_loadu_si128((const __m128i *)p));
        x2 = _mm_xor_si128(_mm_xor_si128(h2, l2), _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = _mm_xor_si128(_mm_xor_si128(h3, l3), _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = _mm_xor_si128(_mm_xor_si128(h4, l4), _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        n -= 64;
    }
    /* four accumulators into one */
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), _mm_clmulepi64_si128(x1, k3k4, 0x00)), x2);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), _mm_clmulepi64_si128(x1, k3k4, 0x00)), x3);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), _mm_clmulepi64_si128(x1, k3k4, 0x00)), x4);
    while (n >= 16) {
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), _mm_clmulepi64_si128(x1, k3k4, 0x00)),
                           _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    /* 128 -> 64 bits (the low half times x^64 mod P, plus the high half), appending 32 zero bits */
    __m128i t = _mm_clmulepi64_si128(k3k4, x1, 0x01);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
    /* 64 -> 32 bits */
    __m128i x2b = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00), x2b);
    /* Barrett reduction */
    __m128i x3b = x1;
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10);
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x00);
    x1 = _mm_xor_si128(x1, x3b);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

uint32_t crc32_update(uint32_t crc, const uint8_t *p, size_t n) {
    uint32_t c = ~crc;
    if (n >= 128) {
        size_t body = n & ~(size_t)15;
        c = crc_fold(c, p, body);
        p += body;
        n -= body;
    }
    return ~crc_bytes(c, p, n);
}

#else

int crc32_fast(void) { return 0; } /* no carry-less multiply here: callers keep zlib.crc32 */

uint32_t crc32_update(uint32_t crc, const uint8_t *p, size_t n) { return ~crc_bytes(~crc, p, n); }

#endif
