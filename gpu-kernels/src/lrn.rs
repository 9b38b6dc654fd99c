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

use crate::device::{fma, grid_stride, powf};

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
        for i in 0..S - 1 {
            xs[i] = xs[i + 1];
        }
        xs[S - 1] = load(ch as i32 - half + S as i32 - 1);
        let mut sum = 0.0f32;
        for i in 0..S {
            sum = fma(xs[i], xs[i], sum);
        }
        let sc = fma(alpha, sum, k);
        let at = ch as usize * hw;
        unsafe {
            *scale.add(at) = sc;
            *y.add(at) = xs[S / 2] * powf(sc, -beta);
        }
    }
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
