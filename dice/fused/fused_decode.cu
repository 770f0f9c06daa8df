// The batch-1 decoding step as one persistent kernel (dice/fused_decode.py explains the design).
// Compile-time sizes arrive as #defines written by FusedDecoder (the model's shape, the token rows,
// the stage width); what depends on the cache's length (attention's chunk size, the ring depth) is
// a launch argument, so one compilation serves every cache. No CUDA headers are needed.
typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define CT (CW * 32)                   // consumer threads
#define STAGE (16 * KCMAX * 2)         // bytes of a ring stage: 16 weight rows x KCMAX columns
#define NSTAGE n_stage                 // ring stages (launch argument)
#define SUB n_sub                      // key slots per attention piece (launch argument)
#define SUB16 ((n_sub + 15) & ~15)     // its buffers' rows: whole 16-key mma tiles
__shared__ int n_stage, n_sub;
__shared__ int tok_pos[NT];            // the new tokens' positions (rows of the RoPE tables)
#define NTAB 10                        // per-layer pointer table: ln1 qkv qn kn o ln2 gu down kc vc
#define TIMEOUT 4000000000LL           // clock cycles (~2 s) before a wait gives up with a trap
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float rnd(float f) { return bf2f(f2bf(f)); }   // round through bf16
__device__ __forceinline__ u32 saddr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
__device__ __forceinline__ long long globaltimer() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Built with TRACE (FusedDecoder's `detail` runs only), consumer thread 0 and the producer record
// where each phase's time goes in 8 slots per (block, phase) (dice.bench fused reads them):
// matrix phases: 0 prologue end, 1 first stage ready, 2 last stage ready (global timer, ns),
// 3 clock cycles thread 0 waited for stages, 4 / 5 the producer's first / last copy of the phase
// (ns), 6 the phase's clock cycles, 7 stages; attention: 0 queries and new keys done, 1 scores to
// value sums done, 2 ticket taken (ns), 3 / 4 / 5 clock cycles waiting for keys and values, in the
// scores, in the softmax and value product (summed over pieces), 6 the phase's clock cycles.
#ifdef TRACE
__shared__ long long* detail;
// This block's 8 detail slots for phase p: behind the trace's 2 slots per (block, phase)
__device__ __forceinline__ long long* detail_slots(long long* trace, int p, int phase_hi) {
    return trace + (gridDim.x * (phase_hi + 1)) * 2 + (blockIdx.x * (phase_hi + 1) + p) * 8;
}
#define DETAIL(i, v) do { if (threadIdx.x == 0 && detail) detail[i] = (v); } while (0)
#define DETAIL_ADD(i, v) do { if (threadIdx.x == 0 && detail) detail[i] += (v); } while (0)
#define CLOCK() clock64()
#else
#define DETAIL(i, v) do { } while (0)
#define DETAIL_ADD(i, v) do { (void)(v); } while (0)
#define CLOCK() 0LL
#endif
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" :: "n"(CT) : "memory"); }

__device__ __forceinline__ void mbar_init(u64* b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(saddr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* b, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(saddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* b, u32 parity) {
    long long t0 = clock64();
    for (;;) {
        u32 done;
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(saddr(b)), "r"(parity) : "memory");
        if (done) return;
        if (clock64() - t0 > TIMEOUT) __trap();
    }
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(bar)) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(saddr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    // C[16x8] += A[16x16] B[16x8] (bf16 in, fp32 accumulate), PTX's fragment layout: lane (g, t) holds
    // A[g][2t, 2t+1] (a0), A[g+8][..] (a1), A[g][2t+8, 2t+9] (a2), A[g+8][..] (a3); B[2t, 2t+1][g] (b0),
    // B[2t+8, 2t+9][g] (b1); C[g][2t, 2t+1] (c0, c1) and C[g+8][..] (c2, c3)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float* c, uint4 a_lo, uint4 a_hi, u32 b0, u32 b1, int half) {
    // `mma16816` on 16-byte loads: lane (g, t) holds A rows g and g+8 and B column g at the reduction
    // indices 8t .. 8t+7 of a 32-wide chunk; half 0 takes 8t .. 8t+3, half 1 takes 8t+4 .. 8t+7.
    // Both operands use the same order of the reduction index, which a dot product may permute.
    if (half) mma16816(c, a_lo.z, a_hi.z, a_lo.w, a_hi.w, b0, b1);
    else mma16816(c, a_lo.x, a_hi.x, a_lo.y, a_hi.y, b0, b1);
}
// Four 8x8 bf16 matrices, transposed: lane l gives the address of row l % 8 of matrix l / 8 and
// receives, of matrix i, the elements [2t][g] and [2t+1][g] in r[i] (an mma B fragment).
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr(row)) : "memory");
}

// The forward as a list of phases; producer and consumers walk the same list.
enum { QKV = 0, ATTN = 1, OPROJ = 2, UP = 3, DOWN = 4, PHASES = 5 };
struct Matrix { const bf16* w; int n; int k; int parts; };   // parts 2: gate rows i, up rows INTER + i

