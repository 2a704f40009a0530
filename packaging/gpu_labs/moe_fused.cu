// LAB, NOT ADOPTED (packaging/gpu_labs/moe_cuda.py builds and times it; its docstring and docs/benchmarks-gpu.md,
// session 11, have the figures: 20.6 µs a call for moe_fused, 20.9 for moe_splitf, 19.1 for moe_plain, against
// the engine's 15.9).
// The Q4_K routed experts of one decode token, and a Q4_K trunk GEMV, written with the control Triton does not give
// — every weight byte a program needs is asked for at its start with bulk asynchronous copies (cp.async.bulk,
// sm_90) into shared memory, so the whole 21.2 MB stream is in flight from the first microsecond, whatever the
// arithmetic is doing.
//
// moe_fused: one persistent launch of G programs (G ≤ what fits at once). Program c
//   1. issues bulk copies of its gate/up rows (h rows [c·KF/G, (c+1)·KF/G) of the K·F of the token's K pairs,
//      gate and up row each) and of its down rows (output rows [c·D/G, (c+1)·D/G) of all K experts) into shared
//      memory, one mbarrier a gate/up row and one for the down;
//   2. computes its h rows as each row lands (a warp a row: lanes 0–15 the gate row's 16 half-blocks, 16–31 the
//      up row's), h = SiLU(g)·u into H (global, float32);
//   3. a grid barrier (atomics: arrive, the last one flips a generation word);
//   4. rounds all of h to q8 (triton_q8's rule) into shared memory, and sums w_k·down_k·ĥ_k for its output rows
//      (a warp a row, its 48 half-blocks over the lanes) from the down rows that landed during steps 2–3.
// The arithmetic is triton_q4k_moe's (dp4a on q8 activations, half-block decode); x̂ comes given (the norm makes it).
// MODE bits (timing only, wrong sums): 1 no dot products, 2 no grid barrier, 4 no rounding of h, 8 no down copies.
//
// gemv_q / gemv_o: y = W·x̂ for a Q4_K [R, 2048] / [R, 4096] matrix, program c's rows bulk-copied at its start.

typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef NW
#define NW 16
#endif
#ifndef CH
#define CH 1  // gate/up rows a bulk copy (a copy never spans two pairs)
#endif
#define NT (NW * 32)

#define K_ 8
#define F_ 768
#define D_ 2048
#define NB_ 8    // blocks a gate/up row (D / 256)
#define NBF_ 3   // blocks a down row (F / 256)
#define GU_ROW 1152
#define DN_ROW 432
#define XSTR 36  // int32 words a half-block's activations take in shared memory (32, padded: no bank conflicts)

// shared memory map (bytes)
#define OFF_XQ 1024
#define OFF_XD (OFF_XQ + 16 * XSTR * 4)
#define OFF_XS (OFF_XD + 64 * 4)
#define OFF_HQ (OFF_XS + 128 * 4)
#define OFF_HD (OFF_HQ + 48 * XSTR * 4)
#define OFF_HS (OFF_HD + 192 * 4)
#define OFF_GU (OFF_HS + 384 * 4)

extern __shared__ __align__(128) unsigned char sm[];

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ float h2f(u32 bits) {
    float f;
    unsigned short h = (unsigned short)bits;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(u32 bar) {
    u32 ok = 0;
    while (!ok) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(bar) : "memory");
    }
}

