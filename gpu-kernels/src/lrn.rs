//! Cross-map local response normalisation (Krizhevsky et al. 2012, §3.3):
//! `scale[c] = k + α·Σ_{c'∈win(c)} x[c']²`, `y[c] = x[c]·scale[c]^(−β)`, where
//! `win(c) = [c − ⌊size/2⌋, c − ⌊size/2⌋ + size − 1] ∩ [0, C)`.
//! Backward: `dx[c] = dy[c]·scale[c]^(−β) − 2αβ·x[c]·Σ_{c' : c∈win(c')} dy[c']·y[c']/scale[c']`,
//! optionally followed by the backward pass of a ReLU whose output `x` is
//! (`dx = 0` where `x ≤ 0`), so that the ReLU needs no pass of its own.
//!
//! Layout NCHW. Mapping: one thread per (n, h, w) pixel and run of `chunk`
//! channels, walking that run (consecutive threads take consecutive pixels,
//! so every access is coalesced; the runs give the GPU enough threads when
//! the planes are small). For window sizes 3 and 5 (AlexNet's) the thread
//! keeps the window's values in registers, sliding it one channel per step,
//! so each input is read once per run (plus the window's edges) and each
//! quotient `dy·y/scale` computed once; the window sums are still formed
//! afresh, in channel order, for each channel (no running sum, so no
//! cancellation drift). Other sizes re-read the window from L1 per channel.
//! 1-D grid-stride over N·H·W·⌈C/chunk⌉ items, any block size.
//!
//! `lrn_pool_forward` / `lrn_pool_backward` fuse the LRN with the max pool
//! that follows it (AlexNet's norm1→pool1, norm2→pool2): the forward reads x
//! and writes only the pooled output and its argmax offsets; the backward
//! reads x, those offsets and the pooled gradient, recomputes scale and y,
//! and writes dx. Neither y, scale nor the pool's input gradient touches
//! memory (about 3 of 4.5 and 5 of 7.5 plane-sized passes saved). Both take
//! a tile of pooled rows and a run of channels of one image per block and
//! go through shared memory a few channels at a time, so that every LRN
//! value is computed once (the overlapping 3×3 windows used to recompute
//! it 9/4 times) and each window's argmax and gradient are read once per
//! 2×2 block of inputs, not once per input (see the kernels' docs).

use crate::device::{
    bdim_x, bid_x, bid_y, bid_z, fma, grid_stride, ld_shared, powf, rcp, shared, shared_addr,
    st_shared, st_shared_if, sync_threads, tid_x, unrolled,
};

/// Item `item` of the grid: the offset of its pixel's channel 0 and its
/// channel run `[c0, c1)`.
#[inline(always)]
fn item(item: usize, pixels: usize, hw: usize, c: u32, chunk: u32) -> (usize, u32, u32) {
    let (run, pix) = ((item / pixels) as u32, item % pixels);
    let base = (pix / hw) * c as usize * hw + pix % hw;
    let c0 = run * chunk;
    (base, c0, (c0 + chunk).min(c))
}

#[inline(always)]
fn window(c: u32, size: u32, channels: u32) -> (u32, u32) {
    let lo = c as i32 - (size / 2) as i32;
    let hi = (lo + size as i32 - 1).min(channels as i32 - 1);
    (lo.max(0) as u32, hi as u32)
}

/// LRN forward: writes `y` and `scale` (both `[n, c, h, w]`).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn lrn_forward(
    x: *const f32,
    y: *mut f32,
    scale: *mut f32,
    n: u32,
    c: u32,
    hw: u32,
    size: u32,
    alpha: f32,
    beta: f32,
    k: f32,
    chunk: u32,
) {
    let (mut i, step) = grid_stride();
    let pixels = n as usize * hw as usize;
    let items = pixels * c.div_ceil(chunk) as usize;
    let hw = hw as usize;
    while i < items {
        let (base, c0, c1) = item(i, pixels, hw, c, chunk);
        let (x, y, scale) = unsafe { (x.add(base), y.add(base), scale.add(base)) };
        let r = (c0, c1, c);
        match size {
            5 => unsafe { forward_sliding::<5>(x, y, scale, r, hw, alpha, beta, k) },
            3 => unsafe { forward_sliding::<3>(x, y, scale, r, hw, alpha, beta, k) },
            _ => unsafe { forward_any(x, y, scale, r, hw, size, alpha, beta, k) },
        }
        i += step;
    }
}

/// One pixel's channels `c0..c1` of `c` (pointers at its channel 0, channel
/// stride `hw`), window of `S` in registers: `xs[i]` holds channel
/// `ch − S/2 + i` (0 outside the channels).
#[inline(always)]
unsafe fn forward_sliding<const S: usize>(
    x: *const f32,
    y: *mut f32,
    scale: *mut f32,
    (c0, c1, c): (u32, u32, u32),
    hw: usize,
    alpha: f32,
    beta: f32,
    k: f32,
) {
    let half = (S / 2) as i32;
    let load = |ch: i32| {
        if ch >= 0 && ch < c as i32 {
            unsafe { *x.add(ch as usize * hw) }
        } else {
            0.0
        }
    };
    let mut xs = [0.0f32; S];
    for i in 1..S {
        xs[i] = load(c0 as i32 + i as i32 - 1 - half);
    }
    for ch in c0..c1 {
        slide(&mut xs, load(ch as i32 - half + S as i32 - 1));
        let (sc, yv) = lrn_at(&xs, alpha, beta, k);
        let at = ch as usize * hw;
        unsafe {
            *scale.add(at) = sc;
            *y.add(at) = yv;
        }
    }
}

