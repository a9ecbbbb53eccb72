//! The phase program of a hierarchical collective, as data ([`Program`]): what a lane owner
//! does inside its node before the lanes run, what the lanes run between nodes, how a mean is
//! taken, and what every rank copies afterwards. `group::executor` runs programs and knows no
//! kind of call; each kind is one program, so the node-scoped and hybrid calls are
//! compositions of the same phases, not special cases. The tests run every program on a model
//! of the node's buffers and check the result against the call's definition.

use crate::op::OpKind;

/// Inside the node, before the lanes run: what local rank `l` does for lane `l`'s pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pre {
    /// Sum the lane's pieces over the node's buffers into its own buffer.
    Reduce,
    /// Fill its own node's lane piece with the chunks the node's other ranks own.
    CollectChunks,
    /// On the root's node, copy the lane's pieces from the root's buffer.
    FromRoot,
    /// Nothing.
    Nothing,
}

/// Between nodes: what each lane runs over its pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lanes {
    /// Nothing crosses nodes.
    Nothing,
    /// A ring reduce-scatter, then a ring all-gather: every piece ends reduced.
    AllReduce,
    /// A ring reduce-scatter: each node ends with its own piece reduced.
    ReduceScatter,
    /// A ring all-gather of the nodes' own pieces.
    AllGather,
    /// A pipelined chain from the root's node.
    Chain,
}

/// Over which ranks a mean divides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeanOver {
    World,
    Node,
}

/// Inside the node, after the lanes: what every rank copies from the other lanes' owners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Post {
    /// Every other lane's pieces: the buffer ends complete.
    OtherLanes,
    /// The parts of this rank's own chunk that other lanes hold (reduce-scatter).
    OwnChunk,
    /// Nothing: each rank keeps its lane's pieces (hybrid, node reduce-scatter).
    Nothing,
}

/// With one node the program collapses to one pass on the ranks' chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Single {
    /// Each rank sums its chunk over all buffers and writes the sum into every buffer.
    AllReduce,
    /// Each rank sums its chunk over all buffers into its own.
    ReduceScatter,
    /// Each rank copies every other rank's chunk.
    Gather,
    /// Each rank copies the root's buffer.
    Broadcast,
}

/// The phases of one kind of collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Program {
    pub pre: Pre,
    pub lanes: Lanes,
    /// The ranks a mean divides by (reductions only).
    pub mean_over: MeanOver,
    pub post: Post,
    pub single: Single,
}

impl Program {
    /// The program of `kind`; `None` for p2p, which is a raw exchange, not a collective.
    pub fn of(kind: OpKind) -> Option<Self> {
        use {Lanes as L, Post as P, Pre as R, Single as S};
        let p = |pre, lanes, mean_over, post, single| {
            Some(Self {
                pre,
                lanes,
                mean_over,
                post,
                single,
            })
        };
        let w = MeanOver::World;
        match kind {
            OpKind::AllReduce | OpKind::Barrier => {
                p(R::Reduce, L::AllReduce, w, P::OtherLanes, S::AllReduce)
            }
            OpKind::ReduceScatter => p(
                R::Reduce,
                L::ReduceScatter,
                w,
                P::OwnChunk,
                S::ReduceScatter,
            ),
            OpKind::HybridReduce => p(R::Reduce, L::AllReduce, w, P::Nothing, S::ReduceScatter),
            OpKind::NodeReduce => p(
                R::Reduce,
                L::Nothing,
                MeanOver::Node,
                P::OtherLanes,
                S::AllReduce,
            ),
            OpKind::NodeReduceScatter => p(
                R::Reduce,
                L::Nothing,
                MeanOver::Node,
                P::Nothing,
                S::ReduceScatter,
            ),
            OpKind::AllGather => p(R::CollectChunks, L::AllGather, w, P::OtherLanes, S::Gather),
            OpKind::NodeGather => p(R::Nothing, L::Nothing, w, P::OtherLanes, S::Gather),
            OpKind::Broadcast => p(R::FromRoot, L::Chain, w, P::OtherLanes, S::Broadcast),
            OpKind::P2p => None,
        }
    }

    /// Whether the ranks must meet between the lane phase and the copies after it (not when
    /// nothing happened since the entry barrier).
    pub fn needs_middle_barrier(&self) -> bool {
        !(self.pre == Pre::Nothing && self.lanes == Lanes::Nothing)
    }

    /// After a reduction's lane phase, whether only this node's own piece of the lane is
    /// reduced (a ring reduce-scatter) rather than every piece of it.
    pub fn only_own_piece_reduced(&self) -> bool {
        self.lanes == Lanes::ReduceScatter
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::Layout;
    use crate::algo::layout::intersect;
    use crate::topology::RankTable;

    const KINDS: [OpKind; 8] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::HybridReduce,
        OpKind::NodeReduce,
        OpKind::NodeReduceScatter,
        OpKind::AllGather,
        OpKind::NodeGather,
        OpKind::Broadcast,
    ];

