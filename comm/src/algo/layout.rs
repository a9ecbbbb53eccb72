//! The element layout of one collective over a buffer of `len` elements.
//!
//! * `chunk(g)`: global rank g's shard (node-major, lengths differ by at most one).
//! * `piece(n, l)`: node n's block (the union of its ranks' chunks, contiguous because ranks
//!   are node-major) split into `lanes` parts. Lane l of every node runs a cross-node ring over
//!   the pieces `piece(0, l) .. piece(N-1, l)`; local rank l of a node owns them inside the node.
//!
//! When every node hosts the same number of ranks, `piece(n, l) == chunk(n * k + l)`, so the
//! cross-node reduce-scatter leaves each rank exactly its own shard.

use crate::topology::{RankTable, split};
use std::ops::Range;

/// Which elements of a collective's buffer each rank (`chunk`) and each lane of each node
/// (`piece`) handles; see the module docs.
#[derive(Debug, Clone)]
pub struct Layout {
    len: usize,
    chunks: Vec<Range<usize>>,
    /// `pieces[node][lane]`
    pieces: Vec<Vec<Range<usize>>>,
}

impl Layout {
    /// The layout of a call over `len` elements on every rank of `table`.
    pub fn new(table: &RankTable, len: usize) -> Self {
        let chunks = split(0..len, table.world());
        let lanes = table.lanes();
        let pieces = (0..table.num_nodes())
            .map(|n| {
                let r = table.ranks_of(n);
                let block = chunks[r.start].start..chunks[r.end - 1].end;
                split(block, lanes)
            })
            .collect();
        Self {
            len,
            chunks,
            pieces,
        }
    }

    /// The layout of a call on one node of `k` ranks whose reduce-scatter cuts `len` elements
    /// into `shards <= k` shards (the node group: see `algo::scope`); ranks past them own an
    /// empty chunk.
    pub fn one_node(len: usize, k: usize, shards: usize) -> Self {
        let mut chunks = split(0..len, shards.clamp(1, k));
        chunks.resize(k, len..len);
        Self {
            len,
            pieces: vec![chunks.clone()],
            chunks,
        }
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lanes (pieces per node).
    pub fn lanes(&self) -> usize {
        self.pieces[0].len()
    }

    /// Rank `rank`'s shard of the buffer (global rank; local rank for [`Self::one_node`]).
    pub fn chunk(&self, rank: usize) -> Range<usize> {
        self.chunks[rank].clone()
    }

    /// Lane `lane`'s part of node `node`'s block.
    pub fn piece(&self, node: usize, lane: usize) -> Range<usize> {
        self.pieces[node][lane].clone()
    }

    /// The pieces of lane `lane`, one per node in node order: the ring's chunks.
    pub fn lane_pieces(&self, lane: usize) -> Vec<Range<usize>> {
        self.pieces.iter().map(|p| p[lane].clone()).collect()
    }
}

/// Intersection of two ranges (empty when disjoint).
pub fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let s = a.start.max(b.start);
    let e = a.end.min(b.end);
    if s < e { s..e } else { s..s }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::topology::table_of as table;

    #[test]
    fn uniform_pieces_are_chunks() {
        for shape in [&[1][..], &[4], &[2, 2], &[3, 3, 3], &[2, 2, 2, 2]] {
            let t = table(shape);
            for len in [0, 1, 7, 13, 1_000_003] {
                let l = Layout::new(&t, len);
                for n in 0..t.num_nodes() {
                    for lane in 0..t.lanes() {
                        assert_eq!(l.piece(n, lane), l.chunk(t.global_rank(n, lane)));
                    }
                }
            }
        }
    }

    #[test]
    fn pieces_partition_the_buffer() {
        for shape in [&[1, 2][..], &[3, 1, 2], &[2, 4]] {
            let t = table(shape);
            for len in [0, 1, 5, 17, 1000] {
                let l = Layout::new(&t, len);
                let mut covered = vec![0u8; len];
                for n in 0..t.num_nodes() {
                    for lane in 0..t.lanes() {
                        for i in l.piece(n, lane) {
                            covered[i] += 1;
                        }
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "{shape:?} {len}");
            }
        }
    }

    #[test]
    fn one_node_layout_cuts_into_its_shards() {
        let l = Layout::one_node(10, 3, 2);
        assert_eq!(
            (0..3).map(|j| l.chunk(j)).collect::<Vec<_>>(),
            [0..5, 5..10, 10..10]
        );
        let l = Layout::one_node(7, 2, 2);
        assert_eq!((0..2).map(|j| l.chunk(j)).collect::<Vec<_>>(), [0..4, 4..7]);
    }

    #[test]
    fn intersect_ranges() {
        assert_eq!(intersect(&(0..5), &(3..9)), 3..5);
        assert!(intersect(&(0..3), &(3..9)).is_empty());
        assert!(intersect(&(5..9), &(0..2)).is_empty());
    }
}
