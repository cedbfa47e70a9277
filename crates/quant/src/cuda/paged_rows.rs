//! Where each query row of the MLA attention reads ([`PagedRows`]: its sequence's page table and how many positions
//! it sees), for both decode kernels ([`super::attention`], [`super::attention_dims`]); re-exported as
//! `attention::PagedRows`.

/// Where each query row reads: its sequence's page table and how many positions it sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedRows {
    /// Per query row, the index of its sequence in `tables`.
    pub row_seq: Vec<u32>,
    /// Per query row, the positions it sees (`0..len`); at least 1.
    pub row_len: Vec<u32>,
    /// Per sequence, its cache blocks in position order, padded to `max_blocks` entries.
    pub tables: Vec<u32>,
    /// Entries per sequence in `tables`.
    pub max_blocks: usize,
    /// Positions per cache block.
    pub block_size: usize,
}

impl PagedRows {
    /// The rows of one sequence's chunk of `n` new tokens after `start` cached positions, its `start + n` positions
    /// held contiguously from cache row 0 (one block): checks and benchmarks over a plain latent buffer.
    pub fn contiguous_chunk(n: usize, start: usize) -> Self {
        Self {
            row_seq: vec![0; n],
            row_len: (0..n).map(|i| (start + i + 1) as u32).collect(),
            tables: vec![0],
            max_blocks: 1,
            block_size: start + n,
        }
    }

    /// Query rows.
    pub fn rows(&self) -> usize {
        self.row_seq.len()
    }

    /// The cache row holding position `pos` of the sequence of query row `row`.
    pub fn slot(&self, row: usize, pos: usize) -> usize {
        let seq = self.row_seq[row] as usize;
        self.tables[seq * self.max_blocks + pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// Checks the tables against a cache of `slots` rows: every row's sequence exists, `1 <= len`, every block a
    /// row reads is inside the table and the cache.
    ///
    /// # Errors
    /// A message naming the row and field that is out of range.
    pub fn validate(&self, slots: usize) -> Result<(), String> {
        if self.row_len.len() != self.row_seq.len() {
            return Err(format!("row_len has {} entries, row_seq {}", self.row_len.len(), self.row_seq.len()));
        }
        if self.block_size == 0 || self.max_blocks == 0 || !self.tables.len().is_multiple_of(self.max_blocks) {
            return Err(format!(
                "block_size {}, max_blocks {}, tables {}: need block_size, max_blocks >= 1 and whole tables",
                self.block_size,
                self.max_blocks,
                self.tables.len()
            ));
        }
        let seqs = self.tables.len() / self.max_blocks;
        // Each sequence's blocks are checked once, up to the longest row that reads them.
        let mut longest = vec![(0usize, 0usize); seqs];
        for (row, (&seq, &len)) in self.row_seq.iter().zip(&self.row_len).enumerate() {
            let (seq, len) = (seq as usize, len as usize);
            if seq >= seqs {
                return Err(format!("row {row}: row_seq {seq} but only {seqs} sequence tables"));
            }
            if len == 0 || len.div_ceil(self.block_size) > self.max_blocks {
                return Err(format!("row {row}: row_len {len} outside 1..={}", self.max_blocks * self.block_size));
            }
            if len > longest[seq].1 {
                longest[seq] = (row, len);
            }
        }
        for (seq, &(row, len)) in longest.iter().enumerate() {
            for b in 0..len.div_ceil(self.block_size) {
                let block = self.tables[seq * self.max_blocks + b] as usize;
                if (block + 1) * self.block_size > slots {
                    return Err(format!("row {row}: block {block} lies past the cache's {slots} rows"));
                }
            }
        }
        Ok(())
    }

    /// Query rows `range` of these rows, with the same tables (for launches of at most [`MAX_ROWS`](super::attention::MAX_ROWS) rows).
    pub fn subset(&self, range: std::ops::Range<usize>) -> PagedRows {
        PagedRows {
            row_seq: self.row_seq[range.clone()].to_vec(),
            row_len: self.row_len[range].to_vec(),
            tables: self.tables.clone(),
            max_blocks: self.max_blocks,
            block_size: self.block_size,
        }
    }

    /// Length of [`Self::packed`].
    pub fn packed_len(&self) -> usize {
        2 * self.rows() + self.tables.len()
    }

    /// `row_seq`, `row_len` and `tables` in one buffer, as the kernel reads them.
    pub fn packed(&self) -> Vec<u32> {
        let mut meta = Vec::with_capacity(2 * self.rows() + self.tables.len());
        meta.extend_from_slice(&self.row_seq);
        meta.extend_from_slice(&self.row_len);
        meta.extend_from_slice(&self.tables);
        meta
    }
}
