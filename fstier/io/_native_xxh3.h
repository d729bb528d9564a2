/*
 * XXH3-64 (seed 0, default secret), written from the XXH3 specification.
 *
 * Only the one-shot 64-bit variant with seed 0 is implemented: it is what
 * fstier's block format records as checksum kind 1 (and what the Python
 * fallback computes with the `xxhash` package, so both paths write and
 * accept the same files). tests/test_native.py compares this code with the
 * `xxhash` package at every length class (0, 1-3, 4-8, 9-16, 17-128,
 * 129-240, long inputs with partial blocks and stripes).
 *
 * Long inputs (> 240 bytes) run the stripe loop with AVX2 when the CPU has
 * it (runtime check), else SSE2 (every x86-64), else portable C.
 */
#ifndef FSTIER_NATIVE_XXH3_H
#define FSTIER_NATIVE_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define FX_P32_1 0x9E3779B1U
#define FX_P32_2 0x85EBCA77U
#define FX_P32_3 0xC2B2AE3DU
#define FX_P64_1 0x9E3779B185EBCA87ULL
#define FX_P64_2 0xC2B2AE3D27D4EB4FULL
#define FX_P64_3 0x165667B19E3779F9ULL
#define FX_P64_4 0x85EBCA77C2B2AE63ULL
#define FX_P64_5 0x27D4EB2F165667C5ULL
#define FX_MX1 0x165667919E3779F9ULL
#define FX_MX2 0x9FB21C651E98DF25ULL

#define FX_SECRET_SIZE 192
#define FX_STRIPE 64
#define FX_ACC_NB 8
#define FX_CONSUME 8
#define FX_STRIPES_PER_BLOCK ((FX_SECRET_SIZE - FX_STRIPE) / FX_CONSUME)
#define FX_BLOCK (FX_STRIPE * FX_STRIPES_PER_BLOCK)

/* The default secret of the specification (192 bytes). */
static const uint8_t fx_secret[FX_SECRET_SIZE] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t fx_r64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* little-endian hosts only (x86-64, aarch64 LE): checked in setup */
}

static inline uint32_t fx_r32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t fx_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fx_fold64(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t fx_xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= FX_P64_2;
    h ^= h >> 29;
    h *= FX_P64_3;
    h ^= h >> 32;
    return h;
}

static inline uint64_t fx_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= FX_MX1;
    h ^= h >> 32;
    return h;
}

static inline uint64_t fx_rrmxmx(uint64_t h, uint64_t len) {
    h ^= fx_rotl64(h, 49) ^ fx_rotl64(h, 24);
    h *= FX_MX2;
    h ^= (h >> 35) + len;
    h *= FX_MX2;
    h ^= h >> 28;
    return h;
}

static inline uint64_t fx_mix16(const uint8_t *in, const uint8_t *sec) {
    return fx_fold64(fx_r64(in) ^ fx_r64(sec), fx_r64(in + 8) ^ fx_r64(sec + 8));
}

static uint64_t fx_len_0to16(const uint8_t *in, size_t len) {
    const uint8_t *s = fx_secret;
    if (len > 8) {
        uint64_t lo = fx_r64(in) ^ (fx_r64(s + 24) ^ fx_r64(s + 32));
        uint64_t hi = fx_r64(in + len - 8) ^ (fx_r64(s + 40) ^ fx_r64(s + 48));
        uint64_t acc = (uint64_t)len + __builtin_bswap64(lo) + hi + fx_fold64(lo, hi);
        return fx_avalanche(acc);
    }
    if (len >= 4) {
        uint64_t in1 = fx_r32(in), in2 = fx_r32(in + len - 4);
        uint64_t keyed = (in2 + (in1 << 32)) ^ (fx_r64(s + 8) ^ fx_r64(s + 16));
        return fx_rrmxmx(keyed, len);
    }
    if (len > 0) {
        uint32_t c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
        uint32_t combined = (c1 << 16) | (c2 << 24) | c3 | ((uint32_t)len << 8);
        uint64_t keyed = (uint64_t)combined ^ (uint64_t)(fx_r32(s) ^ fx_r32(s + 4));
        return fx_xxh64_avalanche(keyed);
    }
    return fx_xxh64_avalanche(fx_r64(s + 56) ^ fx_r64(s + 64));
}

static uint64_t fx_len_17to128(const uint8_t *in, size_t len) {
    const uint8_t *s = fx_secret;
    uint64_t acc = (uint64_t)len * FX_P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += fx_mix16(in + 48, s + 96);
                acc += fx_mix16(in + len - 64, s + 112);
            }
            acc += fx_mix16(in + 32, s + 64);
            acc += fx_mix16(in + len - 48, s + 80);
        }
        acc += fx_mix16(in + 16, s + 32);
        acc += fx_mix16(in + len - 32, s + 48);
    }
    acc += fx_mix16(in, s);
    acc += fx_mix16(in + len - 16, s + 16);
    return fx_avalanche(acc);
}

