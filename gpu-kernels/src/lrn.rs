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
//! memory (about 3 of 4.5 and 5 of 7.5 plane-sized passes saved).

use crate::device::{fma, grid_stride, powf, rcp, unrolled};

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
    let mut sum = 0.0f32;
    for v in xs {
        sum = fma(*v, *v, sum);
    }
    let sc = fma(alpha, sum, k);
    (sc, powf(sc, -beta))
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
/// max-pooled in `pool × pool` windows at `stride` to `oh × ow`; threads
/// walk runs of `chunk` channels.
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
    pub chunk: u32,
    pub alpha: f32,
    pub beta: f32,
    pub k: f32,
}

/// LRN then max pooling in one pass: `z` and `arg` as `maxpool_forward`
/// writes them for `lrn_forward`'s `y`, which is never stored (nor is
/// `scale`: the backward recomputes both from `x`). One thread per (n, oh,
/// ow) output pixel and run of `chunk` channels; for each of its window's
/// `pool²` inputs it slides an LRN window of `size` channels in registers
/// (overlapping windows recompute their shared inputs: 9/4 the LRN
/// arithmetic for 3/2, none of the traffic). The host launches only
/// `size ∈ {3, 5}`, `pool ∈ {2, 3}`, `stride = 2`; others trap.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn lrn_pool_forward(
    x: *const f32,
    z: *mut f32,
    arg: *mut f32,
    g: LrnPoolGeom,
) {
    unsafe {
        match (g.size, g.pool) {
            (5, 3) => pool_forward_fused::<5, 3, 9>(x, z, arg, &g),
            (3, 3) => pool_forward_fused::<3, 3, 9>(x, z, arg, &g),
            (5, 2) => pool_forward_fused::<5, 2, 4>(x, z, arg, &g),
            (3, 2) => pool_forward_fused::<3, 2, 4>(x, z, arg, &g),
            _ => core::arch::nvptx::trap(),
        }
    }
}

/// `lrn_pool_forward` for LRN window `S` and pool window `P` (`Q = P²`
/// inputs, row-major, so input `q`'s window offset `a·P + b` is `q`).
#[inline(always)]
unsafe fn pool_forward_fused<const S: usize, const P: usize, const Q: usize>(
    x: *const f32,
    z: *mut f32,
    arg: *mut f32,
    g: &LrnPoolGeom,
) {
    let (hw, ohw) = ((g.h * g.w) as usize, (g.oh * g.ow) as usize);
    let pixels = g.n as usize * ohw;
    let items = pixels * g.c.div_ceil(g.chunk) as usize;
    let half = (S / 2) as i32;
    let (mut i, step) = grid_stride();
    while i < items {
        let (run, pix) = ((i / pixels) as u32, i % pixels);
        let (img, o) = (pix / ohw, (pix % ohw) as u32);
        let (r, q) = (o / g.ow, o % g.ow);
        let corner = (r * g.stride * g.w + q * g.stride) as usize;
        let xb = unsafe { x.add(img * g.c as usize * hw + corner) };
        let out = img * g.c as usize * ohw + o as usize;
        let (zb, ab) = unsafe { (z.add(out), arg.add(out)) };
        let c0 = run * g.chunk;
        let c1 = (c0 + g.chunk).min(g.c);
        // Input q's value in channel `ch` (0 outside the channels).
        let load = |ch: i32, q: usize| {
            if ch >= 0 && ch < g.c as i32 {
                let at = ch as usize * hw + (q / P) * g.w as usize + q % P;
                unsafe { *xb.add(at) }
            } else {
                0.0
            }
        };
        let mut xs = [[0.0f32; S]; Q];
        unrolled::<Q>(|q| {
            unrolled::<S>(|s| {
                if s > 0 {
                    xs[q][s] = load(c0 as i32 + s as i32 - 1 - half, q);
                }
            })
        });
        // Loads run one channel ahead of their use (two steps in flight).
        let mut next = [0.0f32; Q];
        unrolled::<Q>(|q| next[q] = load(c0 as i32 + half, q));
        for ch in c0..c1 {
            let cur = next;
            unrolled::<Q>(|q| next[q] = load(ch as i32 + 1 + half, q));
            let mut best = f32::NEG_INFINITY;
            let mut at = 0u32;
            unrolled::<Q>(|q| {
                slide(&mut xs[q], cur[q]);
                let (_, yv) = lrn_at(&xs[q], g.alpha, g.beta, g.k);
                // The first input always wins (as the reference starts from
                // it); later ones only on a strict `>`.
                if q == 0 || yv > best {
                    best = yv;
                    at = q as u32;
                }
            });
            let o = ch as usize * ohw;
            unsafe {
                *zb.add(o) = best;
                *ab.add(o) = at as f32;
            }
        }
        i += step;
    }
}

