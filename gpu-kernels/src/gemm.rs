//! Tiled fp32 matrix products: the shared engine behind the fully connected
//! layers and the implicit-GEMM convolutions (`conv.rs`).
//!
//! `C[m, n] = Σ_k A(m, k) · B(k, n)` where `A` and `B` are *operands*: small
//! types that walk one row of A or column of B along k with a per-thread
//! cursor (plain strided matrices here, gathered image patches in `conv.rs`).
//! The
//! result goes through an *epilogue* that stores it (adding a bias, or writing
//! a split-K partial).
//!
//! Tiling: a block of 256 threads computes a 64×64 tile of C, stepping through
//! K 16 at a time. Each step loads a 64×16 tile of A and a 16×64 tile of B into
//! shared memory (prefetched into registers one step ahead), then each thread
//! accumulates a 4×4 sub-tile: thread (tx, ty) = (tid % 16, tid / 16) owns rows
//! `4·ty..4·ty+4` and columns `4·tx..4·tx+4`. Global loads are coalesced along
//! whichever index is contiguous in memory (`K_FAST`). A thread's four
//! elements of a tile share one k, so one cursor per operand (opened once:
//! the only integer divisions) is stepped by adds and compares and read at
//! four fixed offsets.
//!
//! The `MODE` parameter picks the arithmetic. `FP32`: CUDA-core FMAs as above.
//! `TF32`: the same tiles on the tensor cores (`mma.sync` m16n8k8, operands
//! rounded to TF32 when they enter shared memory, fp32 accumulation).
//! `BF16`: operands rounded to bf16 when they enter shared memory, stored as
//! pairs adjacent along k (the register layout of `mma.sync` m16n8k16 bf16),
//! fp32 accumulation. In both tensor-core modes warp w of 8 owns a 16×32
//! slice of the tile, rows `16·(w / 2)..`, columns `32·(w % 2)..`, as four
//! 16×8 accumulators.
//!
//! Grid: x over 64-column tiles of N, y over 64-row tiles of M, z over
//! independent problems (conv groups × split-K slices).

use crate::device::{
    bid_x, bid_y, fma, ld_shared_v4, mma_bf16, mma_tf32, shared, shared_addr, sync_threads, tid_x,
    to_bf16, to_tf32,
};

/// `MODE` of [`gemm_tile`]: fp32 FMAs on the CUDA cores.
pub const FP32: u8 = 0;
/// `MODE` of [`gemm_tile`]: TF32 tensor cores.
pub const TF32: u8 = 1;
/// `MODE` of [`gemm_tile`]: bf16 tensor cores.
pub const BF16: u8 = 2;

pub const BM: u32 = 64;
pub const BN: u32 = 64;
pub const BK: u32 = 16;
pub const THREADS: u32 = 256;
/// Row padding of the shared tiles (keeps 16-byte alignment, spreads banks).
const PAD: u32 = 4;
const AS_STRIDE: u32 = BM + PAD;
const BS_STRIDE: u32 = BN + PAD;
/// Row stride, in bf16 pairs, of the BF16 tiles (`[BK/2][row][2]`): 72 words
/// put the 32 lanes of a fragment load (`t·72 + g`) in 32 different banks.
const PAIR_STRIDE: u32 = 72;
/// Dynamic shared memory the engine needs, in bytes.
pub const SHARED_BYTES: u32 = (BK * AS_STRIDE + BK * BS_STRIDE) * 4;