static uint64_t fx_len_129to240(const uint8_t *in, size_t len) {
    const uint8_t *s = fx_secret;
    uint64_t acc = (uint64_t)len * FX_P64_1;
    size_t rounds = len / 16, i;
    for (i = 0; i < 8; i++) acc += fx_mix16(in + 16 * i, s + 16 * i);
    acc = fx_avalanche(acc);
    for (i = 8; i < rounds; i++) acc += fx_mix16(in + 16 * i, s + 16 * (i - 8) + 3);
    acc += fx_mix16(in + len - 16, s + 136 - 17);
    return fx_avalanche(acc);
}

/* ---- the long-input stripe loop: one accumulate and one scramble per kind */
static void fx_acc512_scalar(uint64_t *acc, const uint8_t *in, const uint8_t *sec) {
    for (int i = 0; i < FX_ACC_NB; i++) {
        uint64_t v = fx_r64(in + 8 * i);
        uint64_t k = v ^ fx_r64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (uint64_t)(uint32_t)k * (k >> 32);
    }
}

static void fx_scramble_scalar(uint64_t *acc, const uint8_t *sec) {
    for (int i = 0; i < FX_ACC_NB; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= fx_r64(sec + 8 * i);
        a *= FX_P32_1;
        acc[i] = a;
    }
}

static void fx_long_scalar(uint64_t *acc, const uint8_t *in, size_t len) {
    size_t nb_blocks = (len - 1) / FX_BLOCK, n, st;
    for (n = 0; n < nb_blocks; n++) {
        const uint8_t *blk = in + n * FX_BLOCK;
        for (st = 0; st < FX_STRIPES_PER_BLOCK; st++)
            fx_acc512_scalar(acc, blk + st * FX_STRIPE, fx_secret + st * FX_CONSUME);
        fx_scramble_scalar(acc, fx_secret + FX_SECRET_SIZE - FX_STRIPE);
    }
    size_t stripes = ((len - 1) - FX_BLOCK * nb_blocks) / FX_STRIPE;
    const uint8_t *blk = in + nb_blocks * FX_BLOCK;
    for (st = 0; st < stripes; st++)
        fx_acc512_scalar(acc, blk + st * FX_STRIPE, fx_secret + st * FX_CONSUME);
    fx_acc512_scalar(acc, in + len - FX_STRIPE, fx_secret + FX_SECRET_SIZE - FX_STRIPE - 7);
}

#if defined(__x86_64__)
static inline void fx_acc512_sse2(__m128i *xacc, const uint8_t *in, const uint8_t *sec) {
    for (int i = 0; i < 4; i++) {
        __m128i d = _mm_loadu_si128((const __m128i *)(in + 16 * i));
        __m128i k = _mm_xor_si128(d, _mm_loadu_si128((const __m128i *)(sec + 16 * i)));
        __m128i khi = _mm_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1));
        __m128i prod = _mm_mul_epu32(k, khi);
        __m128i swap = _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
        xacc[i] = _mm_add_epi64(xacc[i], _mm_add_epi64(prod, swap));
    }
}

static inline void fx_scramble_sse2(__m128i *xacc, const uint8_t *sec) {
    const __m128i p = _mm_set1_epi32((int)FX_P32_1);
    for (int i = 0; i < 4; i++) {
        __m128i a = xacc[i];
        a = _mm_xor_si128(a, _mm_srli_epi64(a, 47));
        a = _mm_xor_si128(a, _mm_loadu_si128((const __m128i *)(sec + 16 * i)));
        __m128i ahi = _mm_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1));
        __m128i lo = _mm_mul_epu32(a, p);
        __m128i hi = _mm_mul_epu32(ahi, p);
        xacc[i] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
    }
}

static void fx_long_sse2(uint64_t *acc, const uint8_t *in, size_t len) {
    __m128i x[4];
    memcpy(x, acc, sizeof x);
    size_t nb_blocks = (len - 1) / FX_BLOCK, n, st;
    for (n = 0; n < nb_blocks; n++) {
        const uint8_t *blk = in + n * FX_BLOCK;
        for (st = 0; st < FX_STRIPES_PER_BLOCK; st++)
            fx_acc512_sse2(x, blk + st * FX_STRIPE, fx_secret + st * FX_CONSUME);
        fx_scramble_sse2(x, fx_secret + FX_SECRET_SIZE - FX_STRIPE);
    }
    size_t stripes = ((len - 1) - FX_BLOCK * nb_blocks) / FX_STRIPE;
    const uint8_t *blk = in + nb_blocks * FX_BLOCK;
    for (st = 0; st < stripes; st++)
        fx_acc512_sse2(x, blk + st * FX_STRIPE, fx_secret + st * FX_CONSUME);
    fx_acc512_sse2(x, in + len - FX_STRIPE, fx_secret + FX_SECRET_SIZE - FX_STRIPE - 7);
    memcpy(acc, x, sizeof x);
}

