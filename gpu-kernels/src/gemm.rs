//! Tiled matrix products: the shared engine behind the fully connected layers
//! and the implicit-GEMM convolutions (`conv.rs`).
//!
//! `C[m, n] = Σ_k A(m, k) · B(k, n)` where `A` and `B` are *operands*: small
//! types that walk one row of A or column of B along k with a per-thread
//! cursor (plain strided matrices here, gathered image patches in `conv.rs`).
//! The result goes through an *epilogue* that stores it (adding a bias, or
//! writing a split-K partial).
//!
//! Tiling: a block of 256 threads computes a BM×64 tile of C (BM = 64, or
//! 128 in the `_wide` variants, which halve the copies per product where M
//! allows), stepping through K 16 at a time. Tiles of A (BM×16) and B
//! (16×64) are copied from global to shared memory with `cp.async` (4 bytes
//! per element, zero-filled outside the operand) through a ring of
//! `stages(wide)` buffers, so all but one of them are in flight while one is
//! multiplied; one barrier per K step. Each thread copies four (B) or BM/16
//! (A) elements of each tile, all at one k and at rows (A) or columns (B)
//! `i0 + 16·j`, so one cursor per operand (opened once: the only integer
//! divisions) is stepped by adds and compares. Copies are coalesced along
//! whichever index is contiguous in memory (`K_FAST`). Shared tiles are fp32,
//! `[k][row]` with rows padded by 4 floats.
//!
//! The `MODE` parameter picks the arithmetic. `FP32`: CUDA-core FMAs, thread
//! (tx, ty) = (tid % 16, tid / 16) owns rows `4·ty..` (and `64 + 4·ty..`
//! when wide) and columns `4·tx..`.
//! `TF32`: `mma.sync` m16n8k8, operands rounded to TF32 as their fragments
//! are read from shared memory. `BF16`: `mma.sync` m16n8k16, fragments
//! rounded and packed to bf16 pairs along k as they are read. Both
//! accumulate in fp32; warp w of 8 owns a (BM/4)×32 slice of the tile, rows
//! `BM/4·(w / 2)..`, columns `32·(w % 2)..`, as four or eight 16×8
//! accumulators.
//!
//! Grid: x over 64-column tiles of N, y over BM-row tiles of M, z over
//! independent problems (conv groups × split-K slices).
//!
//! Two more engines share the operand and epilogue traits: the vector
//! engine ([`gemm_tile_v`]: 128 threads, 16-byte `cp.async` copies,
//! `ldmatrix` + `mma.sync`, tiles of 64 or 128 rows × 64 or 128 columns)
//! and, in the Hopper (`sm_90a`) module only, the warpgroup engine
//! ([`gemm_tile_wg`]: the same tiles on asynchronous `wgmma`; its 128×128
//! tiles take 128 bytes of k per row in 128-byte-swizzled stages and beat
//! the vector engine on the conv forwards, which the host gives them by
//! default; the rest, 64 bytes per row unswizzled, only with
//! `ALEXNET_WGMMA=1`), whose 128×128 tiles also come with their operands
//! fetched by the tensor memory accelerator ([`gemm_tile_tma`], operands
//! given as [`TmaTiles`]).

use crate::device::{
    bid_x, bid_y, bid_z, gdim_x, cp_async_commit, cp_async_f32, cp_async_v4, cp_async_wait, fma,
    fence_proxy_async_shared, ld_shared, mbar_arrive, mbar_arrive_expect_tx, mbar_init, mbar_init_fence, mbar_wait, ld_shared_v4, ldmatrix_x4, ldmatrix_x4_trans, mma_bf16, mma_tf32, pack_bf16, shared,
    bar_sync, shared_addr, st_shared_v2, st_v2, sync_threads, tid_x, to_tf32, unrolled, wg_desc, wg_desc_mn_sw128, wg_desc_sw128, wgmma, wgmma_bf16_mn, wgmma_commit, wgmma_fence, wgmma_hold,
    wgmma_wait,
};
use core::arch::asm;

/// `MODE` of [`gemm_tile`]: fp32 FMAs on the CUDA cores.
pub const FP32: u8 = 0;
/// `MODE` of [`gemm_tile`]: TF32 tensor cores.
pub const TF32: u8 = 1;
/// `MODE` of [`gemm_tile`]: bf16 tensor cores.
pub const BF16: u8 = 2;
/// `MODE` of [`gemm_tile_v`] only: TF32 tensor cores on operands that the
/// launcher already rounded to TF32 (`layout::transpose_tf32`,
/// `row_patches_tf32`), so fragments go to the `mma` as loaded, with no
/// conversion in the inner loop.
pub const TF32_ROUNDED: u8 = 3;
/// `MODE` of [`gemm_tile_v`] only: Hopper's warpgroup tensor cores
/// ([`gemm_tile_wg`]; `sm_90a` module only), TF32 on pre-rounded operands
/// or, with `HALF`, bf16.
pub const WGMMA: u8 = 4;

/// Columns of the C tile.
pub const BN: u32 = 64;
pub const BK: u32 = 16;
pub const THREADS: u32 = 256;
/// Rows of the C tile: 64, or 128 in the wide variant.
pub const fn bm(wide: bool) -> u32 {
    if wide { 128 } else { 64 }
}
/// Shared-memory K tiles in the copy pipeline.
pub const fn stages(wide: bool) -> u32 {
    if wide { 3 } else { 4 }
}
/// Row padding of the shared tiles (keeps 16-byte alignment; with rows of
/// 68 or 132 floats, ≡ 4 mod 32, the fragment reads of all three modes hit
/// 32 distinct banks).
const PAD: u32 = 4;
const fn as_stride(wide: bool) -> u32 {
    bm(wide) + PAD
}
const BS_STRIDE: u32 = BN + PAD;
/// Floats of one pipeline stage (an A tile and a B tile).
const fn stage_floats(wide: bool) -> u32 {
    BK * as_stride(wide) + BK * BS_STRIDE
}
/// Dynamic shared memory the engine needs, in bytes.
pub const fn shared_bytes(wide: bool) -> u32 {
    stages(wide) * stage_floats(wide) * 4
}

/// One operand of the product, `A(m, k)` or `B(k, n)`, read through
/// per-thread *cursors*. Each K step, a thread copies elements of the
/// operand's tile all at the same `k` and at rows of A / columns of B
/// `i0 + 16·j` (j < 4 for B, j < 4 or 8 for A). The engine opens one cursor
/// for them once, then takes their addresses and steps the cursor `BK`
/// further along k each K step. The cursor keeps the shared k position in
/// whatever mixed-radix form the operand needs (e.g. channel, kh, kw of an
/// image patch) plus per-element offsets fixed over the K loop, so an
/// address is an add or two and a bounds check, and a step costs adds and
/// compares, not integer divisions.
pub trait Operand {
    /// Whether consecutive `k` are adjacent in memory (else consecutive rows
    /// of A / columns of B).
    const K_FAST: bool;
    type Cursor: Copy;
    /// A cursor at `k` for rows/columns `i0 + 16·j`. Does not touch memory;
    /// positions may lie outside the operand.
    fn open(&self, k: u32, i0: u32) -> Self::Cursor;
    /// Address of element `j` under the cursor, `None` where it is zero (a
    /// convolution's padding); called only for `k < k_end` and a row/column
    /// inside the operand.
    fn src(&self, c: &Self::Cursor, j: usize) -> Option<*const f32>;
    /// Moves the cursor `BK` further along k.
    fn step(&self, c: &mut Self::Cursor);
    /// Any valid global address of the operand (the source of zero-fill
    /// copies, which read nothing).
    fn base(&self) -> *const f32;
}

/// An epilogue for the transposed product: `C[m, n]` goes where `E` puts
/// `C[n, m]`.
pub struct Transposed<E>(pub E);

impl<E: Epilogue> Epilogue for Transposed<E> {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        unsafe { self.0.store(n, m, acc) }
    }
}

/// Rows/columns of a thread's elements are `i0 + SLOT_STRIDE·j`.
pub const SLOT_STRIDE: u32 = 16;

/// Where a finished `C[m, n]` goes (called only for `m < M`, `n < N`).
pub trait Epilogue {
    /// Whether consecutive n land at consecutive addresses (a dense
    /// row-major C): the vector engine then keeps a row-major fp32 B
    /// operand's columns in `mma` order, so that a warp's stores stay
    /// coalesced, reads its fragments with scalar loads (see
    /// [`vtc_coord`]), and hands the epilogue pairs of columns (`store2`).
    const DENSE_N: bool = false;
    unsafe fn store(&self, m: u32, n: u32, acc: f32);
    /// `C[m, n]` and `C[m, n + 1]` (called only for `n + 1 < N`).
    #[inline(always)]
    unsafe fn store2(&self, m: u32, n: u32, acc: [f32; 2]) {
        unsafe {
            self.store(m, n, acc[0]);
            self.store(m, n + 1, acc[1]);
        }
    }
}