/// Shifts a register window down one slot and puts `v` in the last.
#[inline(always)]
fn slide<const S: usize>(w: &mut [f32; S], v: f32) {
    for i in 0..S - 1 {
        w[i] = w[i + 1];
    }
    w[S - 1] = v;
}

/// `(scale, y)` of the channel at the centre of window `xs` (the sum of
/// squares in channel order, as every LRN kernel forms it).
#[inline(always)]
fn lrn_at<const S: usize>(xs: &[f32; S], alpha: f32, beta: f32, k: f32) -> (f32, f32) {
    let (sc, r) = lrn_scale(xs, alpha, beta, k);
    (sc, xs[S / 2] * r)
}

/// `(scale, scale^(−β))` of the channel at the centre of window `xs`.
#[inline(always)]
fn lrn_scale<const S: usize>(xs: &[f32; S], alpha: f32, beta: f32, k: f32) -> (f32, f32) {
    // (From xs[0]², as fma(xs[0], xs[0], 0) rounds: one instruction less.)
    let mut sum = xs[0] * xs[0];
    for v in &xs[1..] {
        sum = fma(*v, *v, sum);
    }
    let sc = fma(alpha, sum, k);
    (sc, powf(sc, -beta))
}

/// `w[0] + w[1] + …` in that order.
#[inline(always)]
fn window_sum<const S: usize>(w: &[f32; S]) -> f32 {
    w[1..].iter().fold(w[0], |acc, v| acc + v)
}

/// As [`forward_sliding`] for any window size, re-reading the window.
#[inline(always)]
unsafe fn forward_any(
    x: *const f32,
    y: *mut f32,
    scale: *mut f32,
    (c0, c1, c): (u32, u32, u32),
    hw: usize,
    size: u32,
    alpha: f32,
    beta: f32,
    k: f32,
) {
    for ch in c0..c1 {
        let (lo, hi) = window(ch, size, c);
        let mut sum = 0.0f32;
        for j in lo..=hi {
            let v = unsafe { *x.add(j as usize * hw) };
            sum = fma(v, v, sum);
        }
        let sc = fma(alpha, sum, k);
        let at = ch as usize * hw;
        unsafe {
            *scale.add(at) = sc;
            *y.add(at) = *x.add(at) * powf(sc, -beta);
        }
    }
}

/// LRN backward: `dx` from `dy` and the forward's `x`, `y`, `scale`; with
/// `relu` nonzero, also zero where `x ≤ 0` (the preceding ReLU's backward).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn lrn_backward(
    x: *const f32,
    y: *const f32,
    scale: *const f32,
    dy: *const f32,
    dx: *mut f32,
    n: u32,
    c: u32,
    hw: u32,
    size: u32,
    alpha: f32,
    beta: f32,
    relu: u32,
    chunk: u32,
) {
    let (mut i, step) = grid_stride();
    let pixels = n as usize * hw as usize;
    let items = pixels * c.div_ceil(chunk) as usize;
    let hw = hw as usize;
    while i < items {
        let (base, c0, c1) = item(i, pixels, hw, c, chunk);
        let p = unsafe {
            Planes {
                x: x.add(base),
                y: y.add(base),
                scale: scale.add(base),
                dy: dy.add(base),
                dx: dx.add(base),
                relu: relu != 0,
            }
        };
        let r = (c0, c1, c);
        match size {
            5 => unsafe { backward_sliding::<5>(&p, r, hw, alpha, beta) },
            3 => unsafe { backward_sliding::<3>(&p, r, hw, alpha, beta) },
            _ => unsafe { backward_any(&p, r, hw, size, alpha, beta) },
        }
        i += step;
    }
}

/// One pixel's tensors, each at its channel 0 (channel stride `hw`).
struct Planes {
    x: *const f32,
    y: *const f32,
    scale: *const f32,
    dy: *const f32,
    dx: *mut f32,
    relu: bool,
}

impl Planes {
    /// Writes the gradient at `at`, zeroed where the ReLU mask applies.
    #[inline(always)]
    unsafe fn store(&self, at: usize, x: f32, v: f32) {
        let masked = self.relu && !(x > 0.0);
        unsafe { *self.dx.add(at) = if masked { 0.0 } else { v } };
    }
}

