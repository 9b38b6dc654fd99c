//! Device helpers shared by the kernel families: thread indices, dynamic shared
//! memory, fast exp/log through PTX `ex2`/`lg2`, warp shuffles and barriers.

use core::arch::asm;
use core::arch::nvptx;

#[inline(always)]
pub fn tid_x() -> u32 {
    unsafe { nvptx::_thread_idx_x() as u32 }
}
#[inline(always)]
pub fn tid_y() -> u32 {
    unsafe { nvptx::_thread_idx_y() as u32 }
}
#[inline(always)]
pub fn bid_x() -> u32 {
    unsafe { nvptx::_block_idx_x() as u32 }
}
#[inline(always)]
pub fn bid_y() -> u32 {
    unsafe { nvptx::_block_idx_y() as u32 }
}
#[inline(always)]
pub fn bid_z() -> u32 {
    unsafe { nvptx::_block_idx_z() as u32 }
}
#[inline(always)]
pub fn bdim_x() -> u32 {
    unsafe { nvptx::_block_dim_x() as u32 }
}
#[inline(always)]
pub fn bdim_y() -> u32 {
    unsafe { nvptx::_block_dim_y() as u32 }
}
#[inline(always)]
pub fn gdim_x() -> u32 {
    unsafe { nvptx::_grid_dim_x() as u32 }
}
#[inline(always)]
pub fn gdim_y() -> u32 {
    unsafe { nvptx::_grid_dim_y() as u32 }
}

/// Global index of this thread along x, and the grid-stride step.
#[inline(always)]
pub fn grid_stride() -> (usize, usize) {
    let i = bid_x() as usize * bdim_x() as usize + tid_x() as usize;
    (i, gdim_x() as usize * bdim_x() as usize)
}

/// As [`grid_stride`] in 32 bits, for grids over fewer than 2^31 items
/// (the index plus the step then never wraps).
#[inline(always)]
pub fn grid_stride_u32() -> (u32, u32) {
    (bid_x() * bdim_x() + tid_x(), gdim_x() * bdim_x())
}

/// Division by a divisor `d ≥ 1` fixed at launch, for numerators below
/// 2^31: `n / d = (mulhi(n, mul) + n) >> shr`, three instructions where a
/// `div.u32` by a register is a sequence of about twenty. The host computes
/// `mul` and `shr` (`backend::cuda::FastDiv::new`, CUTLASS's `FastDivmod`
/// rule: `shr = ⌈log2 d⌉`, `mul = ⌊2^32·(2^shr − d)/d⌋ + 1`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FastDiv {
    pub d: u32,
    pub mul: u32,
    pub shr: u32,
}

impl FastDiv {
    /// The host's rule on the GPU (`d` in `1..=2^31`), for a divisor known
    /// only in the kernel: one 64-bit division, then three instructions a
    /// quotient.
    #[inline(always)]
    pub fn new(d: u32) -> Self {
        let shr = 32 - (d - 1).leading_zeros();
        let mul = (((1u64 << 32) * ((1u64 << shr) - d as u64)) / d as u64 + 1) as u32;
        FastDiv { d, mul, shr }
    }

    #[inline(always)]
    pub fn div(&self, n: u32) -> u32 {
        let hi = ((n as u64 * self.mul as u64) >> 32) as u32;
        (hi + n) >> self.shr
    }

    /// `(n / d, n % d)`.
    #[inline(always)]
    pub fn divmod(&self, n: u32) -> (u32, u32) {
        let q = self.div(n);
        (q, n - q * self.d)
    }
}

#[inline(always)]
pub fn sync_threads() {
    unsafe { nvptx::_syncthreads() }
}

/// Start of the block's dynamic shared memory (sized by the launcher).
#[inline(always)]
pub fn shared<T>() -> *mut T {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<T>()
}