/// Computes the `bm(WIDE)`×64 tile of C at block (bid_x, bid_y) over `k` in
/// `k_begin..k_end`. All 256 threads of the block must call it.
#[inline(always)]
pub unsafe fn gemm_tile<A: Operand, B: Operand, E: Epilogue, const MODE: u8, const WIDE: bool>(
    a: &A,
    b: &B,
    e: &E,
    m_total: u32,
    n_total: u32,
    k_begin: u32,
    k_end: u32,
) {
    let tid = tid_x();
    let tx = tid % 16;
    let ty = tid / 16;
    let m0 = bid_y() * bm(WIDE);
    let n0 = bid_x() * BN;
    let smem: *mut f32 = shared::<f32>();
    let smem_addr = shared_addr(smem);
    let a_stride = as_stride(WIDE);
    let stage_bytes = stage_floats(WIDE) * 4;
    let n_stages = stages(WIDE);
    let a_slots = bm(WIDE) / SLOT_STRIDE;

    // This thread's elements of each tile share one k and sit at rows (A) or
    // columns (B) `i0 + 16·j`. With k fast in memory, the 16 lanes of a
    // half-warp take 16 consecutive k; otherwise 16 consecutive rows or
    // columns, so global reads stay coalesced either way.
    let place = |k_fast: bool| -> (u32, u32) {
        if k_fast {
            (tid % 16, tid / 16)
        } else {
            (tid / 16, tid % 16)
        }
    };
    let (a_k, a_i) = place(A::K_FAST);
    let (b_k, b_i) = place(B::K_FAST);
    let mut ca = a.open(k_begin + a_k, m0 + a_i);
    let mut cb = b.open(k_begin + b_k, n0 + b_i);
    // Byte offsets of this thread's first element in a stage.
    let a_dst = (a_k * a_stride + a_i) * 4;
    let b_dst = (BK * a_stride + b_k * BS_STRIDE + b_i) * 4;
    let (a_dummy, b_dummy) = (a.base(), b.base());

    // Starts the copies of the K tile at `k0` into stage `stage`.
    let mut issue = |stage: u32, k0: u32| {
        let base = smem_addr + stage * stage_bytes;
        let a_in = k0 + a_k < k_end;
        let b_in = k0 + b_k < k_end;
        for j in 0..8u32 {
            if j < a_slots {
                let src = if a_in && m0 + a_i + SLOT_STRIDE * j < m_total {
                    a.src(&ca, j as usize)
                } else {
                    None
                };
                unsafe { cp_async_f32(base + a_dst + SLOT_STRIDE * j * 4, src, a_dummy) };
            }
        }
        for j in 0..4u32 {
            let src = if b_in && n0 + b_i + SLOT_STRIDE * j < n_total {
                b.src(&cb, j as usize)
            } else {
                None
            };
            unsafe { cp_async_f32(base + b_dst + SLOT_STRIDE * j * 4, src, b_dummy) };
        }
        a.step(&mut ca);
        b.step(&mut cb);
    };

    let tiles = if k_end > k_begin {
        (k_end - k_begin).div_ceil(BK)
    } else {
        0
    };
    let next_stage = |s: u32| if s + 1 == n_stages { 0 } else { s + 1 };
    // Prologue: the first stages − 1 tiles (one group each, empty past the
    // end so that the group count stays uniform).
    let mut write = 0u32;
    for t in 0..n_stages - 1 {
        if t < tiles {
            issue(write, k_begin + t * BK);
        }
        cp_async_commit();
        write = next_stage(write);
    }

    // acc[p][v]: tensor-core modes, product p = 4·mi + nj (16-row block mi,
    // 8-column block nj), value v; fp32 mode, row p of the thread's rows,
    // column v. Only p < 4 in the narrow variant.
    let mut acc = [[0.0f32; 4]; 8];
    let mut read = 0u32;
    for t in 0..tiles {
        // Tile t has landed for this thread; the barrier makes it visible to
        // all, and tells that every warp is done with tile t − 1, whose
        // stage the copies below overwrite.
        if WIDE {
            cp_async_wait::<1>();
        } else {
            cp_async_wait::<2>();
        }
        sync_threads();
        let ahead = t + n_stages - 1;
        if ahead < tiles {
            issue(write, k_begin + ahead * BK);
        }
        cp_async_commit();
        write = next_stage(write);

        let a_s = unsafe { smem.add((read * stage_floats(WIDE)) as usize) } as *const f32;
        let b_s = unsafe { a_s.add((BK * a_stride) as usize) };
        if MODE == TF32 {
            unsafe { mma_steps_tf32::<WIDE>(a_s, b_s, &mut acc) };
        } else if MODE == BF16 {
            unsafe { mma_step_bf16::<WIDE>(a_s, b_s, &mut acc) };
        } else {
            let a_row = smem_addr + read * stage_bytes + ty * 16;
            let b_col = smem_addr + read * stage_bytes + BK * a_stride * 4 + tx * 16;
            for kk in 0..BK {
                // 16-byte aligned: strides and offsets are multiples of 4 floats.
                let av = unsafe { ld_shared_v4(a_row + kk * a_stride * 4) };
                let bv = unsafe { ld_shared_v4(b_col + kk * BS_STRIDE * 4) };
                for i in 0..4 {
                    for j in 0..4 {
                        acc[i][j] = fma(av[i], bv[j], acc[i][j]);
                    }
                }
                if WIDE {
                    let av = unsafe { ld_shared_v4(a_row + kk * a_stride * 4 + 64 * 4) };
                    for i in 0..4 {
                        for j in 0..4 {
                            acc[4 + i][j] = fma(av[i], bv[j], acc[4 + i][j]);
                        }
                    }
                }
            }
        }
        read = next_stage(read);
    }
    cp_async_wait::<0>();

    let store = |p: u32, v: u32| {
        if p >= 4 && !WIDE {
            return;
        }
        let (mi, ni) = if MODE != FP32 {
            tc_coord::<WIDE>(tid, p, v)
        } else {
            (ty * 4 + (p % 4) + 64 * (p / 4), tx * 4 + v)
        };
        let (m, n) = (m0 + mi, n0 + ni);
        if m < m_total && n < n_total {
            unsafe { e.store(m, n, acc[p as usize][v as usize]) };
        }
    };
    // Written out so that `acc` stays in registers (a loop the compiler
    // declines to unroll would index it at run time, from local memory).
    macro_rules! store_rows {
        ($($p:literal)*) => { $( store($p, 0); store($p, 1); store($p, 2); store($p, 3); )* };
    }
    store_rows!(0 1 2 3 4 5 6 7);
}

/// Tile coordinates of accumulator `acc[p][v]` in the tensor-core layout:
/// warp w owns rows `16·(w / 2)..` (narrow) or `32·(w / 2)..` (wide) and
/// columns `32·(w % 2)..`; product p = 4·mi + nj is the 16×8 block at rows
/// `16·mi..`, columns `8·nj..` of that, v which of its four values.
#[inline(always)]
fn tc_coord<const WIDE: bool>(tid: u32, p: u32, v: u32) -> (u32, u32) {
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let (mi, nj) = (p / 4, p % 4);
    let row = (bm(WIDE) / 4) * (warp / 2) + 16 * mi + g + 8 * (v / 2);
    let col = 32 * (warp % 2) + 8 * nj + 2 * t + v % 2;
    (row, col)
}

/// The TF32 inner loop over one shared-memory K tile: two k8 steps, four
/// (narrow) or eight (wide) m16n8k8 products per warp each, fragments
/// rounded to TF32 as read.
#[inline(always)]
unsafe fn mma_steps_tf32<const WIDE: bool>(
    a_s: *const f32,
    b_s: *const f32,
    acc: &mut [[f32; 4]; 8],
) {
    let tid = tid_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let row0 = (bm(WIDE) / 4) * (warp / 2);
    let col0 = 32 * (warp % 2);
    let a_stride = as_stride(WIDE);
    let ld = |p: *const f32, k: u32, x: u32, stride: u32| unsafe {
        to_tf32(*p.add((k * stride + x) as usize))
    };
    for step in 0..BK / 8 {
        let k0 = 8 * step;
        let a = |mi: u32| {
            let row = row0 + 16 * mi + g;
            [
                ld(a_s, k0 + t, row, a_stride),
                ld(a_s, k0 + t, row + 8, a_stride),
                ld(a_s, k0 + t + 4, row, a_stride),
                ld(a_s, k0 + t + 4, row + 8, a_stride),
            ]
        };
        let b = |nj: u32| {
            let col = col0 + 8 * nj + g;
            [
                ld(b_s, k0 + t, col, BS_STRIDE),
                ld(b_s, k0 + t + 4, col, BS_STRIDE),
            ]
        };
        let (b0, b1, b2, b3) = (b(0), b(1), b(2), b(3));
        let a0 = a(0);
        acc[0] = mma_tf32(a0, b0, acc[0]);
        acc[1] = mma_tf32(a0, b1, acc[1]);
        acc[2] = mma_tf32(a0, b2, acc[2]);
        acc[3] = mma_tf32(a0, b3, acc[3]);
        if WIDE {
            let a1 = a(1);
            acc[4] = mma_tf32(a1, b0, acc[4]);
            acc[5] = mma_tf32(a1, b1, acc[5]);
            acc[6] = mma_tf32(a1, b2, acc[6]);
            acc[7] = mma_tf32(a1, b3, acc[7]);
        }
    }
}

/// The bf16 inner loop over one shared-memory K tile: one k16 step, four
/// (narrow) or eight (wide) m16n8k16 products per warp; each fragment
/// register is two fp32 adjacent along k, rounded and packed to bf16 as read.
#[inline(always)]
unsafe fn mma_step_bf16<const WIDE: bool>(
    a_s: *const f32,
    b_s: *const f32,
    acc: &mut [[f32; 4]; 8],
) {
    let tid = tid_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let row0 = (bm(WIDE) / 4) * (warp / 2);
    let col0 = 32 * (warp % 2);
    let a_stride = as_stride(WIDE);
    let ld2 = |p: *const f32, k: u32, x: u32, stride: u32| unsafe {
        let lo = *p.add((k * stride + x) as usize);
        let hi = *p.add(((k + 1) * stride + x) as usize);
        pack_bf16(lo, hi)
    };
    let a = |mi: u32| {
        let row = row0 + 16 * mi + g;
        [
            ld2(a_s, 2 * t, row, a_stride),
            ld2(a_s, 2 * t, row + 8, a_stride),
            ld2(a_s, 2 * t + 8, row, a_stride),
            ld2(a_s, 2 * t + 8, row + 8, a_stride),
        ]
    };
    let b = |nj: u32| {
        let col = col0 + 8 * nj + g;
        [
            ld2(b_s, 2 * t, col, BS_STRIDE),
            ld2(b_s, 2 * t + 8, col, BS_STRIDE),
        ]
    };
    let (b0, b1, b2, b3) = (b(0), b(1), b(2), b(3));
    let a0 = a(0);
    acc[0] = mma_bf16(a0, b0, acc[0]);
    acc[1] = mma_bf16(a0, b1, acc[1]);
    acc[2] = mma_bf16(a0, b2, acc[2]);
    acc[3] = mma_bf16(a0, b3, acc[3]);
    if WIDE {
        let a1 = a(1);
        acc[4] = mma_bf16(a1, b0, acc[4]);
        acc[5] = mma_bf16(a1, b1, acc[5]);
        acc[6] = mma_bf16(a1, b2, acc[6]);
        acc[7] = mma_bf16(a1, b3, acc[7]);
    }
}

/// Declares the entry points of a GEMM-engine kernel, `$impl::<MODE, WIDE>`:
/// fp32, TF32 and bf16 with 64-row tiles, then the same with 128-row tiles,
/// all with the same parameters.
macro_rules! gemm_kernels {
    ($imp:ident $args:tt => $($name:ident: $mode:ident, $wide:literal);+) => {
        $( $crate::gemm::gemm_kernels!(@one $imp, $name, $mode, $wide, $args); )+
    };
    (@one $imp:ident, $name:ident, $mode:ident, $wide:literal, ($($arg:ident: $ty:ty),* $(,)?)) => {
        /// One precision / tile-height variant; see the `_impl` function's doc.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name($($arg: $ty),*) {
            unsafe { $imp::<{ $crate::gemm::$mode }, $wide>($($arg),*) }
        }
    };
}
pub(crate) use gemm_kernels;

/// The K range `[begin, end)` of split-K slice `slice` of `splits`: slices of
/// whole K tiles; trailing slices may be empty (their partials are zeros).
#[inline(always)]
pub fn split_range(k_total: u32, splits: u32, slice: u32) -> (u32, u32) {
    let chunk = k_total.div_ceil(splits).div_ceil(BK) * BK;
    let begin = slice * chunk;
    (begin, (begin + chunk).min(k_total))
}

/// A dense matrix in memory: element `(k, i)` at `p[k·ks + i·is]`.
#[derive(Clone, Copy)]
pub struct Strided<const K_FAST: bool> {
    pub p: *const f32,
    pub ks: usize,
    pub is: usize,
}

/// A `Strided` cursor: the offset of `(k, i0)`.
impl<const KF: bool> Operand for Strided<KF> {
    const K_FAST: bool = KF;
    type Cursor = usize;
    #[inline(always)]
    fn open(&self, k: u32, i0: u32) -> usize {
        (k as usize)
            .wrapping_mul(self.ks)
            .wrapping_add((i0 as usize).wrapping_mul(self.is))
    }
    #[inline(always)]
    fn src(&self, c: &usize, j: usize) -> Option<*const f32> {
        Some(self.p.wrapping_add(c + j * SLOT_STRIDE as usize * self.is))
    }
    #[inline(always)]
    fn step(&self, c: &mut usize) {
        *c = c.wrapping_add(BK as usize * self.ks);
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.p
    }
}

/// Stores `C[m, n] (+ bias[m] or bias[n])` at `c[m·rs + n·cs]`.
pub struct StoreStrided {
    pub c: *mut f32,
    pub rs: usize,
    pub cs: usize,
    /// Bias indexed by row (`bias_by_row`) or by column; null for none.
    pub bias: *const f32,
    pub bias_by_row: bool,
}

impl Epilogue for StoreStrided {
    const DENSE_N: bool = true;
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let b = unsafe { self.bias_at(m, n) };
        unsafe { *self.c.add(m as usize * self.rs + n as usize * self.cs) = acc + b };
    }
    /// One 8-byte store where C is dense along n and the pair is aligned
    /// (a split-K slice of odd size can leave it unaligned).
    #[inline(always)]
    unsafe fn store2(&self, m: u32, n: u32, acc: [f32; 2]) {
        let p = self.c.wrapping_add(m as usize * self.rs + n as usize * self.cs);
        if self.cs != 1 || !(p as usize).is_multiple_of(8) {
            unsafe {
                self.store(m, n, acc[0]);
                self.store(m, n + 1, acc[1]);
            }
            return;
        }
        let (b0, b1) = if self.bias.is_null() {
            (0.0, 0.0)
        } else {
            unsafe { (self.bias_at(m, n), self.bias_at(m, n + 1)) }
        };
        unsafe { st_v2(p, acc[0] + b0, acc[1] + b1) };
    }
}

