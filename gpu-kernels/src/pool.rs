//! Max pooling over `size × size` windows at `stride` (overlapping when
//! stride < size, as AlexNet's 3/2), no padding, output size by PyTorch's floor
//! rule. Layout NCHW.
//!
//! Forward: one thread per output element; it also saves where the window's
//! first maximum (row-major scan, strict `>`) lies, as the offset `a·size + b`
//! inside the window, stored as an f32 (exact for any window up to 2^24
//! elements). Backward without atomics (so it is deterministic): each `dx`
//! element is written once, as the sum in window order of the `dy` of the
//! windows whose saved offset points at it; it reads neither x nor y.
//!
//! Mapping: 256-thread blocks over a plane's work items along grid x, grid y
//! over the N·C planes (striding when there are more than the grid holds);
//! 32-bit index math only. Forward: one thread per output element.
//! Backward: one thread per input element (consecutive threads, consecutive
//! inputs: coalesced stores); where size ≤ 2·stride (AlexNet's 3/2) it
//! checks the ≤ 4 windows that can hold it, else it loops over the windows
//! that contain it. (A thread per `stride × stride` block of inputs, sharing
//! the window loads, had measured 2× slower: its strided stores.)

use crate::device::{bdim_x, bid_x, bid_y, gdim_y, tid_x, unrolled};

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
/// written. Launch h·w threads per plane (see the module doc).
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
    let g = BackGeom {
        planes,
        h,
        w,
        size,
        stride,
        oh,
        ow,
    };
    unsafe {
        if size <= 2 * stride {
            backward_pairs(arg, dy, dx, &g)
        } else {
            backward_per_input(arg, dy, dx, &g)
        }
    }
}

/// The backward kernel's scalar parameters.
#[derive(Clone, Copy)]
struct BackGeom {
    planes: u32,
    h: u32,
    w: u32,
    size: u32,
    stride: u32,
    oh: u32,
    ow: u32,
}

/// `size ≤ 2·stride`: one thread per input element (ih, iw); it lies in
/// window rows r with `r·stride ≤ ih < r·stride + size`, i.e. r ∈
/// {ih/stride − 1, ih/stride}, and likewise columns, so the thread loads
/// those ≤ 4 windows' `arg` and `dy` (neighbours share them through L1) and
/// adds, in window order, the `dy` of those whose `arg` is its offset.
#[inline(always)]
unsafe fn backward_pairs(arg: *const f32, dy: *const f32, dx: *mut f32, g: &BackGeom) {
    let s = g.stride;
    // Never taken (the host checks the geometry); it lets LLVM drop the
    // division-by-zero panics below.
    if s == 0 || g.size == 0 {
        return;
    }
    let Some((q, mut plane, step)) = place(g.h * g.w) else {
        return;
    };
    let (ih, iw) = (q / g.w, q % g.w);
    // Candidate window k = (row ih/s − 1 + k/2, column iw/s − 1 + k%2)
    // (wrapping below 0): this input's offset in it, whether it exists and
    // holds the input, and its in-bounds index to load either way (so all
    // eight loads issue back to back without branches).
    let win = |k: u32| {
        let r = (ih / s + k / 2).wrapping_sub(1);
        let c = (iw / s + k % 2).wrapping_sub(1);
        let (dr, dc) = (ih.wrapping_sub(r * s), iw.wrapping_sub(c * s));
        let ok = (r < g.oh) & (c < g.ow) & (dr < g.size) & (dc < g.size);
        let at = r.min(g.oh - 1) * g.ow + c.min(g.ow - 1);
        ((dr * g.size + dc) as f32, ok, at as usize)
    };
    let wins = [win(0), win(1), win(2), win(3)];
    while plane < g.planes {
        let off = plane as usize * (g.oh * g.ow) as usize;
        let (dyp, argp) = unsafe { (dy.add(off), arg.add(off)) };
        // A zero term leaves the sum unchanged: the sum in window order.
        let mut acc = 0.0f32;
        unrolled::<4>(|k| {
            let (here, ok, at) = wins[k];
            let (a, d) = unsafe { (*argp.add(at), *dyp.add(at)) };
            acc += if ok && a == here { d } else { 0.0 };
        });
        unsafe { *dx.add(plane as usize * (g.h * g.w) as usize + q as usize) = acc };
        plane += step;
    }
}

/// `size > 2·stride`: one thread per input element; it loops over the windows
/// r with `r·stride ≤ ih < r·stride + size` (and likewise columns), in window
/// order, adding the `dy` of each whose saved offset points at it.
#[inline(always)]
unsafe fn backward_per_input(arg: *const f32, dy: *const f32, dx: *mut f32, g: &BackGeom) {
    let BackGeom {
        planes,
        h,
        w,
        size,
        stride,
        oh,
        ow,
    } = *g;
    let Some((q, mut plane, step)) = place(h * w) else {
        return;
    };
    let (ih, iw) = (q / w, q % w);
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
                let (a, d) = unsafe { (*argp.add(o), *dyp.add(o)) };
                if a == here {
                    acc += d;
                }
                c += 1;
            }
            r += 1;
        }
        unsafe { *dx.add(plane as usize * (h * w) as usize + q as usize) = acc };
        plane += step;
    }
}