/// 2^x (PTX `ex2.approx.ftz.f32`, max rel. error ~2^-22).
#[inline(always)]
pub fn ex2(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("ex2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// log2(x) (PTX `lg2.approx.ftz.f32`).
#[inline(always)]
pub fn lg2(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("lg2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// e^x for the softmax; exact to a few ulp over the range used (x ≤ 0).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    ex2(x * core::f32::consts::LOG2_E)
}

/// Natural logarithm.
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    lg2(x) * core::f32::consts::LN_2
}

/// 1/x (PTX `rcp.approx.ftz.f32`, max rel. error ~2^-23).
#[inline(always)]
pub fn rcp(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("rcp.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// x^p for x > 0.
#[inline(always)]
pub fn powf(x: f32, p: f32) -> f32 {
    ex2(p * lg2(x))
}

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn shfl_bfly_f32(mask: u32, v: f32, lane_mask: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
    fn shfl_bfly_i32(mask: u32, v: i32, lane_mask: u32, clamp: u32) -> i32;
}

/// Sum over the 32 lanes of a warp (all lanes get the result).
#[inline(always)]
pub fn warp_sum(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        v += unsafe { shfl_bfly_f32(0xffff_ffff, v, m, 0x1f) };
        m >>= 1;
    }
    v
}

/// Max over the 32 lanes of a warp (all lanes get the result).
#[inline(always)]
pub fn warp_max(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        v = v.max(unsafe { shfl_bfly_f32(0xffff_ffff, v, m, 0x1f) });
        m >>= 1;
    }
    v
}

/// Integer sum over the 32 lanes of a warp.
#[inline(always)]
pub fn warp_sum_i32(mut v: i32) -> i32 {
    let mut m = 16;
    while m > 0 {
        v += unsafe { shfl_bfly_i32(0xffff_ffff, v, m, 0x1f) };
        m >>= 1;
    }
    v
}

/// Block-wide sum of `v` for a block of `bdim_x()` threads (a multiple of 32,
/// at most 1024); every thread gets the result. Needs 32 floats of shared
/// memory at `scratch` and contains barriers: all threads must call it.
#[inline(always)]
pub unsafe fn block_sum(v: f32, scratch: *mut f32) -> f32 {
    let lane = tid_x() % 32;
    let warp = tid_x() / 32;
    let nwarps = bdim_x().div_ceil(32);
    let w = warp_sum(v);
    if lane == 0 {
        unsafe { *scratch.add(warp as usize) = w };
    }
    sync_threads();
    let x = if lane < nwarps {
        unsafe { *scratch.add(lane as usize) }
    } else {
        0.0
    };
    let total = warp_sum(x);
    sync_threads();
    total
}

/// Block-wide max, same contract as [`block_sum`].
#[inline(always)]
pub unsafe fn block_max(v: f32, scratch: *mut f32) -> f32 {
    let lane = tid_x() % 32;
    let warp = tid_x() / 32;
    let nwarps = bdim_x().div_ceil(32);
    let w = warp_max(v);
    if lane == 0 {
        unsafe { *scratch.add(warp as usize) = w };
    }
    sync_threads();
    let x = if lane < nwarps {
        unsafe { *scratch.add(lane as usize) }
    } else {
        f32::NEG_INFINITY
    };
    let total = warp_max(x);
    sync_threads();
    total
}

/// Fused multiply-add `a·b + c` (one `fma.rn.f32`).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::f32::math::mul_add(a, b, c)
}

/// fp32 → tf32 (round to nearest, ties away; `cvt.rna.tf32.f32`), returned
/// as the 32-bit pattern the tensor cores read.
#[inline(always)]
pub fn to_tf32(x: f32) -> u32 {
    let y: u32;
    unsafe { asm!("cvt.rna.tf32.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack)) };
    y
}

/// fp32 rounded to TF32 as an fp32 value (`to_tf32` with the low 13 bits,
/// which the conversion leaves unspecified, cleared): what the TF32
/// operand copies store.
#[inline(always)]
pub fn tf32_rounded(x: f32) -> f32 {
    f32::from_bits(to_tf32(x) & !0x1fff)
}

/// One warp-wide tensor-core product `c += a·b` on a 16×8×8 tile in TF32:
/// `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`. With
/// `g = lane / 4`, `t = lane % 4`: `a = [A[g][t], A[g+8][t], A[g][t+4],
/// A[g+8][t+4]]`, `b = [B[t][g], B[t+4][g]]`, `c = [C[g][2t], C[g][2t+1],
/// C[g+8][2t], C[g+8][2t+1]]`.
#[inline(always)]
pub fn mma_tf32(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
    let mut c = c;
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {{{c0},{c1},{c2},{c3}}}, {{{a0},{a1},{a2},{a3}}}, {{{b0},{b1}}}, {{{c0},{c1},{c2},{c3}}};",
            c0 = inout(reg32) c[0],
            c1 = inout(reg32) c[1],
            c2 = inout(reg32) c[2],
            c3 = inout(reg32) c[3],
            a0 = in(reg32) a[0],
            a1 = in(reg32) a[1],
            a2 = in(reg32) a[2],
            a3 = in(reg32) a[3],
            b0 = in(reg32) b[0],
            b1 = in(reg32) b[1],
        )
    };
    c
}

/// `v` rounded to bf16 (nearest even), as its 16 bits.
#[inline(always)]
pub fn bf16_bits(v: f32) -> u16 {
    (pack_bf16(v, 0.0) & 0xffff) as u16
}

/// Two fp32 → one register of two bf16 (round to nearest even;
/// `cvt.rn.bf16x2.f32`): `lo` in the low half, `hi` in the high half.
#[inline(always)]
pub fn pack_bf16(lo: f32, hi: f32) -> u32 {
    let y: u32;
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {y}, {hi}, {lo};", y = out(reg32) y, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack))
    };
    y
}

