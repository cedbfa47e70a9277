//! The GPU [`Communicator`]: NCCL collectives between the CUDA devices of one process (feature `nccl`), one rank
//! a device, each rank driven by its own thread (no worker processes to orphan).
//!
//! How a collective runs on rank `r`:
//! 1. the shapes every rank passes are exchanged through the host rendezvous of a [`LocalCommunicator`] (no
//!    tensor data). A mismatch (shapes, or ranks calling different collectives) is then a
//!    [`ModelError::Collective`] on every rank before anything reaches NCCL, and a rank whose thread ended makes
//!    the others fail instead of hang, as with the CPU communicator;
//! 2. burn's queue for the device is drained (`Backend::sync`), the tensors' device pointers are taken from
//!    CubeCL's memory pool, and the NCCL call runs on this rank's own stream into a buffer allocated from that
//!    pool; the rank waits for its stream, so the result is complete before burn's kernels read it.
//!
//! The sum is NCCL's (`ncclAllReduce`, f32): every rank gets the same values, but the order of additions is
//! NCCL's, not rank order as on the CPU. `all_gather` needs equal shapes on every rank (NCCL's all-gather);
//! `all_to_all` is grouped `ncclSend` / `ncclRecv` pairs with the row counts known from step 1.
//!
//! NCCL is loaded at run time (`libnccl.so`, or `libnccl.so.2` through a `libnccl.so` link on
//! `LD_LIBRARY_PATH`); [`NcclCommunicator::group`] says so when it is missing instead of panicking.

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys};

use super::comm::{Communicator, LocalCommunicator};
use crate::error::{ModelError, Result};

/// One rank of an NCCL group over CUDA devices of this process. Make the group with [`NcclCommunicator::group`]
/// and move one member into each rank's thread; that thread runs the rank's model on [`Self::device`].
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    ordinal: usize,
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
    host: LocalCommunicator,
    calls: Cell<u64>,
    busy: Cell<Duration>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("cuda_device", &self.ordinal)
            .finish_non_exhaustive()
    }
}

// SAFETY: the NCCL communicator handle and the CUDA stream belong to this rank only; NCCL allows a communicator
// to be used from another thread than the one that created it as long as calls on it are not concurrent, which
// `!Sync` (the `Cell`s) guarantees.
unsafe impl Send for NcclCommunicator {}

