//! Max pooling over `size × size` windows at `stride` (overlapping when
//! stride < size, as AlexNet's 3/2), no padding, output size by PyTorch's floor
//! rule. Layout NCHW.
//!
//! Forward: one thread per output element; it also saves where the window's
//! first maximum (row-major scan, strict `>`) lies, as the offset `a·size + b`
//! inside the window, stored as an f32 (exact for any window up to 2^24
//! elements). Backward without atomics (so it is deterministic): each `dx`
//! element is written once, as the sum in window order of the `dy` of the
//! windows whose saved offset points at it; it reads neither x nor y, except
//! that with the backward of the ReLU before the pool fused in (`z` not
//! null) it reads y (`z`) to drop the windows whose maximum is ≤ 0.
//!
//! Mapping: a 1-D grid-stride loop over every work item of every plane
//! (N·C planes flattened, so small planes such as pool5's 13×13 fill whole
//! blocks; 32-bit indices, split into plane / row / column by [`FastDiv`]s
//! the host computes). Forward: an item is an output element; windows of 2
//! and 3 are unrolled (all loads in flight at once). Backward, where
//! size ≤ 2·stride (AlexNet's 3/2): an item is a `stride × stride` block of
//! inputs (⌈h/stride⌉·⌈w/stride⌉ per plane); every window meeting block
//! (a, b) is one of (a−1 | a, b−1 | b), so the thread loads those ≤ 4
//! windows' `arg` and `dy` once and writes all its inputs. Stride 2 with
//! windows of 2 or 3 has its own unrolled version (each window can name
//! only fixed offsets in the block, compared as constants). Larger windows:
//! an item is an input element, looping over the windows that contain it.

use crate::device::{FastDiv, grid_stride_u32, unrolled};

/// Shape of a pooling launch (passed by value). `items` work items in all,
/// `plane.d` per plane, `row.d` per row of a plane (see the module doc for
/// what an item is in each kernel).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PoolGeom {
    pub h: u32,
    pub w: u32,
    pub size: u32,
    pub stride: u32,
    pub oh: u32,
    pub ow: u32,
    pub items: u32,
    pub plane: FastDiv,
    pub row: FastDiv,
}

/// Max pool forward: `y[n,c,oh,ow] = max` over its window of x, and
/// `arg[n,c,oh,ow]` = the offset of its first maximum in the window. Items:
/// output elements (`plane.d = oh·ow`, `row.d = ow`).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn maxpool_forward(
    x: *const f32,
    y: *mut f32,
    arg: *mut f32,
    g: PoolGeom,
) {
    unsafe {
        match g.size {
            2 => forward_unrolled::<2>(x, y, arg, &g),
            3 => forward_unrolled::<3>(x, y, arg, &g),
            _ => forward_any(x, y, arg, &g),
        }
    }
}

/// Item `i`'s window: the offset of its top-left input (32-bit; the host
/// keeps tensors below 2^31 elements).
#[inline(always)]
fn window_start(i: u32, g: &PoolGeom) -> u32 {
    let (plane, o) = g.plane.divmod(i);
    let (r, c) = g.row.divmod(o);
    plane * (g.h * g.w) + (r * g.w + c) * g.stride
}

#[inline(always)]
unsafe fn forward_unrolled<const P: usize>(
    x: *const f32,
    y: *mut f32,
    arg: *mut f32,
    g: &PoolGeom,
) {
    let (mut i, step) = grid_stride_u32();
    while i < g.items {
        let xp = unsafe { x.add(window_start(i, g) as usize) };
        let mut best = 0.0f32;
        let mut at = 0u32;
        unrolled::<P>(|a| {
            let row = unsafe { xp.add((a as u32 * g.w) as usize) };
            unrolled::<P>(|b| {
                let v = unsafe { *row.add(b) };
                // The first input always wins; later ones only on a strict `>`.
                if (a == 0 && b == 0) || v > best {
                    best = v;
                    at = (a * P + b) as u32;
                }
            })
        });
        unsafe {
            *y.add(i as usize) = best;
            *arg.add(i as usize) = at as f32;
        }
        i += step;
    }
}

#[inline(always)]
unsafe fn forward_any(x: *const f32, y: *mut f32, arg: *mut f32, g: &PoolGeom) {
    let (mut i, step) = grid_stride_u32();
    while i < g.items {
        let xp = unsafe { x.add(window_start(i, g) as usize) };
        let mut best = unsafe { *xp };
        let mut at = 0u32;
        for a in 0..g.size {
            for b in 0..g.size {
                let v = unsafe { *xp.add((a * g.w + b) as usize) };
                if v > best {
                    best = v;
                    at = a * g.size + b;
                }
            }
        }
        unsafe {
            *y.add(i as usize) = best;
            *arg.add(i as usize) = at as f32;
        }
        i += step;
    }
}