__device__ __forceinline__ Matrix phase_matrix(const u64* table, const bf16* lm_w, int p) {
    int layer = p / PHASES, kind = p % PHASES;
    const u64* row = table + layer * NTAB;
    Matrix m = {0, 0, 0, 1};
    if (layer == LAYERS) { m.w = lm_w; m.n = VOCAB_TILED; m.k = HID; }   // zero rows pad to 16
    else if (kind == QKV) { m.w = (const bf16*)row[1]; m.n = NQKV; m.k = HID; }
    else if (kind == OPROJ) { m.w = (const bf16*)row[4]; m.n = HID; m.k = H * D; }
    else if (kind == UP) { m.w = (const bf16*)row[6]; m.n = INTER; m.k = HID; m.parts = 2; }
    else if (kind == DOWN) { m.w = (const bf16*)row[7]; m.n = HID; m.k = INTER; }
    return m;
}
__device__ __forceinline__ int kchunk(int k) { return k < KCMAX ? k : KCMAX; }   // k % KCMAX == 0 or k < KCMAX
// This block's first tile of a phase whose tiles are dealt round-robin, block `offset % grid` first.
__device__ __forceinline__ int first_tile(int offset) {
    return (blockIdx.x - offset % gridDim.x + gridDim.x) % gridDim.x;
}

// A position in the sequence of ring stages of this block: phase p, tile, part, and k0 (a stage is
// rows tile*16 .. +15 of part `part`, columns k0 .. k0 + kc). Tiles are dealt round-robin over the
// blocks, continuing from phase to phase (`offset` counts the tiles of the phases before p).
struct Cursor { int p, tile, part, k0, kc, offset; Matrix m; };

__device__ void seek_phase(Cursor& c, const u64* table, const bf16* lm_w, int phase_lo, int phase_hi) {
    for (; c.p < phase_hi; ++c.p) {
        c.m = phase_matrix(table, lm_w, c.p);
        if (c.m.w && c.p >= phase_lo) {
            c.tile = first_tile(c.offset);
            c.part = c.k0 = 0;
            c.kc = kchunk(c.m.k);
            if (c.tile < c.m.n / 16) return;
        }
        if (c.m.w) c.offset += c.m.n / 16;
    }
}
__device__ void advance(Cursor& c, const u64* table, const bf16* lm_w, int phase_lo, int phase_hi) {
    if ((c.k0 += c.kc) < c.m.k) return;
    c.k0 = 0;
    if (++c.part < c.m.parts) return;
    c.part = 0;
    if ((c.tile += gridDim.x) < c.m.n / 16) return;
    c.offset += c.m.n / 16;
    ++c.p;
    seek_phase(c, table, lm_w, phase_lo, phase_hi);
}
// tiled layout: [tile][k0 / kc][16][kc], so a stage is one contiguous copy
__device__ __forceinline__ const bf16* stage_src(const Cursor& c) {
    return c.m.w + (long long)(c.part * c.m.n + c.tile * 16) * c.m.k + 16 * c.k0;
}

// Weight producer (one thread): streams every stage of this block into the ring, waiting only for
// free stages, never for activations, so the next phase's weights arrive while the consumers wait
// at a grid barrier or run attention.
__device__ void produce(const u64* table, const bf16* lm_w, int phase_lo, int phase_hi, char* ring, u64* full,
                        u64* empty, long long* trace) {
    Cursor c = {0, 0, 0, 0, 0, 0, {0, 0, 0, 1}};
    seek_phase(c, table, lm_w, phase_lo, phase_hi);
    for (int it = 0; c.p < phase_hi; ++it) {
        int st = it % NSTAGE;
        mbar_wait(&empty[st], ((it / NSTAGE) & 1) ^ 1);
        mbar_expect_tx(&full[st], 16 * c.kc * 2);
        bulk_copy(ring + st * STAGE, stage_src(c), 16 * c.kc * 2, &full[st]);
#ifdef TRACE
        if (trace) {
            long long* d = detail_slots(trace, c.p, phase_hi);
            if (!d[4]) d[4] = globaltimer();
            d[5] = globaltimer();
        }
#endif
        advance(c, table, lm_w, phase_lo, phase_hi);
    }
}