/// One warp-wide tensor-core product `c += a·b` on a 16×8×16 tile in bf16
/// with fp32 accumulation: `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`.
/// Each register holds two bf16 adjacent along k (the lower k in the low
/// half). With `g = lane / 4`, `t = lane % 4`: `a = [A[g][2t..], A[g+8][2t..],
/// A[g][2t+8..], A[g+8][2t+8..]]`, `b = [B[2t..][g], B[2t+8..][g]]`, `c` as in
/// [`mma_tf32`].
#[inline(always)]
pub fn mma_bf16(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
    let mut c = c;
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c0},{c1},{c2},{c3}}}, {{{a0},{a1},{a2},{a3}}}, {{{b0},{b1}}}, {{{c0},{c1},{c2},{c3}}};",
            c0 = inout(reg32) c[0],
            c1 = inout(reg32) c[1],
            c2 = inout(reg32) c[2],
            c3 = inout(reg32) c[3],
            a0 = in(reg32) a[0],
            a1 = in(reg32) a[1],
            a2 = in(reg32) a[2],
            a3 = in(reg32) a[3],
            b0 = in(reg32) b[0],
            b1 = in(reg32) b[1],
        )
    };
    c
}

/// The 32-bit shared-window address of a generic pointer into shared memory.
#[inline(always)]
pub fn shared_addr<T>(p: *const T) -> u32 {
    let a: u32;
    unsafe {
        asm!(
            "{{ .reg .u64 s; cvta.to.shared.u64 s, {p}; cvt.u32.u64 {a}, s; }}",
            p = in(reg64) p,
            a = out(reg32) a,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    a
}

/// One float from shared memory at window address `addr` (see
/// [`shared_addr`]): 32-bit address arithmetic, where a generic `*mut f32`
/// into the dynamic shared block makes LLVM compute 64-bit addresses.
#[inline(always)]
pub unsafe fn ld_shared(addr: u32) -> f32 {
    let v: f32;
    unsafe {
        asm!(
            "ld.shared.f32 {v}, [{addr}];",
            addr = in(reg32) addr,
            v = out(reg32) v,
            options(readonly, nostack, preserves_flags),
        )
    };
    v
}

/// Stores one float to shared memory at window address `addr`.
#[inline(always)]
pub unsafe fn st_shared(addr: u32, v: f32) {
    unsafe {
        asm!(
            "st.shared.f32 [{addr}], {v};",
            addr = in(reg32) addr,
            v = in(reg32) v,
            options(nostack, preserves_flags),
        )
    };
}

/// Stores two floats to shared memory at window address `addr` (8-byte
/// aligned).
#[inline(always)]
pub unsafe fn st_shared_v2(addr: u32, a: f32, b: f32) {
    unsafe {
        asm!(
            "st.shared.v2.f32 [{addr}], {{{a}, {b}}};",
            addr = in(reg32) addr,
            a = in(reg32) a,
            b = in(reg32) b,
            options(nostack, preserves_flags),
        )
    };
}

/// Waits at named barrier `id` (1..16; 0 is `sync_threads`'s) until
/// `threads` threads (a multiple of 32) of the block have arrived: a
/// barrier for some of the block's warps only.
#[inline(always)]
pub fn bar_sync(id: u32, threads: u32) {
    unsafe {
        asm!(
            "bar.sync {id}, {n};",
            id = in(reg32) id,
            n = in(reg32) threads,
            options(nostack, preserves_flags),
        )
    };
}

/// As [`st_shared`] where `on`, as one predicated `st.shared` (no branch
/// around it, so the code that computes `v` runs unconditionally).
#[inline(always)]
pub unsafe fn st_shared_if(on: bool, addr: u32, v: f32) {
    unsafe {
        asm!(
            "{{ .reg .pred p; setp.ne.u32 p, {on}, 0; @p st.shared.f32 [{addr}], {v}; }}",
            on = in(reg32) on as u32,
            addr = in(reg32) addr,
            v = in(reg32) v,
            options(nostack, preserves_flags),
        )
    };
}

/// Four floats from shared memory at window address `addr` (see
/// [`shared_addr`]) in one `ld.shared.v4.f32`; `addr` must be 16-byte aligned.
/// (LLVM only knows the dynamic shared base as 4-byte aligned, so plain Rust
/// would load the four one by one.)
#[inline(always)]
pub unsafe fn ld_shared_v4(addr: u32) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    unsafe {
        asm!(
            "ld.shared.v4.f32 {{{a},{b},{c},{d}}}, [{addr}];",
            addr = in(reg32) addr,
            a = out(reg32) a,
            b = out(reg32) b,
            c = out(reg32) c,
            d = out(reg32) d,
            options(readonly, nostack, preserves_flags),
        )
    };
    [a, b, c, d]
}

/// Stores `[a, b]` at `p` in one `st.v2.f32`; `p` must be 8-byte aligned.
#[inline(always)]
pub unsafe fn st_v2(p: *mut f32, a: f32, b: f32) {
    unsafe {
        asm!(
            "st.v2.f32 [{p}], {{{a},{b}}};",
            p = in(reg64) p,
            a = in(reg32) a,
            b = in(reg32) b,
            options(nostack, preserves_flags),
        )
    };
}

/// Starts an asynchronous copy of one float from global memory to shared
/// window address `dst` (`cp.async.ca`, sm_80+), or of a zero when `src` is
/// `None` (source size 0: nothing is read from `dummy`, which only has to be
/// a global address). Completes at [`cp_async_wait`] of its group.
#[inline(always)]
pub unsafe fn cp_async_f32(dst: u32, src: Option<*const f32>, dummy: *const f32) {
    let (p, n) = match src {
        Some(p) => (p, 4u32),
        None => (dummy, 0u32),
    };
    unsafe {
        asm!(
            "cp.async.ca.shared.global [{d}], [{s}], 4, {n};",
            d = in(reg32) dst,
            s = in(reg64) p,
            n = in(reg32) n,
            options(nostack, preserves_flags),
        )
    };
}

/// Closes the group of the asynchronous copies started since the last one.
#[inline(always)]
pub fn cp_async_commit() {
    unsafe { asm!("cp.async.commit_group;", options(nostack, preserves_flags)) };
}

/// Waits until at most `N` of this thread's copy groups are still pending.
/// (A barrier is still needed before reading what other threads copied.)
#[inline(always)]
pub fn cp_async_wait<const N: u32>() {
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack, preserves_flags)) };
}

