//! Byte-pair merging as tiktoken does it: repeatedly merge the adjacent pair whose concatenation has the lowest rank
//! (ties: the leftmost), until no adjacent concatenation is in the table.
//!
//! Two implementations with identical results: a linear rescan (tiktoken's own, O(n^2), fastest for the short pieces
//! the pre-tokenizer produces) and a heap with lazy invalidation (O(n log n)) for long pieces such as runs of spaces.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Pieces at least this long use the heap merge.
const HEAP_THRESHOLD: usize = 128;

/// The rank table: token bytes -> rank (= token id).
pub(crate) type Ranks = HashMap<Vec<u8>, u32>;

/// Encodes one pre-tokenized piece into token ids. Every single byte must be in `ranks` (tiktoken's invariant);
/// a byte that is not yields `None`.
pub(crate) fn byte_pair_encode(ranks: &Ranks, piece: &[u8]) -> Option<Vec<u32>> {
    if piece.len() == 1 {
        return ranks.get(piece).map(|&r| vec![r]);
    }
    let bounds = if piece.len() >= HEAP_THRESHOLD { merge_heap(ranks, piece) } else { merge_linear(ranks, piece) };
    bounds.windows(2).map(|w| ranks.get(&piece[w[0]..w[1]]).copied()).collect()
}

fn rank_of(ranks: &Ranks, bytes: &[u8]) -> u32 {
    ranks.get(bytes).copied().unwrap_or(u32::MAX)
}

/// tiktoken's `_byte_pair_merge`: returns the token boundaries (start offsets plus `piece.len()`).
pub(crate) fn merge_linear(ranks: &Ranks, piece: &[u8]) -> Vec<usize> {
    // parts[i] = (start offset, rank of the merge of part i with part i+1)
    let mut parts: Vec<(usize, u32)> = Vec::with_capacity(piece.len() + 1);
    let mut min = (u32::MAX, usize::MAX);
    for i in 0..piece.len() - 1 {
        let rank = rank_of(ranks, &piece[i..i + 2]);
        if rank < min.0 {
            min = (rank, i);
        }
        parts.push((i, rank));
    }
    parts.push((piece.len() - 1, u32::MAX));
    parts.push((piece.len(), u32::MAX));

    let pair_rank = |parts: &[(usize, u32)], i: usize| {
        if i + 3 < parts.len() { rank_of(ranks, &piece[parts[i].0..parts[i + 3].0]) } else { u32::MAX }
    };
    while min.0 != u32::MAX {
        let i = min.1;
        if i > 0 {
            parts[i - 1].1 = pair_rank(&parts, i - 1);
        }
        parts[i].1 = pair_rank(&parts, i);
        parts.remove(i + 1);
        min = (u32::MAX, usize::MAX);
        for (j, &(_, rank)) in parts[..parts.len() - 1].iter().enumerate() {
            if rank < min.0 {
                min = (rank, j);
            }
        }
    }
    parts.into_iter().map(|(start, _)| start).collect()
}

/// The same merge order with a min-heap keyed by (rank, start offset) over a linked list of parts.
pub(crate) fn merge_heap(ranks: &Ranks, piece: &[u8]) -> Vec<usize> {
    let n = piece.len();
    // Parts are identified by their start offset; next[s] / prev[s] link live parts, n is the end sentinel.
    let mut next: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
    let mut alive = vec![true; n];
    // rank[s] = rank of merging part s with its successor (u32::MAX if none).
    let mut rank: Vec<u32> =
        (0..n).map(|i| if i + 1 < n { rank_of(ranks, &piece[i..i + 2]) } else { u32::MAX }).collect();
    let mut heap: BinaryHeap<Reverse<(u32, usize)>> =
        rank.iter().enumerate().filter(|&(_, &r)| r != u32::MAX).map(|(s, &r)| Reverse((r, s))).collect();

    // rank of merging the part starting at s with its current successor
    let pair_rank = |next: &[usize], s: usize| -> u32 {
        let a = next[s];
        if a >= n {
            return u32::MAX;
        }
        let end = if next[a] >= n { n } else { next[a] };
        rank_of(ranks, &piece[s..end])
    };

    while let Some(Reverse((r, s))) = heap.pop() {
        if !alive[s] || rank[s] != r || r == u32::MAX {
            continue; // stale entry
        }
        // merge part s with its successor a
        let a = next[s];
        alive[a] = false;
        next[s] = next[a];
        if next[a] < n {
            prev[next[a]] = s;
        }
        rank[s] = pair_rank(&next, s);
        if rank[s] != u32::MAX {
            heap.push(Reverse((rank[s], s)));
        }
        let p = prev[s];
        if p != usize::MAX {
            rank[p] = pair_rank(&next, p);
            if rank[p] != u32::MAX {
                heap.push(Reverse((rank[p], p)));
            }
        }
    }
    let mut bounds = Vec::new();
    let mut s = 0;
    while s < n {
        bounds.push(s);
        s = next[s];
    }
    bounds.push(n);
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny deterministic generator, so the test needs no `rand` dependency.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            self.0 >> 33
        }
    }

    fn byte_ranks() -> Ranks {
        (0..=255u8).map(|b| (vec![b], b as u32)).collect()
    }

    #[test]
    fn merges_lowest_rank_first() {
        let mut ranks = byte_ranks();
        ranks.insert(b"ab".to_vec(), 300);
        ranks.insert(b"bc".to_vec(), 256);
        ranks.insert(b"abc".to_vec(), 257);
        // "bc" (256) wins over "ab" (300); then "abc" is not reachable from a + bc... it is: a + bc = abc (257).
        assert_eq!(byte_pair_encode(&ranks, b"abc").unwrap(), vec![257]);
        assert_eq!(byte_pair_encode(&ranks, b"abab").unwrap(), vec![300, 300]);
        assert_eq!(byte_pair_encode(&ranks, b"x").unwrap(), vec![b'x' as u32]);
    }

    #[test]
    fn heap_and_linear_agree_on_random_tables() {
        let mut rng = Lcg(7);
        for round in 0..60 {
            let alphabet = 2 + (round % 5) as u8;
            let mut ranks = byte_ranks();
            let mut next_rank = 256;
            // random merges built from existing tokens, so that long tokens are reachable
            let mut tokens: Vec<Vec<u8>> = (0..alphabet).map(|b| vec![b'a' + b]).collect();
            for _ in 0..40 {
                let x = tokens[rng.next() as usize % tokens.len()].clone();
                let y = tokens[rng.next() as usize % tokens.len()].clone();
                let t = [x, y].concat();
                if !ranks.contains_key(&t) {
                    ranks.insert(t.clone(), next_rank);
                    next_rank += 1;
                    tokens.push(t);
                }
            }
            let len = 1 + rng.next() as usize % 400;
            let piece: Vec<u8> = (0..len).map(|_| b'a' + (rng.next() % alphabet as u64) as u8).collect();
            if piece.len() < 2 {
                continue;
            }
            assert_eq!(merge_linear(&ranks, &piece), merge_heap(&ranks, &piece), "round {round}");
        }
    }

    #[test]
    fn missing_byte_is_none() {
        let ranks: Ranks = [(b"a".to_vec(), 0)].into_iter().collect();
        assert_eq!(byte_pair_encode(&ranks, b"ab"), None);
    }
}