/// One operand of the product, `A(m, k)` or `B(k, n)`, read through
/// per-thread *cursors*. Each thread loads four elements of the operand's
/// tile per K step, all at the same `k` and at four rows of A / columns of B
/// (`i0 + 16·j`). The engine opens one cursor for the four once, then reads
/// them and steps the cursor `BK` further along k each K step. The cursor
/// keeps the shared k position in whatever mixed-radix form the operand needs
/// (e.g. channel, kh, kw of an image patch) plus per-element offsets fixed
/// over the K loop, so a read is an add or two, a bounds check and a load,
/// and a step costs adds and compares, not integer divisions.
pub trait Operand {
    /// Whether consecutive `k` are adjacent in memory (else consecutive rows
    /// of A / columns of B).
    const K_FAST: bool;
    type Cursor: Copy;
    /// A cursor at `k` for rows/columns `i0 + 16·j`, j in 0..4. Does not
    /// touch memory; positions may lie outside the operand.
    fn open(&self, k: u32, i0: u32) -> Self::Cursor;
    /// Element `j` under the cursor (0 in a convolution's padding); called
    /// only for `k < k_end` and a row/column inside the operand.
    unsafe fn read(&self, c: &Self::Cursor, j: usize) -> f32;
    /// Moves the cursor `BK` further along k.
    fn step(&self, c: &mut Self::Cursor);
}

/// Rows/columns of a thread's four elements are `i0 + SLOT_STRIDE·j`.
pub const SLOT_STRIDE: u32 = 16;

/// Where a finished `C[m, n]` goes (called only for `m < M`, `n < N`).
pub trait Epilogue {
    unsafe fn store(&self, m: u32, n: u32, acc: f32);
}

/// Computes the 64×64 tile of C at block (bid_x, bid_y) over `k` in
/// `k_begin..k_end`. All 256 threads of the block must call it.
#[inline(always)]
pub unsafe fn gemm_tile<A: Operand, B: Operand, E: Epilogue, const MODE: u8>(
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
    let m0 = bid_y() * BM;
    let n0 = bid_x() * BN;
    let a_s: *mut f32 = shared::<f32>();
    let b_s: *mut f32 = unsafe { a_s.add((BK * AS_STRIDE) as usize) };
    // BF16 tiles: element (k, row) at `((k/2)·PAIR_STRIDE + row)·2 + k%2`.
    let a_h: *mut u16 = a_s as *mut u16;
    let b_h: *mut u16 = unsafe { a_h.add((BK * PAIR_STRIDE) as usize) };
    let pair_idx = |k: u32, row: u32| (((k / 2) * PAIR_STRIDE + row) * 2 + k % 2) as usize;

    // This thread's four elements of each tile share one k and sit at rows
    // (A) or columns (B) `i0 + 16·j`. With k fast in memory, the 16 lanes of
    // a half-warp take 16 consecutive k; otherwise 16 consecutive rows or
    // columns, so global loads stay coalesced either way.
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

    let mut load_regs = |k0: u32, ra: &mut [f32; 4], rb: &mut [f32; 4]| {
        let a_in = k0 + a_k < k_end;
        let b_in = k0 + b_k < k_end;
        for j in 0..4 {
            ra[j] = if a_in && m0 + a_i + SLOT_STRIDE * (j as u32) < m_total {
                unsafe { a.read(&ca, j) }
            } else {
                0.0
            };
            rb[j] = if b_in && n0 + b_i + SLOT_STRIDE * (j as u32) < n_total {
                unsafe { b.read(&cb, j) }
            } else {
                0.0
            };
        }
        a.step(&mut ca);
        b.step(&mut cb);
    };

    // Shared-window addresses of this thread's 4 A rows and 4 B columns
    // (fp32 mode).
    let a_row = shared_addr(a_s) + ty * 16;
    let b_col = shared_addr(b_s) + tx * 16;
    let round = |v: f32| {
        if MODE == TF32 {
            f32::from_bits(to_tf32(v))
        } else {
            v
        }
    };
    let mut acc = [[0.0f32; 4]; 4];
    let mut ra = [0.0f32; 4];
    let mut rb = [0.0f32; 4];
    let mut k0 = k_begin;
    if k0 < k_end {
        load_regs(k0, &mut ra, &mut rb);
    }
    while k0 < k_end {
        for j in 0..4u32 {
            let (mi, ni) = (a_i + SLOT_STRIDE * j, b_i + SLOT_STRIDE * j);
            if MODE == BF16 {
                unsafe { *a_h.add(pair_idx(a_k, mi)) = to_bf16(ra[j as usize]) };
                unsafe { *b_h.add(pair_idx(b_k, ni)) = to_bf16(rb[j as usize]) };
            } else {
                unsafe { *a_s.add((a_k * AS_STRIDE + mi) as usize) = round(ra[j as usize]) };
                unsafe { *b_s.add((b_k * BS_STRIDE + ni) as usize) = round(rb[j as usize]) };
            }
        }
        sync_threads();
        let next = k0 + BK;
        if next < k_end {
            load_regs(next, &mut ra, &mut rb);
        }
        if MODE == TF32 {
            unsafe { mma_steps(a_s, b_s, &mut acc) };
        } else if MODE == BF16 {
            unsafe { mma_step_bf16(a_s as *const u32, b_h as *const u32, &mut acc) };
        } else {
            for kk in 0..BK {
                // 16-byte aligned: strides and offsets are multiples of 4 floats.
                let av = unsafe { ld_shared_v4(a_row + kk * AS_STRIDE * 4) };
                let bv = unsafe { ld_shared_v4(b_col + kk * BS_STRIDE * 4) };
                for i in 0..4 {
                    for j in 0..4 {
                        acc[i][j] = fma(av[i], bv[j], acc[i][j]);
                    }
                }
            }
        }
        sync_threads();
        k0 = next;
    }

    // Written out so that `acc` stays in registers (a loop the compiler
    // declines to unroll would index it at run time, from local memory).
    let store = |i: u32, j: u32, v: f32| {
        let (mi, ni) = if MODE != FP32 {
            tc_coord(tid, i, j)
        } else {
            (ty * 4 + i, tx * 4 + j)
        };
        let (m, n) = (m0 + mi, n0 + ni);
        if m < m_total && n < n_total {
            unsafe { e.store(m, n, v) };
        }
    };
    store(0, 0, acc[0][0]);
    store(0, 1, acc[0][1]);
    store(0, 2, acc[0][2]);
    store(0, 3, acc[0][3]);
    store(1, 0, acc[1][0]);
    store(1, 1, acc[1][1]);
    store(1, 2, acc[1][2]);
    store(1, 3, acc[1][3]);
    store(2, 0, acc[2][0]);
    store(2, 1, acc[2][1]);
    store(2, 2, acc[2][2]);
    store(2, 3, acc[2][3]);
    store(3, 0, acc[3][0]);
    store(3, 1, acc[3][1]);
    store(3, 2, acc[3][2]);
    store(3, 3, acc[3][3]);
}

