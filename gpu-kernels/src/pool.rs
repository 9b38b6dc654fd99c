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
//! Mapping (both): 32×8 blocks over a plane's columns and rows (the output's
//! for the forward pass, the input's for the backward), grid x over columns,
//! y over rows, z over the N·C planes (striding when there are more than the
//! grid holds), so a thread finds its element without dividing.

use crate::device::{bdim_x, bdim_y, bid_x, bid_y, bid_z, gdim_z, tid_x, tid_y};

/// This thread's (column, row) in a plane, and its first plane and the
/// plane stride.
#[inline(always)]
fn place() -> (u32, u32, u32, u32) {
    (
        bid_x() * bdim_x() + tid_x(),
        bid_y() * bdim_y() + tid_y(),
        bid_z(),
        gdim_z(),
    )
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
    let (c, r, mut plane, step) = place();
    if c >= ow || r >= oh {
        return;
    }
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
    let (iw, ih, mut plane, step) = place();
    if iw >= w || ih >= h {
        return;
    }
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
    while plane < planes {
        let off = plane as usize * (oh * ow) as usize;
        let (dyp, argp) = unsafe { (dy.add(off), arg.add(off)) };
        let mut acc = 0.0f32;
        let mut r = r_lo;
        while r <= r_hi {
            let mut c = c_lo;
            while c <= c_hi {
                let here = ((ih - r * stride) * size + iw - c * stride) as f32;
                let o = (r * ow + c) as usize;
                if unsafe { *argp.add(o) } == here {
                    acc += unsafe { *dyp.add(o) };
                }
                c += 1;
            }
            r += 1;
        }
        unsafe { *dx.add(plane as usize * (h * w) as usize + (ih * w + iw) as usize) = acc };
        plane += step;
    }
}