    use crate::topology::table_of as table;

    /// Runs `prog` on buffers `b[rank]` as the executor does, with ideal lanes (a ring's
    /// result, not its steps: those are `ring`'s tests). Scratch left by a phase is NaN.
    fn run(prog: Program, t: &RankTable, b: &mut [Vec<f64>], root: usize, mean: bool) {
        let len = b[0].len();
        let lay = Layout::new(t, len);
        let (nn, lanes) = (t.num_nodes(), lay.lanes());
        let world = t.world() as f64;
        let rank = |n: usize, j: usize| t.first_rank(n) + j;
        if nn == 1 {
            let k = t.ranks_on(0);
            let old = b.to_vec();
            for j in 0..k {
                let c = lay.chunk(j);
                let div = if mean { k as f64 } else { 1.0 };
                let sum = |i: usize| (0..k).map(|r| old[r][i]).sum::<f64>() / div;
                match prog.single {
                    Single::AllReduce => c
                        .clone()
                        .for_each(|i| (0..k).for_each(|r| b[r][i] = sum(i))),
                    Single::ReduceScatter => c.clone().for_each(|i| b[j][i] = sum(i)),
                    Single::Gather => {
                        (0..k).for_each(|r| c.clone().for_each(|i| b[r][i] = old[j][i]))
                    }
                    Single::Broadcast => (0..len).for_each(|i| b[j][i] = old[root][i]),
                }
            }
            return;
        }
        // Pre: each lane owner works on its lane's pieces.
        for n in 0..nn {
            let k = t.ranks_on(n);
            for l in 0..lanes {
                let me = rank(n, l);
                for r in lay.lane_pieces(l) {
                    for i in r {
                        match prog.pre {
                            Pre::Reduce => b[me][i] = (0..k).map(|j| b[rank(n, j)][i]).sum(),
                            Pre::FromRoot if t.locate(root).0 == n => b[me][i] = b[root][i],
                            _ => {}
                        }
                    }
                }
                if prog.pre == Pre::CollectChunks {
                    for j in (0..k).filter(|&j| j != l) {
                        for i in intersect(&lay.chunk(rank(n, j)), &lay.piece(n, l)) {
                            b[me][i] = b[rank(n, j)][i];
                        }
                    }
                }
            }
        }
        // Lanes: lane l of every node, over piece (n', l) of every node n'.
        for l in 0..lanes {
            let owners: Vec<usize> = (0..nn).map(|n| rank(n, l)).collect();
            let before: Vec<Vec<f64>> = owners.iter().map(|&o| b[o].clone()).collect();
            for (n, &o) in owners.iter().enumerate() {
                for m in 0..nn {
                    for i in lay.piece(m, l) {
                        let total: f64 = before.iter().map(|v| v[i]).sum();
                        match prog.lanes {
                            Lanes::AllReduce => b[o][i] = total,
                            Lanes::ReduceScatter => b[o][i] = if m == n { total } else { f64::NAN },
                            Lanes::AllGather => b[o][i] = before[m][i],
                            Lanes::Chain => b[o][i] = before[t.locate(root).0][i],
                            Lanes::Nothing => {}
                        }
                    }
                }
            }
        }
        // Mean, on what the lane owner holds reduced.
        if mean && prog.pre == Pre::Reduce {
            for n in 0..nn {
                let by = match prog.mean_over {
                    MeanOver::World => world,
                    MeanOver::Node => t.ranks_on(n) as f64,
                };
                for l in 0..lanes {
                    let owned = if prog.only_own_piece_reduced() {
                        vec![lay.piece(n, l)]
                    } else {
                        lay.lane_pieces(l)
                    };
                    owned
                        .into_iter()
                        .flatten()
                        .for_each(|i| b[rank(n, l)][i] /= by);
                }
            }
        }
        // Post: every rank copies from the lane owners of its node.
        let after = b.to_vec();
        for n in 0..nn {
            for j in 0..t.ranks_on(n) {
                let me = rank(n, j);
                for l in (0..lanes).filter(|&l| l != j) {
                    let from = &after[rank(n, l)];
                    let copy = match prog.post {
                        Post::OtherLanes => lay.lane_pieces(l),
                        Post::OwnChunk => vec![intersect(&lay.chunk(me), &lay.piece(n, l))],
                        Post::Nothing => vec![],
                    };
                    copy.into_iter().flatten().for_each(|i| b[me][i] = from[i]);
                }
            }
        }
    }