/// Max pool backward: `dx[n,c,ih,iw] = Σ dy[n,c,oh,ow]` over the windows whose
/// saved first maximum is (ih, iw), in window order; every element of `dx` is
/// written. Items: `stride × stride` blocks of inputs when `size ≤ 2·stride`
/// (`plane.d = ⌈h/stride⌉·⌈w/stride⌉`, `row.d = ⌈w/stride⌉`), else input
/// elements (`plane.d = h·w`, `row.d = w`).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn maxpool_backward(
    arg: *const f32,
    dy: *const f32,
    z: *const f32,
    dx: *mut f32,
    g: PoolGeom,
) {
    let dy = Grad {
        dy,
        z,
        relu: !z.is_null(),
    };
    unsafe {
        match (g.size, g.stride) {
            (3, 2) => backward_s2::<3>(arg, dy, dx, &g),
            (2, 2) => backward_s2::<2>(arg, dy, dx, &g),
            (size, stride) if size <= 2 * stride => backward_blocked(arg, dy, dx, &g),
            _ => backward_per_input(arg, dy, dx, &g),
        }
    }
}

/// The pooled gradient `dy`, and with `relu` the pooled output `z` of a
/// ReLU's output: then a window passes its `dy` on only where `z > 0`. That
/// is the ReLU's backward (`dx = 0` where x ≤ 0) done here, since the input
/// a window routes to is its maximum, whose x equals the window's z.
#[derive(Clone, Copy)]
struct Grad {
    dy: *const f32,
    z: *const f32,
    relu: bool,
}

impl Grad {
    /// Element `o`'s gradient (masked as above).
    #[inline(always)]
    unsafe fn at(self, o: usize) -> f32 {
        let d = unsafe { *self.dy.add(o) };
        if self.relu && !(unsafe { *self.z.add(o) } > 0.0) {
            0.0
        } else {
            d
        }
    }

    /// The same from element `off` on.
    #[inline(always)]
    fn offset(self, off: usize) -> Grad {
        Grad {
            dy: self.dy.wrapping_add(off),
            z: self.z.wrapping_add(off),
            relu: self.relu,
        }
    }
}

/// Stride 2, window `P` ∈ {2, 3}: the thread owns inputs (2a + i, 2b + j),
/// i, j < 2. With P = 3, window (a−1, b−1) can only name (0, 0) (offset 8),
/// (a−1, b) only (0, 0) or (0, 1) (offsets 6, 7), (a, b−1) only (0, 0) or
/// (1, 0) (2, 5), and (a, b) any of the four (0, 1, 3, 4); with P = 2 only
/// window (a, b) meets the block. Missing windows (outside the pooled
/// plane) are not loaded and give 0.
#[inline(always)]
unsafe fn backward_s2<const P: usize>(arg: *const f32, dy: Grad, dx: *mut f32, g: &PoolGeom) {
    let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
    let (mut i, step) = grid_stride_u32();
    while i < g.items {
        let (plane, blk) = g.plane.divmod(i);
        let (a, b) = g.row.divmod(blk);
        let out = plane * ohw;
        // Window (a − 1 + u, b − 1 + v): its (arg, dy), or (−1, 0) where it
        // does not exist (a − 1 wraps past `oh` when a = 0). A missing
        // window's load goes to an in-bounds one and is dropped, so the
        // loads issue back to back without branches.
        let load = |u: u32, v: u32| {
            let (r, c) = ((a + u).wrapping_sub(1), (b + v).wrapping_sub(1));
            let o = (out + r.min(g.oh - 1) * g.ow + c.min(g.ow - 1)) as usize;
            let (at, d) = unsafe { (*arg.add(o), dy.at(o)) };
            // `&`, not `&&`: no short circuit to sink the loads under.
            if (r < g.oh) & (c < g.ow) {
                (at, d)
            } else {
                (-1.0, 0.0)
            }
        };
        let pick = |(at, d): (f32, f32), key: f32| if at == key { d } else { 0.0 };
        let d = if P == 3 {
            let (wa, wb, wc, wd) = (load(0, 0), load(0, 1), load(1, 0), load(1, 1));
            // Window order; a zero term leaves the sum unchanged.
            [
                pick(wa, 8.0) + pick(wb, 6.0) + pick(wc, 2.0) + pick(wd, 0.0),
                pick(wb, 7.0) + pick(wd, 1.0),
                pick(wc, 5.0) + pick(wd, 3.0),
                pick(wd, 4.0),
            ]
        } else {
            let wd = load(1, 1);
            [pick(wd, 0.0), pick(wd, 1.0), pick(wd, 2.0), pick(wd, 3.0)]
        };
        let (ih, iw) = (2 * a, 2 * b);
        let p = unsafe { dx.add((plane * hw + ih * g.w + iw) as usize) };
        let right = iw + 1 < g.w;
        unsafe {
            *p = d[0];
            if right {
                *p.add(1) = d[1];
            }
            if ih + 1 < g.h {
                let q = p.add(g.w as usize);
                *q = d[2];
                if right {
                    *q.add(1) = d[3];
                }
            }
        }
        i += step;
    }
}