impl StoreStrided {
    /// The bias added to `C[m, n]` (0 without one).
    #[inline(always)]
    unsafe fn bias_at(&self, m: u32, n: u32) -> f32 {
        if self.bias.is_null() {
            0.0
        } else if self.bias_by_row {
            unsafe { *self.bias.add(m as usize) }
        } else {
            unsafe { *self.bias.add(n as usize) }
        }
    }
}

/// Fully connected forward, `y[b, o] = Σ_i x[b, i]·w[o, i] + bias[o]`.
///
/// As a GEMM: M = batch, N = outputs, K = inputs; A = x (row-major, k fast),
/// B(k, n) = w[n, k] (k fast). With `splits` > 1, slice z = block z of K
/// writes its partial product (no bias) to `y + z·batch·outputs`, and
/// `splitk_reduce` sums them and adds the bias. Grid (⌈outputs/64⌉,
/// ⌈batch/BM⌉, splits), 256 threads, `shared_bytes(wide)` of dynamic shared
/// memory.
unsafe fn fc_forward_impl<const MODE: u8, const WIDE: bool>(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
    splits: u32,
) {
    unsafe { fc_forward_any::<MODE, WIDE, false, VNARROW, false>(x, w, bias, y, batch, inputs, outputs, splits) }
}

/// `fc_forward` on the vector engine (TF32/bf16; inputs a multiple of 4).
unsafe fn fc_forward_vec_impl<const MODE: u8, const T: u8>(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
    splits: u32,
) {
    unsafe { fc_forward_any::<MODE, false, true, T, false>(x, w, bias, y, batch, inputs, outputs, splits) }
}

#[inline(always)]
unsafe fn fc_forward_any<const MODE: u8, const WIDE: bool, const VEC: bool, const T: u8, const H: bool>(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
    splits: u32,
) {
    let (ni, no) = (inputs as usize, outputs as usize);
    let z = bid_z();
    let (k_begin, k_end) = split_range(inputs, splits, z);
    let e = StoreStrided {
        c: y.wrapping_add(z as usize * batch as usize * no),
        rs: no,
        cs: 1,
        bias: if splits > 1 { core::ptr::null() } else { bias },
        bias_by_row: false,
    };
    let (m, n) = (batch, outputs);
    if VEC {
        let a = VStrided::<true, H> { p: x, ks: 1, is: ni };
        let b = VStrided::<true, H> { p: w, ks: 1, is: ni };
        unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&a, &b, &e, m, n, k_begin, k_end) };
    } else {
        let a = Strided::<true> { p: x, ks: 1, is: ni };
        let b = Strided::<true> { p: w, ks: 1, is: ni };
        unsafe { gemm_tile::<_, _, _, MODE, WIDE>(&a, &b, &e, m, n, k_begin, k_end) };
    }
}

gemm_kernels!(fc_forward_impl (x: *const f32, w: *const f32, bias: *const f32, y: *mut f32, batch: u32, inputs: u32, outputs: u32, splits: u32) =>
    fc_forward: FP32, false; fc_forward_tf32: TF32, false; fc_forward_bf16: BF16, false; fc_forward_wide: FP32, true; fc_forward_tf32_wide: TF32, true; fc_forward_bf16_wide: BF16, true);
gemm_kernels!(fc_forward_vec_impl (x: *const f32, w: *const f32, bias: *const f32, y: *mut f32, batch: u32, inputs: u32, outputs: u32, splits: u32) =>
    fc_forward_vec_tf32: TF32, 0; fc_forward_vec_bf16: BF16, 0; fc_forward_vec_tf32_wide: TF32, 1; fc_forward_vec_bf16_wide: BF16, 1;
    fc_forward_vec_tf32_big: TF32, 2; fc_forward_vec_tf32r: TF32_ROUNDED, 0; fc_forward_vec_tf32r_wide: TF32_ROUNDED, 1; fc_forward_vec_tf32r_big: TF32_ROUNDED, 2);

/// `fc_forward` on the vector engine from bf16 copies of x and w (`u16`
/// storage behind the `f32` pointers; inputs a multiple of 8).
unsafe fn fc_forward_h16_impl<const MODE: u8, const T: u8>(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
    splits: u32,
) {
    unsafe { fc_forward_any::<MODE, false, true, T, true>(x, w, bias, y, batch, inputs, outputs, splits) }
}

gemm_kernels!(fc_forward_h16_impl (x: *const f32, w: *const f32, bias: *const f32, y: *mut f32, batch: u32, inputs: u32, outputs: u32, splits: u32) =>
    fc_forward_vec_h16_bf16: BF16, 0; fc_forward_vec_h16_bf16_wide: BF16, 1; fc_forward_vec_h16_bf16_big: BF16, 2);
#[cfg(feature = "wgmma")]
gemm_kernels!(fc_forward_h16_impl (x: *const f32, w: *const f32, bias: *const f32, y: *mut f32, batch: u32, inputs: u32, outputs: u32, splits: u32) =>
    fc_forward_vec_h16_bf16_wg: WGMMA, 0; fc_forward_vec_h16_bf16_wg_wide: WGMMA, 1);

/// Fully connected data gradient, `dx[b, i] = Σ_o dy[b, o]·w[o, i]`.
///
/// M = batch, N = inputs, K = outputs; A = dy (k fast), B(k, n) = w[k, n]
/// (n fast). Split over K like `fc_forward` (partials at
/// `dx + z·batch·inputs`). Grid (⌈inputs/64⌉, ⌈batch/BM⌉, splits).
unsafe fn fc_backward_data_impl<const MODE: u8, const WIDE: bool>(
    dy: *const f32,
    w: *const f32,
    dx: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
    splits: u32,
) {
    unsafe { fc_backward_data_any::<MODE, WIDE, false, VNARROW, false>(dy, w, dx, batch, inputs, outputs, splits) }
}

/// `fc_backward_data` on the vector engine (TF32/bf16; inputs and outputs
/// multiples of 4).
unsafe fn fc_backward_data_vec_impl<const MODE: u8, const T: u8>(
    dy: *const f32,
    w: *const f32,
    dx: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
    splits: u32,
) {
    unsafe { fc_backward_data_any::<MODE, false, true, T, false>(dy, w, dx, batch, inputs, outputs, splits) }
}

#[inline(always)]
unsafe fn fc_backward_data_any<const MODE: u8, const WIDE: bool, const VEC: bool, const T: u8, const H: bool>(
    dy: *const f32,
    w: *const f32,
    dx: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
    splits: u32,
) {
    let (ni, no) = (inputs as usize, outputs as usize);
    let z = bid_z();
    let (k_begin, k_end) = split_range(outputs, splits, z);
    let e = StoreStrided {
        c: dx.wrapping_add(z as usize * batch as usize * ni),
        rs: ni,
        cs: 1,
        bias: core::ptr::null(),
        bias_by_row: false,
    };
    let (m, n) = (batch, inputs);
    if VEC {
        let a = VStrided::<true, H> { p: dy, ks: 1, is: no };
        let b = VStrided::<false, H> { p: w, ks: ni, is: 1 };
        unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&a, &b, &e, m, n, k_begin, k_end) };
    } else {
        let a = Strided::<true> { p: dy, ks: 1, is: no };
        let b = Strided::<false> { p: w, ks: ni, is: 1 };
        unsafe { gemm_tile::<_, _, _, MODE, WIDE>(&a, &b, &e, m, n, k_begin, k_end) };
    }
}

gemm_kernels!(fc_backward_data_impl (dy: *const f32, w: *const f32, dx: *mut f32, batch: u32, inputs: u32, outputs: u32, splits: u32) =>
    fc_backward_data: FP32, false; fc_backward_data_tf32: TF32, false; fc_backward_data_bf16: BF16, false; fc_backward_data_wide: FP32, true; fc_backward_data_tf32_wide: TF32, true; fc_backward_data_bf16_wide: BF16, true);
gemm_kernels!(fc_backward_data_vec_impl (dy: *const f32, w: *const f32, dx: *mut f32, batch: u32, inputs: u32, outputs: u32, splits: u32) =>
    fc_backward_data_vec_tf32: TF32, 0; fc_backward_data_vec_bf16: BF16, 0; fc_backward_data_vec_tf32_wide: TF32, 1; fc_backward_data_vec_bf16_wide: BF16, 1;
    fc_backward_data_vec_tf32_big: TF32, 2; fc_backward_data_vec_tf32r: TF32_ROUNDED, 0; fc_backward_data_vec_tf32r_wide: TF32_ROUNDED, 1; fc_backward_data_vec_tf32r_big: TF32_ROUNDED, 2);

/// `fc_backward_data` on the vector engine from bf16 copies of dy and w
/// (inputs and outputs multiples of 8).
unsafe fn fc_backward_data_h16_impl<const MODE: u8, const T: u8>(
    dy: *const f32,
    w: *const f32,
    dx: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
    splits: u32,
) {
    unsafe { fc_backward_data_any::<MODE, false, true, T, true>(dy, w, dx, batch, inputs, outputs, splits) }
}

gemm_kernels!(fc_backward_data_h16_impl (dy: *const f32, w: *const f32, dx: *mut f32, batch: u32, inputs: u32, outputs: u32, splits: u32) =>
    fc_backward_data_vec_h16_bf16: BF16, 0; fc_backward_data_vec_h16_bf16_wide: BF16, 1; fc_backward_data_vec_h16_bf16_big: BF16, 2);

/// Fully connected weight gradient, `dw[o, i] = Σ_b dy[b, o]·x[b, i]`.
///
/// M = outputs, N = inputs, K = batch; A(m, k) = dy[k, m] (m fast),
/// B(k, n) = x[k, n] (n fast). Grid (⌈inputs/64⌉, ⌈outputs/64⌉, 1).
unsafe fn fc_backward_filter_impl<const MODE: u8, const WIDE: bool>(
    x: *const f32,
    dy: *const f32,
    dw: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
) {
    unsafe { fc_backward_filter_any::<MODE, WIDE, false, VNARROW, false>(x, dy, dw, batch, inputs, outputs) }
}

/// `fc_backward_filter` on the vector engine (TF32/bf16; inputs and outputs
/// multiples of 4).
unsafe fn fc_backward_filter_vec_impl<const MODE: u8, const T: u8>(
    x: *const f32,
    dy: *const f32,
    dw: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
) {
    unsafe { fc_backward_filter_any::<MODE, false, true, T, false>(x, dy, dw, batch, inputs, outputs) }
}

#[inline(always)]
unsafe fn fc_backward_filter_any<const MODE: u8, const WIDE: bool, const VEC: bool, const T: u8, const H: bool>(
    x: *const f32,
    dy: *const f32,
    dw: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
) {
    let (ni, no) = (inputs as usize, outputs as usize);
    let e = StoreStrided {
        c: dw,
        rs: ni,
        cs: 1,
        bias: core::ptr::null(),
        bias_by_row: false,
    };
    if VEC {
        let a = VStrided::<false, H> { p: dy, ks: no, is: 1 };
        let b = VStrided::<false, H> { p: x, ks: ni, is: 1 };
        unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&a, &b, &e, outputs, inputs, 0, batch) };
    } else {
        let a = Strided::<false> { p: dy, ks: no, is: 1 };
        let b = Strided::<false> { p: x, ks: ni, is: 1 };
        unsafe { gemm_tile::<_, _, _, MODE, WIDE>(&a, &b, &e, outputs, inputs, 0, batch) };
    }
}

gemm_kernels!(fc_backward_filter_impl (x: *const f32, dy: *const f32, dw: *mut f32, batch: u32, inputs: u32, outputs: u32) =>
    fc_backward_filter: FP32, false; fc_backward_filter_tf32: TF32, false; fc_backward_filter_bf16: BF16, false; fc_backward_filter_wide: FP32, true; fc_backward_filter_tf32_wide: TF32, true; fc_backward_filter_bf16_wide: BF16, true);
