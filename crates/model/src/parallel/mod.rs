//! Tensor and expert parallelism (issue 7): the collectives ([`comm`]: the [`Communicator`] trait and the
//! in-process CPU [`LocalCommunicator`]), how DeepSeek-V3 splits over ranks ([`shard`]), and one rank's model
//! with its forward ([`model`]: [`ShardedDeepseekV3`]), and one process driving a whole group from the server's
//! engine thread ([`group`]: [`ParallelGroup`], ranks 1.. in worker threads).
//!
//! The CPU communicator runs N ranks as N threads so the sharding logic is tested in CI
//! (`tests/parallel.rs`: sharded logits equal the unsharded model's); `nccl` (feature `nccl`) implements the same
//! trait over NCCL for the CUDA devices of one process.

pub mod comm;
pub mod group;
pub mod model;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod shard;

pub use comm::{Communicator, LocalCommunicator};
pub use group::{BoxedCommunicator, ParallelBackend, ParallelGroup};
pub use model::{ExpertDispatch, ShardedDeepseekV3};
#[cfg(feature = "nccl")]
pub use nccl::NcclCommunicator;
pub use shard::ShardSpec;