/// Starts an asynchronous copy of 16 bytes (four floats) from global memory
/// to shared window address `dst` (`cp.async.cg`, bypassing L1), or of four
/// zeros when `src` is `None` (source size 0; `dummy` is never read). Both
/// addresses must be 16-byte aligned.
/// With `l1`, the copy goes through the L1 cache (`cp.async.ca`) instead:
/// for gathered operands that re-read the same bytes within a few tiles
/// (a convolution's neighbouring taps).
#[inline(always)]
pub unsafe fn cp_async_v4(dst: u32, src: Option<*const f32>, dummy: *const f32, l1: bool) {
    let (p, n) = match src {
        Some(p) => (p, 16u32),
        None => (dummy, 0u32),
    };
    macro_rules! copy {
        ($cache:literal) => {
            unsafe {
                asm!(
                    concat!("cp.async.", $cache, ".shared.global [{d}], [{s}], 16, {n};"),
                    d = in(reg32) dst,
                    s = in(reg64) p,
                    n = in(reg32) n,
                    options(nostack, preserves_flags),
                )
            }
        };
    }
    if l1 { copy!("ca") } else { copy!("cg") }
}

/// Four 8×8 matrices of 16-bit elements from shared memory in one warp-wide
/// `ldmatrix.sync.aligned.m8n8.x4.shared.b16`: lanes `8i..8i+7` give the
/// window addresses of matrix i's eight 16-byte rows; lane l receives, from
/// each matrix, the 32-bit word `l % 4` of row `l / 4`. With rows of four
/// fp32 that is element `(l / 4, l % 4)`: the layout of a TF32 `mma` fragment.
#[inline(always)]
pub unsafe fn ldmatrix_x4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a},{b},{c},{d}}}, [{addr}];",
            addr = in(reg32) addr,
            a = out(reg32) a,
            b = out(reg32) b,
            c = out(reg32) c,
            d = out(reg32) d,
            options(readonly, nostack, preserves_flags),
        )
    };
    [a, b, c, d]
}