// x (shared) = rmsnorm(h) * w, rounded as the layer-by-layer bf16 model rounds; rows >= T are zero.
// A warp per row holds its row in registers, so all its loads are in flight at once. With `ids`
// (the first layer), the rows are the tokens' embeddings, and block 0 also writes them to h.
#define HV ((HID / 8 + 31) / 32)     // 16-byte vectors of a hidden row per lane
__device__ void load_normed(bf16* h, const bf16* w, int T, float eps, char* xs, const long long* ids = 0,
                            const bf16* embed = 0) {
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int t = warp; t < NT; t += CW) {
        uint4* dst = (uint4*)(xs + t * (HID * 2 + 64));
        const uint4* src = (const uint4*)(ids && t < T ? embed + ids[t] * HID : h + t * HID);
        uint4 v[HV], wv[HV];
        float ss = 0.f;
        for (int j = 0; j < HV; ++j) {      // the row and the norm's weights: every load before any use
            int k = lane + 32 * j;
            v[j] = t < T && k < HID / 8 ? __ldcg(src + k) : make_uint4(0, 0, 0, 0);
            wv[j] = k < HID / 8 ? __ldg((const uint4*)w + k) : make_uint4(0, 0, 0, 0);
        }
        if (ids && blockIdx.x == 0 && t < T)
            for (int j = 0; j < HV; ++j)
                if (lane + 32 * j < HID / 8) ((uint4*)(h + t * HID))[lane + 32 * j] = v[j];
        for (int j = 0; j < HV; ++j) {
            const bf16* e = (const bf16*)&v[j];
            for (int i = 0; i < 8; ++i) ss += bf2f(e[i]) * bf2f(e[i]);
        }
        float rstd = rsqrtf(warp_sum(ss) / HID + eps);
        for (int j = 0; j < HV; ++j) {
            int k = lane + 32 * j;
            if (k >= HID / 8) break;
            uint4 out;
            const bf16* e = (const bf16*)&v[j];
            const bf16* we = (const bf16*)&wv[j];
            bf16* o = (bf16*)&out;
            for (int i = 0; i < 8; ++i) o[i] = f2bf(rnd(bf2f(e[i]) * rstd) * bf2f(we[i]));
            dst[k] = t < T ? out : make_uint4(0, 0, 0, 0);
        }
    }
}
__device__ void load_rows(const bf16* src, int K, int T, char* xs) {
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int t = warp; t < NT; t += CW) {
        uint4* dst = (uint4*)(xs + t * (K * 2 + 64));
        const uint4* s = (const uint4*)(src + (long long)t * K);
        for (int k0 = 0; k0 < K / 8; k0 += 32 * 8) {        // eight loads in flight per lane
            uint4 v[8];
            for (int j = 0; j < 8; ++j) {
                int k = k0 + lane + 32 * j;
                v[j] = t < T && k < K / 8 ? __ldcg(s + k) : make_uint4(0, 0, 0, 0);
            }
            for (int j = 0; j < 8; ++j)
                if (k0 + lane + 32 * j < K / 8) dst[k0 + lane + 32 * j] = v[j];
        }
    }
}

// A greedy choice in the making: the largest logit m seen, its first vocabulary row, and the sum of
// exp(l - m) over the logits seen (choose_greedy). Combining two is associative, so threads and blocks combine
// theirs in any order; equal maxima keep the lower row (the first index, as `max` gives it).
struct Best { float m, s; int row; };
__device__ __forceinline__ Best combine(Best a, Best b) {
    float m = fmaxf(a.m, b.m);
    if (m == NEG_INF) return a;
    float s = (a.m == NEG_INF ? 0.f : a.s * expf(a.m - m)) + (b.m == NEG_INF ? 0.f : b.s * expf(b.m - m));
    return {m, s, a.m > b.m ? a.row : b.m > a.m ? b.row : min(a.row, b.row)};
}
// One more logit l at `row` (rows arrive in increasing order, so a tie keeps the earlier row); the
// first time, m = -inf and s = 0 give s = 0 * exp(-inf) + 1.
__device__ __forceinline__ void fold(Best& b, float l, int row) {
    if (l > b.m) { b.s = b.s * __expf(b.m - l) + 1.f; b.m = l; b.row = row; }
    else b.s += __expf(l - b.m);
}
__device__ __forceinline__ Best warp_combine(Best b) {
    for (int o = 16; o; o >>= 1) {
        Best other = {__shfl_xor_sync(0xffffffff, b.m, o), __shfl_xor_sync(0xffffffff, b.s, o),
                      __shfl_xor_sync(0xffffffff, b.row, o)};
        b = combine(b, other);
    }
    return b;
}