/// c ∈ win(c') ⇔ c' ∈ [c + ⌊S/2⌋ + 1 − S, c + ⌊S/2⌋]: slot `i` of the
/// register window holds channel `ch + ⌊S/2⌋ + 1 − S + i` (its quotient
/// `dy·y/scale`, 0 outside the channels, and its `dy` and `scale`).
#[inline(always)]
unsafe fn backward_sliding<const S: usize>(
    p: &Planes,
    (c0, c1, c): (u32, u32, u32),
    hw: usize,
    alpha: f32,
    beta: f32,
) {
    let half = (S / 2) as i32;
    let first = half + 1 - S as i32;
    let load = |ch: i32| -> (f32, f32, f32) {
        if ch >= 0 && ch < c as i32 {
            let at = ch as usize * hw;
            unsafe {
                let (d, s) = (*p.dy.add(at), *p.scale.add(at));
                (d * *p.y.add(at) / s, d, s)
            }
        } else {
            (0.0, 0.0, 1.0)
        }
    };
    let (mut q, mut d, mut s) = ([0.0f32; S], [0.0f32; S], [1.0f32; S]);
    for i in 1..S {
        (q[i], d[i], s[i]) = load(c0 as i32 + first + i as i32 - 1);
    }
    let me = (-first) as usize;
    for ch in c0..c1 {
        for i in 0..S - 1 {
            (q[i], d[i], s[i]) = (q[i + 1], d[i + 1], s[i + 1]);
        }
        (q[S - 1], d[S - 1], s[S - 1]) = load(ch as i32 + half);
        let mut acc = 0.0f32;
        for v in &q {
            acc += *v;
        }
        let at = ch as usize * hw;
        unsafe {
            let xv = *p.x.add(at);
            let direct = d[me] * powf(s[me], -beta);
            p.store(at, xv, direct - 2.0 * alpha * beta * xv * acc);
        }
    }
}

/// As [`backward_sliding`] for any window size, re-reading the window.
#[inline(always)]
unsafe fn backward_any(
    p: &Planes,
    (c0, c1, c): (u32, u32, u32),
    hw: usize,
    size: u32,
    alpha: f32,
    beta: f32,
) {
    let half = (size / 2) as i32;
    for ch in c0..c1 {
        let lo = (ch as i32 + half + 1 - size as i32).max(0) as u32;
        let hi = (ch as i32 + half).min(c as i32 - 1) as u32;
        let mut acc = 0.0f32;
        for j in lo..=hi {
            let at = j as usize * hw;
            acc += unsafe { *p.dy.add(at) * *p.y.add(at) / *p.scale.add(at) };
        }
        let at = ch as usize * hw;
        unsafe {
            let xv = *p.x.add(at);
            let direct = *p.dy.add(at) * powf(*p.scale.add(at), -beta);
            p.store(at, xv, direct - 2.0 * alpha * beta * xv * acc);
        }
    }
}

/// Shape of a fused LRN + max-pool call (passed by value): LRN over `c`
/// channels of `h × w` planes (window `size`, constants α, β, k), its output
/// max-pooled in `pool × pool` windows at `stride` to `oh × ow`. Block
/// (x, y, z) of the grid takes pooled rows `x·tile ..` (at most `tile`),
/// channels `y·run ..` (at most `run`) of image z.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LrnPoolGeom {
    pub n: u32,
    pub c: u32,
    pub h: u32,
    pub w: u32,
    pub oh: u32,
    pub ow: u32,
    pub size: u32,
    pub pool: u32,
    pub stride: u32,
    pub run: u32,
    pub tile: u32,
    pub alpha: f32,
    pub beta: f32,
    pub k: f32,
}

/// Most threads per block of the fused kernels (the host launches the
/// fewest whole warps a tile needs, up to this; the kernels read the block
/// size).
pub const FUSED_THREADS: u32 = 256;
/// Channels per pipeline step: each step fills one of two shared buffers
/// and ends at one barrier.
pub const FUSED_STEP: usize = 4;
/// Tile pixels and pooled outputs per thread and step in the forward: the
/// host sizes tiles and blocks so that a tile's input rows hold at most
/// `FWD_PIX` pixels per thread and a step's outputs at most `FWD_ITEMS`.
/// The backward takes one pixel and one 2×2 gather block per thread.
pub const FWD_PIX: usize = 2;
pub const FWD_ITEMS: usize = 2;

/// LRN then max pooling in one pass: `z` and `arg` as `maxpool_forward`
/// writes them for `lrn_forward`'s `y`, which never touches global memory
/// (nor does `scale`: the backward recomputes both from `x`).
///
/// A block takes a tile of pooled rows (all `ow` columns) and a run of
/// channels of one image; its input rows, `2·tile + pool − 2` full rows,
/// are contiguous in each channel plane, so thread t takes tile pixels t
/// and t + (block size) (coalesced). Each thread slides its pixels' LRN
/// windows through the channels in registers, computing every y once,
/// and writes them to shared memory, `FUSED_STEP` channels at a time (two
/// buffers, one barrier per step; the next step's x loads are issued
/// before this step's arithmetic). Then the threads take the step's pooled
/// outputs (consecutive threads, consecutive outputs) and scan their
/// windows in shared memory. Shared rows hold the even columns, then the
/// odd ones, so a warp's window reads are consecutive words. The host
/// launches only `size ∈ {3, 5}`, `pool ∈ {2, 3}`, `stride = 2`; others
/// trap.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn lrn_pool_forward(
    x: *const f32,
    z: *mut f32,
    arg: *mut f32,
    g: LrnPoolGeom,
) {
    unsafe {
        match (g.size, g.pool, g.stride) {
            (5, 3, 2) => pool_forward_fused::<5, 3>(x, z, arg, &g),
            (3, 3, 2) => pool_forward_fused::<3, 3>(x, z, arg, &g),
            (5, 2, 2) => pool_forward_fused::<5, 2>(x, z, arg, &g),
            (3, 2, 2) => pool_forward_fused::<3, 2>(x, z, arg, &g),
            _ => core::arch::nvptx::trap(),
        }
    }
}

