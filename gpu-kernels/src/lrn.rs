//! Cross-map local response normalisation (Krizhevsky et al. 2012, §3.3):
//! `scale[c] = k + α·Σ_{c'∈win(c)} x[c']²`, `y[c] = x[c]·scale[c]^(−β)`, where
//! `win(c) = [c − ⌊size/2⌋, c − ⌊size/2⌋ + size − 1] ∩ [0, C)`.
//! Backward: `dx[c] = dy[c]·scale[c]^(−β) − 2αβ·x[c]·Σ_{c' : c∈win(c')} dy[c']·y[c']/scale[c']`.
//!
//! Layout NCHW. Mapping: one thread per (n, h, w) pixel, walking the C
//! channels of that pixel (consecutive threads take consecutive pixels, so
//! every access is coalesced); window sums are recomputed per channel from
//! L1-resident neighbours (no running sum, so no cancellation drift).
//! 1-D grid over N·H·W pixels, any block size.

use crate::device::{fma, grid_stride, powf};

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
) {
    let (mut pix, step) = grid_stride();
    let pixels = n as usize * hw as usize;
    let hw = hw as usize;
    while pix < pixels {
        let base = (pix / hw) * c as usize * hw + pix % hw;
        for ch in 0..c {
            let (lo, hi) = window(ch, size, c);
            let mut sum = 0.0f32;
            for j in lo..=hi {
                let v = unsafe { *x.add(base + j as usize * hw) };
                sum = fma(v, v, sum);
            }
            let sc = fma(alpha, sum, k);
            let at = base + ch as usize * hw;
            unsafe {
                *scale.add(at) = sc;
                *y.add(at) = *x.add(at) * powf(sc, -beta);
            }
        }
        pix += step;
    }
}

/// LRN backward: `dx` from `dy` and the forward's `x`, `y`, `scale`.
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
) {
    let (mut pix, step) = grid_stride();
    let pixels = n as usize * hw as usize;
    let hw = hw as usize;
    let half = (size / 2) as i32;
    while pix < pixels {
        let base = (pix / hw) * c as usize * hw + pix % hw;
        for ch in 0..c {
            // c ∈ win(c') ⇔ c' ∈ [c + half + 1 − size, c + half].
            let lo = (ch as i32 + half + 1 - size as i32).max(0) as u32;
            let hi = (ch as i32 + half).min(c as i32 - 1) as u32;
            let mut acc = 0.0f32;
            for j in lo..=hi {
                let at = base + j as usize * hw;
                acc += unsafe { *dy.add(at) * *y.add(at) / *scale.add(at) };
            }
            let at = base + ch as usize * hw;
            unsafe {
                let direct = *dy.add(at) * powf(*scale.add(at), -beta);
                *dx.add(at) = direct - 2.0 * alpha * beta * *x.add(at) * acc;
            }
        }
        pix += step;
    }
}