// One matrix phase: out rows of this block's tiles. epi 0 store, 1 residual add, 2 silu(gate)*up,
// 3 logits of token rows >= lf.
__device__ void consume(Matrix m, int offset, int epi, bf16* out, int T, int lf, const char* xs,
                        const char* ring, u64* full, u64* empty, float* red, int& it) {
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    int kc = kchunk(m.k), tiles = m.n / 16;
    for (int tile = first_tile(offset); tile < tiles; tile += gridDim.x) {
        float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        // the residual epilogue's old value, loaded now so that its latency hides behind the stages
        int e = threadIdx.x, l = e >> 2, i = e & 3;
        int row = tile * 16 + (l >> 2) + (i >> 1) * 8, tok = (l & 3) * 2 + (i & 1);
        float old = epi == 1 && e < 128 && tok < T ? bf2f(__ldcg(out + tok * m.n + row)) : 0.f;
        for (int part = 0; part < m.parts; ++part)
            for (int k0 = 0; k0 < m.k; k0 += kc, ++it) {
                int st = it % NSTAGE;
#ifdef TRACE
                long long w0 = clock64();
#endif
                mbar_wait(&full[st], (it / NSTAGE) & 1);
#ifdef TRACE
                if (threadIdx.x == 0 && detail) {
                    if (!detail[7]) detail[1] = globaltimer();
                    detail[2] = globaltimer(); detail[3] += clock64() - w0; detail[7] += 1;
                }
#endif
                const char* base = ring + st * STAGE;
                for (int q = warp; q < kc / 32; q += CW) {
                    // 16-byte piece c of row r sits at c ^ (4 * (r & 1)): rows g and g + 1 hit other banks
                    int piece = (q * 4 + t4) ^ ((g & 1) * 4);
                    uint4 wlo = *(const uint4*)(base + g * kc * 2 + piece * 16);
                    uint4 whi = *(const uint4*)(base + (g + 8) * kc * 2 + piece * 16);
                    uint4 xv = g < NT ? *(const uint4*)(xs + g * (m.k * 2 + 64) + (k0 + q * 32) * 2 + t4 * 16)
                                      : make_uint4(0, 0, 0, 0);
                    mma(acc[part], wlo, whi, xv.x, xv.y, 0);
                    mma(acc[part], wlo, whi, xv.z, xv.w, 1);
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[st]);
            }
        consumers_sync();                              // the previous tile's epilogue has read `red`
        for (int part = 0; part < m.parts; ++part)
            for (int j = 0; j < 4; ++j) red[((warp * 2 + part) * 32 + lane) * 4 + j] = acc[part][j];
        consumers_sync();
        if (e < 128 && tok < T) {                       // element e of the 16 x 8 tile, mma C layout
            float y = 0.f, u = 0.f;
            for (int w = 0; w < CW; ++w) {
                y += red[(w * 2) * 128 + e];
                if (m.parts == 2) u += red[(w * 2 + 1) * 128 + e];
            }
            if (epi == 0) out[tok * m.n + row] = f2bf(y);
            else if (epi == 1) out[tok * m.n + row] = f2bf(old + rnd(y));
            else if (epi == 2) {
                float gte = rnd(y);
                out[tok * m.n + row] = f2bf(rnd(gte / (1.f + __expf(-gte))) * rnd(u));
            } else if (tok >= lf && row < VOCAB) out[(long long)(tok - lf) * VOCAB + row] = f2bf(y);
        }
    }
}

// RMSNorm over one head's D values, then rotate-half RoPE at `position` (cosb / sinb: the RoPE
// tables, a row of D per position) by a warp: DL = D / 32 values per lane, so a value's rotation
// partner d +- D/2 sits 16 lanes away. All loads are issued first.
#define DL (D / 32)
__device__ void norm_rope(const bf16* src, const bf16* w, const bf16* cosb, const bf16* sinb, int position, float eps,
                          float* out) {
    int lane = threadIdx.x & 31;
    float x[DL], wv[DL], cs[DL], sn[DL], ss = 0.f;
    for (int e = 0; e < DL; ++e) {
        int d = lane * DL + e;
        x[e] = bf2f(__ldcg(src + d)); wv[e] = bf2f(w[d]); cs[e] = bf2f(cosb[position * D + d]);
        sn[e] = bf2f(sinb[position * D + d]);
    }
    for (int e = 0; e < DL; ++e) ss += x[e] * x[e];
    float rstd = rsqrtf(warp_sum(ss) / D + eps);
    for (int e = 0; e < DL; ++e) x[e] = rnd(rnd(x[e] * rstd) * wv[e]);
    for (int e = 0; e < DL; ++e) {
        float partner = __shfl_xor_sync(0xffffffff, x[e], 16);
        out[e] = rnd(rnd(x[e] * cs[e]) + rnd((lane < 16 ? -partner : partner) * sn[e]));
    }
}

// Element (row, d) of a piece's key or value rows: 16-byte chunk c of row r sits at c ^ (r % 8), so
// the eight rows an ldmatrix reads (or a score load's eight key rows) fall on distinct bank groups.
#define SWZ (D / 8 < 8 ? D / 8 - 1 : 7)
__device__ __forceinline__ int kv_at(int row, int d) { return row * D + (((d >> 3) ^ (row & SWZ)) << 3) + (d & 7); }

// `count` committed keys and values of one KV head from slot `from` into a piece's buffers (cp.async).
__device__ void load_kv(const bf16* kc, const bf16* vc, int from, int count, bf16* ks) {
    for (int i = threadIdx.x; i < count * D / 8; i += CT) {
        int at = kv_at(i / (D / 8), i % (D / 8) * 8);
        cp_async16(ks + at, kc + (long long)from * D + i * 8);
        cp_async16(ks + SUB16 * D + at, vc + (long long)from * D + i * 8);
    }
}
// Block b < NITEMS's attention work item: KV head g = b / NCH and chunk c = b % NCH, the key slots
// lo .. hi - 1: a head's NCH chunks split length + T + SLACK slots evenly and end at length + T, so
// the last, which holds the new tokens and also norms and writes their keys, gets SLACK fewer (in a
// short cache, chunks past the end are empty and the new tokens may start an earlier one).
struct Chunk { int g, c, lo, hi; };
__device__ __forceinline__ Chunk attention_chunk(int length, int T) {
    const int NCH = NITEMS / HKV;
    int total = length + T, cs = (total + SLACK + NCH - 1) / NCH, c = blockIdx.x % NCH;
    return {(int)blockIdx.x / NCH, c, c * cs, min(c * cs + cs, total)};
}
// The committed (cached) slots of the piece of at most SUB slots from `from` below `hi`.
__device__ __forceinline__ int committed_in_piece(int from, int hi, int length) {
    return max(min(from + SUB, min(hi, length)) - from, 0);
}
// The first piece of this block's attention chunk (see `attention`), issued at the start of the
// layer's QKV phase so that it arrives while that phase runs.
__device__ void prefetch_kv(const u64* row, int length, int T, int max_len, char* scratch) {
    if (blockIdx.x >= NITEMS) return;
    auto [g, c, lo, hi] = attention_chunk(length, T);
    load_kv((const bf16*)row[8] + (long long)g * max_len * D, (const bf16*)row[9] + (long long)g * max_len * D, lo,
            committed_in_piece(lo, hi, length), (bf16*)scratch);
}