    /// Each call's definition, checked on what it promises (scratch elsewhere is ignored).
    #[allow(clippy::needless_range_loop)] // r is the rank, also looked up in the table
    fn check(kind: OpKind, t: &RankTable, input: &[Vec<f64>], out: &[Vec<f64>], root: usize) {
        let len = input[0].len();
        let lay = Layout::new(t, len);
        let sum_of = |ranks: &mut dyn Iterator<Item = usize>, i: usize| {
            ranks.map(|r| input[r][i]).sum::<f64>()
        };
        for r in 0..t.world() {
            let (n, j) = t.locate(r);
            let node = t.first_rank(n)..t.first_rank(n) + t.ranks_on(n);
            let mine = if j < lay.lanes() {
                lay.lane_pieces(j)
            } else {
                vec![]
            };
            let (range, want): (Vec<usize>, Box<dyn Fn(usize) -> f64>) = match kind {
                OpKind::AllReduce => (
                    (0..len).collect(),
                    Box::new(|i| sum_of(&mut (0..t.world()), i)),
                ),
                OpKind::ReduceScatter => (
                    lay.chunk(r).collect(),
                    Box::new(|i| sum_of(&mut (0..t.world()), i)),
                ),
                OpKind::HybridReduce => (
                    mine.iter().cloned().flatten().collect(),
                    Box::new(|i| sum_of(&mut (0..t.world()), i)),
                ),
                OpKind::NodeReduce => (
                    (0..len).collect(),
                    Box::new(|i| sum_of(&mut node.clone(), i)),
                ),
                OpKind::NodeReduceScatter => (
                    mine.iter().cloned().flatten().collect(),
                    Box::new(|i| sum_of(&mut node.clone(), i)),
                ),
                // Rank q contributes its chunk.
                OpKind::AllGather => (
                    (0..len).collect(),
                    Box::new(|i| {
                        input[(0..t.world()).find(|&q| lay.chunk(q).contains(&i)).unwrap()][i]
                    }),
                ),
                // Local rank l of this node contributes its lane's pieces.
                OpKind::NodeGather => (
                    (0..len).collect(),
                    Box::new(|i| {
                        let l = (0..lay.lanes())
                            .find(|&l| lay.lane_pieces(l).iter().any(|p| p.contains(&i)))
                            .unwrap();
                        input[t.first_rank(n) + l][i]
                    }),
                ),
                OpKind::Broadcast => ((0..len).collect(), Box::new(|i| input[root][i])),
                _ => unreachable!(),
            };
            for i in range {
                assert_eq!(
                    out[r][i],
                    want(i),
                    "{kind:?} on {t:?}: rank {r} element {i}"
                );
            }
        }
    }

    #[test]
    fn every_program_computes_its_calls_definition_on_any_topology() {
        for ranks in [
            &[4][..],
            &[1, 1],
            &[2, 2],
            &[3, 1, 2],
            &[2, 3],
            &[1, 1, 1, 1],
        ] {
            let t = table(ranks);
            for len in [1, 7, 64, 101] {
                // Distinct powers of two per rank and element: every sum is exact and tells
                // which inputs went into it.
                let input: Vec<Vec<f64>> = (0..t.world())
                    .map(|r| (0..len).map(|i| ((r + 1) * 1000 + i) as f64).collect())
                    .collect();
                for kind in KINDS {
                    let root = t.world() - 1;
                    let mut b = input.clone();
                    run(Program::of(kind).unwrap(), &t, &mut b, root, false);
                    check(kind, &t, &input, &b, root);
                }
            }
        }
    }

    #[test]
    fn a_mean_divides_by_the_ranks_of_the_calls_scope() {
        let t = table(&[2, 3]);
        let input: Vec<Vec<f64>> = (0..5).map(|r| vec![r as f64 * 6.0; 30]).collect();
        for (kind, want) in [
            (
                OpKind::AllReduce,
                vec![(0.0 + 6.0 + 12.0 + 18.0 + 24.0) / 5.0; 5],
            ),
            // Node 0 holds ranks 0-1, node 1 ranks 2-4.
            (OpKind::NodeReduce, vec![3.0, 3.0, 18.0, 18.0, 18.0]),
        ] {
            let mut b = input.clone();
            run(Program::of(kind).unwrap(), &t, &mut b, 0, true);
            for (r, w) in want.iter().enumerate() {
                assert!(b[r].iter().all(|x| x == w), "{kind:?} rank {r}: {:?}", b[r]);
            }
        }
    }

    #[test]
    fn p2p_is_not_a_program_and_only_a_copy_needs_no_middle_barrier() {
        assert_eq!(Program::of(OpKind::P2p), None);
        for kind in KINDS {
            let p = Program::of(kind).unwrap();
            assert_eq!(
                p.needs_middle_barrier(),
                kind != OpKind::NodeGather,
                "{kind:?}"
            );
        }
    }
}
