//! Collective operations between the ranks of a tensor / expert parallel group ([`Communicator`]), and an
//! in-process CPU implementation ([`LocalCommunicator`]: N ranks as N threads) that tests the sharding logic in CI
//! with the same interface an NCCL communicator will have.
//!
//! Semantics (every rank calls the same operation in the same order):
//! - `all_reduce_sum`: every rank gets the element-wise sum of all ranks' `[m, n]` tensors, added in rank order
//!   (rank 0 + rank 1 + ...), so every rank gets bit-identical values and a run is deterministic;
//! - `all_gather(t, dim)`: every rank gets all ranks' tensors concatenated along `dim` in rank order;
//! - `all_to_all(parts)`: rank `r` sends `parts[d]` to rank `d` and gets back one part from every rank, in rank
//!   order (parts may differ in row count: a token dispatch).
//!
//! Mismatched shapes are a [`ModelError::Collective`] naming the ranks and shapes, returned by every rank (each
//! sees all ranks' shapes), never a panic or a hang.

use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::error::{ModelError, Result};

/// The collectives tensor and expert parallelism need, over burn tensors on backend `B`.
pub trait Communicator<B: Backend> {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Element-wise sum over the ranks (added in rank order); every rank passes the same shape.
    fn all_reduce_sum(&self, t: Tensor<B, 2>) -> Result<Tensor<B, 2>>;
    /// All ranks' tensors concatenated along `dim` (0 or 1) in rank order; the other dimension must agree.
    fn all_gather(&self, t: Tensor<B, 2>, dim: usize) -> Result<Tensor<B, 2>>;
    /// `parts[d]` goes to rank `d` (`parts.len() == world_size`); returns the part each rank sent here, in rank
    /// order. Parts must agree in their column count.
    fn all_to_all(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>>;
    /// Collectives called so far and the wall time spent in them, where the communicator measures it.
    fn time_in_collectives(&self) -> Option<(u64, std::time::Duration)> {
        None
    }
}

/// A 2-D tensor on the host.
#[derive(Debug, Clone)]
struct HostTensor {
    shape: [usize; 2],
    data: Vec<f32>,
}

impl HostTensor {
    fn from_tensor<B: Backend>(t: Tensor<B, 2>, op: &'static str, rank: usize) -> Result<Self> {
        let shape = t.dims();
        let data = t.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| ModelError::Collective {
            op,
            rank,
            message: format!("cannot read the tensor to the host: {e:?}"),
        })?;
        Ok(Self { shape, data })
    }

    fn into_tensor<B: Backend>(self, device: &B::Device) -> Tensor<B, 2> {
        Tensor::from_data(TensorData::new(self.data, self.shape), device)
    }
}

/// The rendezvous: each exchange collects one payload per rank, and the last rank to arrive publishes them all.
#[derive(Debug)]
struct Rendezvous {
    world: usize,
    state: Mutex<State>,
    arrived: Condvar,
}

#[derive(Debug)]
struct State {
    /// Completed exchanges; a rank waits until this passes the value it saw when it deposited.
    generation: u64,
    slots: Vec<Option<Vec<HostTensor>>>,
    /// The last completed exchange's payloads by rank; kept until the next exchange completes, which needs every
    /// rank to have read this one first (each deposits only after reading).
    published: Arc<Vec<Vec<HostTensor>>>,
    /// The op names of the last completed exchange, by rank (to report ranks calling different collectives).
    published_ops: Arc<Vec<&'static str>>,
    ops: Vec<&'static str>,
    /// The first member dropped (its thread ended or panicked): every pending and later exchange fails.
    departed: Option<usize>,
}

impl Rendezvous {
    /// Deposits `payload` for `rank` and returns every rank's payload once all have arrived.
    fn exchange(&self, rank: usize, op: &'static str, payload: Vec<HostTensor>) -> Result<Arc<Vec<Vec<HostTensor>>>> {
        let poisoned =
            || ModelError::Collective { op, rank, message: "another rank panicked inside a collective".into() };
        let mut state = self.state.lock().map_err(|_| poisoned())?;
        let generation = state.generation;
        let departed = |other: usize| ModelError::Collective {
            op,
            rank,
            message: format!("rank {other} left the group (its thread ended or panicked)"),
        };
        if let Some(other) = state.departed {
            return Err(departed(other));
        }
        if state.slots[rank].is_some() {
            return Err(ModelError::Collective {
                op,
                rank,
                message: "this rank is already inside a collective".into(),
            });
        }
        state.slots[rank] = Some(payload);
        state.ops[rank] = op;
        if state.slots.iter().all(Option::is_some) {
            let all = state.slots.iter_mut().map(|s| s.take().expect("every slot is filled")).collect();
            state.published = Arc::new(all);
            state.published_ops = Arc::new(std::mem::replace(&mut state.ops, vec![""; self.world]));
            state.generation += 1;
            self.arrived.notify_all();
        } else {
            while state.generation == generation {
                if let Some(other) = state.departed {
                    return Err(departed(other));
                }
                state = self.arrived.wait(state).map_err(|_| poisoned())?;
            }
        }
        if let Some((other, other_op)) = state.published_ops.iter().enumerate().find(|(_, o)| **o != op) {
            return Err(ModelError::Collective {
                op,
                rank,
                message: format!("rank {other} called {other_op} in the same exchange"),
            });
        }
        Ok(Arc::clone(&state.published))
    }
}