gemm_kernels!(fc_backward_filter_vec_impl (x: *const f32, dy: *const f32, dw: *mut f32, batch: u32, inputs: u32, outputs: u32) =>
    fc_backward_filter_vec_tf32: TF32, 0; fc_backward_filter_vec_bf16: BF16, 0; fc_backward_filter_vec_tf32_wide: TF32, 1; fc_backward_filter_vec_bf16_wide: BF16, 1;
    fc_backward_filter_vec_tf32_big: TF32, 2; fc_backward_filter_vec_tf32r: TF32_ROUNDED, 0; fc_backward_filter_vec_tf32r_wide: TF32_ROUNDED, 1; fc_backward_filter_vec_tf32r_big: TF32_ROUNDED, 2);

/// `fc_backward_filter` on the vector engine from bf16 copies of x and dy
/// (inputs and outputs multiples of 8).
unsafe fn fc_backward_filter_h16_impl<const MODE: u8, const T: u8>(
    x: *const f32,
    dy: *const f32,
    dw: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
) {
    unsafe { fc_backward_filter_any::<MODE, false, true, T, true>(x, dy, dw, batch, inputs, outputs) }
}

gemm_kernels!(fc_backward_filter_h16_impl (x: *const f32, dy: *const f32, dw: *mut f32, batch: u32, inputs: u32, outputs: u32) =>
    fc_backward_filter_vec_h16_bf16: BF16, 0; fc_backward_filter_vec_h16_bf16_wide: BF16, 1; fc_backward_filter_vec_h16_bf16_big: BF16, 2);

/// Fully connected bias gradient, `db[o] = Σ_b dy[b, o]`: one thread per
/// output (coalesced across o), summing over the batch in order.
/// Grid ⌈outputs/256⌉ × 256 threads.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fc_backward_bias(
    dy: *const f32,
    db: *mut f32,
    batch: u32,
    outputs: u32,
) {
    let o = bid_x() * 256 + tid_x();
    if o < outputs {
        let mut s = 0.0f32;
        for b in 0..batch {
            s += unsafe { *dy.add(b as usize * outputs as usize + o as usize) };
        }
        unsafe { *db.add(o as usize) = s };
    }
}

/// Sums `parts` split-K partial results `ws[p·len + i]` into `out[i]`, in a
/// fixed order (deterministic), adding `bias[i % cols]` unless `bias` is
/// null. 1-D grid-stride.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn splitk_reduce(
    ws: *const f32,
    out: *mut f32,
    len: usize,
    parts: u32,
    bias: *const f32,
    cols: u32,
) {
    let (mut i, step) = crate::device::grid_stride();
    while i < len {
        let mut s = 0.0f32;
        for p in 0..parts as usize {
            s += unsafe { *ws.add(p * len + i) };
        }
        if !bias.is_null() {
            s += unsafe { *bias.add(i % cols as usize) };
        }
        unsafe { *out.add(i) = s };
        i += step;
    }
}

/// Bytes of one row of a K-major shared tile of the vector engine: 64 bytes
/// of k (16 fp32 or 32 bf16) and 16 of padding, so the eight 16-byte rows
/// of an `ldmatrix` phase hit 32 distinct banks.
const VROW_BYTES: u32 = 80;
/// Threads of a vector-engine block: four warps in a 2×2 grid, each owning
/// a (BM/2)×(BN/2) slice of the tile.
pub const VTHREADS: u32 = 128;
/// Tile shape `T` of the vector engine: 64×64.
pub const VNARROW: u8 = 0;
/// Tile shape `T` of the vector engine: 128×64 (rows × columns).
pub const VWIDE: u8 = 1;
/// Tile shape `T` of the vector engine: 128×128.
pub const VBIG: u8 = 2;
/// Tile shape `T` of the vector engine: 64×128.
pub const VLONG: u8 = 3;
/// Tile shape `T` of the vector engine: 128×48, both operands K-major (the
/// data gradient of a 48-channel group, transposed: pixels × channels;
/// copied as 128×64, the last 16 columns zero-filled and never read).
pub const VSLIM: u8 = 4;
/// Rows of the vector engine's C tile of shape `t`.
pub const fn vbm(t: u8) -> u32 {
    if t == VNARROW || t == VLONG { 64 } else { 128 }
}
/// Columns of the vector engine's C tile of shape `t`.
pub const fn vbn(t: u8) -> u32 {
    if t == VSLIM {
        48
    } else if t == VBIG || t == VLONG {
        128
    } else {
        64
    }
}
/// Columns of the shared B tile of shape `t`: `vbn(t)` rounded up to whole
/// copy slots.
const fn vbn_copy(t: u8) -> u32 {
    vbn(t).next_multiple_of(VSLOT_ROWS)
}
/// 16-row blocks of a warp's slice: 2 or 4.
const fn vmi(t: u8) -> u32 {
    vbm(t) / 32
}
/// 8-column blocks of a warp's slice: 4 or 8.
const fn vnj(t: u8) -> usize {
    (vbn(t) / 16) as usize
}
/// Rows of a K-major tile between a thread's copy slots.
const VSLOT_ROWS: u32 = VTHREADS / 4;
/// k per shared tile of the vector engine: 16 fp32 or 32 bf16 (64 bytes).
pub const fn vbk(half: bool) -> u32 {
    if half { 32 } else { 16 }
}
/// Elements of one 16-byte copy.
pub const fn vlen(half: bool) -> u32 {
    if half { 8 } else { 4 }
}
/// Bytes between k rows of a row-major (`[k][row]`) tile of `rows`: bf16
/// rows padded by 16 bytes so `ldmatrix.trans` reads spread over the banks;
/// fp32 rows unpadded, their 16-byte chunks swizzled instead (see
/// [`rm_swizzle`]).
const fn rm_stride(half: bool, rows: u32) -> u32 {
    if half { (rows + 8) * 2 } else { rows * 4 }
}

/// The XOR applied to the 16-byte chunk index of k row `k` in an fp32
/// row-major tile of `rows` (64 or 128). A lane reads `q = rows / 64` whole
/// chunks per k row (see [`rm_words`]); the eight lanes of one 16-byte-load
/// phase, (g, t) ∈ {0, 1} × {0..3}, then hit eight distinct bank groups:
/// chunks `q·g + i` XOR `{0, 2, 4, 6}` (q = 1) or `{0, 1, 4, 5}` (q = 2)
/// over t = k mod 4.
#[inline(always)]
fn rm_swizzle(rows: u32, k: u32) -> u32 {
    let t = k % 4;
    if rows == 64 { 2 * t } else { (t & 1) | ((t & 2) << 1) }
}
/// Bytes of one stage of the vector engine: an A tile of `vbm(t)` rows and
/// a B tile of `vbn(t)`, each sized for the K-major layout (the larger
/// one).
const fn vstage_bytes(t: u8) -> u32 {
    (vbm(t) + vbn_copy(t)) * VROW_BYTES
}
/// Shared-memory K tiles in the vector engine's pipeline.
pub const fn vstages(t: u8) -> u32 {
    if t == VNARROW { 4 } else { 3 }
}
/// Dynamic shared memory of the vector engine, in bytes: 40, 45 (128×64
/// and 64×128) or 60 KiB (over the default 48 KiB for `BIG`: the host
/// raises the kernels' limit at load time).
pub const fn vshared_bytes(t: u8) -> u32 {
    vstages(t) * vstage_bytes(t)
}

/// Address of element `off` of an operand stored as fp32 or, when `half`,
/// as bf16 (a `u16` array behind the same pointer).
#[inline(always)]
pub fn elem_at(p: *const f32, off: usize, half: bool) -> *const f32 {
    if half {
        (p as *const u16).wrapping_add(off) as *const f32
    } else {
        p.wrapping_add(off)
    }
}

/// An operand of the vector engine ([`gemm_tile_v`]), stored as fp32 or
/// (`HALF`) bf16 and copied 16 bytes (4 or 8 elements, aligned) at a time.
/// `K_MAJOR`: a vector runs along k and the shared tile is `[row][k]` (read
/// with `ldmatrix`); otherwise it runs along rows of A / columns of B and the
/// tile is `[k][row]`. As in [`Operand`], a thread opens one cursor once and
/// steps it `vbk(HALF)` along k each tile; its vectors ("slots": R/32 of
/// them for a tile of R rows, so 2 for B) lie at fixed displacements from
/// the cursor: along rows for a K-major operand (`dk = 0`), along k
/// otherwise (`di = 0`).
pub trait VecOperand {
    const K_MAJOR: bool;
    const HALF: bool;
    /// Whether copies go through L1 (gathers that re-read bytes soon).
    const L1: bool = false;
    type Cursor: Copy;
    /// A cursor at `k` for row/column `i0`; slot j sits `j·dk` further along
    /// k and `j·di` further along the rows/columns. No memory is touched.
    fn open(&self, k: u32, i0: u32, dk: u32, di: u32) -> Self::Cursor;
    /// Address of slot j's vector, `None` where it is zero; called only for
    /// vectors inside the operand.
    fn src(&self, c: &Self::Cursor, j: usize) -> Option<*const f32>;
    /// Moves the cursor `vbk(HALF)` along k.
    fn step(&self, c: &mut Self::Cursor);
    fn base(&self) -> *const f32;
}

/// The vector engine: a `vbm(T)`×`vbn(T)` tile of C (64×64, 128×64,
/// 64×128, 128×128 or 128×48) per block of [`VTHREADS`] (TF32 or BF16 only), warp w owning
/// rows `BM/2·(w / 2)..` and columns `BN/2·(w % 2)..` as (BM/32)×(BN/16)
/// 16×8 accumulators (see [`vtc_coord`]), the same epilogue as
/// [`gemm_tile`]. Operands are copied in 16-byte `cp.async`
/// vectors, R/32 per thread per tile of R rows. The launcher guarantees
/// whole vectors: `k_end − k_begin` a multiple of the vector length for a
/// K-major operand, `m_total` / `n_total` multiples of it for the others.
///
/// `HALF` (bf16 products only): both operands are stored as bf16, a tile is
/// 32 deep, and every fragment comes straight from `ldmatrix` (`.trans` for
/// `[k][row]` tiles) with no conversion. Thread placement per operand tile
/// of R rows: K-major, k = vlen·(tid % 4), row tid / 4, slots 32 rows
/// apart; row-major, rows vlen·(tid % (R/vlen)), k = tid / (R/vlen), slots
/// 128·vlen/R k apart.
///
/// fp32 storage: fragments of a K-major tile come from `ldmatrix` (one `x4`
/// is a TF32 A fragment, 16 rows × 8 k, or a B fragment pair, 8 columns ×
/// 16 k), those of a row-major one from 16-byte loads of a swizzled tile,
/// the rows (columns) of the warp's 16×8 blocks interleaved so that each
/// lane's words are contiguous ([`rm_words`]); B's columns stay in `mma`
/// order, read by scalar loads ([`rm_column`]), in TF32 products (each word
/// lands in the register the `mma` reads; see [`b_interleaved`]) and where
/// the epilogue stores densely along n (`Epilogue::DENSE_N`: interleaved
/// columns would scatter a warp's stores). A K-major TF32 A fragment is one
/// `ldmatrix` ([`a_frag_tf32`]). For bf16, k is
/// permuted inside each 16-deep tile, the same way for A and B (so the
/// products are unchanged): the register the `mma` reads as k `(2t, 2t+1)`
/// holds k `(t, t+4)` and `(2t+8, 2t+9)` holds `(t+8, t+12)`, which is what
/// four 4-wide `ldmatrix` columns deliver.
#[inline(always)]
pub unsafe fn gemm_tile_v<
    A: VecOperand,
    B: VecOperand,
    E: Epilogue,
    const MODE: u8,
    const T: u8,
    const HALF: bool,
