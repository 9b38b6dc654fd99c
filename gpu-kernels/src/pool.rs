//! Max pooling over `size × size` windows at `stride` (overlapping when
//! stride < size, as AlexNet's 3/2), no padding, output size by PyTorch's floor
//! rule. Layout NCHW.
//!
//! Forward: one thread per output element; it also saves where the window's
//! first maximum (row-major scan, strict `>`) lies, as the offset `a·size + b`
//! inside the window, stored as an f32 (exact for any window up to 2^24
//! elements). Backward without atomics (so it is deterministic): one thread per
//! *input* element visits the few windows that contain it and adds the `dy` of
//! each window whose saved offset points at it; it reads neither x nor y.
//!
//! Mapping (both): 256-thread blocks over a plane's elements (the output's
//! for the forward pass, the input's for the backward), grid x over them, y
//! over the N·C planes (striding when there are more than the grid holds);
//! 32-bit index math only. Where a dimension meets at most two windows
//! (size ≤ 2·stride, as AlexNet's 3/2) the backward pass reads its four
//! candidate windows without a loop, so their loads overlap.

use crate::device::{bdim_x, bid_x, bid_y, gdim_y, tid_x};

/// This thread's element in a plane of `len`, its first plane and the
/// plane stride; `None` past the plane's end.
#[inline(always)]
fn place(len: u32) -> Option<(u32, u32, u32)> {
    let q = bid_x() * bdim_x() + tid_x();
    (q < len).then(|| (q, bid_y(), gdim_y()))
}

/// Max pool forward: `y[n,c,oh,ow] = max` over its window of x, and
/// `arg[n,c,oh,ow]` = the offset of its first maximum in the window.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn maxpool_forward(
    x: *const f32,
    y: *mut f32,
    arg: *mut f32,
    planes: u32,
    h: u32,
    w: u32,
    size: u32,
    stride: u32,
    oh: u32,
    ow: u32,
) {
    let Some((q, mut plane, step)) = place(oh * ow) else {
        return;
    };
    let (r, c) = (q / ow, q % ow);
    while plane < planes {
        let xp = unsafe {
            x.add(plane as usize * (h * w) as usize + (r * stride * w + c * stride) as usize)
        };
        let mut best = unsafe { *xp };
        let mut at = 0u32;
        for a in 0..size {
            for b in 0..size {
                let v = unsafe { *xp.add((a * w + b) as usize) };
                if v > best {
                    best = v;
                    at = a * size + b;
                }
            }
        }
        let o = plane as usize * (oh * ow) as usize + (r * ow + c) as usize;
        unsafe {
            *y.add(o) = best;
            *arg.add(o) = at as f32;
        }
        plane += step;
    }
}

/// Max pool backward: `dx[n,c,ih,iw] = Σ dy[n,c,oh,ow]` over the windows whose
/// saved first maximum is (ih, iw), in window order; every element of `dx` is
/// written.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn maxpool_backward(
    arg: *const f32,
    dy: *const f32,
    dx: *mut f32,
    planes: u32,
    h: u32,
    w: u32,
    size: u32,
    stride: u32,
    oh: u32,
    ow: u32,
) {
    let Some((q, mut plane, step)) = place(h * w) else {
        return;
    };
    let (ih, iw) = (q / w, q % w);
    // Windows r with r·stride ≤ ih < r·stride + size.
    let r_lo = if ih + 1 > size {
        (ih + 1 - size).div_ceil(stride)
    } else {
        0
    };
    let r_hi = (ih / stride).min(oh - 1);
    let c_lo = if iw + 1 > size {
        (iw + 1 - size).div_ceil(stride)
    } else {
        0
    };
    let c_hi = (iw / stride).min(ow - 1);
    let two = size <= 2 * stride;
    while plane < planes {
        let off = plane as usize * (oh * ow) as usize;
        let (dyp, argp) = unsafe { (dy.add(off), arg.add(off)) };
        // dy of window (r, c) if its first maximum is this element, else 0.
        let routed = |r: u32, c: u32| -> f32 {
            let here = ((ih - r * stride) * size + iw - c * stride) as f32;
            let o = (r * ow + c) as usize;
            let (a, d) = unsafe { (*argp.add(o), *dyp.add(o)) };
            if a == here { d } else { 0.0 }
        };
        let mut acc = 0.0f32;
        if two {
            // Candidates r_hi − 1, r_hi (and likewise columns), in window
            // order; a zero term leaves the sum unchanged.
            let r0 = r_hi >= 1 && r_hi - 1 >= r_lo;
            let c0 = c_hi >= 1 && c_hi - 1 >= c_lo;
            let (r1, c1) = (r_hi >= r_lo, c_hi >= c_lo);
            let t00 = if r0 && c0 {
                routed(r_hi - 1, c_hi - 1)
            } else {
                0.0
            };
            let t01 = if r0 && c1 {
                routed(r_hi - 1, c_hi)
            } else {
                0.0
            };
            let t10 = if r1 && c0 {
                routed(r_hi, c_hi - 1)
            } else {
                0.0
            };
            let t11 = if r1 && c1 { routed(r_hi, c_hi) } else { 0.0 };
            acc = t00 + t01 + t10 + t11;
        } else {
            let mut r = r_lo;
            while r <= r_hi {
                let mut c = c_lo;
                while c <= c_hi {
                    acc += routed(r, c);
                    c += 1;
                }
                r += 1;
            }
        }
        unsafe { *dx.add(plane as usize * (h * w) as usize + q as usize) = acc };
        plane += step;
    }
}