// True in the block that takes the last of `count` tickets from `counter`, once every block before
// it has published its writes. bar.sync orders every thread's writes before thread 0's release,
// whose acquire side orders the last block's loads (CUTLASS's GenericBarrier pattern; no per-thread
// fences).
__device__ bool last_ticket(int* counter, int count) {
    __shared__ int last;
    consumers_sync();
    if (threadIdx.x == 0) {
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        last = old == count - 1;
    }
    consumers_sync();
    return last;
}

// Attention of the T new tokens (folded GQA rows r = (head - g*G) * T + t) over the cache's `length`
// committed keys plus themselves (block-causal among the new ones). Work item (KV head g, chunk c)
// takes a contiguous range of key slots and streams it through shared memory SUB keys at a time
// (online softmax: a running max and sum per row); the head's last item to finish merges the
// partial softmaxes (flash-decoding). The item whose range holds the new slots writes their k/v to
// the cache.
__device__ void attention(const u64* row, const bf16* qkv, bf16* att, float* part_o, float* part_ml,
                          int* tickets, const bf16* cosb, const bf16* sinb, int length, int T, int max_len,
                          float eps, float scale, float* scratch) {
    const int G = H / HKV, NCH = NITEMS / HKV;
    if (blockIdx.x >= NITEMS) return;
    auto [g, c, lo, hi] = attention_chunk(length, T);
    int R = G * T, warp = threadIdx.x / 32, lane = threadIdx.x & 31, tid = threadIdx.x;
    bf16* kc = (bf16*)row[8] + (long long)g * max_len * D;
    bf16* vc = (bf16*)row[9] + (long long)g * max_len * D;
    bf16* ks = (bf16*)scratch;                   // [SUB16][D] keys of the current piece (the first: prefetch_kv)
    bf16* vs = ks + SUB16 * D;                   // [SUB16][D] and values (both in kv_at order)
    bf16* kn = vs + SUB16 * D;                   // [NT][D] new keys (normed, rotated) of a later piece
    bf16* vn = kn + NT * D;                      // [NT][D] and values
    bf16* qs = vn + NT * D;                      // [RMAX][D] queries (bf16 exactly: norm_rope rounds)
    bf16* P = qs + RMAX * D;                     // [RMAX][SUB16] probabilities, rounded for the value mma
    float* S = (float*)(P + RMAX * SUB16);       // [RMAX][SUB16] scores
    float* run_m = S + RMAX * SUB16;             // [RMAX] running max, sum, and the last rescale factor
    float* run_l = run_m + RMAX;
    float* rescale = run_l + RMAX;
    for (int r = warp; r < R; r += CW) {
        float q[DL];
        norm_rope(qkv + (r % T) * NQKV + (g * G + r / T) * D, (const bf16*)row[2], cosb, sinb, tok_pos[r % T], eps, q);
        for (int e = 0; e < DL; ++e) qs[r * D + lane * DL + e] = f2bf(q[e]);
    }
    for (int s = max(lo, length) + warp; s < hi; s += CW) {
        int j = s - length;
        float k[DL];
        norm_rope(qkv + j * NQKV + (H + g) * D, (const bf16*)row[3], cosb, sinb, tok_pos[j], eps, k);
        for (int e = 0; e < DL; ++e) {
            int d = lane * DL + e;
            bf16 kb = f2bf(k[e]), vb = __ldcg(qkv + j * NQKV + (H + HKV + g) * D + d);
            kc[(long long)s * D + d] = kb; vc[(long long)s * D + d] = vb;
            if (s - lo < SUB) { ks[kv_at(s - lo, d)] = kb; vs[kv_at(s - lo, d)] = vb; }   // the first piece
            else { kn[j * D + d] = kb; vn[j * D + d] = vb; }                               // a later one
        }
    }
    DETAIL(0, globaltimer());
    for (int r = tid; r < RMAX; r += CT) { run_m[r] = NEG_INF; run_l[r] = 0.f; }
    // value product: warp w owns output columns 16w .. 16w+15 of every row tile (two mma n-tiles)
    const int MT = (RMAX + 15) / 16;
    int gq = lane >> 2, t4 = lane & 3, d0 = warp * 16;
    float acc[MT][2][4] = {};
    for (int from = lo; from < hi; from += SUB) {
        long long t0 = CLOCK();
        int n = min(SUB, hi - from), n_old = committed_in_piece(from, hi, length), n16 = (n + 15) & ~15;
        if (from != lo) {
            consumers_sync();      // the previous piece's value product has read ks / vs; kn / vn are written
            load_kv(kc, vc, from, n_old, ks);
            for (int i = tid; i < (n - n_old) * D; i += CT) {  // this piece's new keys, from kn / vn
                int slot = from + n_old + i / D, d = i % D;
                ks[kv_at(slot - from, d)] = kn[(slot - length) * D + d];
                vs[kv_at(slot - from, d)] = vn[(slot - length) * D + d];
            }
        }
        for (int i = tid; i < (n16 - n) * D / 8; i += CT)    // the last tile's unused values: 0 x 0, not 0 x NaN
            ((uint4*)(vs + n * D))[i] = make_uint4(0, 0, 0, 0);
        cp_async_wait_all();
        consumers_sync();
        long long t1 = CLOCK();
        DETAIL_ADD(3, t1 - t0);
        // scores: a warp per 16-key tile, keys as the mma's rows and query rows as its columns
        for (int kt = warp; kt * 16 < n; kt += CW)
            for (int c0 = 0; c0 < R; c0 += 8) {
                float sc[4] = {0.f, 0.f, 0.f, 0.f};
                for (int q = 0; q < D / 32; ++q) {
                    uint4 klo = *(const uint4*)(ks + kv_at(kt * 16 + gq, q * 32 + t4 * 8));
                    uint4 khi = *(const uint4*)(ks + kv_at(kt * 16 + gq + 8, q * 32 + t4 * 8));
                    uint4 qv = c0 + gq < R ? *(const uint4*)(qs + (c0 + gq) * D + q * 32 + t4 * 8)
                                           : make_uint4(0, 0, 0, 0);
                    mma(sc, klo, khi, qv.x, qv.y, 0);
                    mma(sc, klo, khi, qv.z, qv.w, 1);
                }
                for (int e = 0; e < 4; ++e) {
                    int i = kt * 16 + gq + (e >> 1) * 8, r = c0 + 2 * t4 + (e & 1), s = from + i;
                    bool visible = s < length || s / BS <= (length + r % T) / BS;
                    if (i < n && r < R) S[r * SUB16 + i] = visible ? sc[e] * scale : NEG_INF;
                }
            }
        consumers_sync();
        long long t2 = CLOCK();
        DETAIL_ADD(4, t2 - t1);
        for (int r = warp; r < R; r += CW) {
            float m = run_m[r];
            for (int i = lane; i < n; i += 32) m = fmaxf(m, S[r * SUB16 + i]);
            m = warp_max(m);
            float l = 0.f;
            for (int i = lane; i < n16; i += 32) {
                float p = m == NEG_INF || i >= n ? 0.f : __expf(S[r * SUB16 + i] - m);
                P[r * SUB16 + i] = f2bf(p);
                l += p;
            }
            l = warp_sum(l);
            if (lane == 0) {
                float f = run_m[r] == NEG_INF ? 0.f : __expf(run_m[r] - m);
                rescale[r] = f;
                run_l[r] = run_l[r] * f + l;
                run_m[r] = m;
            }
        }
        consumers_sync();
        if (d0 < D) {
            for (int mt = 0; mt < MT; ++mt)
                for (int e = 0; e < 4; ++e) {
                    int r = mt * 16 + gq + (e >> 1) * 8;
                    float f = r < R ? rescale[r] : 0.f;
                    acc[mt][0][e] *= f; acc[mt][1][e] *= f;
                }
            for (int kt = 0; kt * 16 < n; ++kt) {
                u32 b[4];                // values [16 keys][16 columns] as two B fragments
                ldmatrix_x4_trans(b, vs + kv_at(kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, d0 + (lane >> 4) * 8));
                for (int mt = 0; mt < MT; ++mt) {
                    int r0 = mt * 16 + gq;
                    const bf16* p = P + r0 * SUB16 + kt * 16 + 2 * t4;
                    u32 a0 = r0 < R ? *(const u32*)p : 0u, a2 = r0 < R ? *(const u32*)(p + 8) : 0u;
                    u32 a1 = r0 + 8 < R ? *(const u32*)(p + 8 * SUB16) : 0u;
                    u32 a3 = r0 + 8 < R ? *(const u32*)(p + 8 * SUB16 + 8) : 0u;
                    mma16816(acc[mt][0], a0, a1, a2, a3, b[0], b[1]);
                    mma16816(acc[mt][1], a0, a1, a2, a3, b[2], b[3]);
                }
            }
        }
        DETAIL_ADD(5, CLOCK() - t2);
    }
    DETAIL(1, globaltimer());
    int part = g * NCH + c;
    if (d0 < D)
        for (int mt = 0; mt < MT; ++mt)
            for (int j = 0; j < 2; ++j)
                for (int h2 = 0; h2 < 2; ++h2) {
                    int r = mt * 16 + gq + h2 * 8;
                    if (r < R)
                        *(float2*)(part_o + ((long long)part * RMAX + r) * D + d0 + j * 8 + 2 * t4) =
                            make_float2(acc[mt][j][2 * h2], acc[mt][j][2 * h2 + 1]);
                }
    for (int r = tid; r < R; r += CT) {
        part_ml[part * 2 * RMAX + r] = run_m[r];
        part_ml[part * 2 * RMAX + RMAX + r] = run_l[r];
    }
    bool last = last_ticket(tickets + g, NCH);
    DETAIL(2, globaltimer());
    if (!last) return;
    float* wgt = S;                      // [NCH][RMAX] chunk weights exp(m_c - m) / l
    float* ls = wgt + NCH * RMAX;        // [NCH][RMAX] the chunks' softmax sums
    for (int e = tid; e < NCH * R; e += CT) {
        int cc = e / R, r = e % R;
        wgt[cc * RMAX + r] = __ldcg(part_ml + (g * NCH + cc) * 2 * RMAX + r);
        ls[cc * RMAX + r] = __ldcg(part_ml + (g * NCH + cc) * 2 * RMAX + RMAX + r);
    }
    const int Q = D / 4;                 // float4 pieces per row
    float4 o[NCH];                       // this thread's first output piece: its loads fly with the above
    int e0 = tid;
    if (e0 < R * Q)
        for (int cc = 0; cc < NCH; ++cc)
            o[cc] = __ldcg((const float4*)(part_o + ((long long)(g * NCH + cc) * RMAX + e0 / Q) * D) + e0 % Q);
    consumers_sync();
    for (int r = tid; r < R; r += CT) {
        float m = NEG_INF, l = 0.f;
        for (int cc = 0; cc < NCH; ++cc) m = fmaxf(m, wgt[cc * RMAX + r]);
        for (int cc = 0; cc < NCH; ++cc) {
            wgt[cc * RMAX + r] = __expf(wgt[cc * RMAX + r] - m);
            l += wgt[cc * RMAX + r] * ls[cc * RMAX + r];
        }
        for (int cc = 0; cc < NCH; ++cc) wgt[cc * RMAX + r] /= l;
    }
    consumers_sync();
    for (int e = e0; e < R * Q; e += CT) {
        int r = e / Q, d = (e % Q) * 4;
        if (e != e0)
            for (int cc = 0; cc < NCH; ++cc)
                o[cc] = __ldcg((const float4*)(part_o + ((long long)(g * NCH + cc) * RMAX + r) * D) + e % Q);
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int cc = 0; cc < NCH; ++cc) {
            float w = wgt[cc * RMAX + r];
            sum.x += w * o[cc].x; sum.y += w * o[cc].y; sum.z += w * o[cc].z; sum.w += w * o[cc].w;
        }
        bf16* dst = att + (r % T) * H * D + (g * G + r / T) * D + d;
        dst[0] = f2bf(sum.x); dst[1] = f2bf(sum.y); dst[2] = f2bf(sum.z); dst[3] = f2bf(sum.w);
    }
}

