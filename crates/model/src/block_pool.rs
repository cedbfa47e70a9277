//! The block manager of the paged KV cache: which blocks are free, who holds each block (reference counts), and
//! the prefix cache that lets a new sequence reuse the blocks of an identical prompt prefix (the automatic prefix
//! caching of vLLM v1 and SGLang's radix cache, at block granularity).
//!
//! Only FULL blocks of committed tokens are ever shared. A full block is registered under its content key
//! `(parent's content id, the block's tokens)`, so a hit is exact (no hash collisions): equal keys mean the whole
//! token prefix up to the end of the block is equal, hence equal cache contents. Content ids are never reused, so a
//! key that names an evicted parent can never match again.
//!
//! A block is in exactly one of three states: held (`refs > 0`), cached (`refs == 0`, registered, evictable in
//! least-recently-released order), or free (`refs == 0`, unregistered). Allocation takes free blocks first, then
//! evicts the least recently released cached block.

use std::collections::{BTreeMap, HashMap};

/// The exact identity of a full block's contents: the content id of the previous block (0 for the first block of
/// a sequence) and the block's tokens.
type ContentKey = (u64, Vec<u32>);

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    refs: u32,
    /// `(content id, key)` while registered in the prefix cache.
    content: Option<(u64, ContentKey)>,
    /// Position in the eviction order while cached.
    lru_tick: Option<u64>,
}

/// Free list, reference counts and prefix cache over `num_blocks` blocks of `block_size` tokens.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    meta: Vec<BlockMeta>,
    free: Vec<usize>,
    /// Cached blocks by release time (oldest first).
    lru: BTreeMap<u64, usize>,
    by_key: HashMap<ContentKey, usize>,
    tick: u64,
    next_content_id: u64,
    /// Tokens served from the prefix cache since creation (statistics).
    hit_tokens: u64,
}