/// [`ldmatrix_x4`] with `.trans`: lane l receives, from each matrix, the two
/// 16-bit elements of column `l / 4` at rows `2·(l % 4)` and `2·(l % 4) + 1`
/// (the lower row in the low half), i.e. a bf16 `mma` fragment register
/// from a tile stored with k along the rows.
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a},{b},{c},{d}}}, [{addr}];",
            addr = in(reg32) addr,
            a = out(reg32) a,
            b = out(reg32) b,
            c = out(reg32) c,
            d = out(reg32) d,
            options(readonly, nostack, preserves_flags),
        )
    };
    [a, b, c, d]
}

/// Calls `f(i)` for `i` in `0..N` (N ≤ 16), written out: indices into
/// register arrays stay constants, where a loop LLVM declines to unroll (a
/// large body) would move the arrays to local memory.
#[inline(always)]
pub fn unrolled<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= 16) };
    macro_rules! calls {
        ($($i:literal)*) => { $( if $i < N { f($i) } )* };
    }
    calls!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
}

// ---------------------------------------------------------------------------
// Hopper warpgroup products (`wgmma`, PTX target `sm_90a` only: instantiated
// solely by the kernels of the `wgmma` feature's module).
// ---------------------------------------------------------------------------

/// A `wgmma` shared-memory matrix descriptor without swizzling for a tile
/// made of 8-row × 16-byte core matrices (each 128 contiguous bytes) at
/// window address `addr`: `lbo` bytes between core matrices adjacent along
/// k, `sbo` between those adjacent along the rows.
#[inline(always)]
pub fn wg_desc(addr: u32, lbo: u32, sbo: u32) -> u64 {
    ((addr as u64 & 0x3_ffff) >> 4) | (((lbo >> 4) as u64) << 16) | (((sbo >> 4) as u64) << 32)
}

