//! Tensor maps for the kernels whose operands the tensor memory accelerator
//! (TMA, Hopper) fetches: the channels-last conv forwards, data gradients
//! and weight gradients `*_wg_tma_big` (`gpu_kernels::conv::
//! conv_forward_tma`, `conv_backward_data_tma`,
//! `conv_backward_filter_nhwc16_bf16_wg_tma_big` and, in TF32 over the
//! padded pixel grid, `conv_backward_filter_grid_tf32_wg_tma_big`).
//!
//! A tensor map is a 128-byte descriptor the driver encodes on the host
//! (`cuTensorMapEncodeTiled` / `cuTensorMapEncodeIm2col`, no GPU work). The
//! kernels read theirs from device memory: one 256-byte buffer per (shape,
//! precision, x and weight addresses) holds the weights' map and x's, made
//! and uploaded on first use and kept, so that a captured step graph, whose
//! launches keep the buffer's address, stays valid. Adding a map while a
//! graph is captured is an error (a step runs eagerly before its capture,
//! which makes them); past [`MAX_MAPS`] buffers the set starts again, which
//! makes the captured graphs stale (`graph.rs`).

use std::collections::HashMap;

use anyhow::{Result, bail};
use cudarc::driver::{CudaSlice, DevicePtr, sys};

use super::CudaBackend;
use crate::backend::{ConvGeom, GridGeom};

/// Buffers of maps kept at most (a model's conv layers need one each; tests
/// and the autotune make more).
const MAX_MAPS: usize = 256;

/// Which product of a convolution a TMA kernel computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum TmaProduct {
    Forward,
    /// The data gradient (stride 1 only).
    Data,
    /// The data gradient with the roles swapped (`_wg_tma_t`): the same
    /// maps, but weight boxes of 64 rows, all a 64-column tile reads.
    DataSwapped,
    /// The weight gradient in bf16: dy's map in place of the weights'.
    Filter,
    /// The weight gradient in TF32 over the padded pixel grid: dy's grid
    /// and x's KW shifted grids ([`GridGeom`]) as 2-D tiled maps.
    Grid,
}

/// What a conv product's maps depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct MapKey {
    geom: ConvGeom,
    product: TmaProduct,
    half: bool,
    x: u64,
    wt: u64,
}

/// The kept map buffers, by what they encode.
pub(super) type TmaMaps = HashMap<MapKey, CudaSlice<u8>>;

/// Bytes per element of the TMA operands: bf16 or fp32 (TF32-rounded).
fn elem(half: bool) -> usize {
    if half { 2 } else { 4 }
}

/// Why `g` cannot run on the TMA conv forward in this precision (`None`:
/// it can). A K tile is one tap's 128 bytes of a group's channels (a
/// group's last tile of a tap padded with zero terms: [`tap_tiles_fit`]),
/// and the im2col map's corners and strides have hardware limits.
pub(super) fn conv_forward_unfit(g: &ConvGeom, half: bool) -> Option<&'static str> {
    unfit(g, g.c_in / g.groups, half)
}

/// Why `g`'s data gradient cannot run on the TMA kernel (`None`: it can):
/// as the forward's, with dy's channels (a group's filters), and only at
/// stride 1 with padding below the filter size (dy's windows around each
/// input pixel then reach `K − 1 − pad` before it).
pub(super) fn conv_data_unfit(g: &ConvGeom, half: bool) -> Option<&'static str> {
    if g.stride != 1 {
        Some("stride above 1")
    } else if g.pad >= g.k_h.min(g.k_w) {
        Some("padding as large as the filter")
    } else {
        unfit(g, g.c_out / g.groups, half)
    }
}

/// Why `g`'s weight gradient cannot run on the TMA kernels (`None`: it
/// can). bf16 (MN-major tiles straight from the NHWC copies): a group's
/// filters in whole 64-element boxes, its channels in 64-channel boxes a
/// tap as [`tap_tiles_fit`] allows, and the forward's im2col limits. TF32 (whose `wgmma` reads K-major tiles only, so both
/// operands are copied onto the padded pixel grid): stride 1, a group's
/// channels in boxes of 8 to 128 ([`grid_box`]), and a grid whose pixel
/// indices fit the copy engine's 32-bit coordinates.
pub(super) fn conv_filter_unfit(g: &ConvGeom, half: bool) -> Option<&'static str> {
    if !half {
        match GridGeom::conv(g) {
            None => Some("stride above 1 (TF32 runs over the padded pixel grid)"),
            Some(_) if grid_box(g).is_none() => Some("a group's channels are not a multiple of 8"),
            Some((_, _, len)) if len >= 1 << 31 => Some("a pixel grid past 2^31 pixels"),
            Some(_) => None,
        }
    } else if !(g.c_out / g.groups).is_multiple_of(64) {
        Some("a group's filters are not a multiple of 64")
    } else {
        unfit(g, g.c_in / g.groups, half)
    }
}