impl NcclCommunicator {
    /// One member per CUDA device in `devices` (ordinals, rank order; at least one, no repeats), NCCL
    /// communicators initialised together (`ncclCommInitAll`).
    pub fn group(devices: &[usize]) -> Result<Vec<Self>> {
        let fail = |message: String| ModelError::Collective { op: "init", rank: 0, message };
        if devices.is_empty() {
            return Err(fail("a group needs at least one CUDA device".into()));
        }
        if (1..devices.len()).any(|i| devices[..i].contains(&devices[i])) {
            return Err(fail(format!("CUDA devices {devices:?} repeat a device: one rank a device")));
        }
        // SAFETY: only probes whether the library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(fail(
                "the NCCL library was not found: install NCCL, or put a directory holding libnccl.so (a link to \
                 libnccl.so.2 will do) on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let mut contexts = Vec::with_capacity(devices.len());
        let mut streams = Vec::with_capacity(devices.len());
        for &ordinal in devices {
            let context = CudaContext::new(ordinal).map_err(|e| fail(format!("CUDA device {ordinal}: {e}")))?;
            streams.push(context.new_stream().map_err(|e| fail(format!("CUDA device {ordinal}: a stream: {e}")))?);
            contexts.push(context);
        }
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has one slot per device and `ordinals` names existing devices (their contexts exist).
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), devices.len() as i32, ordinals.as_ptr()) }
            .map_err(|e| fail(format!("ncclCommInitAll over CUDA devices {devices:?}: {e:?}")))?;
        let world = devices.len();
        Ok(LocalCommunicator::group(world)
            .into_iter()
            .zip(comms)
            .zip(contexts.into_iter().zip(streams))
            .enumerate()
            .map(|(rank, ((host, comm), (context, stream)))| Self {
                rank,
                world,
                ordinal: devices[rank],
                comm,
                stream,
                context,
                host,
                calls: Cell::new(0),
                busy: Cell::new(Duration::ZERO),
            })
            .collect())
    }

    /// The CUDA device this rank's tensors live on.
    pub fn device(&self) -> CudaDevice {
        CudaDevice::new(self.ordinal)
    }

    /// Collectives called so far and the wall time spent in them, from the moment this rank's queued kernels had
    /// finished (so the time of the work before is not counted) to the result being complete; waiting for slower
    /// ranks is included.
    pub fn collective_time(&self) -> (u64, Duration) {
        (self.calls.get(), self.busy.get())
    }

    fn error(&self, op: &'static str, message: impl Into<String>) -> ModelError {
        ModelError::Collective { op, rank: self.rank, message: message.into() }
    }

    /// Drains burn's queue for this device and starts the clock.
    fn begin(&self, op: &'static str, device: &CudaDevice) -> Result<Instant> {
        <Cuda as Backend>::sync(device).map_err(|e| self.error(op, format!("the device failed before: {e:?}")))?;
        self.context
            .bind_to_thread()
            .map_err(|e| self.error(op, format!("binding CUDA device {}: {e}", self.ordinal)))?;
        Ok(Instant::now())
    }

    /// Waits for this rank's stream and stops the clock.
    fn end(&self, op: &'static str, started: Instant) -> Result<()> {
        self.stream.synchronize().map_err(|e| self.error(op, format!("waiting for NCCL: {e}")))?;
        self.calls.set(self.calls.get() + 1);
        self.busy.set(self.busy.get() + started.elapsed());
        Ok(())
    }

    fn check(&self, op: &'static str, r: std::result::Result<nccl::NcclStatus, nccl::NcclError>) -> Result<()> {
        r.map(|_| ()).map_err(|e| self.error(op, format!("NCCL: {e:?}")))
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: the communicator was made by `ncclCommInitAll` and is destroyed once, here.
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

/// A contiguous f32 device tensor and its device pointer (valid while the returned resource lives).
struct Raw {
    tensor: CubeTensor<burn::cubecl::cuda::CudaRuntime>,
    ptr: u64,
    _resource: Box<dyn std::any::Any>,
}

fn raw(t: Tensor<Cuda, 2>, op: &'static str, comm: &NcclCommunicator) -> Result<Raw> {
    let tensor = burn_cubecl::kernel::into_contiguous(t.into_primitive().tensor());
    if tensor.dtype != DType::F32 {
        return Err(comm.error(op, format!("NCCL collectives here take f32 tensors, not {:?}", tensor.dtype)));
    }
    let resource = tensor
        .client
        .get_resource(tensor.handle.clone())
        .map_err(|e| comm.error(op, format!("the tensor's device memory: {e:?}")))?;
    let ptr = resource.resource().ptr;
    Ok(Raw { tensor, ptr, _resource: Box::new(resource) })
}

/// An uninitialised `[rows, cols]` f32 tensor on `like`'s device, with its pointer.
fn output(
    like: &CubeTensor<burn::cubecl::cuda::CudaRuntime>,
    rows: usize,
    cols: usize,
    op: &'static str,
    comm: &NcclCommunicator,
) -> Result<Raw> {
    let bytes = (rows * cols * 4).max(4);
    let handle = like.client.empty(bytes);
    let tensor = CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::new([rows, cols]),
        handle,
        DType::F32,
    );
    let resource = tensor
        .client
        .get_resource(tensor.handle.clone())
        .map_err(|e| comm.error(op, format!("an output buffer: {e:?}")))?;
    let ptr = resource.resource().ptr;
    Ok(Raw { tensor, ptr, _resource: Box::new(resource) })
}

fn shapes_text(all: &[Vec<[usize; 2]>]) -> String {
    all.iter().enumerate().map(|(r, s)| format!("rank {r}: {s:?}")).collect::<Vec<_>>().join(", ")
}

