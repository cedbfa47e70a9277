//! Tensor and expert parallelism on the CPU (issue 7): every rank of a [`LocalCommunicator`] group runs its
//! [`ShardedDeepseekV3`] shard in its own thread, and the logits (the same on every rank, bit for bit) must equal
//! the unsharded model's within `max|a-b| / max|b| <= 1e-5` on the committed fixtures, for every 2-, 4- and 8-way
//! split the fixture's heads, intermediate sizes and experts allow (tp alone, ep alone, and tp x ep). Also the
//! collectives' semantics and their errors (a shape mismatch is an error on every rank, not a panic or a hang).

mod common;

use common::{fixture, host, ids, scaled_error};

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::error::ModelError;
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::parallel::{
    Communicator, ExpertDispatch, LocalCommunicator, ParallelGroup, ShardSpec, ShardedDeepseekV3,
};
use eyrie_model::quant::SafetensorsFile;
use eyrie_model::{DeepseekV3, ModelConfig};

const TOLERANCE: f32 = 1e-5;

/// Runs `f(rank, comm)` on every rank of a new group of `world`, one thread each; results in rank order.
fn on_ranks<T: Send>(world: usize, f: impl Fn(usize, LocalCommunicator) -> T + Sync) -> Vec<T> {
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = LocalCommunicator::group(world)
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| scope.spawn(move || f(rank, comm)))
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// Two prompt rows of equal length from the fixture's reference file.
fn prompt_rows(name: &str) -> Vec<Vec<u32>> {
    let reference = SafetensorsFile::open(fixture(name).join("reference.safetensors")).unwrap();
    let (a, b) = (ids(&reference, "tokens.0"), ids(&reference, "tokens.1"));
    let len = a.len().min(b.len());
    vec![a[..len].to_vec(), b[..len].to_vec()]
}

/// Sharded logits of every rank for `rows`.
fn sharded_logits(shards: Vec<ShardedDeepseekV3<Flex>>, rows: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let world = shards[0].spec.world();
    let shards: Vec<_> = shards.into_iter().map(std::sync::Mutex::new).collect();
    on_ranks(world, |rank, comm| {
        let shard = shards[rank].lock().unwrap();
        let device = Default::default();
        let flat: Vec<i64> = rows.iter().flatten().map(|&t| i64::from(t)).collect();
        let tokens = Tensor::from_data(TensorData::new(flat, [rows.len(), rows[0].len()]), &device);
        host(shard.forward(tokens, &comm).unwrap_or_else(|e| panic!("rank {rank}: {e}")))
    })
}

/// Every split of `name` among 2/4/8-way tp, ep and tp x ep that its config allows; returns (tp, ep, error).
fn check_fixture(name: &str, must_run: &[(usize, usize)]) -> Vec<(usize, usize, f32)> {
    let device = Default::default();
    let full = DeepseekV3::<Flex>::load(fixture(name), &device).unwrap();
    let rows = prompt_rows(name);
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let want = host(full.forward(full.token_tensor(&refs, &device).unwrap()));
    let ways = [1, 2, 4, 8];
    let mut results = Vec::new();
    for tp in ways {
        for ep in ways {
            if tp * ep == 1 || (tp > 1 && ep > 1 && tp != ep && tp.max(ep) / tp.min(ep) > 2) {
                continue;
            }
            let world = tp.max(ep);
            let specs: Vec<ShardSpec> = (0..world).map(|rank| ShardSpec { rank, tp, ep }).collect();
            if specs[0].validate(&full.config).is_err() {
                assert!(!must_run.contains(&(tp, ep)), "{name}: tp {tp} ep {ep} should be a valid split");
                continue;
            }
            for dispatch in [ExpertDispatch::AllReduce, ExpertDispatch::AllToAll] {
                if ep == 1 && dispatch == ExpertDispatch::AllToAll {
                    continue;
                }
                let shards: Vec<_> = specs
                    .iter()
                    .map(|&s| ShardedDeepseekV3 { dispatch, ..ShardedDeepseekV3::from_full(&full, s).unwrap() })
                    .collect();
                // The 256-token vocabulary splits whenever tp is the whole group.
                assert_eq!(shards[0].vocab_split, tp > 1 && tp == world);
                let got = sharded_logits(shards, &rows);
                for (rank, g) in got.iter().enumerate().skip(1) {
                    assert!(
                        g == &got[0],
                        "{name} tp {tp} ep {ep} {dispatch:?}: rank {rank}'s logits differ from rank 0's"
                    );
                }
                let err = scaled_error(&got[0], &want);
                println!("{name}: tp {tp} ep {ep} {dispatch:?}: max scaled error {err:.2e}");
                assert!(err <= TOLERANCE, "{name} tp {tp} ep {ep} {dispatch:?}: logits error {err:e}");
                results.push((tp, ep, err));
            }
        }
    }
    for split in must_run {
        assert!(results.iter().any(|&(t, e, _)| (t, e) == *split), "{name}: split {split:?} did not run");
    }
    results
}