/// `lrn_pool_forward` for LRN window `S` and pool window `P` (stride 2).
/// Steps whose channels (and the next step's x loads) lie inside the
/// tensor and the run take a copy of the step without per-channel checks;
/// x, z and arg are reached through pointers that walk the channels,
/// shared memory through 32-bit window addresses.
#[inline(always)]
unsafe fn pool_forward_fused<const S: usize, const P: usize>(
    x: *const f32,
    z: *mut f32,
    arg: *mut f32,
    g: &LrnPoolGeom,
) {
    const STEP: u32 = FUSED_STEP as u32;
    if g.w == 0 || g.ow == 0 {
        return; // never (the host checks); drops the division checks below
    }
    let half = (S / 2) as i32;
    let (tid, threads) = (tid_x(), bdim_x());
    let (r0, c0, img) = (bid_x() * g.tile, bid_y() * g.run, bid_z());
    let rows_out = g.tile.min(g.oh - r0);
    let rows_in = 2 * rows_out + P as u32 - 2;
    let npix = rows_in * g.w;
    let c1 = (c0 + g.run).min(g.c);
    if rows_out == 0 || c1 <= c0 {
        return; // never (the host's grid has no such block), and uniform
    }
    let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
    let (hs, ohs) = (hw as usize, ohw as usize);
    // A shared row: columns 0, 2, 4, ... then 1, 3, 5, ...; one channel's
    // tile is a slot, `STEP` slots a buffer (32-bit window addresses).
    let half_w = g.w.div_ceil(2);
    let ws = 2 * half_w;
    let slot = rows_in * ws;
    let ys = shared_addr(shared::<f32>());
    let xb = x.wrapping_add(img as usize * (g.c * hw) as usize + (2 * r0 * g.w) as usize);
    let out = img as usize * (g.c * ohw) as usize + (c0 * ohw + r0 * g.ow) as usize;
    let (zb, ab) = (z.wrapping_add(out), arg.wrapping_add(out));

    // This thread's tile pixels: (in the tile, its x at channel 0, its
    // shared address in slot 0 of buffer 0).
    let mut pix = [(false, x, 0u32); FWD_PIX];
    unrolled::<FWD_PIX>(|k| {
        let p = tid + k as u32 * threads;
        let (row, col) = (p / g.w, p % g.w);
        let so = row * ws + (col & 1) * half_w + col / 2;
        pix[k] = (p < npix, xb.wrapping_add(p as usize), ys + 4 * so);
    });
    // Pixel k's x in channel `ch` (0 outside the channels; a negative
    // channel wraps past `c`).
    let load = |k: usize, ch: i32| {
        let (ok, xp, _) = pix[k];
        if ok && (ch as u32) < g.c {
            unsafe { *xp.add(ch as usize * hs) }
        } else {
            0.0
        }
    };
    // This thread's pooled outputs of a step: (exists, channel slot,
    // shared address of the window's corner in buffer 0, output offset from
    // the run's first plane at step 0).
    let per_ch = rows_out * g.ow;
    let mut items = [(false, 0u32, 0u32, 0usize); FWD_ITEMS];
    unrolled::<FWD_ITEMS>(|m| {
        let it = tid + m as u32 * threads;
        let (cb, ot) = (it / per_ch, it % per_ch);
        let (r, q) = (ot / g.ow, ot % g.ow);
        let so = cb * slot + 2 * r * ws + q;
        items[m] = (
            it < STEP * per_ch,
            cb,
            ys + 4 * so,
            (cb * ohw + ot) as usize,
        );
    });
    // Window column b of an output at shared column q: 2q, 2q + 1, 2q + 2
    // are even[q], odd[q], even[q + 1] (byte offsets).
    let cols = [0, 4 * half_w, 4];
    let (slot_b, row_b, buf_b) = (4 * slot, 4 * ws, 4 * STEP * slot);

    // Before the step at channel ch, prev[k][i] is x(ch − half + i), i < S − 1.
    let mut prev = [[0.0f32; PREV]; FWD_PIX];
    unrolled::<FWD_PIX>(|k| {
        unrolled::<PREV>(|i| {
            if i + 1 < S {
                prev[k][i] = load(k, c0 as i32 + i as i32 - half);
            }
        })
    });
    // The x that step i (channels c0 + i·STEP ..) slides in (`fast`: all
    // inside the tensor).
    let fetch = |i: u32, fast: bool| {
        let mut v = [[0.0f32; FUSED_STEP]; FWD_PIX];
        let ch = (c0 + i * STEP) as i32 + half;
        unrolled::<FWD_PIX>(|k| {
            let (ok, xp, _) = pix[k];
            if fast && ok {
                let mut q = xp.wrapping_add(ch as usize * hs);
                unrolled::<FUSED_STEP>(|j| {
                    v[k][j] = unsafe { *q };
                    q = q.wrapping_add(hs);
                });
            } else if !fast {
                unrolled::<FUSED_STEP>(|j| v[k][j] = load(k, ch + j as i32));
            }
        });
        v
    };
    let steps = (c1 - c0).div_ceil(STEP);
    let mut next = fetch(0, false);
    for i in 0..steps {
        // Step i + 1 loads x up to channel c0 + (i + 2)·STEP − 1 + half and
        // pools channels c0 + i·STEP .. + STEP.
        let ci = c0 + i * STEP;
        let more = i + 1 < steps;
        let fast = more && ci + 2 * STEP - 1 + (half as u32) < g.c && ci + STEP <= c1;
        macro_rules! step {
            ($fast:literal) => {{
                let fast: bool = $fast;
                let cur = next;
                if fast || more {
                    next = fetch(i + 1, fast);
                }
                // Buffer i % 2: its last readers (step i − 2's pooling) are
                // past the barrier of step i − 1.
                let buf = (i & 1) * buf_b;
                unrolled::<FWD_PIX>(|k| {
                    // (Pixels past the tile compute on zeros and store nothing.)
                    let (ok, _, sa) = pix[k];
                    let y = lrn_step::<S>(&mut prev[k], &cur[k], g.alpha, g.beta, g.k);
                    unrolled::<FUSED_STEP>(|j| unsafe {
                        st_shared_if(ok, sa + buf + j as u32 * slot_b, y[j])
                    });
                });
                sync_threads();
                let o = i as usize * STEP as usize * ohs;
                unrolled::<FWD_ITEMS>(|m| {
                    let (ok, cb, sa, oo) = items[m];
                    if ok && (fast || ci + cb < c1) {
                        let t = sa + buf;
                        let (mut best, mut at) = (0.0f32, 0u32);
                        unrolled::<P>(|a| {
                            unrolled::<P>(|b| {
                                let v = unsafe { ld_shared(t + a as u32 * row_b + cols[b]) };
                                // The first input always wins (as the
                                // reference starts from it); later ones
                                // only on a strict `>`.
                                if (a == 0 && b == 0) || v > best {
                                    best = v;
                                    at = (a * P + b) as u32;
                                }
                            })
                        });
                        unsafe {
                            *zb.add(o + oo) = best;
                            *ab.add(o + oo) = at as f32;
                        }
                    }
                });
            }};
        }
        if fast { step!(true) } else { step!(false) }
    }
}