/// Channels per B box of the TF32 grid weight gradient: the largest power
/// of two up to 128 that divides a group's channels, at least 8 (a box
/// fills whole 1024-byte swizzle atoms of 8 rows); `None` below that.
pub(super) fn grid_box(g: &ConvGeom) -> Option<usize> {
    let cg = g.c_in / g.groups;
    [128, 64, 32, 16, 8]
        .into_iter()
        .find(|&b| cg.is_multiple_of(b))
}

/// Whether `bytes` of a group's channels (or filters) a tap fill whole
/// 128-byte K tiles, or enough of their last: at least three quarters of
/// the tiles' bytes (AlexNet's conv2, 48 channels a group: 96 of 128
/// bytes in bf16, 192 of 256 in TF32), in 16-byte steps (the maps' row
/// strides). The zero terms cost their share of the tensor-core work.
fn tap_tiles_fit(bytes: usize) -> bool {
    bytes.is_multiple_of(16) && 4 * bytes >= 3 * bytes.next_multiple_of(128)
}

fn unfit(g: &ConvGeom, chans: usize, half: bool) -> Option<&'static str> {
    let e = elem(half);
    if !tap_tiles_fit(chans * e) {
        Some("a group's channels fill under 3/4 of their 128-byte K tiles (or not 16-byte steps)")
    } else if !(g.c_in * e).is_multiple_of(16) || !(g.c_out * e).is_multiple_of(16) {
        Some("channels not in 16-byte steps")
    } else if g.pad > 127 || g.k_h.max(g.k_w) > 256 || g.k_h.max(g.k_w) > g.pad + 129 {
        // The corners −pad and pad − (K − 1) lie in −128..=127; the taps'
        // offsets below 256.
        Some("padding or filter size past the im2col map's limits")
    } else if g.stride > 8 {
        Some("stride above 8")
    } else if (g.n * g.h * g.w * g.c_in) as u64 * elem(half) as u64 >= 1 << 40 {
        Some("x too large for a tensor map")
    } else {
        None
    }
}

fn encode_err(what: &str, g: &ConvGeom, r: sys::CUresult) -> anyhow::Error {
    anyhow::anyhow!("encoding the TMA {what} map for {g:?} failed: {r:?}")
}

/// The weights as a 3-D map `[F][KH·KW][Cg]` (forward) or `[G·Cg][KH·KW]
/// [Fg]` (data gradient) with boxes of 128 rows (64 with the roles
/// swapped) × one tap × 128 bytes (zeros past a tap's channels); for the
/// weight gradient, dy (NHWC) as
/// a 2-D `[N·OH·OW][F]` with boxes of 64 pixels × 128 bytes (64 filters).
fn weights_map(g: &ConvGeom, p: TmaProduct, wt: u64, half: bool) -> Result<sys::CUtensorMap> {
    let kk = g.k_h * g.k_w;
    let (rows, row_len, box_rows) = match p {
        TmaProduct::Forward => return taps_map(g, wt, [g.c_out, kk, g.c_in / g.groups], 128, half),
        TmaProduct::Data => return taps_map(g, wt, [g.c_in, kk, g.c_out / g.groups], 128, half),
        TmaProduct::DataSwapped => {
            return taps_map(g, wt, [g.c_in, kk, g.c_out / g.groups], 64, half);
        }
        TmaProduct::Filter => (g.n * g.out_h() * g.out_w(), g.c_out, 64),
        TmaProduct::Grid => (g.c_out, grid_len(g)?, 128),
    };
    tiled_map(g, "weights", wt, [rows, row_len, box_rows], half)
}