/// Backward of `lrn_pool_forward` (and, with `relu` nonzero, of the ReLU
/// whose output `x` is): `dx` from `x`, the forward's `arg` and `dz`, as
/// `maxpool_backward` then `lrn_backward` would give, without storing the
/// pool's input gradient. One thread per (n, h, w) input pixel and run of
/// `chunk` channels (consecutive threads take consecutive pixels, so x and
/// dx are coalesced): the ≤ 2×2 pool windows (stride 2) that can hold the
/// pixel give its `dy` where their `arg` names it; the pixel slides its LRN
/// window of x, recomputes `scale` and `y`, and keeps `dy·y/scale` for the
/// `size` channels the output channel needs, so the pipeline runs
/// `size − 1` channels ahead of the channel it writes. (A 2×2 block of
/// pixels per thread, sharing the window loads, measured 1.3× slower: its
/// stride-2 stores and loads.) Issue-bound on the H200: one `powf` and an
/// approximate reciprocal per element, not two `powf` and a division,
/// took norm1 (b128) from 0.345 to 0.271 ms.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn lrn_pool_backward(
    x: *const f32,
    arg: *const f32,
    dz: *const f32,
    dx: *mut f32,
    g: LrnPoolGeom,
    relu: u32,
) {
    let relu = relu != 0;
    unsafe {
        match (g.size, g.pool, g.stride) {
            (5, 3, 2) => pool_backward_fused::<5, 3>(x, arg, dz, dx, &g, relu),
            (3, 3, 2) => pool_backward_fused::<3, 3>(x, arg, dz, dx, &g, relu),
            (5, 2, 2) => pool_backward_fused::<5, 2>(x, arg, dz, dx, &g, relu),
            (3, 2, 2) => pool_backward_fused::<3, 2>(x, arg, dz, dx, &g, relu),
            _ => core::arch::nvptx::trap(),
        }
    }
}