// The greedy choice of each logit row t >= lf (dice.sampling.sampler.greedy_choice): its largest logit's
// first vocabulary row and that token's softmax probability 1 / sum_j exp(l_j - max). Each block
// reads back the logits it wrote (its lm_head tiles, from `first`; every thread's rows in
// increasing order), combines its threads' choices per token, publishes them, and the block that
// takes the last ticket combines the blocks'.
__device__ void choose_greedy(const bf16* logits, int first, int T, int lf, int mask_id, float* red, float* part,
                              int* ticket, long long* tok_out, float* conf_out) {
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, n = T - lf;
    int rows = first < VOCAB_TILED / 16 ? (VOCAB_TILED / 16 - first + gridDim.x - 1) / gridDim.x * 16 : 0;
    Best b[NT];
    for (int t = 0; t < NT; ++t) b[t] = {NEG_INF, 0.f, 0};
    consumers_sync();                                  // the block's logits are written; `red` is free
    for (int i = threadIdx.x; i < rows; i += CT) {
        int row = (first + i / 16 * gridDim.x) * 16 + i % 16;
        if (row < VOCAB && row != mask_id)
            for (int t = 0; t < NT; ++t)
                if (t < n) fold(b[t], bf2f(__ldcg(logits + (long long)t * VOCAB + row)), row);
    }
    Best* all = (Best*)red;                            // [CW][NT] the warps' choices
    for (int t = 0; t < NT; ++t) {
        Best w = warp_combine(b[t]);
        if (lane == 0) all[warp * NT + t] = w;
    }
    consumers_sync();
    if (threadIdx.x < n) {
        Best c = all[threadIdx.x];
        for (int w = 1; w < CW; ++w) c = combine(c, all[w * NT + threadIdx.x]);
        float* p = part + (blockIdx.x * NT + threadIdx.x) * 3;
        p[0] = c.m; p[1] = c.s; p[2] = __int_as_float(c.row);
    }
    if (!last_ticket(ticket, gridDim.x)) return;
    for (int t = warp; t < n; t += CW) {
        Best c = {NEG_INF, 0.f, 0};
        for (int blk = lane; blk < gridDim.x; blk += 32) {
            const float* p = part + (blk * NT + t) * 3;
            c = combine(c, {__ldcg(p), __ldcg(p + 1), __float_as_int(__ldcg(p + 2))});
        }
        c = warp_combine(c);
        if (lane == 0) { tok_out[t] = c.row; conf_out[t] = 1.f / c.s; }
    }
}