>(
    a: &A,
    b: &B,
    e: &E,
    m_total: u32,
    n_total: u32,
    k_begin: u32,
    k_end: u32,
) {
    const { assert!(T != VSLIM || (A::K_MAJOR && B::K_MAJOR)) };
    if MODE == WGMMA {
        unsafe { gemm_tile_wg::<A, B, E, T, HALF>(a, b, e, m_total, n_total, k_begin, k_end) };
        return;
    }
    let tid = tid_x();
    let m0 = bid_y() * vbm(T);
    let n0 = bid_x() * vbn(T);
    let smem_addr = shared_addr(shared::<f32>());
    let stage_bytes = vstage_bytes(T);
    let b_off = vbm(T) * VROW_BYTES;
    let n_stages = vstages(T);
    let bk = vbk(HALF);

    // Returns (k, row, byte offset in the tile, slot dk, slot di, slot bytes).
    let place = |k_major: bool, rows: u32| -> (u32, u32, u32, u32, u32, u32) {
        if k_major {
            let (k, r) = (vlen(HALF) * (tid % 4), tid / 4);
            let slot = VSLOT_ROWS * VROW_BYTES;
            (k, r, r * VROW_BYTES + 16 * (tid % 4), 0, VSLOT_ROWS, slot)
        } else {
            let st = rm_stride(HALF, rows);
            let per_k = rows / vlen(HALF);
            let (k, r) = (tid / per_k, vlen(HALF) * (tid % per_k));
            // Slots lie dk = 4 or 8 k rows apart: the same swizzle.
            let dk = VTHREADS / per_k;
            let chunk = if HALF { tid % per_k } else { (tid % per_k) ^ rm_swizzle(rows, k) };
            (k, r, k * st + 16 * chunk, dk, 0, dk * st)
        }
    };
    let (a_k, a_i, a_dst, a_dk, a_di, a_slot) = place(A::K_MAJOR, vbm(T));
    let (b_k, b_i, b_dst, b_dk, b_di, b_slot) = place(B::K_MAJOR, vbn(T));
    let mut ca = a.open(k_begin + a_k, m0 + a_i, a_dk, a_di);
    let mut cb = b.open(k_begin + b_k, n0 + b_i, b_dk, b_di);
    let (a_dummy, b_dummy) = (a.base(), b.base());
    let a_slots = vbm(T) / VSLOT_ROWS;
    let b_slots = vbn_copy(T) / VSLOT_ROWS;

    let mut issue = |stage: u32, k0: u32| {
        let base = smem_addr + stage * stage_bytes;
        for j in 0..4u32 {
            if j < a_slots {
                let inside = k0 + a_k + a_dk * j < k_end && m0 + a_i + a_di * j < m_total;
                let src = if inside { a.src(&ca, j as usize) } else { None };
                unsafe { cp_async_v4(base + a_dst + a_slot * j, src, a_dummy, A::L1) };
            }
        }
        for j in 0..4u32 {
            if j >= b_slots {
                break;
            }
            let inside = k0 + b_k + b_dk * j < k_end && n0 + b_i + b_di * j < n_total;
            let src = if inside { b.src(&cb, j as usize) } else { None };
            unsafe { cp_async_v4(base + b_off + b_dst + b_slot * j, src, b_dummy, B::L1) };
        }
        a.step(&mut ca);
        b.step(&mut cb);
    };

    let tiles = if k_end > k_begin {
        (k_end - k_begin).div_ceil(bk)
    } else {
        0
    };
    let next_stage = |s: u32| if s + 1 == n_stages { 0 } else { s + 1 };
    let mut write = 0u32;
    for t in 0..n_stages - 1 {
        if t < tiles {
            issue(write, k_begin + t * bk);
        }
        cp_async_commit();
        write = next_stage(write);
    }

    let mut acc = [[0.0f32; 4]; 32];
    let mut read = 0u32;
    for t in 0..tiles {
        // All but the newest `n_stages − 2` groups done: tile t is in.
        if T == VNARROW {
            cp_async_wait::<2>();
        } else {
            cp_async_wait::<1>();
        }
        sync_threads();
        let ahead = t + n_stages - 1;
        if ahead < tiles {
            issue(write, k_begin + ahead * bk);
        }
        cp_async_commit();
        write = next_stage(write);

        let a_s = smem_addr + read * stage_bytes;
        let b_s = a_s + b_off;
        if HALF {
            unsafe { vmma_tile_half::<A, B, T>(a_s, b_s, &mut acc) };
        } else {
            unsafe { vmma_tile::<A, B, E, MODE, T>(a_s, b_s, &mut acc) };
        }
        read = next_stage(read);
    }
    cp_async_wait::<0>();

    let b_rm = b_interleaved::<B, E, MODE, HALF>();
    let rows = !HALF && !A::K_MAJOR;
    let live = |p: u32| p < (vbm(T) / 32) * vnj(T) as u32;
    macro_rules! store_rows {
        ($store:ident, $($p:literal)*) => { $( $store($p, 0); $store($p, 1); $store($p, 2); $store($p, 3); )* };
    }
    if E::DENSE_N {
        // Accumulators v and v + 1 (v even) are columns n and n + 1 of
        // one row (B is never interleaved here): one `store2` where both
        // are inside C.
        let pair = |p: u32, v: u32| {
            if v % 2 == 1 || !live(p) {
                return;
            }
            let (mi, ni) = vtc_coord::<T>(tid, p, v, rows, false);
            let (m, n) = (m0 + mi, n0 + ni);
            let a = &acc[p as usize];
            if m >= m_total || n >= n_total {
                return;
            }
            if n + 1 < n_total {
                unsafe { e.store2(m, n, [a[v as usize], a[v as usize + 1]]) };
            } else {
                unsafe { e.store(m, n, a[v as usize]) };
            }
        };
        store_rows!(pair, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
    } else {
        let single = |p: u32, v: u32| {
            if !live(p) {
                return;
            }
            let (mi, ni) = vtc_coord::<T>(tid, p, v, rows, b_rm);
            let (m, n) = (m0 + mi, n0 + ni);
            if m < m_total && n < n_total {
                unsafe { e.store(m, n, acc[p as usize][v as usize]) };
            }
        };
        store_rows!(single, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
    }
}

/// Whether B's columns are interleaved across the warp's 16×8 blocks (see
/// [`vtc_coord`]): fp32 row-major B tiles of bf16 products read by
/// [`rm_words`]. TF32 products read row-major B one word at a time
/// ([`rm_column`], straight into the `mma`'s registers: the 16-byte loads
/// of [`rm_words`] cost ptxas two moves per fragment) and keep the columns
/// in `mma` order, as does a dense-along-n epilogue. Measured (`…-v18/`,
/// batch 128): TF32 weight gradients conv2 0.661 → 0.622 ms, conv3 0.477 →
/// 0.435, conv5 0.267 → 0.244, conv1 0.618 → 0.573.
const fn b_interleaved<B: VecOperand, E: Epilogue, const MODE: u8, const HALF: bool>() -> bool {
    !HALF && !B::K_MAJOR && !E::DENSE_N && MODE == BF16
}

/// Bytes of one stage of the warpgroup engine: an A tile of `vbm(t)` rows
/// and a B tile of `vbn(t)`, 64 bytes of k per row, unpadded.
const fn wstage_bytes(t: u8) -> u32 {
    (vbm(t) + vbn(t)) * 64
}
/// Shared-memory K tiles in the warpgroup engine's pipeline (copies run two
/// tiles ahead). Six measured slower than four: the products are bound by
/// L2 bandwidth, and shared memory taken from L1 loses the gathers' hits.
pub const fn wstages(_t: u8) -> u32 {
    4
}
/// Dynamic shared memory of the warpgroup engine, in bytes: 32 (64×64),
/// 48 (128×64, 64×128) or 64 KiB (128×128).
pub const fn wshared_bytes(t: u8) -> u32 {
    wstages(t) * wstage_bytes(t)
}
/// Byte offset of 16-byte chunk `q` (of four along k) of row `r` in a
/// warpgroup-engine tile: `wgmma`'s unswizzled K-major layout, core matrices
/// of 8 rows × 16 bytes (128 contiguous bytes), the four of a row group
/// 128 bytes apart along k ([`WG_LBO`]), row groups 512 apart ([`WG_SBO`]).
const fn wg_offset(r: u32, q: u32) -> u32 {
    (r / 8) * WG_SBO + q * WG_LBO + (r % 8) * 16
}
const WG_LBO: u32 = 128;
const WG_SBO: u32 = 512;

/// The warpgroup engine (Hopper, `wgmma`): the tile of [`gemm_tile_v`]
/// (same shapes, operands, cursors, copy slots and epilogue), both operands
/// K-major, stored as TF32-rounded fp32 or (`HALF`) bf16, 64 bytes of k per
/// tile (8 or 16 k per `wgmma`, two per tile). The block's four warps form
/// one warpgroup; per tile it issues one `wgmma` m64n`BN` per 64 rows and k
/// step, asynchronously: the copies of tile t + 2 are issued while those of
/// t run, and a stage is refilled only after every warp has waited for the
/// `wgmma`s that read it (the barrier of the tile after next).
/// [`wstages`] stages of [`wg_offset`]-laid tiles ([`wg_products`]);
/// accumulators: rows `64h + 16w + …` of warp w in `acc[h]` (see
/// [`wgmma`]). 128×128 tiles instead take 128 bytes of k per row in
/// 128-byte-swizzled stages, in blocks of two warpgroups, one per 64 rows
/// ([`wg_products_sw`]): rows `16w + …` of warp w (of 8).
#[inline(always)]
pub unsafe fn gemm_tile_wg<A: VecOperand, B: VecOperand, E: Epilogue, const T: u8, const HALF: bool>(
    a: &A,
    b: &B,
    e: &E,
    m_total: u32,
    n_total: u32,
    k_begin: u32,
    k_end: u32,
) {
    if !A::K_MAJOR || !B::K_MAJOR || T == VSLIM {
        unsafe { core::arch::nvptx::trap() };
    }
    let m0 = bid_y() * vbm(T);
    let n0 = bid_x() * vbn(T);
    if T == VBIG {
        // Two warpgroups: warp w's rows are 16w + … (h = 0 for both).
        let acc = unsafe { wg_products_sw::<A, B, HALF>(a, b, m_total, n_total, k_begin, k_end) };
        unsafe { wg_store(e, &acc, 128, m0, n0, m_total, n_total) };
        return;
    }
    let (acc0, acc1) = unsafe { wg_products::<A, B, T, HALF>(a, b, m_total, n_total, k_begin, k_end) };
    unsafe { wg_store(e, &acc0, vbn(T), m0, n0, m_total, n_total) };
    if vbm(T) == 128 {
        unsafe { wg_store(e, &acc1, vbn(T), m0 + 64, n0, m_total, n_total) };
    }
}

/// Stores a warpgroup accumulator of `bn` (64 or 128) columns through `e`: warp w (of
/// the block) holds rows `m0 + 16w + …` and columns `n0..` (see [`wgmma`]);
/// only `C[m, n]` inside `m_total × n_total` are written.
#[inline(always)]
unsafe fn wg_store<E: Epilogue>(e: &E, acc: &[f32; 64], bn: u32, m0: u32, n0: u32, m_total: u32, n_total: u32) {
    let (warp, lane) = (tid_x() / 32, tid_x() % 32);
    let (g, tq) = (lane / 4, lane % 4);
    unrolled::<16>(|i| {
        if i < (bn / 8) as usize {
            unrolled::<4>(|v| {
                let m = m0 + 16 * warp + g + 8 * (v as u32 / 2);
                let n = n0 + 8 * i as u32 + 2 * tq + v as u32 % 2;
                if m < m_total && n < n_total {
                    unsafe { e.store(m, n, acc[4 * i + v]) };
                }
            })
        }
    })
}

/// [`wg_store`] of a 128×128 tile through shared memory at `smem` (the
/// [`STAGED_BYTES`] there free once every consumer's `wgmma`s are done):
/// the 256 threads of the two warpgroups (named barrier 1; the producer
/// warp takes no part) write their accumulators as pairs, then warp w
/// stores rows `w, w + 8, …`, lane l columns `l + 32j`, so each store
/// instruction (and each mask or bias read of the epilogue) covers 32
/// consecutive columns: consecutive pixels of one NCHW channel in the conv
/// kernels, where [`wg_store`]'s cover 8 channels × 4 pixels 8 bytes apart.
#[inline(always)]
unsafe fn wg_store_staged<E: Epilogue>(e: &E, acc: &[f32; 64], smem: u32, m0: u32, n0: u32, m_total: u32, n_total: u32) {
    let (warp, lane) = (tid_x() / 32, tid_x() % 32);
    let (g, tq) = (lane / 4, lane % 4);
    bar_sync(1, WS_THREADS);
    unrolled::<16>(|i| {
        unrolled::<2>(|h| {
            let m = 16 * warp + g + 8 * h as u32;
            let n = 8 * i as u32 + 2 * tq;
            unsafe { st_shared_v2(smem + 4 * (m * STAGED_ROW + n), acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]) };
        })
    });
    bar_sync(1, WS_THREADS);
    for r in 0..16 {
        let m = warp + 8 * r;
        unrolled::<4>(|j| {
            let n = lane + 32 * j as u32;
            if m0 + m < m_total && n0 + n < n_total {
                unsafe { e.store(m0 + m, n0 + n, ld_shared(smem + 4 * (m * STAGED_ROW + n))) };
            }
        })
    }
}

/// Bytes of k per row in a tile of the swizzled warpgroup pipeline: one
/// 128-byte line (32 TF32 or 64 bf16 k), so the 8 threads copying a row
/// ask L2 for whole lines.
const WS_ROW: u32 = 128;
/// Stages of the swizzled pipeline (copies two tiles ahead).
const WS_STAGES: u32 = 4;
/// Bytes of one stage of the swizzled pipeline: (128 + 128) rows ×
/// [`WS_ROW`].
const WS_STAGE_BYTES: u32 = 256 * WS_ROW;
/// Dynamic shared memory of the 128×128 warpgroup kernels fed by
/// `cp.async` (`_wg_big`): [`WS_STAGES`] stages and 1 KiB to align them to
/// the 1024-byte swizzle pattern.
pub const fn wshared_bytes_sw() -> u32 {
    WS_STAGES * WS_STAGE_BYTES + 1024
}
/// Threads of a 128×128 warpgroup kernel's block: two warpgroups.
pub const WS_THREADS: u32 = 2 * VTHREADS;

/// Copies of a swizzled warpgroup tile: the thread's rows `32j` (j < 4)
/// below its first at shared address `at` (A) and `at + b_off` (B), from
/// cursors `ca`, `cb` (slots 32 rows apart); only rows below `am` (A) and
/// `bn` (B) are read, the rest zero-filled.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn ws_copy<A: VecOperand, B: VecOperand>(
    a: &A,
    b: &B,
    ca: &A::Cursor,
    cb: &B::Cursor,
    at: u32,
    b_off: u32,
    am: u32,
    bn: u32,
) {
    unrolled::<4>(|j| {
        let (row, at) = (32 * j as u32, at + 32 * j as u32 * WS_ROW);
        let src = if row < am { a.src(ca, j) } else { None };
        unsafe { cp_async_v4(at, src, a.base(), A::L1) };
        let src = if row < bn { b.src(cb, j) } else { None };
        unsafe { cp_async_v4(at + b_off, src, b.base(), B::L1) };
    });
}