/// A `wgmma` shared-memory matrix descriptor for a K-major tile in the
/// 128-byte swizzle: rows of 128 bytes, 8-row atoms 1024 bytes apart (the
/// stride field), the atoms 1024-byte aligned; `addr` may sit 32·s bytes
/// into a row to start at k-step s.
#[inline(always)]
pub fn wg_desc_sw128(addr: u32) -> u64 {
    wg_desc(addr, 16, 1024) | (1u64 << 62)
}

/// A `wgmma` descriptor for an MN-major bf16 tile in the 128-byte swizzle
/// (what a TMA box of 64 elements of M or N × k rows lands as): a row of
/// 128 bytes (64 consecutive elements of M or N) per k, 8-row atoms 1024
/// bytes apart along k (the stride field), the next 64 elements of M or N
/// `lbo` bytes on (the leading field; the PTX ISA's canonical MN-major
/// layout `((8,8,m),(8,k)):((1,8,LBO),(64,SBO))` in bf16 elements).
#[inline(always)]
pub fn wg_desc_mn_sw128(addr: u32, lbo: u32) -> u64 {
    wg_desc(addr, lbo, 1024) | (1u64 << 62)
}

/// `wgmma.fence`: orders this warp's earlier register and shared-memory
/// accesses before the warpgroup's next `wgmma`s.
#[inline(always)]
pub fn wgmma_fence() {
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack, preserves_flags)) };
}

/// Closes the warpgroup's `wgmma`s issued since the last commit into one group.
#[inline(always)]
pub fn wgmma_commit() {
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack, preserves_flags)) };
}

/// Waits until at most `N` of the warpgroup's `wgmma` groups are pending.
#[inline(always)]
pub fn wgmma_wait<const N: u32>() {
    unsafe {
        asm!("wgmma.wait_group.sync.aligned {n};", n = const N, options(nostack, preserves_flags))
    };
}

/// Makes this thread's generic-proxy writes to shared memory (`cp.async`
/// copies included, once waited for) visible to the async proxy that
/// `wgmma` reads through; a barrier then publishes them to the warpgroup.
#[inline(always)]
pub fn fence_proxy_async_shared() {
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack, preserves_flags)) };
}

/// Initialises the shared-memory barrier (`mbarrier`, 8 bytes) at shared
/// address `bar` to expect `count` arrivals per phase.
#[inline(always)]
pub unsafe fn mbar_init(bar: u32, count: u32) {
    unsafe {
        asm!(
            "mbarrier.init.shared::cta.b64 [{b}], {c};",
            b = in(reg32) bar,
            c = in(reg32) count,
            options(nostack, preserves_flags),
        )
    };
}

/// Publishes this thread's `mbarrier` initialisations to the other threads
/// and to the copy engine (then a block barrier): `fence.mbarrier_init`
/// and `fence.proxy.async`.
#[inline(always)]
pub fn mbar_init_fence() {
    unsafe {
        asm!(
            "fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta;",
            options(nostack, preserves_flags)
        )
    };
}

/// This thread's arrival on the barrier at `bar`, which also tells the
/// phase to wait for `bytes` more of asynchronous (TMA) writes.
#[inline(always)]
pub unsafe fn mbar_arrive_expect_tx(bar: u32, bytes: u32) {
    unsafe {
        asm!(
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};",
            b = in(reg32) bar,
            n = in(reg32) bytes,
            options(nostack, preserves_flags),
        )
    };
}