// Grid barrier number `epoch` (1, 2, ...): each block adds 1 to one counter and waits for all.
__device__ void grid_barrier(int* counter, int epoch) {
    consumers_sync();                  // every consumer's writes precede the release below
    if (threadIdx.x == 0) {
        long long t0 = clock64();
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(counter) : "memory");
        for (;;) {
            int seen;
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            if (seen >= epoch * (int)gridDim.x) break;
            if (clock64() - t0 > TIMEOUT) __trap();
        }
    }
    consumers_sync();
}

extern "C" __global__ void __launch_bounds__(CT + 32, 1)
decode_step(const u64* table, bf16* h, bf16* qkv, bf16* att, bf16* act, float* part_o, float* part_ml,
            int* counters, const long long* ids, const long long* positions, const bf16* embed, const bf16* cosb,
            const bf16* sinb, const long long* slots, const bf16* final_norm, const bf16* lm_w, bf16* logits,
            float* greedy_part, long long* greedy_tok, float* greedy_conf, int mask_id, int T, int lf, int phase_lo,
            int phase_hi, int max_len, float eps, float scale, int nstage, int scratch, int sub, long long* trace) {
    extern __shared__ __align__(128) char smem[];
    u64* full = (u64*)smem;
    u64* empty = full + nstage;
    float* red = (float*)(smem + 1024);                      // [CW][2][128]
    char* xs = smem + 1024 + CW * 2 * 128 * 4;               // activations, or attention scratch
    char* ring = xs + scratch;
    if (threadIdx.x == 0) {
        n_stage = nstage;
        n_sub = sub;
        for (int s = 0; s < nstage; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CW); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (threadIdx.x < NT) tok_pos[threadIdx.x] = threadIdx.x < T ? (int)positions[threadIdx.x] : 0;
    __syncthreads();
    if (threadIdx.x >= CT) {
        if (threadIdx.x == CT) produce(table, lm_w, phase_lo, phase_hi, ring, full, empty, trace);
        return;
    }
    int length = (int)slots[0], it = 0, offset = 0, barriers = 0;
    for (int p = 0; p < phase_hi; ++p) {
        int layer = p / PHASES, kind = p % PHASES;
        const u64* row = table + layer * NTAB;
        Matrix m = phase_matrix(table, lm_w, p);
        if (p >= phase_lo) {
            if (p > phase_lo) grid_barrier(counters, ++barriers);
            if (trace && threadIdx.x == 0) trace[(blockIdx.x * (phase_hi + 1) + p) * 2] = globaltimer();
#ifdef TRACE
            if (threadIdx.x == 0)
                detail = trace ? detail_slots(trace, p, phase_hi) : 0;
            long long c0 = clock64();
#endif
            if (layer == LAYERS) load_normed(h, final_norm, T, eps, xs);
            else if (kind == QKV) {
                prefetch_kv(row, length, T, max_len, xs + ATTN_OFFSET);
                load_normed(h, (const bf16*)row[0], T, eps, xs, p == 0 ? ids : 0, embed);
            }
            else if (kind == OPROJ) load_rows(att, H * D, T, xs);
            else if (kind == UP) load_normed(h, (const bf16*)row[5], T, eps, xs);
            else if (kind == DOWN) load_rows(act, INTER, T, xs);
            if (kind == ATTN && layer < LAYERS) {
                if (p == phase_lo) prefetch_kv(row, length, T, max_len, xs + ATTN_OFFSET);
                attention(row, qkv, att, part_o, part_ml, counters + 1 + layer * HKV, cosb, sinb, length, T,
                          max_len, eps, scale, (float*)(xs + ATTN_OFFSET));
            } else {
                consumers_sync();
                DETAIL(0, globaltimer());
                int epi = layer == LAYERS ? 3 : kind == QKV ? 0 : kind == UP ? 2 : 1;
                bf16* out = layer == LAYERS ? logits : kind == QKV ? qkv : kind == UP ? act : h;
                consume(m, offset, epi, out, T, lf, xs, ring, full, empty, red, it);
                if (layer == LAYERS && greedy_tok)
                    choose_greedy(logits, first_tile(offset), T, lf, mask_id, red, greedy_part,
                                  counters + 1 + LAYERS * HKV, greedy_tok, greedy_conf);
            }
            if (trace && threadIdx.x == 0) trace[(blockIdx.x * (phase_hi + 1) + p) * 2 + 1] = globaltimer();
#ifdef TRACE
            DETAIL(6, clock64() - c0);
#endif
        }
        if (m.w) offset += m.n / 16;
    }
}