impl Communicator<Cuda> for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn time_in_collectives(&self) -> Option<(u64, Duration)> {
        Some(self.collective_time())
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, t: Tensor<Cuda, 2>) -> Result<Tensor<Cuda, 2>> {
        const OP: &str = "all_reduce_sum";
        let shape = t.dims();
        let all = self.host.exchange_shapes(OP, vec![shape])?;
        if all.iter().any(|s| s[0] != shape) {
            return Err(self.error(OP, format!("shapes differ between ranks: {}", shapes_text(&all))));
        }
        let device = t.device();
        let started = self.begin(OP, &device)?;
        let src = raw(t, OP, self)?;
        let dst = output(&src.tensor, shape[0], shape[1], OP, self)?;
        // SAFETY: both pointers hold `shape[0] * shape[1]` f32 on this rank's device and stay alive (`src`, `dst`)
        // until the stream is synchronised in `end`.
        let r = unsafe {
            nccl::all_reduce(
                src.ptr as *const _,
                dst.ptr as *mut _,
                shape[0] * shape[1],
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream.cu_stream() as _,
            )
        };
        self.check(OP, r)?;
        self.end(OP, started)?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(dst.tensor)))
    }

    fn all_gather(&self, t: Tensor<Cuda, 2>, dim: usize) -> Result<Tensor<Cuda, 2>> {
        const OP: &str = "all_gather";
        let shape = t.dims();
        let all = self.host.exchange_shapes(OP, vec![shape])?;
        if dim > 1 {
            return Err(self.error(OP, format!("dimension {dim} of a 2-D tensor")));
        }
        if all.iter().any(|s| s[0] != shape) {
            return Err(self.error(OP, format!("NCCL gathers equal shapes only: {}", shapes_text(&all))));
        }
        let device = t.device();
        let started = self.begin(OP, &device)?;
        let [m, n] = shape;
        let src = raw(t, OP, self)?;
        let dst = output(&src.tensor, self.world * m, n, OP, self)?;
        // SAFETY: `src` holds `m * n` f32 and `dst` `world * m * n`, on this rank's device, alive until `end`.
        let r = unsafe {
            nccl::all_gather(
                src.ptr as *const _,
                dst.ptr as *mut _,
                m * n,
                sys::ncclDataType_t::ncclFloat32,
                self.comm,
                self.stream.cu_stream() as _,
            )
        };
        self.check(OP, r)?;
        self.end(OP, started)?;
        // [world * m, n], rank-major.
        let gathered = Tensor::<Cuda, 2>::from_primitive(TensorPrimitive::Float(dst.tensor));
        Ok(if dim == 0 {
            gathered
        } else {
            gathered.reshape([self.world, m, n]).swap_dims(0, 1).reshape([m, self.world * n])
        })
    }

    fn all_to_all(&self, parts: Vec<Tensor<Cuda, 2>>) -> Result<Vec<Tensor<Cuda, 2>>> {
        const OP: &str = "all_to_all";
        let shapes: Vec<[usize; 2]> = parts.iter().map(Tensor::dims).collect();
        let all = self.host.exchange_shapes(OP, shapes)?;
        let world = self.world;
        if all.iter().any(|p| p.len() != world) {
            return Err(self.error(OP, format!("every rank must send {world} parts: {}", shapes_text(&all))));
        }
        let cols = all[0][0][1];
        if all.iter().flatten().any(|s| s[1] != cols) {
            return Err(self.error(OP, format!("column counts differ: {}", shapes_text(&all))));
        }
        let device = parts[0].device();
        let started = self.begin(OP, &device)?;
        // Empty parts take no buffer and no kernel (a zero-sized launch is a CUDA error); `like` only lends its
        // client and device to the output buffers.
        let like = parts[0].clone().into_primitive().tensor();
        let sends = parts
            .into_iter()
            .map(|t| if t.dims()[0] == 0 { Ok(None) } else { raw(t, OP, self).map(Some) })
            .collect::<Result<Vec<_>>>()?;
        let recvs =
            (0..world).map(|src| output(&like, all[src][self.rank][0], cols, OP, self)).collect::<Result<Vec<_>>>()?;
        self.check(OP, nccl::group_start())?;
        // The first failure inside the group; the group is closed whatever happens.
        let mut first_error = Ok(());
        for peer in 0..world {
            let (out_rows, in_rows) = (all[self.rank][peer][0], all[peer][self.rank][0]);
            if let Some(send) = sends[peer].as_ref().filter(|_| first_error.is_ok()) {
                // SAFETY: `send` holds `out_rows * cols` f32 on this device, alive until `end`.
                first_error = self.check(OP, unsafe {
                    nccl::send(
                        send.ptr as *const _,
                        out_rows * cols,
                        sys::ncclDataType_t::ncclFloat32,
                        peer as i32,
                        self.comm,
                        self.stream.cu_stream() as _,
                    )
                });
            }
            if in_rows > 0 && first_error.is_ok() {
                // SAFETY: `recvs[peer]` was allocated for `in_rows * cols` f32 on this device, alive until `end`.
                first_error = self.check(OP, unsafe {
                    nccl::recv(
                        recvs[peer].ptr as *mut _,
                        in_rows * cols,
                        sys::ncclDataType_t::ncclFloat32,
                        peer as i32,
                        self.comm,
                        self.stream.cu_stream() as _,
                    )
                });
            }
        }
        let closed = self.check(OP, nccl::group_end());
        first_error?;
        closed?;
        self.end(OP, started)?;
        drop(sends);
        Ok(recvs.into_iter().map(|r| Tensor::from_primitive(TensorPrimitive::Float(r.tensor))).collect())
    }
}
