//! Max pooling over `size × size` windows at `stride` (overlapping when
//! stride < size, as AlexNet's 3/2), no padding, output size by PyTorch's floor
//! rule. Layout NCHW.
//!
//! Forward: one thread per output element. Backward without atomics (so it is
//! deterministic): one thread per *input* element, which visits the few
//! windows that contain it and adds `dy` of each window whose first maximum
//! (row-major scan, strict `>`) is this element. An element can only be that
//! if it equals the window's output `y`, so the window is scanned (for an
//! earlier equal element) only then. 1-D grid-stride mappings.

use crate::device::grid_stride;

/// Whether no element of window (oh, ow) before plane index `p` (row-major)
/// equals the window's maximum `best`, i.e. `p` holds its first maximum.
#[inline(always)]
unsafe fn first_max(
    plane: *const f32,
    w: u32,
    size: u32,
    stride: u32,
    oh: u32,
    ow: u32,
    p: u32,
    best: f32,
) -> bool {
    let (h0, w0) = (oh * stride, ow * stride);
    for i in 0..size {
        for j in 0..size {
            let idx = (h0 + i) * w + w0 + j;
            if idx == p {
                return true;
            }
            if unsafe { *plane.add(idx as usize) } == best {
                return false;
            }
        }
    }
    true
}

/// Max pool forward: `y[n,c,oh,ow] = max` over its window of x.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn maxpool_forward(
    x: *const f32,
    y: *mut f32,
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
        let xp = unsafe { x.add(plane * (h * w) as usize) };
        let mut best = unsafe { *xp.add((r * stride * w + c * stride) as usize) };
        for a in 0..size {
            for b in 0..size {
                let v = unsafe { *xp.add(((r * stride + a) * w + c * stride + b) as usize) };
                if v > best {
                    best = v;
                }
            }
        }
        unsafe { *y.add(i) = best };
        i += step;
    }
}

/// Max pool backward: `dx[n,c,ih,iw] = Σ dy[n,c,oh,ow]` over the windows whose
/// first maximum is (ih, iw); every element of `dx` is written.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn maxpool_backward(
    x: *const f32,
    y: *const f32,
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
        let xp = unsafe { x.add(plane * (h * w) as usize) };
        let dyp = unsafe { dy.add(plane * (oh * ow) as usize) };
        let yp = unsafe { y.add(plane * (oh * ow) as usize) };
        let v = unsafe { *xp.add(p as usize) };
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
                let best = unsafe { *yp.add((r * ow + c) as usize) };
                if v == best && unsafe { first_max(xp, w, size, stride, r, c, p, best) } {
                    acc += unsafe { *dyp.add((r * ow + c) as usize) };
                }
                c += 1;
            }
            r += 1;
        }
        unsafe { *dx.add(i) = acc };
        i += step;
    }
}