/// This thread's arrival on the barrier at `bar` (release, CTA scope).
#[inline(always)]
pub unsafe fn mbar_arrive(bar: u32) {
    unsafe {
        asm!(
            "mbarrier.arrive.shared::cta.b64 _, [{b}];",
            b = in(reg32) bar,
            options(nostack, preserves_flags),
        )
    };
}

/// Waits until the phase of parity `parity` of the barrier at `bar` has
/// completed (acquire, CTA scope): its arrivals and its TMA bytes are in.
/// A phase that never completes (a copy lost, a wrong byte count) traps
/// after 2^22 tries (seconds), a launch error instead of a hang.
#[inline(always)]
pub unsafe fn mbar_wait(bar: u32, parity: u32) {
    let mut tries = 0u32;
    loop {
        tries += 1;
        if tries > 1 << 22 {
            unsafe { nvptx::trap() };
        }
        let done: u32;
        unsafe {
            asm!(
                "{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {q}; selp.u32 {d}, 1, 0, p; }}",
                b = in(reg32) bar,
                q = in(reg32) parity,
                d = out(reg32) done,
                options(nostack, preserves_flags),
            )
        };
        if done != 0 {
            break;
        }
    }
}

/// Makes the 128-byte tensor map at global address `map`, written before
/// the launch, visible to the tensor memory accelerator (whose proxy a
/// kernel does not acquire at its start), and prefetches it.
#[inline(always)]
pub unsafe fn tma_map_acquire(map: *const u8) {
    unsafe {
        asm!(
            "fence.proxy.tensormap::generic.acquire.gpu [{m}], 128; prefetch.tensormap [{m}];",
            m = in(reg64) map,
            options(nostack, preserves_flags),
        )
    };
}

/// A tile of a 2-D tensor (the box of the tensor map at global address
/// `map`, whose coordinates are `x` along the rows, `y` across them) into
/// shared memory at `dst` by the tensor memory accelerator, completing as
/// bytes on the barrier at `bar`. Elements outside the tensor arrive as zeros.
#[inline(always)]
pub unsafe fn tma_tile_2d(dst: u32, map: *const u8, x: i32, y: i32, bar: u32) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{{x}, {y}}}], [{b}];",
            d = in(reg32) dst,
            m = in(reg64) map,
            x = in(reg32) x,
            y = in(reg32) y,
            b = in(reg32) bar,
            options(nostack, preserves_flags),
        )
    };
}

/// A tile of a 3-D tensor (the box of the tensor map at global address
/// `map`, whose coordinates are `x` along the rows, then `y`, then `z`)
/// into shared memory at `dst` by the tensor memory accelerator, completing
/// as bytes on the barrier at `bar`; elements past the tensor's bounds
/// arrive as zeros.
#[inline(always)]
pub unsafe fn tma_tile_3d(dst: u32, map: *const u8, x: i32, y: i32, z: i32, bar: u32) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{{x}, {y}, {z}}}], [{b}];",
            d = in(reg32) dst,
            m = in(reg64) map,
            x = in(reg32) x,
            y = in(reg32) y,
            z = in(reg32) z,
            b = in(reg32) bar,
            options(nostack, preserves_flags),
        )
    };
}

/// An im2col load of a 4-D NHWC tensor (the tensor map at global address
/// `map`): `pixels` (the map's) consecutive filter windows from the one
/// whose corner is at `(w, h)` of image `n`, each contributing the channels
/// `c..` of its tap `(dw, dh)`, into shared memory at `dst`, completing as
/// bytes on the barrier at `bar`. Padding and windows past the last image
/// arrive as zeros.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tma_im2col_4d(dst: u32, map: *const u8, c: i32, w: i32, h: i32, n: i32, dw: u16, dh: u16, bar: u32) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [{d}], [{m}, {{{c}, {w}, {h}, {n}}}], [{b}], {{{dw}, {dh}}};",
            d = in(reg32) dst,
            m = in(reg64) map,
            c = in(reg32) c,
            w = in(reg32) w,
            h = in(reg32) h,
            n = in(reg32) n,
            dw = in(reg16) dw,
            dh = in(reg16) dh,
            b = in(reg32) bar,
            options(nostack, preserves_flags),
        )
    };
}