/// Room for the `S − 1` channels a step carries over (S ≤ 5).
const PREV: usize = 4;

/// LRN outputs of one pixel's channels ch .. ch + `FUSED_STEP` from
/// `prev` (x of channels ch − S/2 .., `S − 1` of them) and `cur` (x of
/// channels ch + S/2 ..); leaves in `prev` the channels the next step
/// needs. Outputs come in pairs sharing the inner `S − 1` squares of their
/// windows: `Σ(j) = x(j − S/2)² + t`, `Σ(j + 1) = t + x(j + 1 + S/2)²`
/// (`S + 1` multiply-adds a pair, not `2S`; the sums differ from the
/// channel-order ones only in rounding).
#[inline(always)]
fn lrn_step<const S: usize>(
    prev: &mut [f32; PREV],
    cur: &[f32; FUSED_STEP],
    alpha: f32,
    beta: f32,
    k: f32,
) -> [f32; FUSED_STEP] {
    const { assert!(S % 2 == 1 && S <= PREV + 1 && FUSED_STEP % 2 == 0) };
    // w[i]: x of channel ch − S/2 + i.
    let mut w = [0.0f32; PREV + FUSED_STEP];
    unrolled::<{ PREV + FUSED_STEP }>(|i| {
        if i + 1 < S {
            w[i] = prev[i];
        } else if i + 1 < S + FUSED_STEP {
            w[i] = cur[i + 1 - S];
        }
    });
    let mut y = [0.0f32; FUSED_STEP];
    unrolled::<{ FUSED_STEP / 2 }>(|p| {
        let j = 2 * p;
        let mut t = w[j + 1] * w[j + 1];
        unrolled::<{ PREV + FUSED_STEP }>(|i| {
            if i > j + 1 && i < j + S {
                t = fma(w[i], w[i], t);
            }
        });
        let sums = [fma(w[j], w[j], t), fma(w[j + S], w[j + S], t)];
        unrolled::<2>(|e| {
            let scale = fma(alpha, sums[e], k);
            y[j + e] = w[j + e + S / 2] * powf(scale, -beta);
        });
    });
    unrolled::<PREV>(|i| {
        if i + 1 < S {
            prev[i] = w[i + FUSED_STEP];
        }
    });
    y
}

/// What one pixel's backward carries from step to step (see
/// `pool_backward_fused`).
struct Back<const S: usize> {
    x: [f32; PREV],
    q: [f32; PREV],
    d: [f32; PREV],
}