// One Q4_K half-block (header hdr, its 64 quant bytes qp[0..3]: sub-blocks 4·hv … 4·hv + 3) · its q8
// activations: xw (its 32 words),
// xd (its 4 sub-block scales), xs (its 8 16-sums) — triton_q4k_moe._dot_half's arithmetic.
__device__ __forceinline__ float dot_half_v(const uint4 hdr, const uint4* qp, int hv, const int* xw, const float* xd,
                                            const float* xs) {
    const float d = h2f(hdr.x & 0xFFFF), dmin = h2f(hdr.x >> 16);
    const u32 scw = hv ? ((hdr.w & 0x0F0F0F0Fu) | ((hdr.y >> 2) & 0x30303030u)) : (hdr.y & 0x3F3F3F3Fu);
    const u32 mnw = hv ? (((hdr.w >> 4) & 0x0F0F0F0Fu) | ((hdr.z >> 2) & 0x30303030u)) : (hdr.z & 0x3F3F3F3Fu);
    const int4* xp = (const int4*)xw;
    float acc = 0.f, mn = 0.f;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const uint4 qa = qp[2 * c], qz = qp[2 * c + 1];
        const int4 x0 = xp[4 * c], x1 = xp[4 * c + 1], x2 = xp[4 * c + 2], x3 = xp[4 * c + 3];
        int ia = __dp4a((int)(qa.x & 0x0F0F0F0Fu), x0.x, 0);
        ia = __dp4a((int)(qa.y & 0x0F0F0F0Fu), x0.y, ia);
        ia = __dp4a((int)(qa.z & 0x0F0F0F0Fu), x0.z, ia);
        ia = __dp4a((int)(qa.w & 0x0F0F0F0Fu), x0.w, ia);
        ia = __dp4a((int)(qz.x & 0x0F0F0F0Fu), x1.x, ia);
        ia = __dp4a((int)(qz.y & 0x0F0F0F0Fu), x1.y, ia);
        ia = __dp4a((int)(qz.z & 0x0F0F0F0Fu), x1.z, ia);
        ia = __dp4a((int)(qz.w & 0x0F0F0F0Fu), x1.w, ia);
        int ib = __dp4a((int)((qa.x >> 4) & 0x0F0F0F0Fu), x2.x, 0);
        ib = __dp4a((int)((qa.y >> 4) & 0x0F0F0F0Fu), x2.y, ib);
        ib = __dp4a((int)((qa.z >> 4) & 0x0F0F0F0Fu), x2.z, ib);
        ib = __dp4a((int)((qa.w >> 4) & 0x0F0F0F0Fu), x2.w, ib);
        ib = __dp4a((int)((qz.x >> 4) & 0x0F0F0F0Fu), x3.x, ib);
        ib = __dp4a((int)((qz.y >> 4) & 0x0F0F0F0Fu), x3.y, ib);
        ib = __dp4a((int)((qz.z >> 4) & 0x0F0F0F0Fu), x3.z, ib);
        ib = __dp4a((int)((qz.w >> 4) & 0x0F0F0F0Fu), x3.w, ib);
        const int sca = (scw >> (16 * c)) & 0xFF, scb = (scw >> (16 * c + 8)) & 0xFF;
        const int mna = (mnw >> (16 * c)) & 0xFF, mnb = (mnw >> (16 * c + 8)) & 0xFF;
        acc += (float)(ia * sca) * xd[2 * c] + (float)(ib * scb) * xd[2 * c + 1];
        mn += (float)mna * (xs[4 * c] + xs[4 * c + 1]) + (float)mnb * (xs[4 * c + 2] + xs[4 * c + 3]);
    }
    return d * acc - dmin * mn;
}

// dot_half_v of the half-block at `blk` (its header and quant bytes read from where they are: shared memory here)
__device__ __forceinline__ float dot_half(const unsigned char* blk, int hv, const int* xw, const float* xd,
                                          const float* xs) {
    return dot_half_v(*(const uint4*)blk, (const uint4*)(blk + 16 + 64 * hv), hv, xw, xd, xs);
}