/// One K tile of a swizzled stage into `acc`: the four `wgmma` k-steps of
/// the warpgroup's 64 rows at `a` (A) and the 128 columns at `b` (B), in one
/// group; then waits for the group before (so the tile before it is read).
#[inline(always)]
fn ws_mma<const HALF: bool, const N: u32>(acc: &mut [f32; 64], a: u32, b: u32) {
    wgmma_fence();
    for s in 0..4u32 {
        unsafe { wgmma::<HALF, N>(acc, wg_desc_sw128(a + 32 * s), wg_desc_sw128(b + 32 * s)) };
    }
    wgmma_commit();
    wgmma_wait::<1>();
}

/// [`ws_mma`] on MN-major bf16 stages (the TMA weight gradient): k runs
/// down the rows, 64 of them per stage; A's 64 rows of M are one 8 KiB box
/// at `a`, B's 128 columns two boxes 8 KiB apart from `b`; four k16 steps
/// of 16 rows (2048 bytes).
#[inline(always)]
fn ws_mma_mn(acc: &mut [f32; 64], a: u32, b: u32) {
    wgmma_fence();
    for s in 0..4u32 {
        unsafe { wgmma_bf16_mn(acc, wg_desc_mn_sw128(a + 2048 * s, 8192), wg_desc_mn_sw128(b + 2048 * s, 8192)) };
    }
    wgmma_commit();
    wgmma_wait::<1>();
}

/// The products of [`gemm_tile_wg`] for 128×128 tiles on 128-byte-swizzled
/// stages, in blocks of [`WS_THREADS`] (two warpgroups): warpgroup h issues
/// the `wgmma`s of rows `64h..64h+64` and returns their accumulator. Row
/// `r` of a stage's tile sits at `r·128`, its 16-byte chunk `q` at
/// `16·(q ⊕ r mod 8)` (`wgmma`'s 128-byte swizzle, 1024-byte atoms of 8
/// rows). Thread t copies chunk `t mod 8` of rows `t/8 + 32j` (j < 4, one
/// cursor of four slots per operand), so each quarter-warp reads one whole
/// line and writes it across all banks; four `wgmma` k-steps of 32 bytes
/// per tile, the descriptor's start moved along the row. Copies go two
/// tiles ahead of [`WS_STAGES`] stages; a tile's `wgmma`s may run on until
/// the next tile's are issued. Two warpgroups halve each thread's copies
/// and cursor steps against one, and give each scheduler two warps.
#[inline(always)]
unsafe fn wg_products_sw<A: VecOperand, B: VecOperand, const HALF: bool>(
    a: &A,
    b: &B,
    m_total: u32,
    n_total: u32,
    k_begin: u32,
    k_end: u32,
) -> [f32; 64] {
    let tid = tid_x();
    let h = tid / VTHREADS;
    let m0 = bid_y() * 128;
    let n0 = bid_x() * 128;
    let smem = (shared_addr(shared::<f32>()) + 1023) & !1023;
    let b_off = 128 * WS_ROW;
    let bk = 2 * vbk(HALF);
    let (q, r) = (tid % 8, tid / 8);
    let dst = r * WS_ROW + 16 * (q ^ (r % 8));
    let kq = vlen(HALF) * q;
    let mut ca = a.open(k_begin + kq, m0 + r, 0, 32);
    let mut cb = b.open(k_begin + kq, n0 + r, 0, 32);
    // A macro, not a closure: ptxas got the closure as a call with its
    // captures in local memory (the data gradients' cursors).
    macro_rules! issue {
        ($stage:expr, $k0:expr) => {{
            let (stage, k0): (u32, u32) = ($stage, $k0);
            let at = smem + stage * WS_STAGE_BYTES + dst;
            // Rows past the operands' ends (and k past `k_end`) are zeros.
            let (am, bn) = if k0 + kq < k_end {
                (m_total.saturating_sub(m0 + r), n_total.saturating_sub(n0 + r))
            } else {
                (0, 0)
            };
            unsafe { ws_copy(a, b, &ca, &cb, at, b_off, am, bn) };
            for _ in 0..2 {
                a.step(&mut ca);
                b.step(&mut cb);
            }
        }};
    }

    let tiles = if k_end > k_begin {
        (k_end - k_begin).div_ceil(bk)
    } else {
        0
    };
    for t in 0..WS_STAGES - 2 {
        if t < tiles {
            issue!(t, k_begin + t * bk);
        }
        cp_async_commit();
    }
    let mut acc = [0.0f32; 64];
    for t in 0..tiles {
        // As in `wg_products`: tile t is in, and every warp has passed the
        // wait for tile t − 2's `wgmma`s, so that tile's stage is free.
        cp_async_wait::<1>();
        fence_proxy_async_shared();
        sync_threads();
        let ahead = t + WS_STAGES - 2;
        if ahead < tiles {
            issue!(ahead % WS_STAGES, k_begin + ahead * bk);
        }
        cp_async_commit();

        let stage = smem + (t % WS_STAGES) * WS_STAGE_BYTES;
        ws_mma::<HALF, 128>(&mut acc, stage + 64 * h * WS_ROW, stage + b_off);
    }
    wgmma_wait::<0>();
    cp_async_wait::<0>();
    wgmma_hold::<128>(&mut acc);
    acc
}

/// The operands of one C tile of [`gemm_tile_tma`], fetched by the tensor
/// memory accelerator: K tile after tile (of [`TmaTiles::tiles`]), A's (the
/// tile's 128 rows × 128 bytes of k) and B's (its 128 columns × the same
/// k) into shared memory at `a` and `b`, 128-byte-swizzled, completing on
/// the `mbarrier` at `bar` ([`WS_STAGE_BYTES`] in all, zeros outside the
/// operands); the cursor names the next tile.
pub trait TmaTiles {
    type Cursor;
    /// Readies the tensor maps (by the producer, before its first load).
    unsafe fn acquire(&self);
    /// A cursor at the first K tile.
    fn start(&self) -> Self::Cursor;
    fn tiles(&self) -> u32;
    /// Loads the cursor's tile and moves the cursor to the next.
    unsafe fn load(&self, c: &mut Self::Cursor, a: u32, b: u32, bar: u32);
}

/// Most stages [`gemm_tile_tma`] takes: 7 × 32 KiB and their barriers fit
/// the 227 KiB of shared memory a block may have.
pub const TMA_STAGES_MAX: u32 = 7;
/// Bit of [`gemm_tile_tma`]'s `ring` argument (above the stage count in its
/// low byte) that keeps the epilogue's stores straight from the
/// accumulators ([`wg_store`]) instead of through shared memory
/// ([`wg_store_staged`]).
pub const TMA_DIRECT_STORE: u32 = 1 << 8;
/// Row stride, in floats, of the tile [`wg_store_staged`] stages: 128 and
/// 4 more, so that the 8 rows a warp's lanes write at once start 4 banks
/// apart.
const STAGED_ROW: u32 = 132;
/// Bytes of [`wg_store_staged`]'s tile: 128 rows of [`STAGED_ROW`] floats.
const STAGED_BYTES: u32 = 128 * STAGED_ROW * 4;
/// Threads of a [`gemm_tile_tma`] block: two warpgroups issuing `wgmma`s and
/// one producer warp.
pub const TMA_THREADS: u32 = WS_THREADS + 32;
/// Dynamic shared memory of [`gemm_tile_tma`] with `stages` stages: the
/// stages, 1 KiB to align them to the 1024-byte swizzle pattern, and two
/// 8-byte `mbarrier`s per stage ("full" and "empty").
pub const fn tma_shared_bytes(stages: u32) -> u32 {
    stages * WS_STAGE_BYTES + 1024 + 16 * stages
}