impl<const S: usize> Back<S> {
    /// One step at pipeline channels c' .. c' + `FUSED_STEP`: `cur` is x of
    /// channels c' + S/2 .., `dy` the pool's gradient of c' .. (`inside`:
    /// the channel exists). Returns x and the LRN's dx of the output
    /// channels c' − S/2 ..; window sums in pairs as [`lrn_step`]'s.
    #[inline(always)]
    fn step(
        &mut self,
        cur: &[f32; FUSED_STEP],
        dy: &[f32; FUSED_STEP],
        inside: &[bool; FUSED_STEP],
        g: &LrnPoolGeom,
        ncoef: f32,
    ) -> ([f32; FUSED_STEP], [f32; FUSED_STEP]) {
        const N: usize = PREV + FUSED_STEP;
        let h = S / 2;
        // x of c' − h + i; dy·y/scale of c' − S + 1 + i; dy·scale^(−β) of
        // c' − h + i.
        let (mut w, mut q, mut d) = ([0.0f32; N], [0.0f32; N], [0.0f32; N]);
        unrolled::<N>(|i| {
            if i + 1 < S {
                (w[i], q[i]) = (self.x[i], self.q[i]);
            } else if i + 1 < S + FUSED_STEP {
                w[i] = cur[i + 1 - S];
            }
            if i < h {
                d[i] = self.d[i];
            }
        });
        let sums = pair_sums::<S>(&w, true);
        unrolled::<FUSED_STEP>(|j| {
            let sc = fma(g.alpha, sums[j], g.k);
            let dr = dy[j] * powf(sc, -g.beta);
            let inn = inside[j];
            q[j + S - 1] = if inn { dr * w[j + h] * rcp(sc) } else { 0.0 };
            d[j + h] = if inn { dr } else { 0.0 };
        });
        let qsums = pair_sums::<S>(&q, false);
        let mut xt = [0.0f32; FUSED_STEP];
        let mut v = [0.0f32; FUSED_STEP];
        unrolled::<FUSED_STEP>(|j| {
            xt[j] = w[j];
            v[j] = fma(ncoef * w[j], qsums[j], d[j]);
        });
        unrolled::<PREV>(|i| {
            if i + 1 < S {
                (self.x[i], self.q[i]) = (w[i + FUSED_STEP], q[i + FUSED_STEP]);
            }
            if i < h {
                self.d[i] = d[i + FUSED_STEP];
            }
        });
        (xt, v)
    }
}

/// Window sums `Σ_{i=j}^{j+S−1} f(v[i])` for j < `FUSED_STEP`, f the square
/// (`squares`) or the identity, in pairs sharing their inner `S − 1` terms.
#[inline(always)]
fn pair_sums<const S: usize>(v: &[f32; PREV + FUSED_STEP], squares: bool) -> [f32; FUSED_STEP] {
    let add = |acc: f32, x: f32| if squares { fma(x, x, acc) } else { acc + x };
    let mut out = [0.0f32; FUSED_STEP];
    unrolled::<{ FUSED_STEP / 2 }>(|p| {
        let j = 2 * p;
        let mut t = if squares { v[j + 1] * v[j + 1] } else { v[j + 1] };
        unrolled::<{ PREV + FUSED_STEP }>(|i| {
            if i > j + 1 && i < j + S {
                t = add(t, v[i]);
            }
        });
        out[j] = add(t, v[j]);
        out[j + 1] = add(t, v[j + S]);
    });
    out
}

/// Backward of `lrn_pool_forward` (and, with `relu` nonzero, of the ReLU
/// whose output `x` is): `dx` from `x`, the forward's `arg` and `dz`, as
/// `maxpool_backward` then `lrn_backward` would give, without storing the
/// pool's input gradient `dy` in global memory.
///
/// A block takes the input rows of a tile of pooled rows (`2·tile`; the
/// last tile down to the bottom row) and a run of channels of one image;
/// thread t owns tile pixel t (coalesced x loads and dx stores). The block
/// walks the channels `FUSED_STEP` at a time. Gather: thread t also owns a
/// 2×2 block of the tile's pixels in one channel of a step, loads the ≤ 4
/// windows that can route to it (their `arg` and `dz`, each read once per
/// block, not once per pixel) and writes the block's `dy`, in window order,
/// to shared memory (two buffers, one barrier per step; step i + 1's
/// gather loads and x loads are issued before step i's arithmetic). LRN:
/// each thread slides its pixel's window of x through the channels in
/// registers, recomputes `scale` once per element, keeps `dy·y/scale` and
/// `dy·scale^(−β)` for the `size` channels its output channel needs (so
/// the pipeline runs `size − 1` channels ahead of the channel it writes),
/// and writes dx.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn lrn_pool_backward(
    x: *const f32,
    arg: *const f32,
    dz: *const f32,
    dx: *mut f32,
    g: LrnPoolGeom,
    relu: u32,
) {
    unsafe {
        match (g.size, g.pool, g.stride, relu != 0) {
            (5, 3, 2, false) => pool_backward_fused::<5, 3, false>(x, arg, dz, dx, &g),
            (5, 3, 2, true) => pool_backward_fused::<5, 3, true>(x, arg, dz, dx, &g),
            (3, 3, 2, false) => pool_backward_fused::<3, 3, false>(x, arg, dz, dx, &g),
            (3, 3, 2, true) => pool_backward_fused::<3, 3, true>(x, arg, dz, dx, &g),
            (5, 2, 2, false) => pool_backward_fused::<5, 2, false>(x, arg, dz, dx, &g),
            (5, 2, 2, true) => pool_backward_fused::<5, 2, true>(x, arg, dz, dx, &g),
            (3, 2, 2, false) => pool_backward_fused::<3, 2, false>(x, arg, dz, dx, &g),
            (3, 2, 2, true) => pool_backward_fused::<3, 2, true>(x, arg, dz, dx, &g),
            _ => core::arch::nvptx::trap(),
        }
    }
}