// h (one value a lane) through triton_q8's rule as one q8 block: its 8 words (words[lane / 4]), scale (*d_out)
// and two 16-sums d·Σq (s_out[0..1])
__device__ __forceinline__ void q8_round32(float v, int lane, int* words, float* d_out, float* s_out) {
    float amax = fabsf(v);
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const float d = __fdiv_rn(amax, 127.0f);
    const float t = __fdiv_rn(v, d > 0.f ? d : 1.0f);
    const int q = d > 0.f ? (int)(t + (t >= 0.f ? 0.5f : -0.5f)) : 0;
    const u32 byte = (u32)q & 0xFFu;
    const u32 word = byte | (__shfl_down_sync(0xFFFFFFFFu, byte, 1) << 8) |
                     (__shfl_down_sync(0xFFFFFFFFu, byte, 2) << 16) | (__shfl_down_sync(0xFFFFFFFFu, byte, 3) << 24);
    if ((lane & 3) == 0) words[lane >> 2] = (int)word;
    int sq = q;
    for (int o = 8; o; o >>= 1) sq += __shfl_xor_sync(0xFFFFFFFFu, sq, o);
    if (lane == 0) *d_out = d;
    if ((lane & 15) == 0) s_out[lane >> 4] = (float)sq * d;
}

// x̂ (XQ words, XD scales, XS 16-sums; `halves` half-blocks) into shared memory, a half-block's words XSTR apart
__device__ __forceinline__ void stage_x(unsigned char* sm, const int* XQ, const float* XD, const float* XS,
                                        int halves) {
    int* sxq = (int*)(sm + OFF_XQ);
    for (int i = threadIdx.x; i < halves * 32; i += NT) sxq[(i >> 5) * XSTR + (i & 31)] = XQ[i];
    for (int i = threadIdx.x; i < halves * 4; i += NT) ((float*)(sm + OFF_XD))[i] = XD[i];
    for (int i = threadIdx.x; i < halves * 8; i += NT) ((float*)(sm + OFF_XS))[i] = XS[i];
}

// a warp's gate (lanes 0–15) and up (lanes 16–31) half-block products -> SiLU(gate)·up, valid on lane 0
__device__ __forceinline__ float swiglu_lanes(float v) {
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 8);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    const float u = __shfl_sync(0xFFFFFFFFu, v, 16);
    return v / (1.0f + expf(-v)) * u;
}

// the token's K slot offsets and routing weights into shared memory at bytes 512 and 576 (after the mbarriers)
__device__ __forceinline__ const long long* stage_routes(const long long* slot, const float* WT) {
    if (threadIdx.x < K_) {
        ((long long*)(sm + 512))[threadIdx.x] = slot[threadIdx.x];
        ((float*)(sm + 576))[threadIdx.x] = WT[threadIdx.x];
    }
    return (const long long*)(sm + 512);
}