/// The 128×`BN` tiles of C (`dims`: N, M, and independent problems, such as
/// groups; `BN` 128, or 64 where N is small: B's copies then fill the
/// first 64 rows of its stage, the `wgmma`s read those, and each stage
/// waits for 128 + 64 rows' bytes), each as
/// [`gemm_tile_wg`]'s, with their operand tiles fetched by
/// the tensor memory accelerator ([`TmaTiles`], `tile([x, y, problem])`
/// giving a tile's operands and epilogue) into `stages`
/// (2..=[`TMA_STAGES_MAX`]) stages laid out as [`wg_products_sw`]'s.
/// Block b of a 1-D grid takes tiles b, b + grid, … (x fastest, then y,
/// then the problem: a grid of one block per tile is the usual launch
/// order; a smaller one keeps blocks resident). Blocks of [`TMA_THREADS`]:
/// warpgroup h (threads `128h..`) issues the `wgmma`s of rows
/// `64h..64h+64`; lane 0 of warp 8, the producer, issues each K tile's two
/// copies as soon as its stage is free, through all the block's tiles, so
/// the next tile's first copies overlap this one's stores. Per stage s,
/// barrier `full[s]` completes when the tile's bytes are in, `empty[s]`
/// when all 8 consumer warps have finished the `wgmma`s that read it (each
/// warp's lane 0 arrives once its `wgmma_wait` has seen them done); no
/// block-wide barrier is taken after the set-up. With `MN` (bf16 only),
/// the stages hold MN-major tiles, k down the rows ([`ws_mma_mn`]): the
/// weight gradient's. `ring`: the stage count
/// in its low byte, and [`TMA_DIRECT_STORE`]. Where a block has one tile
/// and the stages hold [`STAGED_BYTES`] (3 or more), the free stages stage
/// a 128-column tile's epilogue ([`wg_store_staged`]) unless that bit says
/// not to.
#[inline(always)]
pub unsafe fn gemm_tile_tma<
    L: TmaTiles,
    E: Epilogue,
    T: Fn([u32; 3]) -> (L, E),
    const HALF: bool,
    const MN: bool,
    const BN: u32,
>(
    tile: T,
    [n_total, m_total, problems]: [u32; 3],
    ring: u32,
) {
    let stages = ring & 0xff;
    if !(2..=TMA_STAGES_MAX).contains(&stages) {
        unsafe { core::arch::nvptx::trap() };
    }
    let tid = tid_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let smem = (shared_addr(shared::<f32>()) + 1023) & !1023;
    let full = smem + stages * WS_STAGE_BYTES;
    let empty = full + 8 * stages;
    let b_off = 128 * WS_ROW;
    let (nx, ny) = (n_total.div_ceil(BN), m_total.div_ceil(128));
    let total = nx * ny * problems;
    let at = |i: u32| [i % nx, i / nx % ny, i / (nx * ny)];
    let staged =
        BN == 128 && ring & TMA_DIRECT_STORE == 0 && gdim_x() >= total && stages * WS_STAGE_BYTES >= STAGED_BYTES;
    if tid == 0 {
        for s in 0..stages {
            unsafe {
                mbar_init(full + 8 * s, 1);
                mbar_init(empty + 8 * s, WS_THREADS / 32);
            }
        }
        mbar_init_fence();
    }
    sync_threads();
    // The ring's next stage and how many times it has wrapped.
    let (mut s, mut round) = (0u32, 0u32);
    let mut next = || {
        let now = (s, round);
        s += 1;
        if s == stages {
            s = 0;
            round += 1;
        }
        now
    };
    if warp == WS_THREADS / 32 {
        if lane == 0 {
            let mut i = bid_x();
            while i < total {
                let (l, _) = tile(at(i));
                if i == bid_x() {
                    unsafe { l.acquire() };
                }
                let mut c = l.start();
                for _ in 0..l.tiles() {
                    let (s, round) = next();
                    if round > 0 {
                        unsafe { mbar_wait(empty + 8 * s, (round - 1) % 2) };
                    }
                    let stage = smem + s * WS_STAGE_BYTES;
                    unsafe {
                        mbar_arrive_expect_tx(full + 8 * s, (128 + BN) * WS_ROW);
                        l.load(&mut c, stage, stage + b_off, full + 8 * s);
                    }
                }
                i += gdim_x();
            }
        }
        return;
    }
    let h = tid / VTHREADS;
    let mut i = bid_x();
    while i < total {
        let [x, y, problem] = at(i);
        let (l, e) = tile([x, y, problem]);
        let mut acc = [0.0f32; 64];
        let mut last = None;
        for _ in 0..l.tiles() {
            let (s, round) = next();
            unsafe { mbar_wait(full + 8 * s, round % 2) };
            let stage = smem + s * WS_STAGE_BYTES;
            if MN {
                ws_mma_mn(&mut acc, stage + 64 * h * WS_ROW, stage + b_off);
            } else {
                ws_mma::<HALF, BN>(&mut acc, stage + 64 * h * WS_ROW, stage + b_off);
            }
            // `ws_mma` waited for the K tile before this one: its stage is free.
            if let Some(p) = last
                && lane == 0
            {
                unsafe { mbar_arrive(empty + 8 * p) };
            }
            last = Some(s);
        }
        wgmma_wait::<0>();
        if let Some(p) = last
            && lane == 0
        {
            unsafe { mbar_arrive(empty + 8 * p) };
        }
        wgmma_hold::<BN>(&mut acc);
        if staged {
            unsafe { wg_store_staged(&e, &acc, smem, y * 128, x * 128, m_total, n_total) };
        } else {
            unsafe { wg_store(&e, &acc, BN, y * 128, x * BN, m_total, n_total) };
        }
        i += gdim_x();
    }
}

/// The products of [`gemm_tile_wg`] (tiles of 64 bytes of k per row,
/// [`wg_offset`]-laid): the accumulators of rows `0..64` and `64..128`.
#[inline(always)]
unsafe fn wg_products<A: VecOperand, B: VecOperand, const T: u8, const HALF: bool>(
    a: &A,
    b: &B,
    m_total: u32,
    n_total: u32,
    k_begin: u32,
    k_end: u32,
) -> ([f32; 64], [f32; 64]) {
    let tid = tid_x();
    let m0 = bid_y() * vbm(T);
    let n0 = bid_x() * vbn(T);
    let smem = shared_addr(shared::<f32>());
    let stage_bytes = wstage_bytes(T);
    let b_off = vbm(T) * 64;
    let bk = vbk(HALF);
    // Thread: chunk q of row r (and of rows r + 32j, slot j).
    let (q, r) = (tid % 4, tid / 4);
    let dst = wg_offset(r, q);
    let slot_bytes = wg_offset(VSLOT_ROWS, 0);
    let kq = vlen(HALF) * q;
    let mut ca = a.open(k_begin + kq, m0 + r, 0, VSLOT_ROWS);
    let mut cb = b.open(k_begin + kq, n0 + r, 0, VSLOT_ROWS);
    let (a_dummy, b_dummy) = (a.base(), b.base());
    let (a_slots, b_slots) = (vbm(T) / VSLOT_ROWS, vbn(T) / VSLOT_ROWS);
    let mut issue = |stage: u32, k0: u32| {
        let base = smem + stage * stage_bytes;
        let k_in = k0 + kq < k_end;
        for j in 0..4u32 {
            if j < a_slots {
                let inside = k_in && m0 + r + VSLOT_ROWS * j < m_total;
                let src = if inside { a.src(&ca, j as usize) } else { None };
                unsafe { cp_async_v4(base + dst + slot_bytes * j, src, a_dummy, A::L1) };
            }
        }
        for j in 0..4u32 {
            if j < b_slots {
                let inside = k_in && n0 + r + VSLOT_ROWS * j < n_total;
                let src = if inside { b.src(&cb, j as usize) } else { None };
                unsafe { cp_async_v4(base + b_off + dst + slot_bytes * j, src, b_dummy, B::L1) };
            }
        }
        a.step(&mut ca);
        b.step(&mut cb);
    };

    let tiles = if k_end > k_begin {
        (k_end - k_begin).div_ceil(bk)
    } else {
        0
    };
    let n_stages = wstages(T);
    for t in 0..n_stages - 2 {
        if t < tiles {
            issue(t, k_begin + t * bk);
        }
        cp_async_commit();
    }
    let (mut acc0, mut acc1) = ([0.0f32; 64], [0.0f32; 64]);
    for t in 0..tiles {
        // Tile t's copies are in (the newest one group may be pending),
        // visible to the async proxy, and every warp has passed the wait
        // for tile t − 1's `wgmma`s: tile t − 2's stage is free.
        match n_stages {
            4 => cp_async_wait::<1>(),
            6 => cp_async_wait::<3>(),
            _ => cp_async_wait::<5>(),
        }
        fence_proxy_async_shared();
        sync_threads();
        let ahead = t + n_stages - 2;
        if ahead < tiles {
            issue(ahead % n_stages, k_begin + ahead * bk);
        }
        cp_async_commit();

        let a_s = smem + (t % n_stages) * stage_bytes;
        let b_s = a_s + b_off;
        wgmma_fence();
        for s in 0..2u32 {
            let db = wg_desc(b_s + 2 * WG_LBO * s, WG_LBO, WG_SBO);
            let da = |h: u32| wg_desc(a_s + 8 * WG_SBO * h + 2 * WG_LBO * s, WG_LBO, WG_SBO);
            if vbn(T) == 128 {
                unsafe { wgmma::<HALF, 128>(&mut acc0, da(0), db) };
                if vbm(T) == 128 {
                    unsafe { wgmma::<HALF, 128>(&mut acc1, da(1), db) };
                }
            } else {
                unsafe { wgmma::<HALF, 64>(&mut acc0, da(0), db) };
                if vbm(T) == 128 {
                    unsafe { wgmma::<HALF, 64>(&mut acc1, da(1), db) };
                }
            }
        }
        wgmma_commit();
        wgmma_wait::<1>();
    }
    wgmma_wait::<0>();
    cp_async_wait::<0>();
    if vbn(T) == 128 {
        wgmma_hold::<128>(&mut acc0);
        wgmma_hold::<128>(&mut acc1);
    } else {
        wgmma_hold::<64>(&mut acc0);
        wgmma_hold::<64>(&mut acc1);
    }
    (acc0, acc1)
}

/// Tile coordinates of the vector engine's accumulator `acc[p][v]`: warp w
/// owns rows `BM/2·(w / 2)..` and columns `BN/2·(w % 2)..`; p = NJ·mi + nj
/// (NJ = BN/16) is the 16×8 block at rows `16·mi..`, columns `8·nj..` of
/// that, v which of its four values. Where an fp32 operand's tile is
/// row-major (`a_rm`, `b_rm`), its fragments come from [`rm_words`] and the
/// block's rows (columns) are interleaved instead: row `(g, h)` of block mi
/// is slice row `2·MI·g + 2·mi + h`, column n of block nj is `NJ·n + nj`.
#[inline(always)]
fn vtc_coord<const T: u8>(tid: u32, p: u32, v: u32, a_rm: bool, b_rm: bool) -> (u32, u32) {
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let nj_count = vnj(T) as u32;
    let (mi, nj) = (p / nj_count, p % nj_count);
    let (h, n) = (v / 2, 2 * t + v % 2);
    let row = if a_rm {
        2 * vmi(T) * g + 2 * mi + h
    } else {
        16 * mi + g + 8 * h
    };
    let col = if b_rm { nj_count * n + nj } else { 8 * nj + n };
    ((vbm(T) / 2) * (warp / 2) + row, (vbn(T) / 2) * (warp % 2) + col)
}

/// `[f(0), …, f(7)]` with the blocks past a warp's `vnj(T)` left zero,
/// written out so that the fragments stay in registers.
#[inline(always)]
fn each_nj<const T: u8, F: Copy + Default>(f: impl Fn(u32) -> F) -> [F; 8] {
    let g = |i: u32| if (i as usize) < vnj(T) { f(i) } else { F::default() };
    [g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7)]
}

/// The four fp32 words of a K-major shared tile (`[x][k]`, 16 deep) that
/// lane (g, t) of a warp needs for row/column `x0 + g` at k = t, t+4, t+8,
/// t+12: one `ldmatrix`.
#[inline(always)]
unsafe fn frag_words(tile: u32, x0: u32) -> [u32; 4] {
    let lane = tid_x() % 32;
    // Lanes 8i..8i+7 address rows x0..x0+7 at k = 4i.
    let addr = tile + (x0 + lane % 8) * VROW_BYTES + 16 * (lane / 8);
    unsafe { ldmatrix_x4(addr) }
}

