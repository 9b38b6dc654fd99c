//! `copy_block`: a strided device-to-device copy, no kernel. A contiguous
//! block is one `memcpy_dtod`; a strided one is one `cuMemcpy2DAsync` (the
//! driver's pitched copy: `rows` rows of `cols` floats, each row at its own
//! pitch in source and destination), queued on the backend's stream.

use anyhow::Result;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, sys};

use super::{BlockCopy, CudaBackend, gpu_err};

pub(super) fn copy_block(
    be: &CudaBackend,
    b: &BlockCopy,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
) -> Result<()> {
    b.check(src.len(), dst.len())?;
    if b.rows == 0 || b.cols == 0 {
        return Ok(());
    }
    let contiguous = b.rows == 1 || (b.src_stride == b.cols && b.dst_stride == b.cols);
    if contiguous {
        let len = b.rows * b.cols;
        let from = src.slice(b.src_offset..b.src_offset + len);
        let mut to = dst.slice_mut(b.dst_offset..b.dst_offset + len);
        be.stream.memcpy_dtod(&from, &mut to).map_err(gpu_err)?;
    } else {
        const F: usize = std::mem::size_of::<f32>();
        be.ctx.bind_to_thread().map_err(gpu_err)?;
        let (src_ptr, _src_record) = src.device_ptr(&be.stream);
        let (dst_ptr, _dst_record) = dst.device_ptr_mut(&be.stream);
        let params = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src_ptr + (b.src_offset * F) as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: b.src_stride * F,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst_ptr + (b.dst_offset * F) as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: b.dst_stride * F,
            WidthInBytes: b.cols * F,
            Height: b.rows,
        };
        // SAFETY: `check` keeps every row of both views inside its buffer,
        // the buffers outlive the call, and the copy is ordered on the
        // backend's stream like every other use of them.
        unsafe { sys::cuMemcpy2DAsync_v2(&params, be.stream.cu_stream()) }
            .result()
            .map_err(gpu_err)?;
    }
    be.after_launch("copy_block", &|| format!("{b:?}"))
}
