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
//! 1-D grid-stride mappings.

use crate::device::grid_stride;

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
    let (mut i, step) = grid_stride();
    let total = planes as usize * (oh * ow) as usize;
    while i < total {
        let plane = i / (oh * ow) as usize;
        let o = (i % (oh * ow) as usize) as u32;
        let (r, c) = (o / ow, o % ow);
        let xp = unsafe { x.add(plane * (h * w) as usize + (r * stride * w + c * stride) as usize) };
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
        unsafe {
            *y.add(i) = best;
            *arg.add(i) = at as f32;
        }
        i += step;
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
    let (mut i, step) = grid_stride();
    let total = planes as usize * (h * w) as usize;
    while i < total {
        let plane = i / (h * w) as usize;
        let p = (i % (h * w) as usize) as u32;
        let (ih, iw) = (p / w, p % w);
        let off = plane * (oh * ow) as usize;
        let (dyp, argp) = unsafe { (dy.add(off), arg.add(off)) };
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
        unsafe { *dx.add(i) = acc };
        i += step;
    }
}
