//! The backend's buffer: a `CudaSlice` that owns its allocation, or a range
//! of an arena ([`crate::arena`]) that other buffers may share. Launchers see
//! a plain `&CudaSlice<f32>` through `Deref` either way.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut, Range};
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, sys,
};

pub struct DevBuf {
    slice: ManuallyDrop<CudaSlice<f32>>,
    /// The arena `slice` points into (kept alive by every range of it);
    /// `None` where `slice` owns its allocation.
    arena: Option<Arc<CudaSlice<f32>>>,
}

impl DevBuf {
    /// Floats `range` of `arena`, as a buffer of their own.
    pub(super) fn part(
        arena: &Arc<CudaSlice<f32>>,
        stream: &Arc<CudaStream>,
        range: Range<usize>,
    ) -> Self {
        assert!(range.end <= arena.len(), "{range:?} is outside the arena");
        let base = arena.device_ptr(stream).0;
        let start = base + (range.start * size_of::<f32>()) as u64;
        // Safety: the floats lie inside `arena`, which outlives this buffer
        // (held below); `Drop` leaks the slice instead of freeing it.
        let slice = unsafe { stream.upgrade_device_ptr::<f32>(start, range.len()) };
        Self {
            slice: ManuallyDrop::new(slice),
            arena: Some(arena.clone()),
        }
    }
}

impl From<CudaSlice<f32>> for DevBuf {
    fn from(slice: CudaSlice<f32>) -> Self {
        Self {
            slice: ManuallyDrop::new(slice),
            arena: None,
        }
    }
}

impl Deref for DevBuf {
    type Target = CudaSlice<f32>;
    fn deref(&self) -> &CudaSlice<f32> {
        &self.slice
    }
}

impl DerefMut for DevBuf {
    fn deref_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.slice
    }
}

// cudarc's copies and NCCL calls take any device slice: a `DevBuf` is its
// `CudaSlice`'s.
impl DeviceSlice<f32> for DevBuf {
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl DevicePtr<f32> for DevBuf {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr(stream)
    }
}

impl DevicePtrMut<f32> for DevBuf {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr_mut(stream)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // Safety: `slice` is not used after this.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        if self.arena.is_some() {
            // The arena frees these bytes with its last range.
            slice.leak();
        } else {
            drop(slice);
        }
    }
}