__device__ __forceinline__ void grid_sync(u32* sync, u32 G) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile u32* gen = sync + 32;  // its own 128-byte line
        const u32 g0 = *gen;
        __threadfence();
        const u32 arrived = atomicAdd(sync, 1u);
        if (arrived == G - 1) {
            atomicExch(sync, 0u);
            __threadfence();
            atomicExch(sync + 32, g0 + 1);
        } else {
            while (*gen == g0) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(NT, 1)
    moe_fused(const unsigned char* __restrict__ pool, const long long* __restrict__ slot, const int* __restrict__ XQ,
              const float* __restrict__ XD, const float* __restrict__ XS, const float* __restrict__ WT, float* H,
              float* __restrict__ Y, u32* sync, int go, int uo, int dno, int G, int MODE) {
    const int c = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int KF = K_ * F_;
    const int MAXR = (KF + G - 1) / G, MAXD = (D_ + G - 1) / G;
    const int r0 = (int)((long long)c * KF / G), nr = (int)((long long)(c + 1) * KF / G) - r0;
    const int d0 = c * D_ / G, nd = (c + 1) * D_ / G - d0;
    const int DNS = MAXD * DN_ROW + 48;  // bytes between experts' down rows (3 16-byte units of padding)
    unsigned char* gu = sm + OFF_GU;
    unsigned char* dn = gu + MAXR * (2 * GU_ROW);
    const u32 bars = smem(sm);  // bar 0: the down rows; bar 1 + i: gate/up row i

    if (tid == 0) {
        bar_init(bars, K_);
        for (int i = 0; i < nr; ++i)
            if (i % CH == 0 || (r0 + i) % F_ == 0) bar_init(bars + 8 * (1 + i), 2);  // a chunk's first row
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    for (int t = tid; t < 2 * nr + K_; t += NT) {
        if (t < 2 * nr) {
            const int i = t >> 1, mat = t & 1, g = r0 + i;
            if (i % CH == 0 || g % F_ == 0) {  // a chunk: rows i … up to the next multiple of CH, pair or the end
                const int n = min(min(CH - i % CH, F_ - g % F_), nr - i);
                const long long s = slot[g / F_];
                const u32 bar = bars + 8 * (1 + i);
                if (s >= 0)
                    bulk_copy(smem(gu + mat * (MAXR * GU_ROW) + i * GU_ROW),
                              pool + s + (mat ? uo : go) + (long long)(g % F_) * GU_ROW, n * GU_ROW, bar);
                else
                    bar_arrive(bar);
            }
        } else if (!(MODE & 8)) {  // MODE 8: no down copies (timing only)
            const int k = t - 2 * nr;
            const long long s = slot[k];
            if (s >= 0)
                bulk_copy(smem(dn + k * DNS), pool + s + dno + (long long)d0 * DN_ROW, nd * DN_ROW, bars);
            else
                bar_arrive(bars);
        }
    }
    stage_x(sm, XQ, XD, XS, 16);
    const long long* sslot = stage_routes(slot, WT);  // after the barriers (G ≥ 100: at most 62 rows)
    const float* swt = (const float*)(sm + 576);
    __syncthreads();

    // gate/up: a warp a row
    const int* sxq = (const int*)(sm + OFF_XQ);
    const float* sxd = (const float*)(sm + OFF_XD);
    const float* sxs = (const float*)(sm + OFF_XS);
    {
        const int mat = lane >> 4, hb = lane & 15, b = hb >> 1, hv = hb & 1;
        for (int i = w; i < nr; i += NW) {
            const int g = r0 + i;
            bar_wait(bars + 8 * (1 + max(i - i % CH, i - g % F_)));  // its chunk's barrier
            float v = 0.f;
            if (!(MODE & 1))
                v = dot_half(gu + mat * (MAXR * GU_ROW) + i * GU_ROW + b * 144, hv, sxq + hb * XSTR, sxd + hb * 4,
                             sxs + hb * 8);
            const float h = swiglu_lanes(v);
            if (lane == 0) H[g] = sslot[g / F_] >= 0 ? h : 0.f;
        }
    }
    if (!(MODE & 2)) grid_sync(sync, (u32)G);  // MODE 2: no barrier (wrong sums; what it costs)

    // ĥ: all K·F values of h through triton_q8's rounding, a warp a 32-block
    int* shq = (int*)(sm + OFF_HQ);
    float* shd = (float*)(sm + OFF_HD);
    float* shs = (float*)(sm + OFF_HS);
    constexpr int PER = K_ * F_ / 32 / NW;  // 32-blocks a warp: all loaded before any is used (one L2 round trip)
    float hv_[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) hv_[j] = __ldcg(H + (w + NW * j) * 32 + lane);
#pragma unroll
    for (int j = 0; j < (MODE & 4 ? 0 : PER); ++j) {  // MODE 4: no rounding (timing only)
        const int blk = w + NW * j, half = (blk / 24) * 6 + (blk % 24) / 4;  // pair blk / 24, sub-block blk % 24
        q8_round32(hv_[j], lane, shq + half * XSTR + ((blk % 24) % 4) * 8, shd + blk, shs + 2 * blk);
    }
    __syncthreads();
    if (!(MODE & 8)) bar_wait(bars);

    // down: a warp an output row, its K·6 half-blocks over the lanes
    for (int rr = w; rr < nd; rr += NW) {
        float acc = 0.f;
        if (!(MODE & 1)) {
            for (int e = lane; e < K_ * 2 * NBF_; e += 32) {
                const int k = e / (2 * NBF_), hb = e % (2 * NBF_), b = hb >> 1, hv = hb & 1;
                if (sslot[k] >= 0)
                    acc += swt[k] * dot_half(dn + k * DNS + rr * DN_ROW + b * 144, hv, shq + e * XSTR, shd + e * 4,
                                            shs + e * 8);
            }
        }
        for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
        if (lane == 0) Y[d0 + rr] = acc;
    }
}

// Q4_K GEMV y = W·x̂ (NB blocks a row): program c's rows [c·R/G, (c+1)·R/G) bulk-copied at its start, one
// mbarrier a row; a row's 2·NB half-blocks on 2·NB lanes (a warp 32 / (2·NB) rows at a time).
template <int NB>
__device__ __forceinline__ void gemv_body(const unsigned char* W, const int* XQ, const float* XD, const float* XS,
                                          float* Y, int R, int G) {
    constexpr int ROW = NB * 144, LPR = 2 * NB, RPW = 32 / LPR;
    const int c = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int r0 = (int)((long long)c * R / G), nr = (int)((long long)(c + 1) * R / G) - r0;
    unsigned char* rows = sm + OFF_GU + (NB > 8 ? 16 * XSTR * 4 : 0);  // o: 32 half-blocks of x̂
    const u32 bars = smem(sm);
    if (tid == 0) {
        for (int i = 0; i < nr; ++i) bar_init(bars + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    for (int i = tid; i < nr; i += NT) bulk_copy(smem(rows + i * ROW), W + (long long)(r0 + i) * ROW, ROW, bars + 8 * i);
    // x̂: 2·NB half-blocks (o needs 32: its words run on past OFF_XD, so scales and sums go after them)
    int* sxq = (int*)(sm + OFF_XQ);
    float* sxd = (float*)(sm + OFF_XQ + LPR * XSTR * 4);
    float* sxs = sxd + LPR * 4;
    for (int i = tid; i < LPR * 32; i += NT) sxq[(i >> 5) * XSTR + (i & 31)] = XQ[i];
    for (int i = tid; i < LPR * 4; i += NT) sxd[i] = XD[i];
    for (int i = tid; i < LPR * 8; i += NT) sxs[i] = XS[i];
    __syncthreads();
    const int hb = lane % LPR, b = hb >> 1, hv = hb & 1;
    for (int i0 = w * RPW; i0 < nr; i0 += NW * RPW) {
        const int i = i0 + lane / LPR;
        float v = 0.f;
        if (i < nr) {
            bar_wait(bars + 8 * i);
            v = dot_half(rows + i * ROW + b * 144, hv, sxq + hb * XSTR, sxd + hb * 4, sxs + hb * 8);
        }
        for (int o = LPR / 2; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
        if (hb == 0 && i < nr) Y[r0 + i] = v;
    }
}

extern "C" __global__ void __launch_bounds__(NT, 1)
    gemv_q(const unsigned char* __restrict__ W, const int* __restrict__ XQ, const float* __restrict__ XD,
           const float* __restrict__ XS, float* __restrict__ Y, int R, int G) {
    gemv_body<8>(W, XQ, XD, XS, Y, R, G);
}

extern "C" __global__ void __launch_bounds__(NT, 1)
    gemv_o(const unsigned char* __restrict__ W, const int* __restrict__ XQ, const float* __restrict__ XD,
           const float* __restrict__ XS, float* __restrict__ Y, int R, int G) {
    gemv_body<16>(W, XQ, XD, XS, Y, R, G);
}

// ---------------------------------------------------------------------------------------------------------------
// moe_splitf: the routed experts with no grid barrier. Program (j, k): pair k's h rows 32j … 32j + 31 — exactly
// one q8 block of ĥ, so it rounds its own h — then the matching 32 columns (sub-block j) of pair k's down
// matrix for all D rows, added into Y with float atomics. Its gate/up rows land in shared memory by cp.async
// (16-byte copies, all issued at its start); its down slice (a row's 16-byte header and the 32 quant bytes of the
// sub-block's chunk) is prefetched into L2 at its start too (PF), so both streams are in flight while it waits.
// CTA 0 zeroes YZ (the next call's Y). MODE 1: no dot products; 2: no atomics (timing only).
__device__ __forceinline__ void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void l2_prefetch(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

extern "C" __global__ void __launch_bounds__(NT)
    moe_splitf(const unsigned char* __restrict__ pool, const long long* __restrict__ slot, const int* __restrict__ XQ,
               const float* __restrict__ XD, const float* __restrict__ XS, const float* __restrict__ WT,
               float* __restrict__ Y, float* __restrict__ YZ, int go, int uo, int dno, int PF, int MODE) {
    const int j = blockIdx.x, k = blockIdx.y, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    if (j == 0 && k == 0)
        for (int i = tid; i < D_; i += NT) YZ[i] = 0.f;
    const long long s = slot[k];
    if (s < 0) return;
    unsigned char* gu = sm + OFF_GU;  // gate rows 0..31, then up rows 0..31
    float* sh = (float*)(sm + OFF_HD);  // h of the 32 rows, then its q8 scale and 16-sums (words at OFF_HQ)
    const unsigned char* gsrc = pool + s + go + (long long)(32 * j) * GU_ROW;
    const unsigned char* usrc = pool + s + uo + (long long)(32 * j) * GU_ROW;
    constexpr int N16 = 32 * GU_ROW / 16;  // 16-byte pieces a matrix
    for (int i = tid; i < 2 * N16; i += NT)
        cp16(smem(gu + 16 * i), (i < N16 ? gsrc : usrc - 16 * N16) + 16 * i);
    asm volatile("cp.async.commit_group;" ::: "memory");
    // sub-block j of the F columns: block b, chunk c (32 quant bytes), high nibbles when j is odd
    const int b = j >> 3, c4 = (j & 7) >> 1, hi = j & 1;
    const unsigned char* drow = pool + s + dno + b * 144;
    if (PF)
        for (int r = tid; r < D_; r += NT) {
            l2_prefetch(drow + (long long)r * DN_ROW);
            l2_prefetch(drow + (long long)r * DN_ROW + 16 + 32 * c4);
        }
    stage_x(sm, XQ, XD, XS, 16);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();

    const int* sxq = (const int*)(sm + OFF_XQ);
    const float* sxd = (const float*)(sm + OFF_XD);
    const float* sxs = (const float*)(sm + OFF_XS);
    {
        const int mat = lane >> 4, hb = lane & 15, bb = hb >> 1, hv = hb & 1;
        for (int i = w; i < 32; i += NW) {
            float v = 0.f;
            if (!(MODE & 1))
                v = dot_half(gu + mat * (32 * GU_ROW) + i * GU_ROW + bb * 144, hv, sxq + hb * XSTR, sxd + hb * 4,
                             sxs + hb * 8);
            const float h = swiglu_lanes(v);
            if (lane == 0) sh[i] = h;
        }
    }
    __syncthreads();
    // ĥ: the 32 values through triton_q8's rule (warp 0), as 8 words, the scale and the sum d·Σq
    int* hq = (int*)(sm + OFF_HQ);
    if (w == 0) q8_round32(sh[lane], lane, hq, sh + 32, sh + 34);
    __syncthreads();
    int4 x0 = ((const int4*)hq)[0], x1 = ((const int4*)hq)[1];
    const float dh = sh[32], sumh = sh[34] + sh[35], wk = WT[k];
    // each thread: rows tid, tid + NT, … ; a row: header (d, dmin, 6-bit scale and min of sub-block j & 7) and the
    // chunk's 32 quant bytes (this sub-block's nibbles)
    constexpr int RPT = D_ / NT;
#pragma unroll 4
    for (int q = 0; q < RPT; ++q) {
        const int r = tid + q * NT;
        const unsigned char* p = drow + (long long)r * DN_ROW;
        const uint4 hdr = __ldcg((const uint4*)p);
        const uint4 qa = __ldcg((const uint4*)(p + 16 + 32 * c4)), qz = __ldcg((const uint4*)(p + 32 + 32 * c4));
        float part = 0.f;
        if (!(MODE & 1)) {
            const int sb = j & 7;  // get_scale_min_k4
            const u32 sc_b = sb < 4 ? (hdr.y >> (8 * sb)) & 0x3F
                                    : ((hdr.w >> (8 * (sb - 4))) & 0x0F) | (((hdr.y >> (8 * (sb - 4))) >> 2) & 0x30);
            const u32 m_b = sb < 4 ? (hdr.z >> (8 * sb)) & 0x3F
                                   : ((hdr.w >> (8 * (sb - 4) + 4)) & 0x0F) | (((hdr.z >> (8 * (sb - 4))) >> 2) & 0x30);
            const int sft = 4 * hi;
            int acc = __dp4a((int)((qa.x >> sft) & 0x0F0F0F0Fu), x0.x, 0);
            acc = __dp4a((int)((qa.y >> sft) & 0x0F0F0F0Fu), x0.y, acc);
            acc = __dp4a((int)((qa.z >> sft) & 0x0F0F0F0Fu), x0.z, acc);
            acc = __dp4a((int)((qa.w >> sft) & 0x0F0F0F0Fu), x0.w, acc);
            acc = __dp4a((int)((qz.x >> sft) & 0x0F0F0F0Fu), x1.x, acc);
            acc = __dp4a((int)((qz.y >> sft) & 0x0F0F0F0Fu), x1.y, acc);
            acc = __dp4a((int)((qz.z >> sft) & 0x0F0F0F0Fu), x1.z, acc);
            acc = __dp4a((int)((qz.w >> sft) & 0x0F0F0F0Fu), x1.w, acc);
            const float d = h2f(hdr.x & 0xFFFF), dmin = h2f(hdr.x >> 16);
            part = wk * (d * (float)(acc * (int)sc_b) * dh - dmin * (float)m_b * sumh);
        } else {
            part = (float)(hdr.x ^ qa.x ^ qz.w);
        }
        if (!(MODE & 2))
            atomicAdd(Y + r, part);
        else if (part == 12345.f)
            Y[r] = part;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// moe_plain: moe_fused's one launch and grid barrier with the gate/up bytes in flight first, as plain loads.
// Program c = 24·k + j (G = 192, all resident: ≤ 2 an SM) owns pair k's h rows 32j … 32j + 31 — one q8 block,
// which it rounds itself into ĥ (global) before the barrier — and output rows [c·D/G, (c+1)·D/G).
//   1. every lane loads its gate/up half-blocks of all its warp's rows into registers (16-byte loads, issued
//      before anything waits), then the program's down rows of all 8 experts go to shared memory by cp.async;
//   2. h from the registers (a warp a row: lanes 0–15 the gate's half-blocks, 16–31 the up's), ĥ block c;
//   3. grid barrier; all 192 ĥ blocks into shared memory (one L2 round trip); the down from shared memory.
// MODE bits (timing only): 1 no dot products, 2 no grid barrier.
#define RPW (32 / NW)  // gate/up rows a warp

extern "C" __global__ void __launch_bounds__(NT, 2)
    moe_plain(const unsigned char* __restrict__ pool, const long long* __restrict__ slot, const int* __restrict__ XQ,
              const float* __restrict__ XD, const float* __restrict__ XS, const float* __restrict__ WT,
              int* HQg, float* HDg, float* HSg, float* __restrict__ Y, u32* sync, int go, int uo, int dno, int MODE) {
    const int G = gridDim.x, c = blockIdx.x, k = c / 24, j = c % 24, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int MAXD = (D_ + G - 1) / G, d0 = c * D_ / G, nd = (c + 1) * D_ / G - d0;
    const int DNS = MAXD * DN_ROW + 48;
    unsigned char* dn = sm + OFF_GU;
    const long long s = slot[k];
    // 1. the gate/up half-blocks of this warp's rows, all loads in flight
    const int mat = lane >> 4, hb = lane & 15, b = hb >> 1, hv = hb & 1;
    uint4 wv[RPW][5];
    if (s >= 0) {
        const unsigned char* base = pool + s + (mat ? uo : go) + b * 144;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const uint4* p = (const uint4*)(base + (long long)(32 * j + w + NW * r) * GU_ROW);
            wv[r][0] = __ldcs(p);
#pragma unroll
            for (int q = 0; q < 4; ++q) wv[r][1 + q] = __ldcs(p + 1 + 4 * hv + q);
        }
    }
    // then the down rows of all 8 experts into shared memory
    for (int i = tid; i < K_ * nd * (DN_ROW / 16); i += NT) {
        const int e = i / (nd * (DN_ROW / 16)), o = i % (nd * (DN_ROW / 16));
        const long long se = slot[e];
        if (se >= 0) cp16(smem(dn + e * DNS + 16 * o), pool + se + dno + (long long)d0 * DN_ROW + 16 * o);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    stage_x(sm, XQ, XD, XS, 16);
    const long long* sslot = stage_routes(slot, WT);
    const float* swt = (const float*)(sm + 576);
    float* sh = (float*)(sm + 640);  // h of the 32 rows
    __syncthreads();
    // 2. h, then ĥ block c
    const int* sxq = (const int*)(sm + OFF_XQ);
    const float* sxd = (const float*)(sm + OFF_XD);
    const float* sxs = (const float*)(sm + OFF_XS);
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        float v = 0.f;
        if (s >= 0 && !(MODE & 1)) v = dot_half_v(wv[r][0], &wv[r][1], hv, sxq + hb * XSTR, sxd + hb * 4, sxs + hb * 8);
        const float h = swiglu_lanes(v);
        if (lane == 0) sh[w + NW * r] = s >= 0 ? h : 0.f;
    }
    __syncthreads();
    if (w == 0) q8_round32(sh[lane], lane, HQg + 8 * c, HDg + c, HSg + 2 * c);
    if (!(MODE & 2)) grid_sync(sync, (u32)G);
    // 3. every ĥ block into shared memory (pair k's sub-block sb: half-block k·6 + sb / 4, words XSTR apart)
    int* shq = (int*)(sm + OFF_HQ);
    float* shd = (float*)(sm + OFF_HD);
    float* shs = (float*)(sm + OFF_HS);
    for (int i = tid; i < 192 * 8; i += NT) {
        const int blk = i >> 3, half = (blk / 24) * 6 + (blk % 24) / 4;
        shq[half * XSTR + ((blk % 24) % 4) * 8 + (i & 7)] = __ldcg(HQg + i);
    }
    for (int i = tid; i < 192; i += NT) shd[i] = __ldcg(HDg + i);
    for (int i = tid; i < 384; i += NT) shs[i] = __ldcg(HSg + i);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    for (int rr = w; rr < nd; rr += NW) {
        float acc = 0.f;
        if (!(MODE & 1))
            for (int e = lane; e < K_ * 2 * NBF_; e += 32) {
                const int ke = e / (2 * NBF_), h6 = e % (2 * NBF_);
                if (sslot[ke] >= 0)
                    acc += swt[ke] * dot_half(dn + ke * DNS + rr * DN_ROW + (h6 >> 1) * 144, h6 & 1, shq + e * XSTR,
                                              shd + e * 4, shs + e * 8);
            }
        for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
        if (lane == 0) Y[d0 + rr] = acc;
    }
}
