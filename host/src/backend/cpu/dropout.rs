//! CPU reference: inverted dropout with a counter-based mask (Philox-4x32-10).
//!
//! Element `i` of a flat buffer is kept iff `u ≥ p`, where `u ∈ [0, 1)` comes
//! from one Philox-4x32-10 call with
//! `key = [seed as u32, (seed >> 32) as u32]` and
//! `counter = [(i/4) as u32, ((i/4) >> 32) as u32, step as u32, (step >> 32) as u32]`:
//! output word `i % 4`, `u = (word >> 8) · 2⁻²⁴` (24 bits, exact in f32). Kept
//! values are multiplied by `1/(1 − p)` (computed in f32), dropped ones become
//! 0. The mask is a pure function of `(seed, step, i)`, so the backward pass
//! regenerates it instead of storing it, and GPU kernels can reproduce it
//! bit for bit. `p = 0` keeps everything unchanged.

use rayon::prelude::*;

use crate::backend::*;

/// Philox-4x32 round multipliers (for counter words 0 and 2).
const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Philox-4x32 key increments (the Weyl sequence).
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// The high and low 32-bit halves of `a · b`.
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// Philox-4x32-10 (Salmon et al. 2011, as defined in Random123): 10 rounds, the
/// key bumped by the Weyl increments between consecutive rounds.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
        }
        let (hi0, lo0) = mulhilo(PHILOX_M0, c[0]);
        let (hi1, lo1) = mulhilo(PHILOX_M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Multiplies every kept element by `1/(1 − p)` and zeroes the dropped ones.
/// Forward and backward are the same operation.
fn apply_mask(p: &DropoutParams, buf: &mut [f32]) {
    assert!(
        (0.0..=1.0).contains(&p.p),
        "dropout: probability {} is outside [0, 1]",
        p.p
    );
    let key = [p.seed as u32, (p.seed >> 32) as u32];
    let scale = 1.0f32 / (1.0 - p.p);
    buf.par_chunks_mut(4).enumerate().for_each(|(block, vals)| {
        let block = block as u64;
        let counter = [
            block as u32,
            (block >> 32) as u32,
            p.step as u32,
            (p.step >> 32) as u32,
        ];
        let words = philox4x32_10(counter, key);
        for (v, word) in vals.iter_mut().zip(words) {
            let u = (word >> 8) as f32 * (1.0 / (1u32 << 24) as f32);
            *v = if u >= p.p { *v * scale } else { 0.0 };
        }
    });
}

/// Inverted dropout in place.
pub fn dropout_forward(p: &DropoutParams, y: &mut [f32]) {
    apply_mask(p, y);
}

/// Applies the forward's mask and scale to the gradient, in place.
pub fn dropout_backward(p: &DropoutParams, d: &mut [f32]) {
    apply_mask(p, d);
}