/// `size ≤ 2·stride`: this thread owns the inputs `(stride·a + i, stride·b + j)`,
/// i, j < stride (clipped to the plane). An input in row `ih` lies in window
/// rows r with `r·stride ≤ ih < r·stride + size`, i.e. r ∈ {a − 1, a}; likewise
/// for columns. Each of those ≤ 4 windows names one input, so the thread
/// turns each window's `arg` into a block-local key `i·stride + j` (`NONE`
/// when it points outside the block or the window does not exist) and sums,
/// per input, the `dy` of the windows whose key matches.
#[inline(always)]
unsafe fn backward_blocked(arg: *const f32, dy: Grad, dx: *mut f32, g: &PoolGeom) {
    const NONE: u32 = u32::MAX;
    let s = g.stride;
    // Never taken (the host checks the geometry); it lets LLVM drop the
    // division-by-zero panics below.
    if s == 0 || g.size == 0 {
        return;
    }
    let (mut it, step) = grid_stride_u32();
    while it < g.items {
        let (plane, q) = g.plane.divmod(it);
        let (a, b) = g.row.divmod(q);
        let (ih0, iw0) = (a * s, b * s);
        // Owned rows and columns, clipped at the plane's bottom and right edges.
        let (rows, cols) = ((g.h - ih0).min(s), (g.w - iw0).min(s));
        // Candidate window rows and columns in window order (a − 1 wraps to
        // u32::MAX when a = 0), whether each exists, and the in-bounds
        // row/column to load instead (a missing window's values are loaded
        // but ignored, so all eight loads issue back to back without
        // branches).
        let (rs, cs) = ([a.wrapping_sub(1), a], [b.wrapping_sub(1), b]);
        let (r_ok, c_ok) = (rs.map(|r| r < g.oh), cs.map(|c| c < g.ow));
        let (rl, cl) = (rs.map(|r| r.min(g.oh - 1)), cs.map(|c| c.min(g.ow - 1)));
        let off = plane * (g.oh * g.ow);
        let (dyp, argp) = (dy.offset(off as usize), unsafe { arg.add(off as usize) });
        let load = |u: usize, v: usize| {
            let o = (rl[u] * g.ow + cl[v]) as usize;
            unsafe { (*argp.add(o), dyp.at(o)) }
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
        let dxp = unsafe { dx.add((plane * (g.h * g.w)) as usize) };
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
        it += step;
    }
}

/// `size > 2·stride`: one item per input element; it loops over the windows
/// r with `r·stride ≤ ih < r·stride + size` (and likewise columns), in window
/// order, adding the `dy` of each whose saved offset points at it.
#[inline(always)]
unsafe fn backward_per_input(arg: *const f32, dy: Grad, dx: *mut f32, g: &PoolGeom) {
    let PoolGeom {
        h,
        w,
        size,
        stride,
        oh,
        ow,
        ..
    } = *g;
    if stride == 0 {
        return;
    }
    let (mut it, step) = grid_stride_u32();
    while it < g.items {
        let (plane, q) = g.plane.divmod(it);
        let (ih, iw) = g.row.divmod(q);
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
        let off = plane * (oh * ow);
        let (dyp, argp) = (dy.offset(off as usize), unsafe { arg.add(off as usize) });
        let mut acc = 0.0f32;
        let mut r = r_lo;
        while r <= r_hi {
            let mut c = c_lo;
            while c <= c_hi {
                let here = ((ih - r * stride) * size + iw - c * stride) as f32;
                let o = (r * ow + c) as usize;
                let (a, d) = unsafe { (*argp.add(o), dyp.at(o)) };
                if a == here {
                    acc += d;
                }
                c += 1;
            }
            r += 1;
        }
        unsafe { *dx.add((plane * (h * w) + q) as usize) = acc };
        it += step;
    }
}