/// One `wgmma` with an fp32 accumulator `$d` (an array of `$n` registers:
/// `$first $rest` are its indices), A and B from descriptors.
macro_rules! wgmma_asm {
    ($instr:literal, $tail:literal, $d:ident, $a:ident, $b:ident; $first:literal $($i:literal)*) => {
        unsafe {
            asm!(
                concat!(
                    "{{ .reg .pred p; setp.ne.b32 p, {one}, 0; ", $instr, " {{{", stringify!($first), "}",
                    $(", {", stringify!($i), "}",)* "}}, {a}, {b}, p, ", $tail, " }}"
                ),
                inout(reg32) $d[$first], $(inout(reg32) $d[$i],)*
                a = in(reg64) $a,
                b = in(reg64) $b,
                one = in(reg32) 1u32,
                options(nostack),
            )
        }
    };
}

/// An empty `asm!` that claims to read and write every register of `$d`:
/// no use of an accumulator moves across it (placed after the last
/// [`wgmma_wait`], before the epilogue reads them).
macro_rules! wg_hold {
    ($d:ident; $($i:literal)*) => {
        unsafe {
            asm!(
                concat!("// hold", $(" {", stringify!($i), "}",)*),
                $(inout(reg32) $d[$i],)*
                options(nomem, nostack, preserves_flags),
            )
        }
    };
}

/// `d += A·B` on the warpgroup's tensor cores for a 64×N×k tile, N = 128 or
/// 64 (then only `d[..32]` is used), k = 8 (TF32) or 16 (`HALF`: bf16),
/// accumulating in fp32: `wgmma.mma_async.sync.aligned.m64nNk{8,16}.f32.
/// {tf32,bf16}`. A (64×k) and B (N×k) are K-major tiles in shared memory
/// given by descriptors ([`wg_desc`]). Asynchronous: `d` must not be
/// touched until [`wgmma_wait`] says its group is done. Warp w of the
/// warpgroup, lane (g, t) = (l / 4, l % 4) holds `d[4i + v]` =
/// D[16w + g + 8·(v / 2)][8i + 2t + v % 2].
#[inline(always)]
pub unsafe fn wgmma<const HALF: bool, const N: u32>(d: &mut [f32; 64], a: u64, b: u64) {
    match (HALF, N) {
        (false, 128) => wgmma_asm!("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32", "1, 1;", d, a, b;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
            32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63),
        (false, 64) => wgmma_asm!("wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32", "1, 1;", d, a, b;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31),
        (true, 128) => wgmma_asm!("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "1, 1, 0, 0;", d, a, b;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
            32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63),
        (true, 64) => wgmma_asm!("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "1, 1, 0, 0;", d, a, b;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31),
        _ => unsafe { nvptx::trap() },
    }
}

/// [`wgmma`] in bf16, 64×128×16, with both tiles MN-major (A's M and B's N
/// contiguous: `imm-trans-a = imm-trans-b = 1`; descriptors from
/// [`wg_desc_mn_sw128`]). Only 16-bit types may be transposed.
#[inline(always)]
pub unsafe fn wgmma_bf16_mn(d: &mut [f32; 64], a: u64, b: u64) {
    wgmma_asm!("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "1, 1, 1, 1;", d, a, b;
        0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
        32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63)
}

/// See [`wg_hold!`]: pins the accumulator `d` of an N-column [`wgmma`]
/// after the final wait.
#[inline(always)]
pub fn wgmma_hold<const N: u32>(d: &mut [f32; 64]) {
    if N == 128 {
        wg_hold!(d; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
            32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63);
    } else {
        wg_hold!(d; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
    }
}