/// `lrn_pool_backward` for LRN window `S`, pool window `P` (stride 2) and
/// the ReLU mask `RELU`. Block (a, b) of the tile's 2×2 blocks lies in
/// window rows a − 1 and a at most (and likewise columns); with P = 3,
/// window (a−1, b−1) can only name the block's (0, 0) (offset 8), (a−1, b)
/// only (0, 0) or (0, 1) (6, 7), (a, b−1) only (0, 0) or (1, 0) (2, 5),
/// and (a, b) any of the four (0, 1, 3, 4); with P = 2 only window (a, b)
/// meets the block.
///
/// Steps whose channels all lie inside the tensor and the run (all but
/// the first one and the last one or two) take a copy of the step without
/// any per-channel check; x and dx are reached through pointers that walk
/// the channels, shared memory through 32-bit window addresses.
#[inline(always)]
unsafe fn pool_backward_fused<const S: usize, const P: usize, const RELU: bool>(
    x: *const f32,
    arg: *const f32,
    dz: *const f32,
    dx: *mut f32,
    g: &LrnPoolGeom,
) {
    const STEP: u32 = FUSED_STEP as u32;
    if g.w == 0 || g.oh == 0 || g.ow == 0 {
        return; // never (the host checks); drops the division checks below
    }
    let half = (S / 2) as i32;
    let ncoef = -2.0 * g.alpha * g.beta;
    let tid = tid_x();
    let (r0, c0, img) = (bid_x() * g.tile, bid_y() * g.run, bid_z());
    // Owned input rows: 2·r0 .. 2·(r0 + tile), or to the bottom for the
    // last tile (rows below every window get dy = 0, so dx = 0).
    let row0 = 2 * r0;
    let rows = if r0 + g.tile >= g.oh {
        g.h - row0
    } else {
        2 * g.tile
    };
    let npix = rows * g.w;
    let c1 = (c0 + g.run).min(g.c);
    if rows == 0 || c1 <= c0 {
        return; // never (the host's grid has no such block), and uniform
    }
    let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
    let (hs, ohs) = (hw as usize, ohw as usize);
    let tile_in = img as usize * (g.c * hw) as usize + (row0 * g.w) as usize;
    let img_out = img as usize * (g.c * ohw) as usize;
    // Two buffers of `STEP` channel slots of `npix` floats each, at 32-bit
    // shared-window addresses.
    let slots = STEP * npix;
    let dys = shared_addr(shared::<f32>());
    // Pipeline step c' (channels c0 − half .. c1 + half) computes scale,
    // dy·y/scale and dy·scale^(−β) of channel c' and writes dx of channel
    // c' − half; step i of the loop covers c' = cs + i·STEP ...
    let cs = c0 as i32 - half;

    // This thread's pixel; its x and dx at channel 0 (the pointers walk the
    // channels with `wrapping_*` and are dereferenced only at channels
    // inside the tensor).
    let p = tid;
    let mine = p < npix;
    let xp = x.wrapping_add(tile_in + p as usize);
    let dxp = dx.wrapping_add(tile_in + p as usize);
    let load_x = |ch: i32| {
        if mine && (ch as u32) < g.c {
            unsafe { *xp.add(ch as usize * hs) }
        } else {
            0.0
        }
    };
    // The x that step i slides in: channels c0 + i·STEP ... (`fast`: all
    // inside the tensor).
    let x_load = |i: u32, fast: bool| {
        let mut v = [0.0f32; FUSED_STEP];
        if mine {
            let ch = c0 + i * STEP;
            let mut q = xp.wrapping_add(ch as usize * hs);
            unrolled::<FUSED_STEP>(|j| {
                if fast || ch + (j as u32) < g.c {
                    v[j] = unsafe { *q };
                }
                q = q.wrapping_add(hs);
            });
        }
        v
    };

    // This thread's gather block: 2×2 block (ba, bb) of the tile in
    // channel slot `cb` of a step, i.e. block (a, b) = (r0 + ba, bb) of the
    // plane.
    let bw = g.w.div_ceil(2);
    let nblk = rows.div_ceil(2) * bw;
    let gathers = tid < STEP * nblk;
    let (cb, blk) = (tid / nblk, tid % nblk);
    let (ba, bb) = (blk / bw, blk % bw);
    let (a, b) = (r0 + ba, bb);
    // Window (a − 1 + u, b − 1 + v) for index 2u + v: whether it exists
    // (a − 1 wraps past `oh` when a = 0) and its offset in a pooled plane.
    let mut wins = [(false, 0usize); 4];
    unrolled::<4>(|i| {
        let r = (a + (i / 2) as u32).wrapping_sub(1);
        let c = (b + (i % 2) as u32).wrapping_sub(1);
        wins[i] = (
            r < g.oh && c < g.ow,
            (r.min(g.oh - 1) * g.ow + c.min(g.ow - 1)) as usize,
        );
    });
    let (argp, dzp) = (arg.wrapping_add(img_out), dz.wrapping_add(img_out));
    // The windows' (arg, dz) for step i ((−1, 0) where a window does not
    // exist or the channel is outside 0..c; `fast`: it is inside).
    let gather_load = |i: u32, fast: bool| {
        let ch = cs + (i * STEP + cb) as i32;
        let mut v = [(-1.0f32, 0.0f32); 4];
        if gathers && (fast || (ch as u32) < g.c) {
            let plane = ch as usize * ohs;
            let (argq, dzq) = (argp.wrapping_add(plane), dzp.wrapping_add(plane));
            unrolled::<4>(|w| {
                if P == 3 || w == 3 {
                    let (ok, off) = wins[w];
                    let (at, d) = unsafe { (*argq.add(off), *dzq.add(off)) };
                    if ok {
                        v[w] = (at, d);
                    }
                }
            });
        }
        v
    };
    // The block's dy in window order (a zero term leaves a sum unchanged),
    // into slot `cb` of buffer `buf`.
    let corner = 2 * ba * g.w + 2 * bb;
    let (down, right) = (2 * ba + 1 < rows, 2 * bb + 1 < g.w);
    let gather_at = dys + 4 * (cb * npix + corner);
    let gather_store = |v: [(f32, f32); 4], buf: u32| {
        if !gathers {
            return;
        }
        let pick = |(at, d): (f32, f32), key: f32| if at == key { d } else { 0.0 };
        let d = if P == 3 {
            [
                pick(v[0], 8.0) + pick(v[1], 6.0) + pick(v[2], 2.0) + pick(v[3], 0.0),
                pick(v[1], 7.0) + pick(v[3], 1.0),
                pick(v[2], 5.0) + pick(v[3], 3.0),
                pick(v[3], 4.0),
            ]
        } else {
            [
                pick(v[3], 0.0),
                pick(v[3], 1.0),
                pick(v[3], 2.0),
                pick(v[3], 3.0),
            ]
        };
        unsafe {
            let q = gather_at + buf * 4 * slots;
            st_shared(q, d[0]);
            if right {
                st_shared(q + 4, d[1]);
            }
            if down {
                let q = q + 4 * g.w;
                st_shared(q, d[2]);
                if right {
                    st_shared(q + 4, d[3]);
                }
            }
        }
    };

    // Carried into the step at pipeline channel c': x of channels
    // c' − half .. (S − 1 of them), dy·y/scale of c' − S + 1 .. (S − 1) and
    // dy·scale^(−β) of c' − half .. (half); 0 outside the channels.
    let mut back = Back::<S> {
        x: [0.0; PREV],
        q: [0.0; PREV],
        d: [0.0; PREV],
    };
    unrolled::<PREV>(|i| {
        if i + 1 < S {
            back.x[i] = load_x(cs + i as i32 - half);
        }
    });
    let steps = (c1 - c0 + 2 * half as u32).div_ceil(STEP);
    let my_dy = dys + 4 * p;
    let mut x_next = x_load(0, false);
    gather_store(gather_load(0, false), 0);
    sync_threads();
    for i in 0..steps {
        let more = i + 1 < steps;
        // Step i computes channels c' = cs + i·STEP + j, writes t = c' − half
        // and loads x and the gather of step i + 1 (channels up to
        // c0 + i·STEP + 2·STEP − 1): all inside the tensor and t inside the
        // run, or the checked copy.
        let ci = c0 + i * STEP;
        let fast = more
            && i * STEP >= 2 * half as u32
            && ci + 2 * STEP - 1 < g.c
            && ci + STEP - 1 < c1 + 2 * half as u32;
        macro_rules! step {
            ($fast:literal) => {{
                let fast: bool = $fast;
                let x_cur = x_next;
                let mut g_next = [(-1.0f32, 0.0f32); 4];
                if fast || more {
                    x_next = x_load(i + 1, fast);
                    g_next = gather_load(i + 1, fast);
                }
                // (Threads past the tile only gather.)
                if mine {
                    let dy_at = my_dy + (i & 1) * 4 * slots;
                    let t0 = cs - half + (i * STEP) as i32;
                    let mut dq = dxp.wrapping_offset(t0 as isize * hs as isize);
                    let mut dy = [0.0f32; FUSED_STEP];
                    let mut inside = [true; FUSED_STEP];
                    unrolled::<FUSED_STEP>(|j| {
                        dy[j] = unsafe { ld_shared(dy_at + j as u32 * 4 * npix) };
                        inside[j] = fast || ((cs + (i * STEP + j as u32) as i32) as u32) < g.c;
                    });
                    let (xt, v) = back.step(&x_cur, &dy, &inside, g, ncoef);
                    unrolled::<FUSED_STEP>(|j| {
                        // Channel t = c' − half of pipeline channel c'.
                        let t = cs + (i * STEP + j as u32) as i32 - half;
                        if fast || ((t - c0 as i32) as u32) < c1 - c0 {
                            let masked = RELU && !(xt[j] > 0.0);
                            unsafe { *dq = if masked { 0.0 } else { v[j] } };
                        }
                        dq = dq.wrapping_add(hs);
                    });
                }
                // Buffer (i + 1) % 2: its last readers (step i − 1) are
                // past the previous barrier.
                if fast || more {
                    gather_store(g_next, (i + 1) & 1);
                }
            }};
        }
        if fast {
            step!(true)
        } else {
            step!(false)
        }
        sync_threads();
    }
}