/// A row-major `rows × taps × chans` tensor at `at` as a 3-D map with
/// boxes of `box_rows` rows × one tap × 128 bytes of channels, 128-byte
/// swizzled: in shared memory the same `box_rows` × 128-byte tile as
/// [`tiled_map`]'s.
fn taps_map(
    g: &ConvGeom,
    at: u64,
    [rows, taps, chans]: [usize; 3],
    box_rows: u32,
    half: bool,
) -> Result<sys::CUtensorMap> {
    let e = elem(half);
    let dims = [chans as u64, taps as u64, rows as u64];
    let strides = [(chans * e) as u64, (taps * chans * e) as u64];
    let boxes = [(128 / e) as u32, 1, box_rows];
    encode_tiled(g, "weights", at, &dims, &strides, &boxes, half)
}

/// The TF32 grid weight gradient's x: its KW shifted grids `[KW][C][len]`
/// as one 2-D map of KW·C rows with boxes of 32 pixels × [`grid_box`]
/// channels.
fn grid_x_map(g: &ConvGeom, x: u64) -> Result<sys::CUtensorMap> {
    let bx = grid_box(g).ok_or_else(|| anyhow::anyhow!("{g:?} has no TMA grid box"))?;
    tiled_map(g, "x grid", x, [g.k_w * g.c_in, grid_len(g)?, bx], false)
}

fn grid_len(g: &ConvGeom) -> Result<usize> {
    GridGeom::conv(g)
        .map(|(_, _, len)| len)
        .ok_or_else(|| anyhow::anyhow!("{g:?} has no pixel grid (stride above 1)"))
}

/// A row-major `rows × row_len` tensor at `at` as a 2-D map with boxes of
/// 128 bytes of a row × `box_rows` rows, 128-byte swizzled.
fn tiled_map(
    g: &ConvGeom,
    what: &str,
    at: u64,
    [rows, row_len, box_rows]: [usize; 3],
    half: bool,
) -> Result<sys::CUtensorMap> {
    let e = elem(half);
    let dims = [row_len as u64, rows as u64];
    let strides = [(row_len * e) as u64];
    let boxes = [(128 / e) as u32, box_rows as u32];
    encode_tiled(g, what, at, &dims, &strides, &boxes, half)
}

/// `cuTensorMapEncodeTiled` of the tensor at `at` (rank `dims.len()`,
/// `strides` in bytes between rows of each dimension past the first),
/// boxes of `boxes` elements, 128-byte swizzled, zeros past the bounds.
fn encode_tiled(
    g: &ConvGeom,
    what: &str,
    at: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    half: bool,
) -> Result<sys::CUtensorMap> {
    let rank = dims.len();
    assert!(strides.len() + 1 == rank && boxes.len() == rank && (1..=5).contains(&rank));
    let ones = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every array has the rank's length (strides one less, checked
    // above); the driver only encodes, reading nothing at `at`.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type(half),
            rank as u32,
            at as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            ones.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(encode_err(what, g, r));
    }
    // SAFETY: encoded above.
    Ok(unsafe { map.assume_init() })
}

/// The geometry of a product's im2col map: the gathered tensor's `(W, H)`
/// (dy's for the data gradient), its channels, and per spatial axis
/// (W, then H) the window corners' bounding box (`lower` to `dim − 1 +
/// upper`) and step. Forward: x's windows from `−pad` to `pad − (K − 1)`
/// past the far edge, stepped by the stride: the output pixels in order.
/// Data gradient: dy's windows from `−(K − 1 − pad)` to `−pad`, one per
/// input pixel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Im2col {
    dims: [usize; 2],
    chans: usize,
    lower: [i32; 2],
    upper: [i32; 2],
    step: u32,
}

fn im2col(g: &ConvGeom, p: TmaProduct) -> Im2col {
    let (pad, kw, kh) = (g.pad as i32, g.k_w as i32, g.k_h as i32);
    match p {
        TmaProduct::Forward | TmaProduct::Filter | TmaProduct::Grid => Im2col {
            dims: [g.w, g.h],
            chans: g.c_in,
            lower: [-pad, -pad],
            upper: [pad - (kw - 1), pad - (kh - 1)],
            step: g.stride as u32,
        },
        TmaProduct::Data | TmaProduct::DataSwapped => Im2col {
            dims: [g.out_w(), g.out_h()],
            chans: g.c_out,
            lower: [pad - (kw - 1), pad - (kh - 1)],
            upper: [-pad, -pad],
            step: 1,
        },
    }
}