/// Tile coordinates of accumulator `acc[j][i]` in the tensor-core layout
/// (`j` = which 16×8 product, `i` = which of its four values).
#[inline(always)]
fn tc_coord(tid: u32, i: u32, j: u32) -> (u32, u32) {
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let row = 16 * (warp / 2) + g + 8 * (j / 2);
    let col = 32 * (warp % 2) + 8 * i + 2 * t + j % 2;
    (row, col)
}

/// The tensor-core inner loop over one shared-memory K tile: two k8 steps,
/// four m16n8k8 products per warp each. `acc[n8 tile][value]`.
#[inline(always)]
unsafe fn mma_steps(a_s: *const f32, b_s: *const f32, acc: &mut [[f32; 4]; 4]) {
    let tid = tid_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let row0 = 16 * (warp / 2);
    let col0 = 32 * (warp % 2);
    let ld = |p: *const f32, k: u32, x: u32, stride: u32| unsafe {
        (*p.add((k * stride + x) as usize)).to_bits()
    };
    for step in 0..BK / 8 {
        let k0 = 8 * step;
        let a = [
            ld(a_s, k0 + t, row0 + g, AS_STRIDE),
            ld(a_s, k0 + t, row0 + g + 8, AS_STRIDE),
            ld(a_s, k0 + t + 4, row0 + g, AS_STRIDE),
            ld(a_s, k0 + t + 4, row0 + g + 8, AS_STRIDE),
        ];
        let b = |j: u32| {
            let col = col0 + 8 * j + g;
            [
                ld(b_s, k0 + t, col, BS_STRIDE),
                ld(b_s, k0 + t + 4, col, BS_STRIDE),
            ]
        };
        acc[0] = mma_tf32(a, b(0), acc[0]);
        acc[1] = mma_tf32(a, b(1), acc[1]);
        acc[2] = mma_tf32(a, b(2), acc[2]);
        acc[3] = mma_tf32(a, b(3), acc[3]);
    }
}