impl BlockPool {
    /// A pool with every block free.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            meta: vec![BlockMeta::default(); num_blocks],
            // Handed out from the end: block ids of one sequence are not contiguous, as in a long-running server.
            free: (0..num_blocks).collect(),
            lru: BTreeMap::new(),
            by_key: HashMap::new(),
            tick: 0,
            next_content_id: 1,
            hit_tokens: 0,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// All blocks.
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks an allocation can take now: free plus cached (evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks held by at least one sequence.
    pub fn held(&self) -> usize {
        self.meta.len() - self.available()
    }

    /// Blocks kept only for the prefix cache.
    pub fn cached(&self) -> usize {
        self.lru.len()
    }

    /// Tokens whose cache entries were reused instead of recomputed, since the pool was made.
    pub fn prefix_hit_tokens(&self) -> u64 {
        self.hit_tokens
    }

    /// Takes `n` blocks (reference count 1 each), or none when fewer are available.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<usize>> {
        if n > self.available() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let block = match self.free.pop() {
                Some(b) => b,
                None => {
                    let (_, b) = self.lru.pop_first().expect("available() counted the cached blocks");
                    self.unregister(b);
                    b
                }
            };
            let meta = &mut self.meta[block];
            meta.refs = 1;
            meta.lru_tick = None;
            out.push(block);
        }
        Some(out)
    }

    /// Drops one reference to `block`; at zero it becomes cached (if registered) or free.
    pub fn release(&mut self, block: usize) {
        let meta = &mut self.meta[block];
        debug_assert!(meta.refs > 0, "block {block} released more often than taken");
        meta.refs = meta.refs.saturating_sub(1);
        if meta.refs == 0 {
            if meta.content.is_some() {
                self.tick += 1;
                meta.lru_tick = Some(self.tick);
                self.lru.insert(self.tick, block);
            } else {
                self.free.push(block);
            }
        }
    }

    /// Whether `block` is registered in the prefix cache (its contents must never change).
    pub fn is_shared(&self, block: usize) -> bool {
        self.meta[block].content.is_some() || self.meta[block].refs > 1
    }

    /// The longest run of cached full blocks that holds a prefix of `tokens`, at most `max_tokens` tokens long;
    /// each returned block gains a reference (cached blocks leave the eviction order).
    pub fn match_prefix(&mut self, tokens: &[u32], max_tokens: usize) -> Vec<usize> {
        let bs = self.block_size;
        let mut parent = 0u64;
        let mut out = Vec::new();
        for chunk in tokens[..max_tokens.min(tokens.len())].chunks_exact(bs) {
            let Some(&block) = self.by_key.get(&(parent, chunk.to_vec())) else { break };
            let meta = &mut self.meta[block];
            if let Some(tick) = meta.lru_tick.take() {
                self.lru.remove(&tick);
            }
            meta.refs += 1;
            parent = meta.content.as_ref().map_or(0, |(id, _)| *id);
            out.push(block);
        }
        self.hit_tokens += (out.len() * bs) as u64;
        out
    }

    /// Registers the full blocks of a sequence whose page table is `blocks` and whose first `tokens.len()` tokens
    /// are committed, so later prompts with the same prefix can reuse them. Blocks already registered are kept; a
    /// block whose contents are already cached under another id stays private.
    pub fn register(&mut self, blocks: &[usize], tokens: &[u32]) {
        let bs = self.block_size;
        let mut parent = 0u64;
        for (chunk, &block) in tokens.chunks_exact(bs).zip(blocks) {
            if let Some((id, _)) = &self.meta[block].content {
                parent = *id;
                continue;
            }
            let key = (parent, chunk.to_vec());
            if let Some(&other) = self.by_key.get(&key) {
                // Same contents cached in another block: follow that chain, keep this one private.
                parent = self.meta[other].content.as_ref().map_or(0, |(id, _)| *id);
                continue;
            }
            let id = self.next_content_id;
            self.next_content_id += 1;
            self.by_key.insert(key.clone(), block);
            self.meta[block].content = Some((id, key));
            parent = id;
        }
    }

    fn unregister(&mut self, block: usize) {
        if let Some((_, key)) = self.meta[block].content.take() {
            self.by_key.remove(&key);
        }
    }

    /// Forgets every cached prefix (cached blocks become free); held blocks keep their contents but are no longer
    /// offered to new prompts.
    pub fn clear_prefix_cache(&mut self) {
        while let Some((_, b)) = self.lru.pop_first() {
            self.meta[b].lru_tick = None;
            self.unregister(b);
            self.free.push(b);
        }
        for b in 0..self.meta.len() {
            self.unregister(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_invariants(pool: &BlockPool) {
        let mut state = vec![0u8; pool.num_blocks()];
        for &b in &pool.free {
            state[b] += 1;
            assert_eq!(pool.meta[b].refs, 0);
            assert!(pool.meta[b].content.is_none());
        }
        for &b in pool.lru.values() {
            state[b] += 1;
            assert_eq!(pool.meta[b].refs, 0);
            assert!(pool.meta[b].content.is_some());
        }
        for (b, m) in pool.meta.iter().enumerate() {
            if m.refs > 0 {
                state[b] += 1;
            }
        }
        assert!(state.iter().all(|&s| s == 1), "every block in exactly one state: {state:?}");
        assert_eq!(pool.by_key.len(), pool.meta.iter().filter(|m| m.content.is_some()).count());
    }

    #[test]
    fn allocate_release_and_exhaustion() {
        let mut pool = BlockPool::new(4, 2);
        let a = pool.allocate(3).unwrap();
        assert_eq!(pool.available(), 1);
        assert!(pool.allocate(2).is_none(), "all or nothing");
        assert_eq!(pool.available(), 1);
        for b in a {
            pool.release(b);
        }
        assert_eq!(pool.available(), 4);
        check_invariants(&pool);
    }

    #[test]
    fn shared_prefix_is_reused_and_evicted_last_released_last() {
        let mut pool = BlockPool::new(6, 2);
        let prompt = [1, 2, 3, 4, 5];
        let a = pool.allocate(3).unwrap();
        pool.register(&a, &prompt);
        // Two full blocks registered, the partial third is not.
        assert_eq!(pool.by_key.len(), 2);
        let hit = pool.match_prefix(&[1, 2, 3, 4, 9, 9], 5);
        assert_eq!(hit, a[..2].to_vec());
        assert_eq!(pool.prefix_hit_tokens(), 4);
        // A different first block matches nothing, even with an equal second block.
        assert!(pool.match_prefix(&[7, 7, 3, 4], 4).is_empty());
        // max_tokens caps the match (the last prompt token must be computed).
        let capped = pool.match_prefix(&[1, 2, 3, 4], 3);
        assert_eq!(capped, a[..1].to_vec());
        for &b in a.iter().chain(&hit).chain(&capped) {
            pool.release(b);
        }
        check_invariants(&pool);
        assert_eq!(pool.cached(), 2);
        assert_eq!(pool.available(), 6);
        // Allocation prefers free blocks, then evicts the oldest cached one.
        let b = pool.allocate(5).unwrap();
        assert_eq!(pool.cached(), 1, "{b:?}");
        assert!(!b.contains(&a[0]), "the block released last is evicted last: {b:?}");
        assert!(pool.allocate(1).is_some());
        assert_eq!(pool.cached(), 0);
        assert!(pool.match_prefix(&prompt, 5).is_empty(), "evicted blocks never match");
        check_invariants(&pool);
    }

    #[test]
    fn evicted_parent_invalidates_children() {
        let mut pool = BlockPool::new(3, 1);
        let a = pool.allocate(2).unwrap();
        pool.register(&a, &[10, 11]);
        // Parent released first: it is the oldest cached block and goes first; its child stays cached.
        pool.release(a[0]);
        pool.release(a[1]);
        let x = pool.allocate(2).unwrap();
        assert!(x.contains(&a[0]) && !x.contains(&a[1]), "{x:?} {a:?}");
        assert_eq!(pool.cached(), 1);
        // The same first block registered again gets a new content id: the stale child never matches.
        pool.register(&x[..1], &[10]);
        assert_eq!(pool.match_prefix(&[10, 11, 12], 3), vec![x[0]]);
        check_invariants(&pool);
    }

    #[test]
    fn clear_prefix_cache_frees_cached_blocks() {
        let mut pool = BlockPool::new(4, 2);
        let a = pool.allocate(2).unwrap();
        pool.register(&a, &[1, 2, 3, 4]);
        pool.release(a[0]);
        pool.clear_prefix_cache();
        assert_eq!(pool.cached(), 0);
        assert!(!pool.is_shared(a[1]));
        pool.release(a[1]);
        assert_eq!(pool.available(), 4);
        check_invariants(&pool);
    }
}