/// One rank of an in-process group: N ranks run as N threads of one process and exchange tensors through host
/// memory. Make the group with [`LocalCommunicator::group`] and move one member into each rank's thread.
///
/// Every rank must call the same collectives in the same order; a rank that never calls while it lives leaves the
/// others waiting (as with NCCL). Dropping a member (its thread ends or panics) makes the other ranks' pending and
/// later calls fail instead of hang, so a member is not `Clone`.
#[derive(Debug)]
pub struct LocalCommunicator {
    rank: usize,
    shared: Arc<Rendezvous>,
}

impl LocalCommunicator {
    /// The `world_size` members of a new group, rank order (at least one).
    pub fn group(world_size: usize) -> Vec<Self> {
        let world = world_size.max(1);
        let shared = Arc::new(Rendezvous {
            world,
            state: Mutex::new(State {
                generation: 0,
                slots: vec![None; world],
                published: Arc::new(Vec::new()),
                published_ops: Arc::new(Vec::new()),
                ops: vec![""; world],
                departed: None,
            }),
            arrived: Condvar::new(),
        });
        (0..world).map(|rank| Self { rank, shared: Arc::clone(&shared) }).collect()
    }

    fn error(&self, op: &'static str, message: String) -> ModelError {
        ModelError::Collective { op, rank: self.rank, message }
    }

    /// Exchanges shapes only (no data) through the rendezvous: every rank's list, in rank order. What a device
    /// communicator checks before it starts a collective.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn exchange_shapes(&self, op: &'static str, shapes: Vec<[usize; 2]>) -> Result<Vec<Vec<[usize; 2]>>> {
        let payload = shapes.into_iter().map(|shape| HostTensor { shape, data: Vec::new() }).collect();
        let all = self.shared.exchange(self.rank, op, payload)?;
        Ok(all.iter().map(|p| p.iter().map(|t| t.shape).collect()).collect())
    }
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        let mut state = self.shared.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.departed.get_or_insert(self.rank);
        self.shared.arrived.notify_all();
    }
}

fn shapes(all: &[Vec<HostTensor>]) -> String {
    all.iter()
        .enumerate()
        .map(|(r, p)| format!("rank {r}: {:?}", p.iter().map(|t| t.shape).collect::<Vec<_>>()))
        .collect::<Vec<_>>()
        .join(", ")
}

impl<B: Backend> Communicator<B> for LocalCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, t: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        const OP: &str = "all_reduce_sum";
        let device = t.device();
        let mine = HostTensor::from_tensor(t, OP, self.rank)?;
        let all = self.shared.exchange(self.rank, OP, vec![mine])?;
        let shape = all[0][0].shape;
        if all.iter().any(|p| p[0].shape != shape) {
            return Err(self.error(OP, format!("shapes differ between ranks: {}", shapes(&all))));
        }
        let mut sum = all[0][0].data.clone();
        for part in &all[1..] {
            sum.iter_mut().zip(&part[0].data).for_each(|(s, v)| *s += v);
        }
        Ok(HostTensor { shape, data: sum }.into_tensor(&device))
    }

    fn all_gather(&self, t: Tensor<B, 2>, dim: usize) -> Result<Tensor<B, 2>> {
        const OP: &str = "all_gather";
        let device = t.device();
        let mine = HostTensor::from_tensor(t, OP, self.rank)?;
        let all = self.shared.exchange(self.rank, OP, vec![mine])?;
        if dim > 1 {
            return Err(self.error(OP, format!("dimension {dim} of a 2-D tensor")));
        }
        let other = 1 - dim;
        if all.iter().any(|p| p[0].shape[other] != all[0][0].shape[other]) {
            return Err(self.error(OP, format!("dimension {other} differs between ranks: {}", shapes(&all))));
        }
        let parts = all.iter().map(|p| p[0].clone().into_tensor::<B>(&device)).collect();
        Ok(Tensor::cat(parts, dim))
    }

    fn all_to_all(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>> {
        const OP: &str = "all_to_all";
        let device = parts.first().map(Tensor::device);
        let mine = parts.into_iter().map(|t| HostTensor::from_tensor(t, OP, self.rank)).collect::<Result<Vec<_>>>()?;
        let all = self.shared.exchange(self.rank, OP, mine)?;
        let world = self.shared.world;
        if all.iter().any(|p| p.len() != world) {
            return Err(self.error(OP, format!("every rank must send {world} parts: {}", shapes(&all))));
        }
        let cols = all[0][0].shape[1];
        if all.iter().flatten().any(|t| t.shape[1] != cols) {
            return Err(self.error(OP, format!("column counts differ: {}", shapes(&all))));
        }
        let device = device.expect("world >= 1 parts were sent");
        Ok(all.iter().map(|p| p[self.rank].clone().into_tensor::<B>(&device)).collect())
    }
}
