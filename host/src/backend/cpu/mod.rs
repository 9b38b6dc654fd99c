//! The CPU reference backend: every op in plain, obviously-correct Rust with
//! f64 accumulation. It is the oracle for the GPU tests, lets CI exercise the
//! model and trainer without a GPU, and trains tiny configs. Each family's
//! functions live in the file of the same name as the GPU kernel file and
//! carry the same names (`lrn_forward`, ...). Batch-parallel with rayon where
//! that keeps the code plain.

pub mod activation;
pub mod conv;
pub mod dropout;
pub mod gemm;
pub mod layout;
pub mod loss;
pub mod lrn;
pub mod optimizer;
pub mod pool;
#[cfg(test)]
mod tests;

use anyhow::ensure;
use std::convert::Infallible;

use super::*;

/// Checks that each buffer holds exactly the floats its shape needs.
fn lens(op: &str, bufs: &[(&Vec<f32>, usize)]) -> Result<()> {
    for (i, (b, want)) in bufs.iter().enumerate() {
        anyhow::ensure!(
            b.len() == *want,
            "{op}: operand {i} holds {} floats, the shape needs {want}",
            b.len()
        );
    }
    Ok(())
}

/// The CPU backend. Buffers are `Vec<f32>`; nothing is asynchronous.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Labels = Vec<i32>;
    type SgdTable = ();
    /// The CPU runs every op at once: nothing to capture.
    type Graph = Infallible;

    fn name(&self) -> String {
        "cpu".into()
    }
    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(host.to_vec())
    }
    fn write(&self, dst: &mut Vec<f32>, host: &[f32]) -> Result<()> {
        anyhow::ensure!(
            dst.len() == host.len(),
            "write: length {} into buffer of {}",
            host.len(),
            dst.len()
        );
        dst.copy_from_slice(host);
        Ok(())
    }
    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }
    fn upload_labels(&self, host: &[i32]) -> Result<Vec<i32>> {
        Ok(host.to_vec())
    }
    fn write_labels(&self, dst: &mut Vec<i32>, host: &[i32]) -> Result<()> {
        anyhow::ensure!(
            dst.len() == host.len(),
            "write_labels: length {} into buffer of {}",
            host.len(),
            dst.len()
        );
        dst.copy_from_slice(host);
        Ok(())
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }
    fn copy_block(&self, b: &BlockCopy, src: &Vec<f32>, dst: &mut Vec<f32>) -> Result<()> {
        b.check(src.len(), dst.len())?;
        if b.cols == 0 {
            return Ok(());
        }
        for i in 0..b.rows {
            let from = b.src_offset + i * b.src_stride;
            let to = b.dst_offset + i * b.dst_stride;
            dst[to..to + b.cols].copy_from_slice(&src[from..from + b.cols]);
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn conv_forward(
        &self,
        g: &ConvGeom,
        x: &Vec<f32>,
        w: &Vec<f32>,
        bias: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        g.check()?;
        lens(
            "conv_forward",
            &[
                (x, g.x_len()),
                (w, g.w_len()),
                (bias, g.c_out),
                (y, g.y_len()),
            ],
        )?;
        conv::conv_forward(g, x, w, bias, y);
        Ok(())
    }
    fn conv_backward_data(
        &self,
        g: &ConvGeom,
        dy: &Vec<f32>,
        w: &Vec<f32>,
        dx: &mut Vec<f32>,
    ) -> Result<()> {
        g.check()?;
        lens(
            "conv_backward_data",
            &[(dy, g.y_len()), (w, g.w_len()), (dx, g.x_len())],
        )?;
        conv::conv_backward_data(g, dy, w, dx);
        Ok(())
    }
    fn conv_backward_filter(
        &self,
        g: &ConvGeom,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> Result<()> {
        g.check()?;
        lens(
            "conv_backward_filter",
            &[(x, g.x_len()), (dy, g.y_len()), (dw, g.w_len())],
        )?;
        conv::conv_backward_filter(g, x, dy, dw);
        Ok(())
    }
    fn conv_backward_bias(&self, g: &ConvGeom, dy: &Vec<f32>, db: &mut Vec<f32>) -> Result<()> {
        g.check()?;
        lens("conv_backward_bias", &[(dy, g.y_len()), (db, g.c_out)])?;
        conv::conv_backward_bias(g, dy, db);
        Ok(())
    }
    fn fc_forward(
        &self,
        g: &FcGeom,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        lens(
            "fc_forward",
            &[
                (x, g.n * g.inputs),
                (w, g.outputs * g.inputs),
                (b, g.outputs),
                (y, g.n * g.outputs),
            ],
        )?;
        gemm::fc_forward(g, x, w, b, y);
        Ok(())
    }
    fn fc_backward_data(
        &self,
        g: &FcGeom,
        dy: &Vec<f32>,
        w: &Vec<f32>,
        dx: &mut Vec<f32>,
    ) -> Result<()> {
        lens(
            "fc_backward_data",
            &[
                (dy, g.n * g.outputs),
                (w, g.outputs * g.inputs),
                (dx, g.n * g.inputs),
            ],
        )?;
        gemm::fc_backward_data(g, dy, w, dx);
        Ok(())
    }
    fn fc_backward_filter(
        &self,
        g: &FcGeom,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> Result<()> {
        lens(
            "fc_backward_filter",
            &[
                (x, g.n * g.inputs),
                (dy, g.n * g.outputs),
                (dw, g.outputs * g.inputs),
            ],
        )?;
        gemm::fc_backward_filter(g, x, dy, dw);
        Ok(())
    }
    fn fc_backward_bias(&self, g: &FcGeom, dy: &Vec<f32>, db: &mut Vec<f32>) -> Result<()> {
        lens(
            "fc_backward_bias",
            &[(dy, g.n * g.outputs), (db, g.outputs)],
        )?;
        gemm::fc_backward_bias(g, dy, db);
        Ok(())
    }
    fn relu_forward(&self, y: &mut Vec<f32>) -> Result<()> {
        activation::relu_forward(y);
        Ok(())
    }
    fn relu_backward(&self, y: &Vec<f32>, d: &mut Vec<f32>) -> Result<()> {
        activation::relu_backward(y, d);
        Ok(())
    }
    fn lrn_forward(
        &self,
        p: &LrnParams,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        scale: &mut Vec<f32>,
    ) -> Result<()> {
        lens(
            "lrn_forward",
            &[(x, p.len()), (y, p.len()), (scale, p.len())],
        )?;
        lrn::lrn_forward(p, x, y, scale);
        Ok(())
    }
    fn lrn_backward(
        &self,
        p: &LrnParams,
        x: &Vec<f32>,
        y: &Vec<f32>,
        scale: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
    ) -> Result<()> {
        lens(
            "lrn_backward",
            &[
                (x, p.len()),
                (y, p.len()),
                (scale, p.len()),
                (dy, p.len()),
                (dx, p.len()),
            ],
        )?;
        lrn::lrn_backward(p, x, y, scale, dy, dx);
        Ok(())
    }
    fn lrn_pool_fusable(&self, _: &LrnParams, _: &PoolGeom) -> bool {
        true
    }
    fn lrn_pool_forward(
        &self,
        p: &LrnParams,
        g: &PoolGeom,
        x: &Vec<f32>,
        z: &mut Vec<f32>,
        arg: &mut Vec<f32>,
    ) -> Result<()> {
        lens(
            "lrn_pool_forward",
            &[(x, p.len()), (z, g.y_len()), (arg, g.y_len())],
        )?;
        lrn::lrn_pool_forward(p, g, x, z, arg);
        Ok(())
    }
    fn lrn_pool_backward(
        &self,
        p: &LrnParams,
        g: &PoolGeom,
        x: &Vec<f32>,
        arg: &Vec<f32>,
        dz: &Vec<f32>,
        dx: &mut Vec<f32>,
        relu: bool,
    ) -> Result<()> {
        lens(
            "lrn_pool_backward",
            &[
                (x, p.len()),
                (arg, g.y_len()),
                (dz, g.y_len()),
                (dx, p.len()),
            ],
        )?;
        lrn::lrn_pool_backward(p, g, x, arg, dz, dx, relu);
        Ok(())
    }
    fn maxpool_forward(
        &self,
        g: &PoolGeom,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        arg: &mut Vec<f32>,
    ) -> Result<()> {
        lens(
            "maxpool_forward",
            &[(x, g.x_len()), (y, g.y_len()), (arg, g.y_len())],
        )?;
        pool::maxpool_forward(g, x, y, arg);
        Ok(())
    }
    fn maxpool_backward(
        &self,
        g: &PoolGeom,
        arg: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
    ) -> Result<()> {
        lens(
            "maxpool_backward",
            &[(arg, g.y_len()), (dy, g.y_len()), (dx, g.x_len())],
        )?;
        pool::maxpool_backward(g, arg, dy, dx);
        Ok(())
    }
    fn dropout_forward(&self, p: &DropoutParams, y: &mut Vec<f32>) -> Result<()> {
        dropout::dropout_forward(p, y);
        Ok(())
    }
    fn dropout_backward(&self, p: &DropoutParams, d: &mut Vec<f32>) -> Result<()> {
        dropout::dropout_backward(p, d);
        Ok(())
    }
    fn softmax_xent_forward(
        &self,
        n: usize,
        classes: usize,
        logits: &Vec<f32>,
        labels: &Vec<i32>,
        probs: &mut Vec<f32>,
        loss: &mut Vec<f32>,
    ) -> Result<()> {
        loss::softmax_xent_forward(n, classes, logits, labels, probs, loss);
        Ok(())
    }
    fn softmax_xent_backward(
        &self,
        n: usize,
        classes: usize,
        probs: &Vec<f32>,
        labels: &Vec<i32>,
        dlogits: &mut Vec<f32>,
    ) -> Result<()> {
        loss::softmax_xent_backward(n, classes, probs, labels, dlogits);
        Ok(())
    }
    fn label_rank(
        &self,
        n: usize,
        classes: usize,
        scores: &Vec<f32>,
        labels: &Vec<i32>,
        rank: &mut Vec<f32>,
    ) -> Result<()> {
        loss::label_rank(n, classes, scores, labels, rank);
        Ok(())
    }
    fn sgd_update_all(
        &self,
        p: &SgdParams,
        tensors: &mut [SgdTensor<'_, Vec<f32>>],
        _table: &mut (),
    ) -> Result<()> {
        for (i, t) in tensors.iter().enumerate() {
            lens(
                &format!("sgd_update_all tensor {i}"),
                &[(t.g, t.w.len()), (&*t.v, t.w.len())],
            )?;
            ensure!(
                t.copy.is_none(),
                "sgd_update_all tensor {i}: the CPU keeps no weight copies"
            );
        }
        optimizer::sgd_update_all(p, tensors);
        Ok(())
    }
    fn graph_current(&self, g: &Infallible) -> bool {
        match *g {}
    }
    unsafe fn replay(&self, g: &Infallible, _: &StepArgs) -> Result<()> {
        match *g {}
    }
}