/// The TF32 `mma` A fragment of rows `r..r+16` at k `8s..8s+8` of a
/// K-major shared tile, in the `mma`'s register order (row g, k t; row
/// g+8, k t; row g, k t+4; row g+8, k t+4): one `ldmatrix`, whose matrix q
/// is rows `r + 8·(q % 2)` at k `8s + 4·(q / 2)`. Loading rows g and g+8
/// with separate `ldmatrix`es instead left ptxas four moves per fragment
/// (the `mma` wants its A registers consecutive): ~2.5 moves per `mma` in
/// conv2's TF32 forward (SASS of `…-v18/probe`).
#[inline(always)]
unsafe fn a_frag_tf32(tile: u32, r: u32, s: u32) -> [u32; 4] {
    let lane = tid_x() % 32;
    let (l8, q) = (lane % 8, lane / 8);
    unsafe { ldmatrix_x4(tile + (r + l8 + 8 * (q % 2)) * VROW_BYTES + 16 * (2 * s + q / 2)) }
}

/// The four fp32 words of a row-major shared tile (as [`rm_words`] reads)
/// that lane (g, t) needs for column `x0 + g` at k = t, t+4, t+8, t+12:
/// scalar loads, for columns kept in `mma` order. Conflict-free for tiles
/// of 64 columns (every TF32 product with a row-major B: the weight
/// gradients and fc data gradients); 128-column tiles' swizzle would make
/// them 2-way conflicted (none reads them this way today).
#[inline(always)]
unsafe fn rm_column(tile: u32, x0: u32, rows: u32, stride: u32) -> [u32; 4] {
    let lane = tid_x() % 32;
    let (g, t) = (lane / 4, lane % 4);
    let x = x0 + g;
    let at = 16 * ((x / 4) ^ rm_swizzle(rows, t)) + 4 * (x % 4);
    let ld = |kk: u32| unsafe { ld_shared(tile + (t + 4 * kk) * stride + at).to_bits() };
    [ld(0), ld(1), ld(2), ld(3)]
}

/// The words of a row-major fp32 shared tile (`[k][x]`, 16 deep, `stride`
/// bytes per k row, chunks swizzled by [`rm_swizzle`]) that lane (g, t)
/// needs for its warp's slice `x0..x0 + rows/2`: `w[kk][e]` is k = t + 4·kk,
/// slice entry `q·4·g + e` (q = rows/64: one or two 16-byte loads per k).
/// The slice's entries are interleaved across the 16×8 blocks (see
/// [`vtc_coord`]), so each lane's share is contiguous.
#[inline(always)]
unsafe fn rm_words(tile: u32, x0: u32, rows: u32, stride: u32) -> [[u32; 8]; 4] {
    let lane = tid_x() % 32;
    let (g, t) = (lane / 4, lane % 4);
    let q = rows / 64;
    let sw = rm_swizzle(rows, t);
    let row = |kk: u32| {
        let base = tile + (t + 4 * kk) * stride + 4 * x0;
        let ld = |i: u32| unsafe { ld_shared_v4(base + 16 * ((q * g + i) ^ sw)).map(f32::to_bits) };
        let lo = ld(0);
        let hi = if q == 2 { ld(1) } else { [0; 4] };
        [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
    };
    [row(0), row(1), row(2), row(3)]
}

/// Products of one fp32 shared K tile for the vector engine: per warp, its
/// (BM/2)×(BN/2) slice as 16×8 accumulators (see [`vtc_coord`]).
#[inline(always)]
unsafe fn vmma_tile<A: VecOperand, B: VecOperand, E: Epilogue, const MODE: u8, const T: u8>(
    a_s: u32,
    b_s: u32,
    acc: &mut [[f32; 4]; 32],
) {
    let warp = tid_x() / 32;
    let row0 = (vbm(T) / 2) * (warp / 2);
    let col0 = (vbn(T) / 2) * (warp % 2);
    let a_stride = rm_stride(false, vbm(T));
    let b_stride = rm_stride(false, vbn(T));
    let nj_count = vnj(T);
    // Words for rows r..r+7 and r+8..r+15 of A, columns c..c+7 of B, each at
    // k = t, t+4, t+8, t+12.
    // Row-major tiles: every word the lane needs, up front (see `rm_words`).
    let a_rm = if A::K_MAJOR {
        [[0; 8]; 4]
    } else {
        unsafe { rm_words(a_s, row0, vbm(T), a_stride) }
    };
    let b_rm = if !b_interleaved::<B, E, MODE, false>() {
        [[0; 8]; 4]
    } else {
        unsafe { rm_words(b_s, col0, vbn(T), b_stride) }
    };
    let bw = |nj: u32| {
        if B::K_MAJOR {
            unsafe { frag_words(b_s, col0 + 8 * nj) }
        } else if !b_interleaved::<B, E, MODE, false>() {
            unsafe { rm_column(b_s, col0 + 8 * nj, vbn(T), b_stride) }
        } else {
            let e = nj as usize;
            [b_rm[0][e], b_rm[1][e], b_rm[2][e], b_rm[3][e]]
        }
    };
    // Rows g (`h` = 0) or g + 8 (`h` = 1) of 16-row block mi.
    let aw = |mi: u32, h: u32| {
        if A::K_MAJOR {
            unsafe { frag_words(a_s, row0 + 16 * mi + 8 * h) }
        } else {
            let e = (2 * mi + h) as usize;
            [a_rm[0][e], a_rm[1][e], a_rm[2][e], a_rm[3][e]]
        }
    };
    let b = each_nj::<T, _>(bw);
    if MODE == TF32 || MODE == TF32_ROUNDED {
        let tf = |w: u32| {
            if MODE == TF32 {
                to_tf32(f32::from_bits(w))
            } else {
                w
            }
        };
        // k8 step s reads k = 8s + t and 8s + t + 4: words 2s and 2s + 1.
        let bt = b.map(|w| w.map(tf));
        let mut rows = |mi: u32| {
            // Both k8 steps' A fragments first, as the row-major path does.
            let a2 = if A::K_MAJOR {
                let f = |s: u32| unsafe { a_frag_tf32(a_s, row0 + 16 * mi, s) }.map(tf);
                [f(0), f(1)]
            } else {
                let (lo, hi) = (aw(mi, 0).map(tf), aw(mi, 1).map(tf));
                [[lo[0], hi[0], lo[1], hi[1]], [lo[2], hi[2], lo[3], hi[3]]]
            };
            for (s, &a) in a2.iter().enumerate() {
                for nj in 0..nj_count {
                    let p = nj_count * mi as usize + nj;
                    acc[p] = mma_tf32(a, [bt[nj][2 * s], bt[nj][2 * s + 1]], acc[p]);
                }
            }
        };
        each_mi::<T>(&mut rows);
    } else {
        let pk = |w: [u32; 4]| {
            let f = |i: usize| f32::from_bits(w[i]);
            [pack_bf16(f(0), f(1)), pack_bf16(f(2), f(3))]
        };
        let bp = b.map(pk);
        let mut rows = |mi: u32| {
            let lo = pk(aw(mi, 0));
            let hi = pk(aw(mi, 1));
            let a = [lo[0], hi[0], lo[1], hi[1]];
            for nj in 0..nj_count {
                let p = nj_count * mi as usize + nj;
                acc[p] = mma_bf16(a, bp[nj], acc[p]);
            }
        };
        each_mi::<T>(&mut rows);
    }
}

/// Calls `f(mi)` for each 16-row block of a warp's slice, `mi < vmi(T)`,
/// written out so that accumulator indices stay constants (registers).
#[inline(always)]
fn each_mi<const T: u8>(f: &mut impl FnMut(u32)) {
    f(0);
    f(1);
    if vmi(T) == 4 {
        f(2);
        f(3);
    }
}

/// Products of one bf16 shared K tile (32 deep) for the vector engine.
/// A fragments (16 rows × 16 k): K-major, `ldmatrix` of rows r..r+15 at k
/// and k+8; row-major, `ldmatrix.trans` of k rows at columns r and r+8.
/// B (8 columns × 32 k, both k16 steps): four 8×8 blocks along k.
#[inline(always)]
unsafe fn vmma_tile_half<A: VecOperand, B: VecOperand, const T: u8>(
    a_s: u32,
    b_s: u32,
    acc: &mut [[f32; 4]; 32],
) {
    let lane = tid_x() % 32;
    let warp = tid_x() / 32;
    let row0 = (vbm(T) / 2) * (warp / 2);
    let col0 = (vbn(T) / 2) * (warp % 2);
    let (l8, q) = (lane % 8, lane / 8);
    let a_stride = rm_stride(true, vbm(T));
    let b_stride = rm_stride(true, vbn(T));
    let nj_count = vnj(T);
    // B: matrix q holds k 8q..8q+7 of columns c..c+7: registers
    // [step 0 lo, step 0 hi, step 1 lo, step 1 hi].
    let bfrag = |c: u32| unsafe {
        if B::K_MAJOR {
            ldmatrix_x4(b_s + (c + l8) * VROW_BYTES + 16 * q)
        } else {
            ldmatrix_x4_trans(b_s + (8 * q + l8) * b_stride + 2 * c)
        }
    };
    // A, k16 step s: matrix q holds rows r + 8·(q % 2), k 16s + 8·(q / 2).
    let afrag = |r: u32, s: u32| unsafe {
        if A::K_MAJOR {
            ldmatrix_x4(a_s + (r + l8 + 8 * (q % 2)) * VROW_BYTES + 32 * s + 16 * (q / 2))
        } else {
            ldmatrix_x4_trans(a_s + (16 * s + l8 + 8 * (q / 2)) * a_stride + 2 * (r + 8 * (q % 2)))
        }
    };
    let b = each_nj::<T, _>(|nj| bfrag(col0 + 8 * nj));
    for s in 0..2u32 {
        let mut rows = |mi: u32| {
            let a = afrag(row0 + 16 * mi, s);
            for nj in 0..nj_count {
                let p = nj_count * mi as usize + nj;
                let bs = [b[nj][2 * s as usize], b[nj][2 * s as usize + 1]];
                acc[p] = mma_bf16(a, bs, acc[p]);
            }
        };
        each_mi::<T>(&mut rows);
    }
}

/// A dense matrix for the vector engine: element `(k, i)` at
/// `p[k·ks + i·is]` (fp32, or bf16 when `H`), with `ks = 1` (`K_MAJOR`) or
/// `is = 1`; vectors start 16-byte aligned. `CA`: copies go through L1
/// (the conv forwards' and data gradients' filter banks, which
/// neighbouring blocks re-read).
#[derive(Clone, Copy)]
pub struct VStrided<const K_MAJOR: bool, const H: bool, const CA: bool = false> {
    pub p: *const f32,
    pub ks: usize,
    pub is: usize,
}

/// A `VStrided` cursor: the offset of the thread's first element and the
/// offset between its slots.
#[derive(Clone, Copy)]
pub struct VStridedCursor {
    off: usize,
    slot: usize,
}

impl<const KM: bool, const H: bool, const CA: bool> VecOperand for VStrided<KM, H, CA> {
    const K_MAJOR: bool = KM;
    const HALF: bool = H;
    const L1: bool = CA;
    type Cursor = VStridedCursor;
    #[inline(always)]
    fn open(&self, k: u32, i0: u32, dk: u32, di: u32) -> VStridedCursor {
        VStridedCursor {
            off: (k as usize)
                .wrapping_mul(self.ks)
                .wrapping_add((i0 as usize).wrapping_mul(self.is)),
            slot: dk as usize * self.ks + di as usize * self.is,
        }
    }
    #[inline(always)]
    fn src(&self, c: &VStridedCursor, j: usize) -> Option<*const f32> {
        Some(elem_at(self.p, c.off.wrapping_add(j * c.slot), H))
    }
    #[inline(always)]
    fn step(&self, c: &mut VStridedCursor) {
        c.off = c.off.wrapping_add(vbk(H) as usize * self.ks);
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.p
    }
}
