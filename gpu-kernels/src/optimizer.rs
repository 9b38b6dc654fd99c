//! Momentum SGD with weight decay, in place, over every parameter tensor of a
//! model in one launch (`sgd_update_all`).
//! `rule == 0` (PyTorch): `v ← μv + (g + λw)`, `w ← w − lr·v`.
//! `rule == 1` (the paper): `v ← μv − λ·lr·w − lr·g`, `w ← w + v`.
//! Plain fp32 operations in the order written (PTX `mul.rn`/`add.rn`, no
//! fused multiply-add), so the result is bit-identical to the CPU reference.
//!
//! Per-step values: `hyper = [lr, μ, λ]` is read from device memory, which
//! the host writes before the launch (or before replaying a captured step
//! graph), so a graph picks up a new learning rate.
//!
//! Layout: `table[t]` ([`SgdTensor`]) holds tensor `t`'s `w`, `g`, `v`
//! addresses, its length, the first chunk it owns, and the addresses of a
//! bf16 and a TF32 copy of `w` to refresh (`half`, `tf32`: the fc products'
//! operand copies; 0 for none), written as `convert_bf16` / `convert_tf32`
//! would round the new `w`. Each tensor is cut
//! into chunks of `blockDim.x · PER_THREAD` elements, numbered across the
//! tensors in table order (`first[t+1] = first[t] + ⌈n_t / chunk⌉`).
//! Mapping: block `b` takes chunks `b, b + gridDim.x, …`, finding each one's
//! tensor by walking the table forward (its chunks only increase); thread
//! `x` takes elements `x + k·blockDim.x` (`k < PER_THREAD`) of the chunk,
//! coalesced, and loads all of them before computing any.

use crate::device::{bdim_x, bf16_bits, bid_x, gdim_x, tf32_rounded, tid_x};

/// One parameter tensor of [`sgd_update_all`]'s table (seven 64-bit words,
/// as the host writes them).
#[repr(C)]
pub struct SgdTensor {
    pub w: *mut f32,
    pub g: *const f32,
    pub v: *mut f32,
    pub n: usize,
    pub first_chunk: usize,
    pub half: *mut u16,
    pub tf32: *mut f32,
}

/// Elements per thread per chunk (the host's chunk is `256 · PER_THREAD`).
const PER_THREAD: usize = 4;

/// One element's update under `rule`: the new `(w, v)`.
#[inline(always)]
fn update(rule: u32, [lr, momentum, weight_decay]: [f32; 3], w: f32, g: f32, v: f32) -> (f32, f32) {
    if rule == 0 {
        let nv = momentum * v + (g + weight_decay * w);
        (w - lr * nv, nv)
    } else {
        let nv = momentum * v - weight_decay * lr * w - lr * g;
        (w + nv, nv)
    }
}

/// One SGD step over the `tensors` entries of `table` (`chunks` chunks in
/// all), with `hyper = [lr, momentum, weight_decay]`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn sgd_update_all(
    table: *const SgdTensor,
    tensors: usize,
    chunks: usize,
    hyper: *const f32,
    rule: u32,
) {
    let h = unsafe { [*hyper, *hyper.add(1), *hyper.add(2)] };
    let threads = bdim_x() as usize;
    let chunk_len = threads * PER_THREAD;
    let x = tid_x() as usize;
    let mut t = 0;
    let mut c = bid_x() as usize;
    while c < chunks {
        while t + 1 < tensors && unsafe { (*table.add(t + 1)).first_chunk } <= c {
            t += 1;
        }
        // Read once into registers (the stores below could alias the table
        // as far as the compiler knows).
        let SgdTensor {
            w: pw,
            g: pg,
            v: pv,
            n,
            first_chunk,
            half,
            tf32,
        } = unsafe { core::ptr::read(table.add(t)) };
        let base = (c - first_chunk) * chunk_len + x;
        let (mut w, mut g, mut v) = (
            [0.0f32; PER_THREAD],
            [0.0f32; PER_THREAD],
            [0.0f32; PER_THREAD],
        );
        for k in 0..PER_THREAD {
            let i = base + k * threads;
            if i < n {
                unsafe { (w[k], g[k], v[k]) = (*pw.add(i), *pg.add(i), *pv.add(i)) };
            }
        }
        for k in 0..PER_THREAD {
            let i = base + k * threads;
            if i < n {
                let (nw, nv) = update(rule, h, w[k], g[k], v[k]);
                unsafe {
                    *pv.add(i) = nv;
                    *pw.add(i) = nw;
                    if !half.is_null() {
                        *half.add(i) = bf16_bits(nw);
                    }
                    if !tf32.is_null() {
                        *tf32.add(i) = tf32_rounded(nw);
                    }
                }
            }
        }
        c += gdim_x() as usize;
    }
}