/// The bf16 inner loop over one shared-memory K tile: one k16 step, four
/// m16n8k16 products per warp. `a_p`/`b_p` are the tiles as bf16 pairs.
#[inline(always)]
unsafe fn mma_step_bf16(a_p: *const u32, b_p: *const u32, acc: &mut [[f32; 4]; 4]) {
    let tid = tid_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let row0 = 16 * (warp / 2);
    let col0 = 32 * (warp % 2);
    let ld = |p: *const u32, k2: u32, x: u32| unsafe { *p.add((k2 * PAIR_STRIDE + x) as usize) };
    let a = [
        ld(a_p, t, row0 + g),
        ld(a_p, t, row0 + g + 8),
        ld(a_p, t + 4, row0 + g),
        ld(a_p, t + 4, row0 + g + 8),
    ];
    let b = |j: u32| {
        let col = col0 + 8 * j + g;
        [ld(b_p, t, col), ld(b_p, t + 4, col)]
    };
    acc[0] = mma_bf16(a, b(0), acc[0]);
    acc[1] = mma_bf16(a, b(1), acc[1]);
    acc[2] = mma_bf16(a, b(2), acc[2]);
    acc[3] = mma_bf16(a, b(3), acc[3]);
}

/// Declares the fp32, TF32 and bf16 entry points of a GEMM-engine kernel
/// (`$impl::<FP32>`, `<TF32>`, `<BF16>`), with the same parameters.
macro_rules! gemm_kernels {
    ($imp:ident => $fp32:ident, $tf32:ident, $bf16:ident ($($arg:ident: $ty:ty),* $(,)?)) => {
        /// fp32 (CUDA-core FMA) variant; see the `_impl` function's doc.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $fp32($($arg: $ty),*) {
            unsafe { $imp::<{ $crate::gemm::FP32 }>($($arg),*) }
        }
        /// TF32 tensor-core variant; see the `_impl` function's doc.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $tf32($($arg: $ty),*) {
            unsafe { $imp::<{ $crate::gemm::TF32 }>($($arg),*) }
        }
        /// bf16 tensor-core variant; see the `_impl` function's doc.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $bf16($($arg: $ty),*) {
            unsafe { $imp::<{ $crate::gemm::BF16 }>($($arg),*) }
        }
    };
}
pub(crate) use gemm_kernels;

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
    unsafe fn read(&self, c: &usize, j: usize) -> f32 {
        unsafe { *self.p.add(c + j * SLOT_STRIDE as usize * self.is) }
    }
    #[inline(always)]
    fn step(&self, c: &mut usize) {
        *c = c.wrapping_add(BK as usize * self.ks);
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
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let b = if self.bias.is_null() {
            0.0
        } else if self.bias_by_row {
            unsafe { *self.bias.add(m as usize) }
        } else {
            unsafe { *self.bias.add(n as usize) }
        };
        unsafe { *self.c.add(m as usize * self.rs + n as usize * self.cs) = acc + b };
    }
}

