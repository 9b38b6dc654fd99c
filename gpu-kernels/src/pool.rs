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
//! 32-bit index math only. Forward: one thread per output element. Backward,
//! where size ≤ 2·stride (AlexNet's 3/2): one thread per `stride × stride`
//! block of inputs (⌈h/stride⌉·⌈w/stride⌉ per plane); every window meeting
//! block (a, b) is one of (a−1 | a, b−1 | b), so the thread loads those ≤ 4
//! windows' `arg` and `dy` once and writes all its inputs. Larger windows:
//! one thread per input element, looping over the windows that contain it.

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
/// written. Launch ⌈h/stride⌉·⌈w/stride⌉ threads per plane when
/// `size <= 2·stride`, else h·w (see the module doc).
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
            backward_blocked(arg, dy, dx, &g)
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

/// `size ≤ 2·stride`: this thread owns the inputs `(stride·a + i, stride·b + j)`,
/// i, j < stride (clipped to the plane). An input in row `ih` lies in window
/// rows r with `r·stride ≤ ih < r·stride + size`, i.e. r ∈ {a − 1, a}; likewise
/// for columns. Each of those ≤ 4 windows names one input, so the thread
/// turns each window's `arg` into a block-local key `i·stride + j` (`NONE`
/// when it points outside the block or the window does not exist) and sums,
/// per input, the `dy` of the windows whose key matches.
#[inline(always)]
unsafe fn backward_blocked(arg: *const f32, dy: *const f32, dx: *mut f32, g: &BackGeom) {
    const NONE: u32 = u32::MAX;
    let s = g.stride;
    // Never taken (the host checks the geometry); it lets LLVM drop the
    // division-by-zero panics below.
    if s == 0 || g.size == 0 {
        return;
    }
    let bw = g.w.div_ceil(s);
    let Some((q, mut plane, step)) = place(g.h.div_ceil(s) * bw) else {
        return;
    };
    let (a, b) = (q / bw, q % bw);
    let (ih0, iw0) = (a * s, b * s);
    // Owned rows and columns, clipped at the plane's bottom and right edges.
    let (rows, cols) = ((g.h - ih0).min(s), (g.w - iw0).min(s));
    // Candidate window rows and columns in window order (a − 1 wraps to
    // u32::MAX when a = 0), whether each exists, and the in-bounds row/column
    // to load instead (a missing window's values are loaded but ignored, so
    // all eight loads issue back to back without branches).
    let (rs, cs) = ([a.wrapping_sub(1), a], [b.wrapping_sub(1), b]);
    let (r_ok, c_ok) = (rs.map(|r| r < g.oh), cs.map(|c| c < g.ow));
    let (rl, cl) = (rs.map(|r| r.min(g.oh - 1)), cs.map(|c| c.min(g.ow - 1)));
    while plane < g.planes {
        let off = plane as usize * (g.oh * g.ow) as usize;
        let (dyp, argp) = unsafe { (dy.add(off), arg.add(off)) };
        let load = |u: usize, v: usize| {
            let o = (rl[u] * g.ow + cl[v]) as usize;
            unsafe { (*argp.add(o), *dyp.add(o)) }
        };
        let wins = [load(0, 0), load(0, 1), load(1, 0), load(1, 1)];
        // Window (rs[u], cs[v])'s block-local key and dy.
        let key = |u: usize, v: usize| -> (u32, f32) {
            let (at, d) = wins[2 * u + v];
            // `at` is an exact small integer (the forward pass wrote it).
            let at = unsafe { at.to_int_unchecked::<u32>() };
            let (p, pq) = (at / g.size, at % g.size);
            // Block-local row and column of the window's maximum: window row
            // a − 1 + u starts (u − 1)·stride from the block's first row
            // (wrapping: above or left of the block gives a huge value).
            let i = (p + u as u32 * s).wrapping_sub(s);
            let j = (pq + v as u32 * s).wrapping_sub(s);
            // `&`, not `&&`: a short circuit would let LLVM sink the loads
            // back under branches.
            if r_ok[u] & c_ok[v] & (i < s) & (j < s) {
                (i * s + j, d)
            } else {
                (NONE, 0.0)
            }
        };
        // Window order: (a−1, b−1), (a−1, b), (a, b−1), (a, b).
        let (k0, d0) = key(0, 0);
        let (k1, d1) = key(0, 1);
        let (k2, d2) = key(1, 0);
        let (k3, d3) = key(1, 1);
        let pick = |k: u32, kw: u32, d: f32| if k == kw { d } else { 0.0 };
        let dxp = unsafe { dx.add(plane as usize * (g.h * g.w) as usize) };
        for i in 0..rows {
            let row = unsafe { dxp.add(((ih0 + i) * g.w + iw0) as usize) };
            for j in 0..cols {
                let k = i * s + j;
                // A zero term leaves the sum unchanged, so this is the sum in
                // window order over the windows routed here.
                let acc = pick(k0, k, d0) + pick(k1, k, d1) + pick(k2, k, d2) + pick(k3, k, d3);
                unsafe { *row.add(j as usize) = acc };
            }
        }
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