/// The gathered operand as an im2col map ([`im2col`]): boxes of 128
/// consecutive windows (w fastest, then h, then the image; 64 for the
/// weight gradient) × 128 bytes of channels.
fn patches_map(g: &ConvGeom, p: TmaProduct, x: u64, half: bool) -> Result<sys::CUtensorMap> {
    let e = elem(half) as u64;
    let m = im2col(g, p);
    let (c, w, h, n) = (
        m.chans as u64,
        m.dims[0] as u64,
        m.dims[1] as u64,
        g.n as u64,
    );
    let dims = [c, w, h, n];
    let strides = [c * e, w * c * e, h * w * c * e];
    let (lower, upper) = (m.lower, m.upper);
    let steps = [1, m.step, m.step, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: as in `weights_map`.
    let r = unsafe {
        sys::cuTensorMapEncodeIm2col(
            map.as_mut_ptr(),
            data_type(half),
            4,
            x as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            lower.as_ptr(),
            upper.as_ptr(),
            (128 / e) as u32,
            if p == TmaProduct::Filter { 64 } else { 128 },
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(encode_err("x im2col", g, r));
    }
    // SAFETY: encoded above.
    Ok(unsafe { map.assume_init() })
}

/// Raw bits: bf16, or fp32 (the TF32 kernels read TF32-rounded values as
/// they are, like their `cp.async` twins).
fn data_type(half: bool) -> sys::CUtensorMapDataType {
    if half {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    } else {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32
    }
}

impl CudaBackend {
    /// The device address of a conv product's two tensor maps (weights,
    /// then the gathered operand), made on first use: forward, NHWC `x`
    /// and `[F][KH][KW][Cg]` `wt`; data gradient, NHWC dy and
    /// `[G][Cg][KH][KW][Fg]` `wt`; weight gradient, NHWC x and NHWC dy as
    /// `wt` (bf16), or x's and dy's pixel grids (TF32, [`TmaProduct::Grid`]).
    pub(super) fn conv_tma_maps(
        &self,
        g: &ConvGeom,
        product: TmaProduct,
        x: &CudaSlice<f32>,
        wt: &CudaSlice<f32>,
        half: bool,
    ) -> Result<u64> {
        let (xa, wa) = (x.device_ptr(&self.stream).0, wt.device_ptr(&self.stream).0);
        if !xa.is_multiple_of(16) || !wa.is_multiple_of(16) {
            bail!(
                "the TMA conv forward needs 16-byte aligned x and weights ({xa:#x}, {wa:#x}) for {g:?}"
            );
        }
        let key = MapKey {
            geom: *g,
            product,
            half,
            x: xa,
            wt: wa,
        };
        let mut maps = self.tma_maps.lock().unwrap();
        if let Some(b) = maps.get(&key) {
            return Ok(b.device_ptr(&self.stream).0);
        }
        if maps.len() >= MAX_MAPS {
            self.before_replacing("TMA tensor maps", MAX_MAPS * 256)?;
            maps.clear();
        } else if self.capturing.load(std::sync::atomic::Ordering::SeqCst) {
            bail!(
                "a TMA tensor map for {g:?} would be made while capturing a CUDA graph; run the same step once eagerly first"
            );
        }
        let gathered = match product {
            TmaProduct::Grid => grid_x_map(g, xa)?,
            _ => patches_map(g, product, xa, half)?,
        };
        let both = [weights_map(g, product, wa, half)?, gathered];
        // SAFETY: two `repr(C)` arrays of 16 u64, 256 bytes without padding.
        let bytes: &[u8] = unsafe { std::slice::from_raw_parts(both.as_ptr().cast::<u8>(), 256) };
        let buf = self.stream.clone_htod(bytes).map_err(super::gpu_err)?;
        let at = buf.device_ptr(&self.stream).0;
        maps.insert(key, buf);
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::{
        TmaProduct, conv_data_unfit, conv_filter_unfit, conv_forward_unfit, grid_box, im2col,
    };
    use crate::backend::{ConvGeom, GridGeom};

    /// The im2col maps against a model of the TMA traversal (window corners
    /// stepping through their bounding box, w fastest, then h, then the
    /// image): one window per output pixel (forward) or input pixel (data
    /// gradient), window p at the corner `gpu_kernels::conv::ConvTma`
    /// computes for pixel p (written out again here). The forward's
    /// geometry ran on an H200 (`gpu_ops conv_tma`); this holds the data
    /// gradient's to the same model.
    #[test]
    fn im2col_windows_are_the_products_pixels() {
        let g = geom;
        let cases = [
            g(2, 256, 13, 13, 384, (3, 3), 1, 1, 1),
            g(2, 96, 27, 27, 256, (5, 5), 1, 2, 2),
            g(3, 128, 11, 9, 256, (3, 5), 1, 2, 2),
            g(3, 128, 11, 9, 256, (3, 5), 1, 1, 2),
            g(2, 64, 15, 15, 72, (3, 3), 2, 1, 1),
            g(2, 64, 12, 10, 64, (3, 3), 1, 0, 1),
        ];
        for c in cases {
            let data = [TmaProduct::Data, TmaProduct::DataSwapped];
            for p in [TmaProduct::Forward, data[0], data[1], TmaProduct::Filter] {
                if data.contains(&p) && c.stride != 1 {
                    continue;
                }
                let m = im2col(&c, p);
                let count =
                    |a: usize| (m.dims[a] as i32 - 1 + m.upper[a] - m.lower[a]) / m.step as i32 + 1;
                // The pixels the kernel walks: output (forward), input (data).
                let (pw, ph) = match p {
                    TmaProduct::Forward | TmaProduct::Filter | TmaProduct::Grid => {
                        (c.out_w(), c.out_h())
                    }
                    TmaProduct::Data | TmaProduct::DataSwapped => (c.w, c.h),
                };
                assert_eq!((count(0), count(1)), (pw as i32, ph as i32), "{c:?} {p:?}");
                for q in 0..pw * ph {
                    let (y, x) = ((q / pw) as i32, (q % pw) as i32);
                    let model = (
                        m.lower[1] + m.step as i32 * y,
                        m.lower[0] + m.step as i32 * x,
                    );
                    let (s, pad) = (c.stride as i32, c.pad as i32);
                    let (kh, kw) = (c.k_h as i32, c.k_w as i32);
                    let kernel = match p {
                        TmaProduct::Forward | TmaProduct::Filter | TmaProduct::Grid => {
                            (y * s - pad, x * s - pad)
                        }
                        TmaProduct::Data | TmaProduct::DataSwapped => {
                            (y - (kh - 1 - pad), x - (kw - 1 - pad))
                        }
                    };
                    assert_eq!(model, kernel, "{c:?} {p:?} pixel {q}");
                }
            }
        }
    }

    /// The copy engine needs a tiled box's first element on a 16-byte
    /// boundary along its row (`…-h100-wgrad-tma/run3`: boxes that started
    /// 1–3 floats off one never arrived). The TF32 grid weight gradient's
    /// boxes start at pixel `p + kh·Wp` (p a multiple of 32): every shape
    /// it takes has Wp a multiple of 4 floats and rows of whole K tiles.
    #[test]
    fn tf32_grid_boxes_start_on_16_byte_boundaries() {
        let g = geom;
        for c in [
            alexnet(96, 256, 5, 1, 2, 2),
            alexnet(256, 384, 3, 1, 1, 1),
            alexnet(384, 256, 3, 1, 1, 2),
            g(3, 40, 7, 9, 72, (3, 3), 1, 0, 1),
            g(3, 128, 11, 9, 256, (3, 5), 1, 2, 2),
            g(1, 16, 6, 5, 8, (5, 5), 1, 2, 2),
        ] {
            assert_eq!(conv_filter_unfit(&c, false), None, "{c:?}");
            let (_, wp, len) = GridGeom::conv(&c).unwrap();
            assert!(
                wp.is_multiple_of(4) && len.is_multiple_of(32),
                "{c:?}: wp {wp}, len {len}"
            );
            assert!(128 % grid_box(&c).unwrap() == 0);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn geom(
        n: usize,
        c_in: usize,
        h: usize,
        w: usize,
        c_out: usize,
        (k_h, k_w): (usize, usize),
        stride: usize,
        pad: usize,
        groups: usize,
    ) -> ConvGeom {
        ConvGeom::of([n, c_in, h, w, c_out, k_h, k_w, stride, pad, groups])
    }

    /// AlexNet's layers at batch 128 (13×13 images, as conv3–5 see them).
    fn alexnet(
        c_in: usize,
        c_out: usize,
        k: usize,
        stride: usize,
        pad: usize,
        groups: usize,
    ) -> ConvGeom {
        geom(128, c_in, 13, 13, c_out, (k, k), stride, pad, groups)
    }

    /// AlexNet's conv2–5 take the TMA forward in TF32 and bf16 (conv3–5's
    /// groups' 256 and 192 channels are whole 128-byte K tiles, conv2's 48
    /// three quarters of theirs); conv1 (3 channels) does not, nor does a
    /// stride past 8.
    #[test]
    fn tma_forward_fits_alexnet_conv3_to_5() {
        for half in [false, true] {
            assert_eq!(
                conv_forward_unfit(&alexnet(256, 384, 3, 1, 1, 1), half),
                None
            );
            assert_eq!(
                conv_forward_unfit(&alexnet(384, 384, 3, 1, 1, 2), half),
                None
            );
            assert_eq!(
                conv_forward_unfit(&alexnet(384, 256, 3, 1, 1, 2), half),
                None
            );
            assert_eq!(
                conv_forward_unfit(&alexnet(96, 256, 5, 1, 2, 2), half),
                None
            );
            assert!(conv_forward_unfit(&alexnet(3, 96, 11, 4, 2, 1), half).is_some());
            // 40 channels: 80 of 128 bytes (bf16), 160 of 256 (TF32).
            assert!(conv_forward_unfit(&alexnet(40, 64, 3, 1, 1, 1), half).is_some());
            assert!(conv_forward_unfit(&alexnet(256, 256, 3, 9, 1, 1), half).is_some());
        }
        // Data gradients: conv3–5 (stride 1, pad 1 < 3), not conv1 (stride 4).
        for half in [false, true] {
            assert_eq!(conv_data_unfit(&alexnet(256, 384, 3, 1, 1, 1), half), None);
            assert_eq!(conv_data_unfit(&alexnet(384, 384, 3, 1, 1, 2), half), None);
            assert_eq!(conv_data_unfit(&alexnet(384, 256, 3, 1, 1, 2), half), None);
            assert!(conv_data_unfit(&alexnet(3, 96, 11, 4, 2, 1), half).is_some());
            assert!(conv_data_unfit(&alexnet(256, 384, 3, 1, 3, 1), half).is_some());
        }
        // Weight gradients in bf16: filters in 64s, channels filling 3/4 of
        // their 64-channel boxes or more (conv2–5).
        assert_eq!(
            conv_filter_unfit(&alexnet(256, 384, 3, 1, 1, 1), true),
            None
        );
        assert_eq!(
            conv_filter_unfit(&alexnet(384, 384, 3, 1, 1, 2), true),
            None
        );
        assert_eq!(
            conv_filter_unfit(&alexnet(384, 256, 3, 1, 1, 2), true),
            None
        );
        assert_eq!(conv_filter_unfit(&alexnet(96, 256, 5, 1, 2, 2), true), None);
        // TF32, over the padded pixel grid: stride 1 and channels in eights
        // (conv2–5), not conv1.
        for conv in [
            (96, 256, 5, 1, 2, 2),
            (256, 384, 3, 1, 1, 1),
            (384, 256, 3, 1, 1, 2),
        ] {
            let (c_in, c_out, k, stride, pad, groups) = conv;
            assert_eq!(
                conv_filter_unfit(&alexnet(c_in, c_out, k, stride, pad, groups), false),
                None
            );
        }
        assert!(conv_filter_unfit(&alexnet(3, 96, 11, 4, 2, 1), false).is_some());
        assert!(conv_filter_unfit(&alexnet(12, 96, 3, 1, 1, 1), false).is_some());
        assert!(conv_filter_unfit(&alexnet(128, 96, 3, 1, 1, 1), true).is_some());
        // 32 channels a group: one TF32 K tile, half a bf16 one.
        assert_eq!(
            conv_forward_unfit(&alexnet(64, 64, 3, 1, 1, 2), false),
            None
        );
        assert!(conv_forward_unfit(&alexnet(64, 64, 3, 1, 1, 2), true).is_some());
    }
}