#[test]
fn yarn_qlora_sharded_logits_equal_unsharded() {
    // 4 heads, 8 experts: tp 2/4, ep 2/4/8, and combined.
    check_fixture("yarn_qlora", &[(2, 1), (4, 1), (1, 2), (1, 4), (1, 8), (2, 2), (4, 4), (2, 4), (4, 8)]);
}

#[test]
fn v2lite_sharded_logits_equal_unsharded() {
    // 4 heads, 6 routed experts (ep 2 only), shared intermediate 48, dense 80.
    check_fixture("v2lite", &[(2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]);
}

#[test]
fn int4_experts_sharded_logits_equal_unsharded() {
    check_fixture("int4_experts", &[(2, 1), (4, 1), (1, 2), (1, 4), (1, 8), (2, 2), (4, 4)]);
}

#[test]
fn load_reads_a_rank_shard_and_rejects_bad_splits() {
    let device = Default::default();
    let dir = fixture("v2lite");
    let full = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    let rows = prompt_rows("v2lite");
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let want = host(full.forward(full.token_tensor(&refs, &device).unwrap()));
    let shards: Vec<_> =
        (0..2).map(|rank| ShardedDeepseekV3::<Flex>::load(&dir, rank, 2, 2, &device).unwrap()).collect();
    // Each rank loaded only its own routed experts (6 experts, 3 a rank) and its tensor-parallel slices: half
    // the heads' projections, half the dense and shared MLP widths, no copy of the whole.
    let c = &full.config;
    for (rank, shard) in shards.iter().enumerate() {
        for layer in &shard.layers {
            let attn = &layer.self_attn;
            assert_eq!(attn.num_heads, c.num_heads / 2);
            assert_eq!(attn.o_proj.dims(), [c.num_heads / 2 * c.v_head_dim, c.hidden_size]);
            assert_eq!(attn.kv_b_proj.dims()[1], c.num_heads / 2 * (c.qk_nope_head_dim + c.v_head_dim));
            match &layer.mlp {
                eyrie_model::parallel::model::ShardedFeedForward::Moe(moe) => {
                    assert_eq!((moe.first_expert, moe.moe.experts.len()), (3 * rank, 3));
                    assert_eq!(moe.moe.shared_experts.down_proj.dims()[0], c.shared_intermediate_size() / 2);
                }
                eyrie_model::parallel::model::ShardedFeedForward::Dense(mlp) => {
                    assert_eq!(mlp.gate_proj.dims()[1], c.intermediate_size / 2);
                }
            }
        }
    }
    let got = sharded_logits(shards, &rows);
    assert!(scaled_error(&got[1], &want) <= TOLERANCE);
    // tp alone over the whole group: the vocabulary is split at load too.
    let dir_q = fixture("yarn_qlora");
    let full_q = DeepseekV3::<Flex>::load(&dir_q, &device).unwrap();
    let rows_q = prompt_rows("yarn_qlora");
    let refs_q: Vec<&[u32]> = rows_q.iter().map(Vec::as_slice).collect();
    let want_q = host(full_q.forward(full_q.token_tensor(&refs_q, &device).unwrap()));
    let shards_q: Vec<_> =
        (0..4).map(|rank| ShardedDeepseekV3::<Flex>::load(&dir_q, rank, 4, 1, &device).unwrap()).collect();
    assert!(shards_q[0].vocab_split);
    assert_eq!(shards_q[3].lm_head.dims(), [full_q.config.hidden_size, full_q.config.vocab_size / 4]);
    let got_q = sharded_logits(shards_q, &rows_q);
    assert!(scaled_error(&got_q[2], &want_q) <= TOLERANCE);
    // 4 heads do not split 8 ways; 6 experts do not split 4 ways; tp 3 does not divide a group of 4.
    for (tp, ep, field) in [(8, 1, "num_attention_heads"), (1, 4, "n_routed_experts"), (3, 4, "tp/ep")] {
        match ShardedDeepseekV3::<Flex>::load(&dir, 0, tp, ep, &device).unwrap_err() {
            ModelError::InvalidConfig { field: f, .. } => assert_eq!(f, field, "tp {tp} ep {ep}"),
            e => panic!("tp {tp} ep {ep}: {e}"),
        }
    }
    // A communicator of another group size is an input error.
    let shard = ShardedDeepseekV3::from_full(&full, ShardSpec { rank: 0, tp: 2, ep: 1 }).unwrap();
    let comm = LocalCommunicator::group(1).remove(0);
    let tokens = full.token_tensor(&refs, &device).unwrap();
    assert!(matches!(shard.forward(tokens, &comm), Err(ModelError::Input { .. })));
}

/// The unsharded model's batched cached steps: a prefill of two prompts of different lengths in one batch, then
/// greedy decode steps of both; returns each step's logits (`[batch, vocab]`, last rows) and the tokens fed.
fn cached_steps(full: &DeepseekV3<Flex>, prompts: &[Vec<u32>], steps: usize) -> (Vec<Vec<f32>>, Vec<Vec<Vec<u32>>>) {
    let device = Default::default();
    let mut cache = PagedMlaCache::new(&full.config, 16, 4, &device).unwrap();
    let mut seqs = vec![SequenceCache::default(); prompts.len()];
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    let (mut all_logits, mut fed) = (Vec::new(), Vec::new());
    for _ in 0..=steps {
        let mut batch: Vec<BatchEntry<'_>> =
            seqs.iter_mut().zip(&inputs).map(|(seq, t)| BatchEntry { seq, tokens: t }).collect();
        let logits = host(full.forward_batch(&mut batch, &mut cache, LogitRows::Last, &device).unwrap());
        let vocab = full.config.vocab_size;
        fed.push(inputs.clone());
        inputs = logits
            .chunks_exact(vocab)
            .map(|row| vec![row.iter().enumerate().fold(0, |b, (i, v)| if *v > row[b] { i } else { b }) as u32])
            .collect();
        all_logits.push(logits);
    }
    (all_logits, fed)
}

#[test]
fn sharded_cached_batched_steps_equal_unsharded() {
    let device = Default::default();
    let full = DeepseekV3::<Flex>::load(fixture("yarn_qlora"), &device).unwrap();
    let rows = prompt_rows("yarn_qlora");
    // Different lengths, so the batch mixes positions (and pages: block size 4).
    let prompts = vec![rows[0].clone(), rows[1][..rows[1].len() - 3].to_vec()];
    let (want, fed) = cached_steps(&full, &prompts, 4);
    for (tp, ep, dispatch) in [
        (2, 1, ExpertDispatch::AllReduce),
        (1, 2, ExpertDispatch::AllReduce),
        (2, 2, ExpertDispatch::AllToAll),
        (4, 4, ExpertDispatch::AllReduce),
        (2, 4, ExpertDispatch::AllToAll),
    ] {
        let world = tp.max(ep);
        let shards: Vec<_> = (0..world)
            .map(|rank| ShardedDeepseekV3 {
                dispatch,
                ..ShardedDeepseekV3::from_full(&full, ShardSpec { rank, tp, ep }).unwrap()
            })
            .map(std::sync::Mutex::new)
            .collect();
        let got = on_ranks(world, |rank, comm| {
            let shard = shards[rank].lock().unwrap();
            let device = Default::default();
            let mut cache = PagedMlaCache::new(&full.config, 16, 4, &device).unwrap();
            let mut seqs = vec![SequenceCache::default(); prompts.len()];
            let mut steps = Vec::new();
            for inputs in &fed {
                let mut batch: Vec<BatchEntry<'_>> =
                    seqs.iter_mut().zip(inputs).map(|(seq, t)| BatchEntry { seq, tokens: t }).collect();
                let logits = shard.forward_batch(&mut batch, &mut cache, LogitRows::Last, &comm, &device);
                steps.push(host(logits.unwrap_or_else(|e| panic!("rank {rank}: {e}"))));
            }
            (steps, seqs.iter().map(|s| s.len).collect::<Vec<_>>(), cache.free_blocks())
        });
        for (rank, (steps, lens, free)) in got.iter().enumerate() {
            assert_eq!(steps, &got[0].0, "tp {tp} ep {ep}: rank {rank}'s logits differ from rank 0's");
            assert_eq!(lens, &vec![prompts[0].len() + 4, prompts[1].len() + 4]);
            assert_eq!(*free, got[0].2);
        }
        for (step, (g, w)) in got[0].0.iter().zip(&want).enumerate() {
            let err = scaled_error(g, w);
            assert!(err <= TOLERANCE, "tp {tp} ep {ep} {dispatch:?} step {step}: logits error {err:e}");
        }
        println!("yarn_qlora cached: tp {tp} ep {ep} {dispatch:?}: {} steps equal", fed.len());
    }
}

#[test]
fn a_parallel_group_serves_batched_steps_like_the_unsharded_model() {
    let device = Default::default();
    let dir = fixture("yarn_qlora");
    let full = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    let rows = prompt_rows("yarn_qlora");
    let prompts = vec![rows[0].clone(), rows[1][..rows[1].len() - 3].to_vec()];
    let (want, fed) = cached_steps(&full, &prompts, 4);
    for (tp, ep) in [(2, 1), (2, 2), (1, 4), (2, 4)] {
        let (mut group, device) = ParallelGroup::<Flex>::load(&dir, tp, ep, &device, 16, 4).unwrap();
        let mut cache = PagedMlaCache::new(group.config(), 16, 4, &device).unwrap();
        // The server's attention warm-up reaches every rank and leaves the group working (nothing compiles on the
        // CPU, so there are no shapes to report).
        assert_eq!(group.warm_up_attention(&cache).unwrap(), None);
        let mut seqs = vec![SequenceCache::default(); prompts.len()];
        for (step, inputs) in fed.iter().enumerate() {
            // Bad input is refused before any rank starts, and the group keeps working.
            let mut bad_seq = SequenceCache::default();
            let mut bad = [BatchEntry { seq: &mut bad_seq, tokens: &[u32::MAX] }];
            assert!(matches!(
                group.forward_batch(&mut bad, &mut cache, LogitRows::Last, &device),
                Err(ModelError::Input { .. })
            ));
            let mut batch: Vec<BatchEntry<'_>> =
                seqs.iter_mut().zip(inputs).map(|(seq, t)| BatchEntry { seq, tokens: t }).collect();
            let got = host(group.forward_batch(&mut batch, &mut cache, LogitRows::Last, &device).unwrap());
            let err = scaled_error(&got, &want[step]);
            assert!(err <= TOLERANCE, "tp {tp} ep {ep} step {step}: logits error {err:e}");
        }
        // Pages taken only on rank 0's cache, as the unsharded model would.
        assert_eq!(seqs[0].blocks.len(), (prompts[0].len() + 4).div_ceil(4));
        // A full cache is an input error too, refused before the ranks start.
        let mut long = SequenceCache::default();
        let tokens = vec![1u32; 16 * 4];
        let mut batch = [BatchEntry { seq: &mut long, tokens: &tokens }];
        assert!(matches!(
            group.forward_batch(&mut batch, &mut cache, LogitRows::Last, &device),
            Err(ModelError::Input { .. })
        ));
        let mut batch: Vec<BatchEntry<'_>> = seqs.iter_mut().map(|seq| BatchEntry { seq, tokens: &[3] }).collect();
        group.forward_batch(&mut batch, &mut cache, LogitRows::Last, &device).unwrap();
        // Dropping the group joins its workers (the test would hang otherwise).
        drop(group);
    }
    // A split the config does not allow names the field.
    match ParallelGroup::<Flex>::load(&dir, 8, 1, &device, 16, 4).unwrap_err() {
        ModelError::InvalidConfig { field, .. } => assert_eq!(field, "num_attention_heads"),
        e => panic!("{e}"),
    }
}

#[test]
fn synthetic_groups_equal_the_synthetic_model() {
    // The benchmark's model source: every rank makes the same replicated weights and its own experts.
    let device = Default::default();
    let config = ModelConfig::from_dir(fixture("yarn_qlora")).unwrap();
    let full = DeepseekV3::<Flex>::synthetic(&config, &device, 0..config.n_routed_experts).unwrap();
    // Routed experts are INT4, as Kimi-K2 stores them.
    let moe = full.layers.iter().find_map(|l| match &l.mlp {
        eyrie_model::deepseek_v3::FeedForward::Moe(moe) => Some(moe),
        _ => None,
    });
    assert!(matches!(moe.unwrap().experts[0].gate_proj, eyrie_model::linear::StoredLinear::Int4(_)));
    let prompts = vec![vec![1, 5, 9, 200, 17, 3, 8], vec![4, 4, 100]];
    let (want, fed) = cached_steps(&full, &prompts, 3);
    let spread = want[0].iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(want.iter().flatten().all(|v| v.is_finite()) && spread > 1e-3, "synthetic logits: max |v| {spread}");
    for (tp, ep) in [(2, 2), (1, 4), (4, 1)] {
        let (mut group, device) = ParallelGroup::<Flex>::synthetic(&config, tp, ep, &device, 16, 4).unwrap();
        let mut cache = PagedMlaCache::new(group.config(), 16, 4, &device).unwrap();
        let mut seqs = vec![SequenceCache::default(); prompts.len()];
        for (step, inputs) in fed.iter().enumerate() {
            let mut batch: Vec<BatchEntry<'_>> =
                seqs.iter_mut().zip(inputs).map(|(seq, t)| BatchEntry { seq, tokens: t }).collect();
            let got = host(group.forward_batch(&mut batch, &mut cache, LogitRows::Last, &device).unwrap());
            let err = scaled_error(&got, &want[step]);
            assert!(err <= TOLERANCE, "synthetic tp {tp} ep {ep} step {step}: logits error {err:e}");
        }
    }
}

fn tensor(values: Vec<f32>, shape: [usize; 2]) -> Tensor<Flex, 2> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

#[test]
fn collectives_reduce_gather_and_exchange_in_rank_order() {
    let out = on_ranks(3, |rank, comm| {
        let r = rank as f32;
        let t = tensor(vec![r, 10.0 * r, 1.0, 2.0], [2, 2]);
        let sum = host(comm.all_reduce_sum(t.clone()).unwrap());
        let rows = comm.all_gather(t.clone(), 0).unwrap().dims();
        let gathered = host(comm.all_gather(t, 1).unwrap());
        // Rank r sends r + 1 rows of value 100 r + d to rank d.
        let parts = (0..3).map(|d| tensor(vec![100.0 * r + d as f32; 2 * (rank + 1)], [rank + 1, 2])).collect();
        let got = comm.all_to_all(parts).unwrap().into_iter().map(host).collect::<Vec<_>>();
        (sum, rows, gathered, got)
    });
    for (rank, (sum, rows, gathered, got)) in out.into_iter().enumerate() {
        assert_eq!(sum, vec![3.0, 30.0, 3.0, 6.0]);
        assert_eq!(rows, [6, 2]);
        assert_eq!(gathered, vec![0.0, 0.0, 1.0, 10.0, 2.0, 20.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]);
        for (src, part) in got.iter().enumerate() {
            assert_eq!(part, &vec![100.0 * src as f32 + rank as f32; 2 * (src + 1)], "rank {rank} from {src}");
        }
    }
}

#[test]
fn mismatched_collectives_are_errors_on_every_rank() {
    let out = on_ranks(2, |rank, comm| {
        let reduce = <LocalCommunicator as Communicator<Flex>>::all_reduce_sum(
            &comm,
            tensor(vec![1.0; 2 + 2 * rank], [1 + rank, 2]),
        )
        .unwrap_err();
        let gather = <LocalCommunicator as Communicator<Flex>>::all_gather(
            &comm,
            tensor(vec![1.0; 2 + 2 * rank], [1, 2 + 2 * rank]),
            0,
        )
        .unwrap_err();
        let a2a = comm.all_to_all(vec![tensor(vec![1.0; 2], [1, 2])]).unwrap_err();
        // Different collectives in the same exchange.
        let t = tensor(vec![1.0; 2], [1, 2]);
        let mixed = if rank == 0 { comm.all_reduce_sum(t).unwrap_err() } else { comm.all_gather(t, 0).unwrap_err() };
        // The group still works afterwards.
        let ok = host(comm.all_reduce_sum(tensor(vec![1.0; 2], [1, 2])).unwrap());
        (reduce, gather, a2a, mixed, ok)
    });
    for (rank, (reduce, gather, a2a, mixed, ok)) in out.into_iter().enumerate() {
        for e in [reduce, gather, a2a, mixed] {
            match &e {
                ModelError::Collective { rank: r, message, .. } => {
                    assert_eq!(*r, rank);
                    assert!(message.contains("rank"), "{e}");
                }
                e => panic!("{e}"),
            }
        }
        assert_eq!(ok, vec![2.0, 2.0]);
    }
}

#[test]
fn a_rank_that_leaves_fails_the_others_instead_of_hanging() {
    let out = on_ranks(2, |rank, comm| {
        if rank == 1 {
            drop(comm);
            return None;
        }
        Some(comm.all_reduce_sum(tensor(vec![1.0; 2], [1, 2])).unwrap_err())
    });
    match &out[0] {
        Some(ModelError::Collective { rank: 0, message, .. }) => assert!(message.contains("rank 1 left"), "{message}"),
        e => panic!("{e:?}"),
    }
}

#[test]
fn int4_routed_experts_stay_packed_on_the_device() {
    // The INT4 checkpoints' routed experts are held as packed words + scales (what makes a 1T-parameter INT4 model
    // load in about its checkpoint's size), in the full model and in every rank's shard.
    let device = Default::default();
    let tiny = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../server/assets/tiny-model");
    for (name, dir) in [("int4_experts", fixture("int4_experts")), ("eyrie-tiny", tiny)] {
        let full = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
        let mut moe_layers = 0;
        for layer in &full.layers {
            if let eyrie_model::deepseek_v3::FeedForward::Moe(moe) = &layer.mlp {
                moe_layers += 1;
                for e in &moe.experts {
                    for p in [&e.gate_proj, &e.up_proj, &e.down_proj] {
                        assert!(matches!(p, eyrie_model::linear::StoredLinear::Int4(_)), "{name}");
                    }
                }
            }
        }
        assert!(moe_layers > 0, "{name}");
        let shard = ShardedDeepseekV3::<Flex>::load(&dir, 1, 1, 2, &device).unwrap();
        for layer in &shard.layers {
            if let eyrie_model::parallel::model::ShardedFeedForward::Moe(moe) = &layer.mlp {
                assert!(matches!(moe.moe.experts[0].down_proj, eyrie_model::linear::StoredLinear::Int4(_)), "{name}");
            }
        }
    }
}

/// The fused experts' layout (what CUDA runs through the fused INT4 kernel) holds the same experts: on the CPU,
/// whose path dequantizes each selected expert from the fused buffers, logits are bit for bit the per-expert
/// model's, unsharded and expert-parallel (a rank's share cut from the fused buffers).
#[test]
fn fused_expert_layout_gives_the_same_logits_unsharded_and_sharded() {
    let device = Default::default();
    let full = DeepseekV3::<Flex>::load(fixture("int4_experts"), &device).unwrap();
    let mut fused = full.clone();
    let mut n_fused = 0;
    for layer in &mut fused.layers {
        if let eyrie_model::deepseek_v3::FeedForward::Moe(moe) = &mut layer.mlp {
            let n = moe.n_experts();
            assert!(moe.fuse(true), "the fixture's INT4 experts fit the fused layout");
            assert!(moe.experts.is_empty() && moe.n_experts() == n);
            n_fused += 1;
        }
    }
    assert!(n_fused > 0);
    let rows = prompt_rows("int4_experts");
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let want = host(full.forward(full.token_tensor(&refs, &device).unwrap()));
    assert_eq!(host(fused.forward(fused.token_tensor(&refs, &device).unwrap())), want);
    for (tp, ep) in [(1, 2), (2, 2)] {
        let shards: Vec<_> = (0..tp.max(ep))
            .map(|rank| ShardedDeepseekV3::from_full(&fused, ShardSpec { rank, tp, ep }).unwrap())
            .collect();
        for got in sharded_logits(shards, &rows) {
            let err = scaled_error(&got, &want);
            assert!(err <= TOLERANCE, "tp {tp} ep {ep}: error {err}");
        }
    }
}

/// One batched step of a model with optional device-fed token ids (`forward_batch_fed`).
type FedStep<'a> = dyn FnMut(
        &mut [BatchEntry<'_>],
        &mut PagedMlaCache<Flex>,
        Option<&Tensor<Flex, 1, burn::tensor::Int>>,
    ) -> eyrie_model::error::Result<Tensor<Flex, 2>>
    + 'a;

/// A greedy chain whose steps embed the previous step's picks on the device (`forward_batch_fed` with
/// `sampling::pending_argmax`'s ids, the overlap schedule of the server and `bench_decode --overlap`) gives the same
/// logits as the host-fed chain, on the unsharded model, a one-rank group and (`forward_batch_chained`, each worker
/// feeding its own picks) groups of 2 and 4 ranks; the picks are the host's `argmax`; fed ids of the wrong length,
/// fed ids to a multi-rank group's plain step, and a chained step with no picks kept are input errors that change
/// nothing.
#[test]
fn device_fed_greedy_steps_equal_host_fed_steps() {
    let device = Default::default();
    let dir = fixture("yarn_qlora");
    let full = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    let rows = prompt_rows("yarn_qlora");
    let prompts = vec![rows[0].clone(), rows[1][..rows[1].len() - 3].to_vec()];
    let (want, _) = cached_steps(&full, &prompts, 4);
    let vocab = full.config.vocab_size;
    // `forward` is the model's step with `fed`: the unsharded model, then a one-rank group.
    let chain = |forward: &mut FedStep<'_>| {
        let mut cache = PagedMlaCache::new(&full.config, 16, 4, &device).unwrap();
        let mut seqs = vec![SequenceCache::default(); prompts.len()];
        let mut batch: Vec<BatchEntry<'_>> =
            seqs.iter_mut().zip(&prompts).map(|(seq, t)| BatchEntry { seq, tokens: t }).collect();
        let mut logits = forward(&mut batch, &mut cache, None).unwrap();
        let mut got = vec![host(logits.clone())];
        for _ in 0..4 {
            let picks = eyrie_model::sampling::pending_argmax(&logits).unwrap();
            // Wrong length: refused before anything changes (the sequences' lengths stay).
            let lens: Vec<usize> = seqs.iter().map(|s| s.len).collect();
            let short = picks.ids.clone().narrow(0, 0, 1);
            let mut batch: Vec<BatchEntry<'_>> = seqs.iter_mut().map(|seq| BatchEntry { seq, tokens: &[0] }).collect();
            match forward(&mut batch, &mut cache, Some(&short)) {
                Err(ModelError::Input { message }) => assert!(message.contains("fed token ids"), "{message}"),
                other => panic!("ids of the wrong length: {:?}", other.map(|t| t.dims())),
            }
            assert_eq!(seqs.iter().map(|s| s.len).collect::<Vec<_>>(), lens);
            // Placeholder host tokens (0): only their count is used.
            let mut batch: Vec<BatchEntry<'_>> = seqs.iter_mut().map(|seq| BatchEntry { seq, tokens: &[0] }).collect();
            let next = forward(&mut batch, &mut cache, Some(&picks.ids)).unwrap();
            let host_rows = host(logits.clone());
            let want_picks: Vec<u32> = host_rows.chunks_exact(vocab).map(eyrie_model::sampling::argmax).collect();
            assert_eq!(picks.wait().unwrap(), want_picks, "the picks are the host argmax's");
            got.push(host(next.clone()));
            logits = next;
        }
        got
    };
    let unsharded = chain(&mut |b, c, f| full.forward_batch_fed(b, c, LogitRows::Last, &device, f));
    let (mut group, gdev) = ParallelGroup::<Flex>::load(&dir, 1, 1, &device, 16, 4).unwrap();
    let grouped = chain(&mut |b, c, f| group.forward_batch_fed(b, c, LogitRows::Last, &gdev, f));
    // Two and four ranks: every worker embeds the picks it kept itself (`forward_batch_chained`).
    let (mut tp2, dev2) = ParallelGroup::<Flex>::load(&dir, 2, 1, &device, 16, 4).unwrap();
    let chained_tp2 = chain(&mut |b, c, f| tp2.forward_batch_chained(b, c, LogitRows::Last, &dev2, f));
    let (mut tp2ep2, dev4) = ParallelGroup::<Flex>::load(&dir, 2, 2, &device, 16, 4).unwrap();
    let chained_tp2ep2 = chain(&mut |b, c, f| tp2ep2.forward_batch_chained(b, c, LogitRows::Last, &dev4, f));
    for (name, got) in [
        ("unsharded", &unsharded),
        ("one-rank group", &grouped),
        ("tp 2, chained", &chained_tp2),
        ("tp 2 x ep 2, chained", &chained_tp2ep2),
    ] {
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = scaled_error(g, w);
            assert!(err <= TOLERANCE, "{name} step {step}: device-fed logits error {err:e}");
        }
    }
    // More ranks than one: fed ids need the chained step, and a chained step needs the workers' picks of the
    // previous one; both refused before any rank starts, and the group keeps working.
    let mut cache = PagedMlaCache::new(tp2.config(), 16, 4, &dev2).unwrap();
    let mut seq = SequenceCache::default();
    let ids = Tensor::<Flex, 1, burn::tensor::Int>::from_data(TensorData::new(vec![3i64], [1]), &dev2);
    let mut batch = [BatchEntry { seq: &mut seq, tokens: &[3] }];
    match tp2.forward_batch_fed(&mut batch, &mut cache, LogitRows::Last, &dev2, Some(&ids)) {
        Err(ModelError::Input { message }) => assert!(message.contains("one-rank"), "{message}"),
        other => panic!("a two-rank group took fed ids: {:?}", other.map(|t| t.dims())),
    }
    let mut batch = [BatchEntry { seq: &mut seq, tokens: &[3] }];
    tp2.forward_batch(&mut batch, &mut cache, LogitRows::Last, &dev2).unwrap();
    let mut batch = [BatchEntry { seq: &mut seq, tokens: &[3] }];
    match tp2.forward_batch_chained(&mut batch, &mut cache, LogitRows::Last, &dev2, Some(&ids)) {
        Err(ModelError::Input { message }) => assert!(message.contains("no picks"), "{message}"),
        other => panic!("a chained step after a plain one: {:?}", other.map(|t| t.dims())),
    }
    assert_eq!(seq.len, 1);
    let mut batch = [BatchEntry { seq: &mut seq, tokens: &[3] }];
    tp2.forward_batch(&mut batch, &mut cache, LogitRows::Last, &dev2).unwrap();
}
