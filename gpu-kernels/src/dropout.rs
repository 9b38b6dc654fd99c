//! Inverted dropout with an on-device counter-based generator (Philox-4x32-10,
//! Salmon et al. 2011): element `i` is kept iff `u ≥ p`, where `u` is word
//! `i % 4` of `philox(counter = [i/4 lo, i/4 hi, step lo, step hi],
//! key = [seed lo, seed hi])` scaled to [0, 1) by its top 24 bits; kept values
//! are multiplied by `1/(1−p)`. The mask is a pure function of
//! (seed, step, i), so backward regenerates it and nothing is stored; the CPU
//! reference computes the same bits.
//!
//! The step is read from device memory (`*step`), which the host writes
//! before the launch or before replaying a captured step graph, so a graph
//! draws new masks each step.
//!
//! Mapping: one thread per group of 4 consecutive elements (one Philox call),
//! 1-D grid-stride.

use crate::device::grid_stride;

#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// Philox-4x32 with 10 rounds.
#[inline(always)]
pub fn philox4x32_10(mut c: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(0x9E37_79B9);
            k[1] = k[1].wrapping_add(0xBB67_AE85);
        }
        let (hi0, lo0) = mulhilo(0xD251_1F53, c[0]);
        let (hi1, lo1) = mulhilo(0xCD9E_8D57, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

#[inline(always)]
unsafe fn apply(y: *mut f32, n: usize, p: f32, seed: u64, step: u64) {
    let scale = 1.0 / (1.0 - p);
    let key = [seed as u32, (seed >> 32) as u32];
    let (mut g, stride) = grid_stride();
    let groups = n.div_ceil(4);
    while g < groups {
        let r = philox4x32_10(
            [
                g as u32,
                (g as u64 >> 32) as u32,
                step as u32,
                (step >> 32) as u32,
            ],
            key,
        );
        for (j, word) in r.iter().enumerate() {
            let i = g * 4 + j;
            if i < n {
                let u = (word >> 8) as f32 * (1.0 / 16_777_216.0);
                unsafe {
                    let v = *y.add(i);
                    *y.add(i) = if u >= p { v * scale } else { 0.0 };
                }
            }
        }
        g += stride;
    }
}

/// Dropout forward in place on `y[0..n]`, for the step `*step`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn dropout_forward(
    y: *mut f32,
    n: usize,
    p: f32,
    seed: u64,
    step: *const u64,
) {
    unsafe { apply(y, n, p, seed, *step) }
}

/// Dropout backward in place on the gradient `d[0..n]` (same mask and scale).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn dropout_backward(
    d: *mut f32,
    n: usize,
    p: f32,
    seed: u64,
    step: *const u64,
) {
    unsafe { apply(d, n, p, seed, *step) }
}