/// `lrn_pool_backward` for LRN window `S`, pool window `P ≤ 4`, stride 2:
/// input row `ih` lies in window rows `ih/2 − 1` and `ih/2` at most (and
/// likewise columns), at offset `(ih − 2r)·P + (iw − 2c)` in window (r, c).
#[inline(always)]
unsafe fn pool_backward_fused<const S: usize, const P: usize>(
    x: *const f32,
    arg: *const f32,
    dz: *const f32,
    dx: *mut f32,
    g: &LrnPoolGeom,
    relu: bool,
) {
    let (hw, ohw) = ((g.h * g.w) as usize, (g.oh * g.ow) as usize);
    let pixels = g.n as usize * hw;
    let items = pixels * g.c.div_ceil(g.chunk) as usize;
    let half = (S / 2) as i32;
    let coef = 2.0 * g.alpha * g.beta;
    let (mut it, step) = grid_stride();
    while it < items {
        let (run, pix) = ((it / pixels) as u32, it % pixels);
        let (img, q) = (pix / hw, (pix % hw) as u32);
        let (ih, iw) = (q / g.w, q % g.w);
        let plane_in = img * g.c as usize * hw + q as usize;
        let plane_out = img * g.c as usize * ohw;
        // Candidate windows (r, c) in window order; for each, the offset
        // this pixel would have in it (as `arg` stores it), whether it
        // holds the pixel, and its in-bounds index in a pooled plane.
        let mut wins = [(0.0f32, false, 0usize); 4];
        unrolled::<4>(|k| {
            let (r, c) = ((ih / 2 + k as u32 / 2).wrapping_sub(1), (iw / 2 + k as u32 % 2).wrapping_sub(1));
            let (dr, dc) = (ih.wrapping_sub(2 * r), iw.wrapping_sub(2 * c));
            let ok = r < g.oh && c < g.ow && dr < P as u32 && dc < P as u32;
            let at = (r.min(g.oh - 1) * g.ow + c.min(g.ow - 1)) as usize;
            wins[k] = ((dr * P as u32 + dc) as f32, ok, at);
        });
        let c0 = run * g.chunk;
        let c1 = (c0 + g.chunk).min(g.c);
        let start = c0 as i32 - 2 * half;
        // Pointers walk a channel a step (wrapping below channel 0; read
        // only inside the channels): x at channel `xe`, the windows' arg and
        // dz at `we`, dx at the step's output channel.
        let at_ch = |p: *const f32, plane: usize, ch: i32| p.wrapping_offset(ch as isize * plane as isize);
        let mut xe = start;
        let mut xp = at_ch(x.wrapping_add(plane_in), hw, xe);
        let mut we = start + half;
        let mut ap = at_ch(arg.wrapping_add(plane_out), ohw, we);
        let mut zp = at_ch(dz.wrapping_add(plane_out), ohw, we);
        let mut dp = at_ch(dx.wrapping_add(plane_in), hw, start) as *mut f32;
        let inside = |ch: i32| (ch as u32) < g.c;
        let mut next_x = || {
            let v = if inside(xe) { unsafe { *xp } } else { 0.0 };
            (xe, xp) = (xe + 1, xp.wrapping_add(hw));
            v
        };
        // x over channels [t, t + S − 1] and, for channels
        // [t − ⌊S/2⌋, t + ⌊S/2⌋] (those whose window holds t), dy·y/scale
        // and dy·scale^(−β) (both 0 outside the channels).
        let mut xs = [0.0f32; S];
        let (mut qs, mut ds) = ([0.0f32; S], [0.0f32; S]);
        unrolled::<S>(|s| {
            if s > 0 {
                xs[s] = next_x();
            }
        });
        // The windows' (arg, dz) in channel `we` (unused outside the
        // channels), then on to the next channel.
        let mut next_w = || {
            let mut v = [(0.0f32, 0.0f32); 4];
            if inside(we) {
                unrolled::<4>(|k| {
                    let at = wins[k].2;
                    v[k] = unsafe { (*ap.add(at), *zp.add(at)) };
                });
            }
            (we, ap, zp) = (we + 1, ap.wrapping_add(ohw), zp.wrapping_add(ohw));
            v
        };
        for t in start..c1 as i32 {
            slide(&mut xs, next_x());
            let w_now = next_w();
            let (qv, dv) = if inside(t + half) {
                // Window order; a zero term leaves the sum unchanged.
                let mut dy = 0.0f32;
                unrolled::<4>(|k| {
                    let ((here, ok, _), (a, d)) = (wins[k], w_now[k]);
                    dy += if ok && a == here { d } else { 0.0 };
                });
                let (sc, r) = lrn_scale(&xs, g.alpha, g.beta, g.k);
                let dr = dy * r;
                (dr * xs[S / 2] * rcp(sc), dr)
            } else {
                (0.0, 0.0)
            };
            slide(&mut qs, qv);
            slide(&mut ds, dv);
            if t >= c0 as i32 {
                let xv = xs[0];
                let mut acc = 0.0f32;
                for v in &qs {
                    acc += *v;
                }
                let v = ds[S / 2] - coef * xv * acc;
                let masked = relu && !(xv > 0.0);
                unsafe { *dp = if masked { 0.0 } else { v } };
            }
            dp = dp.wrapping_add(hw);
        }
        it += step;
    }
}