__attribute__((target("avx2"))) static inline void fx_acc512_avx2(__m256i *xacc, const uint8_t *in,
                                                                  const uint8_t *sec) {
    for (int i = 0; i < 2; i++) {
        __m256i d = _mm256_loadu_si256((const __m256i *)(in + 32 * i));
        __m256i k = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)(sec + 32 * i)));
        __m256i khi = _mm256_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1));
        __m256i prod = _mm256_mul_epu32(k, khi);
        __m256i swap = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
        xacc[i] = _mm256_add_epi64(xacc[i], _mm256_add_epi64(prod, swap));
    }
}

__attribute__((target("avx2"))) static inline void fx_scramble_avx2(__m256i *xacc,
                                                                    const uint8_t *sec) {
    const __m256i p = _mm256_set1_epi32((int)FX_P32_1);
    for (int i = 0; i < 2; i++) {
        __m256i a = xacc[i];
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(sec + 32 * i)));
        __m256i ahi = _mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1));
        __m256i lo = _mm256_mul_epu32(a, p);
        __m256i hi = _mm256_mul_epu32(ahi, p);
        xacc[i] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
    }
}

__attribute__((target("avx2"))) static void fx_long_avx2(uint64_t *acc, const uint8_t *in,
                                                         size_t len) {
    __m256i x[2];
    memcpy(x, acc, sizeof x);
    size_t nb_blocks = (len - 1) / FX_BLOCK, n, st;
    for (n = 0; n < nb_blocks; n++) {
        const uint8_t *blk = in + n * FX_BLOCK;
        for (st = 0; st < FX_STRIPES_PER_BLOCK; st++)
            fx_acc512_avx2(x, blk + st * FX_STRIPE, fx_secret + st * FX_CONSUME);
        fx_scramble_avx2(x, fx_secret + FX_SECRET_SIZE - FX_STRIPE);
    }
    size_t stripes = ((len - 1) - FX_BLOCK * nb_blocks) / FX_STRIPE;
    const uint8_t *blk = in + nb_blocks * FX_BLOCK;
    for (st = 0; st < stripes; st++)
        fx_acc512_avx2(x, blk + st * FX_STRIPE, fx_secret + st * FX_CONSUME);
    fx_acc512_avx2(x, in + len - FX_STRIPE, fx_secret + FX_SECRET_SIZE - FX_STRIPE - 7);
    memcpy(acc, x, sizeof x);
}
#endif

/* 0 portable, 1 SSE2, 2 AVX2; fixed at module init (fx_pick_impl). */
static int fx_impl = 0;

static void fx_pick_impl(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    fx_impl = __builtin_cpu_supports("avx2") ? 2 : 1;
#else
    fx_impl = 0;
#endif
}

static uint64_t fx_xxh3_64_impl(const uint8_t *in, size_t len, int impl) {
    if (len <= 16) return fx_len_0to16(in, len);
    if (len <= 128) return fx_len_17to128(in, len);
    if (len <= 240) return fx_len_129to240(in, len);
    uint64_t acc[FX_ACC_NB] __attribute__((aligned(32))) = {
        FX_P32_3, FX_P64_1, FX_P64_2, FX_P64_3, FX_P64_4, FX_P32_2, FX_P64_5, FX_P32_1};
#if defined(__x86_64__)
    if (impl == 2)
        fx_long_avx2(acc, in, len);
    else if (impl == 1)
        fx_long_sse2(acc, in, len);
    else
        fx_long_scalar(acc, in, len);
#else
    (void)impl;
    fx_long_scalar(acc, in, len);
#endif
    uint64_t r = (uint64_t)len * FX_P64_1;
    const uint8_t *s = fx_secret + 11;
    for (int i = 0; i < 4; i++)
        r += fx_fold64(acc[2 * i] ^ fx_r64(s + 16 * i), acc[2 * i + 1] ^ fx_r64(s + 16 * i + 8));
    return fx_avalanche(r);
}

static inline uint64_t fx_xxh3_64(const void *in, size_t len) {
    return fx_xxh3_64_impl((const uint8_t *)in, len, fx_impl);
}

/* ---- CRC32C (Castagnoli), measured against XXH3 (docs/format.md) -------- */
static uint32_t fx_crc_table[256];

static void fx_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78U & (0U - (c & 1U)));
        fx_crc_table[i] = c;
    }
}

static uint32_t fx_crc32c_table(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFU;
    while (n--) c = fx_crc_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFU;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t fx_crc32c_hw(const uint8_t *p, size_t n) {
    uint64_t c = 0xFFFFFFFFU;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return c32 ^ 0xFFFFFFFFU;
}
#endif

#endif
