//! What a strategy answers about the state it holds, which the trainer's checkpoint, heal and
//! memory code asks instead of branching on the strategy's stage or scope: which piece of its state
//! a rank writes to a checkpoint ([`GradSync::checkpoint_piece`](super::GradSync)), which
//! ranks hold replicas of each other's state ([`Replicas`]) and how many elements it holds
//! ([`Holding`]).

use std::ops::Range;

/// Which ranks hold the same state, so that a lost node's state can be taken from another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Replicas {
    /// Rank `r` holds the same state as every rank of group `groups[r]` (DDP: one group;
    /// hybrid and HSDP: a group per local rank, spanning the nodes).
    Groups(Vec<usize>),
    /// Each node holds a state of its own, and the ranks agree on a state they all share
    /// (DiLoCo: the nodes' inner states apart, one outer state).
    NodesApart,
    /// A state shard exists on one rank only; the reason, said after the strategy's name.
    None(&'static str),
}

/// The f32 elements a rank holds between steps (what the memory report counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holding {
    /// Parameters: the whole flat vector, or a shard plus the units gathered at once.
    pub params: usize,
    /// Gradients: the whole flat vector, or a shard plus the buckets in flight.
    pub grads: usize,
}

/// The flat ranges of `piece`, positions in the concatenation of `owned` (in order): each
/// owned range's overlap with the piece, empty ones left out.
pub(crate) fn flat_ranges(owned: &[Range<usize>], piece: Range<usize>) -> Vec<Range<usize>> {
    let mut ranges = Vec::new();
    let mut at = 0;
    for r in owned {
        let (lo, hi) = (piece.start.max(at), piece.end.min(at + r.len()));
        if lo < hi {
            ranges.push(r.start + (lo - at)..r.start + (hi - at));
        }
        at += r.len();
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_maps_to_the_flat_ranges_it_spans() {
        let owned = [0..4, 10..12, 20..25];
        assert_eq!(flat_ranges(&owned, 0..11), vec![0..4, 10..12, 20..25]);
        assert_eq!(flat_ranges(&owned, 3..7), vec![3..4, 10..12, 20..21]);
        assert_eq!(flat_ranges(&owned, 6..6), Vec::<Range<usize>>::new());
        assert_eq!(flat_ranges(&[0..0, 5..9], 1..3), vec![6..8]);
    }
}