/// Fully connected forward, `y[b, o] = Σ_i x[b, i]·w[o, i] + bias[o]`.
///
/// As a GEMM: M = batch, N = outputs, K = inputs; A = x (row-major, k fast),
/// B(k, n) = w[n, k] (k fast). Grid (⌈outputs/64⌉, ⌈batch/64⌉, 1), 256 threads,
/// `SHARED_BYTES` of dynamic shared memory.
unsafe fn fc_forward_impl<const MODE: u8>(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
) {
    let (ni, no) = (inputs as usize, outputs as usize);
    let a = Strided::<true> {
        p: x,
        ks: 1,
        is: ni,
    };
    let b = Strided::<true> {
        p: w,
        ks: 1,
        is: ni,
    };
    let e = StoreStrided {
        c: y,
        rs: no,
        cs: 1,
        bias,
        bias_by_row: false,
    };
    unsafe { gemm_tile::<_, _, _, MODE>(&a, &b, &e, batch, outputs, 0, inputs) };
}

gemm_kernels!(fc_forward_impl => fc_forward, fc_forward_tf32, fc_forward_bf16 (x: *const f32, w: *const f32, bias: *const f32, y: *mut f32, batch: u32, inputs: u32, outputs: u32));

/// Fully connected data gradient, `dx[b, i] = Σ_o dy[b, o]·w[o, i]`.
///
/// M = batch, N = inputs, K = outputs; A = dy (k fast), B(k, n) = w[k, n]
/// (n fast). Grid (⌈inputs/64⌉, ⌈batch/64⌉, 1).
unsafe fn fc_backward_data_impl<const MODE: u8>(
    dy: *const f32,
    w: *const f32,
    dx: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
) {
    let (ni, no) = (inputs as usize, outputs as usize);
    let a = Strided::<true> {
        p: dy,
        ks: 1,
        is: no,
    };
    let b = Strided::<false> {
        p: w,
        ks: ni,
        is: 1,
    };
    let e = StoreStrided {
        c: dx,
        rs: ni,
        cs: 1,
        bias: core::ptr::null(),
        bias_by_row: false,
    };
    unsafe { gemm_tile::<_, _, _, MODE>(&a, &b, &e, batch, inputs, 0, outputs) };
}

gemm_kernels!(fc_backward_data_impl => fc_backward_data, fc_backward_data_tf32, fc_backward_data_bf16 (dy: *const f32, w: *const f32, dx: *mut f32, batch: u32, inputs: u32, outputs: u32));

/// Fully connected weight gradient, `dw[o, i] = Σ_b dy[b, o]·x[b, i]`.
///
/// M = outputs, N = inputs, K = batch; A(m, k) = dy[k, m] (m fast),
/// B(k, n) = x[k, n] (n fast). Grid (⌈inputs/64⌉, ⌈outputs/64⌉, 1).
unsafe fn fc_backward_filter_impl<const MODE: u8>(
    x: *const f32,
    dy: *const f32,
    dw: *mut f32,
    batch: u32,
    inputs: u32,
    outputs: u32,
) {
    let (ni, no) = (inputs as usize, outputs as usize);
    let a = Strided::<false> {
        p: dy,
        ks: no,
        is: 1,
    };
    let b = Strided::<false> {
        p: x,
        ks: ni,
        is: 1,
    };
    let e = StoreStrided {
        c: dw,
        rs: ni,
        cs: 1,
        bias: core::ptr::null(),
        bias_by_row: false,
    };
    unsafe { gemm_tile::<_, _, _, MODE>(&a, &b, &e, outputs, inputs, 0, batch) };
}

gemm_kernels!(fc_backward_filter_impl => fc_backward_filter, fc_backward_filter_tf32, fc_backward_filter_bf16 (x: *const f32, dy: *const f32, dw: *mut f32, batch: u32, inputs: u32, outputs: u32));

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
/// fixed order (deterministic). 1-D grid-stride.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn splitk_reduce(
    ws: *const f32,
    out: *mut f32,
    len: usize,
    parts: u32,
) {
    let (mut i, step) = crate::device::grid_stride();
    while i < len {
        let mut s = 0.0f32;
        for p in 0..parts as usize {
            s += unsafe { *ws.add(p * len + i) };
        }
        unsafe { *out.add(i) = s };
        i += step;
    }
}
