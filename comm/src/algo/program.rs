//! The phase program of a hierarchical collective, as data ([`Program`]): what a lane owner
//! does inside its node before the lanes run, what the lanes run between nodes, how a mean is
//! taken, and what every rank copies afterwards. `group::executor` runs programs and knows no
//! kind of call; each kind is one program, run on the rank table of the call's group
//! ([`super::Scope`]), so the node-group, replica-group and hybrid calls are the same programs
//! on other tables, not special cases. The tests run every program on a model of the node's
//! buffers and check the result against the call's definition, and check that hybrid sharding
//! composed of sub-group calls is the world's reduction.

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
}

/// Between nodes: what each lane runs over its pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lanes {
    /// A ring reduce-scatter, then a ring all-gather: every piece ends reduced.
    AllReduce,
    /// A ring reduce-scatter: each node ends with its own piece reduced.
    ReduceScatter,
    /// A ring all-gather of the nodes' own pieces.
    AllGather,
    /// A pipelined chain from the root's node.
    Chain,
}

/// Inside the node, after the lanes: what every rank copies from the other lanes' owners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Post {
    /// Every other lane's pieces: the buffer ends complete.
    OtherLanes,
    /// The parts of this rank's own chunk that other lanes hold (reduce-scatter).
    OwnChunk,
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
    /// Inside the node, before the lanes run (several nodes).
    pub pre: Pre,
    /// Between nodes, on each lane (several nodes).
    pub lanes: Lanes,
    /// Inside the node, after the lanes (several nodes).
    pub post: Post,
    /// The whole collective when the call's group has one node.
    pub single: Single,
}

impl Program {
    /// The program of `kind`; `None` for p2p, which is a raw exchange, not a collective. A
    /// mean divides by the size of the call's group.
    pub fn of(kind: OpKind) -> Option<Self> {
        use {Lanes as L, Post as P, Pre as R, Single as S};
        let p = |pre, lanes, post, single| {
            Some(Self {
                pre,
                lanes,
                post,
                single,
            })
        };
        match kind {
            OpKind::AllReduce | OpKind::Barrier => {
                p(R::Reduce, L::AllReduce, P::OtherLanes, S::AllReduce)
            }
            OpKind::ReduceScatter => p(R::Reduce, L::ReduceScatter, P::OwnChunk, S::ReduceScatter),
            OpKind::AllGather => p(R::CollectChunks, L::AllGather, P::OtherLanes, S::Gather),
            OpKind::Broadcast => p(R::FromRoot, L::Chain, P::OtherLanes, S::Broadcast),
            OpKind::P2p | OpKind::Send | OpKind::Recv => None,
        }
    }

    /// After a reduction's lane phase, whether only this node's own piece of the lane is
    /// reduced (a ring reduce-scatter) rather than every piece of it.
    pub fn only_own_piece_reduced(&self) -> bool {
        self.lanes == Lanes::ReduceScatter
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // ranks index buffers and the rank table alike
mod tests {
    use super::*;
    use crate::algo::layout::intersect;
    use crate::algo::{Layout, Scope};
    use crate::op::Group;
    use crate::topology::RankTable;

    const KINDS: [OpKind; 4] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
    ];

    use crate::topology::table_of as table;

    /// Where a simulated call runs: the rank table, the scope's layout, the root, and
    /// whether it takes the mean.
    struct Sim<'a> {
        t: &'a RankTable,
        lay: &'a Layout,
        root: usize,
        mean: bool,
    }

    impl Sim<'_> {
        fn rank(&self, n: usize, j: usize) -> usize {
            self.t.first_rank(n) + j
        }
    }

    /// Runs `prog` on buffers `b[rank]` as the executor does, with ideal lanes (a ring's
    /// result, not its steps: those are `ring`'s tests), with `lay` the layout of the call's
    /// scope. Scratch left by a phase is NaN.
    fn run_on(
        prog: Program,
        t: &RankTable,
        lay: &Layout,
        b: &mut [Vec<f64>],
        root: usize,
        mean: bool,
    ) {
        let sim = Sim { t, lay, root, mean };
        if t.num_nodes() == 1 {
            return run_single(prog, &sim, b);
        }
        run_pre(prog, &sim, b);
        run_lanes(prog, &sim, b);
        if mean && prog.pre == Pre::Reduce {
            run_mean(prog, &sim, b);
        }
        run_post(prog, &sim, b);
    }

    /// One node: every rank works on its chunk.
    fn run_single(prog: Program, sim: &Sim<'_>, b: &mut [Vec<f64>]) {
        let (t, lay, root, mean) = (sim.t, sim.lay, sim.root, sim.mean);
        let len = b[0].len();
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
                Single::Gather => (0..k).for_each(|r| c.clone().for_each(|i| b[r][i] = old[j][i])),
                Single::Broadcast => (0..len).for_each(|i| b[j][i] = old[root][i]),
            }
        }
    }

    /// Pre: each lane owner works on its lane's pieces.
    fn run_pre(prog: Program, sim: &Sim<'_>, b: &mut [Vec<f64>]) {
        let (t, lay, root) = (sim.t, sim.lay, sim.root);
        let (nn, lanes) = (t.num_nodes(), lay.lanes());
        let rank = |n: usize, j: usize| sim.rank(n, j);
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
    }

    /// Lanes: lane l of every node, over piece (n', l) of every node n'.
    fn run_lanes(prog: Program, sim: &Sim<'_>, b: &mut [Vec<f64>]) {
        let (t, lay, root) = (sim.t, sim.lay, sim.root);
        let (nn, lanes) = (t.num_nodes(), lay.lanes());
        let rank = |n: usize, j: usize| sim.rank(n, j);
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
                        }
                    }
                }
            }
        }
    }

    /// Mean, on what the lane owner holds reduced.
    fn run_mean(prog: Program, sim: &Sim<'_>, b: &mut [Vec<f64>]) {
        let (t, lay) = (sim.t, sim.lay);
        let world = t.world() as f64;
        let (nn, lanes) = (t.num_nodes(), lay.lanes());
        let rank = |n: usize, j: usize| sim.rank(n, j);
        for n in 0..nn {
            for l in 0..lanes {
                let owned = if prog.only_own_piece_reduced() {
                    vec![lay.piece(n, l)]
                } else {
                    lay.lane_pieces(l)
                };
                owned
                    .into_iter()
                    .flatten()
                    .for_each(|i| b[rank(n, l)][i] /= world);
            }
        }
    }

    /// Post: every rank copies from the lane owners of its node.
    fn run_post(prog: Program, sim: &Sim<'_>, b: &mut [Vec<f64>]) {
        let (t, lay) = (sim.t, sim.lay);
        let (nn, lanes) = (t.num_nodes(), lay.lanes());
        let rank = |n: usize, j: usize| sim.rank(n, j);
        let after = b.to_vec();
        for n in 0..nn {
            for j in 0..t.ranks_on(n) {
                let me = rank(n, j);
                for l in (0..lanes).filter(|&l| l != j) {
                    let from = &after[rank(n, l)];
                    let copy = match prog.post {
                        Post::OtherLanes => lay.lane_pieces(l),
                        Post::OwnChunk => vec![intersect(&lay.chunk(me), &lay.piece(n, l))],
                    };
                    copy.into_iter().flatten().for_each(|i| b[me][i] = from[i]);
                }
            }
        }
    }

    /// A world call's program run as the executor runs it.
    fn run(prog: Program, t: &RankTable, b: &mut [Vec<f64>], root: usize, mean: bool) {
        let lay = Layout::new(t, b[0].len());
        run_on(prog, t, &lay, b, root, mean);
    }

    /// Each call's definition, checked on what it promises (scratch elsewhere is ignored).
    fn check(kind: OpKind, t: &RankTable, input: &[Vec<f64>], out: &[Vec<f64>], root: usize) {
        let len = input[0].len();
        let lay = Layout::new(t, len);
        let sum = |i: usize| (0..t.world()).map(|r| input[r][i]).sum::<f64>();
        for r in 0..t.world() {
            let (range, want): (Vec<usize>, Box<dyn Fn(usize) -> f64>) = match kind {
                OpKind::AllReduce => ((0..len).collect(), Box::new(sum)),
                OpKind::ReduceScatter => (lay.chunk(r).collect(), Box::new(sum)),
                // Rank q contributes its chunk.
                OpKind::AllGather => (
                    (0..len).collect(),
                    Box::new(|i| {
                        input[(0..t.world()).find(|&q| lay.chunk(q).contains(&i)).unwrap()][i]
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

    /// Runs `kind` on `group` from every rank, as each rank's executor would: on the
    /// buffers of the ranks of its group (positions `elems` of them), with the group's table
    /// and layout.
    fn run_group(
        kind: OpKind,
        group: Group,
        t: &RankTable,
        b: &mut [Vec<f64>],
        elems: &dyn Fn(usize) -> std::ops::Range<usize>,
        mean: bool,
    ) {
        let prog = Program::of(kind).unwrap();
        let mut done = vec![false; t.world()];
        for r in 0..t.world() {
            let (n, j) = t.locate(r);
            let Some(s) = Scope::of(group, t, n, j) else {
                continue;
            };
            if done[r] {
                continue;
            }
            // The world ranks of this rank's group, in group-rank order.
            let members: Vec<usize> = (0..t.world())
                .filter(|&q| {
                    let (qn, qj) = t.locate(q);
                    match group {
                        Group::World => true,
                        Group::Node => qn == n,
                        Group::Replica => qj == j,
                    }
                })
                .collect();
            assert_eq!(members.len(), s.size());
            let e = elems(r);
            let mut sub: Vec<Vec<f64>> =
                members.iter().map(|&q| b[q][e.clone()].to_vec()).collect();
            run_on(prog, &s.table, &s.layout(e.len()), &mut sub, 0, mean);
            for (q, v) in members.iter().zip(sub) {
                b[*q][e.clone()].copy_from_slice(&v);
                done[*q] = true;
            }
        }
    }

    /// Hybrid sharding as FSDP2 composes it: a reduce-scatter on the node group, then an
    /// all-reduce of the shard on the replica group, leaves every rank with the world's sum
    /// on its node shard, the same positions on every node; an all-gather on the node group
    /// then completes every buffer. Node-group calls stay inside the node.
    #[test]
    fn hybrid_sharding_is_two_sub_group_calls() {
        for ranks in [&[2, 2][..], &[3, 3, 3], &[1, 1], &[3, 1, 2], &[2, 3], &[4]] {
            let t = table(ranks);
            for len in [1, 7, 64, 101] {
                let input: Vec<Vec<f64>> = (0..t.world())
                    .map(|r| (0..len).map(|i| ((r + 1) * 1000 + i) as f64).collect())
                    .collect();
                let sum = |i: usize| (0..t.world()).map(|r| input[r][i]).sum::<f64>();
                let shard = |r: usize| {
                    let (n, j) = t.locate(r);
                    Scope::of(Group::Node, &t, n, j).unwrap().shard(len)
                };
                let whole = |_: usize| 0..len;
                let on_node = |kind, b: &mut [Vec<f64>]| {
                    run_group(kind, Group::Node, &t, b, &whole, false);
                };
                let mut b = input.clone();
                on_node(OpKind::ReduceScatter, &mut b);
                for r in 0..t.world() {
                    let (n, _) = t.locate(r);
                    for i in shard(r) {
                        let node: f64 = t.ranks_of(n).map(|q| input[q][i]).sum();
                        assert_eq!(b[r][i], node, "{ranks:?} node sum at rank {r} [{i}]");
                    }
                }
                run_group(OpKind::AllReduce, Group::Replica, &t, &mut b, &shard, false);
                let mut covered = vec![0; len];
                for r in 0..t.world() {
                    for i in shard(r) {
                        assert_eq!(b[r][i], sum(i), "{ranks:?} len {len} rank {r} [{i}]");
                        covered[i] += 1;
                    }
                }
                // Every element is owned once per node.
                assert!(
                    covered.iter().all(|&c| c == t.num_nodes()),
                    "{ranks:?} {len}"
                );
                on_node(OpKind::AllGather, &mut b);
                for r in 0..t.world() {
                    assert!(
                        (0..len).all(|i| b[r][i] == sum(i)),
                        "{ranks:?} {len} rank {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_mean_divides_by_the_size_of_the_calls_group() {
        let t = table(&[2, 3]);
        let input: Vec<Vec<f64>> = (0..5).map(|r| vec![r as f64 * 6.0; 30]).collect();
        let mut b = input.clone();
        run(Program::of(OpKind::AllReduce).unwrap(), &t, &mut b, 0, true);
        assert!(b.iter().flatten().all(|&x| x == 12.0), "{b:?}");
        // Node 0 holds ranks 0-1, node 1 ranks 2-4.
        let mut b = input.clone();
        run_group(OpKind::AllReduce, Group::Node, &t, &mut b, &|_| 0..30, true);
        for (r, w) in [3.0, 3.0, 18.0, 18.0, 18.0].iter().enumerate() {
            assert!(b[r].iter().all(|x| x == w), "rank {r}: {:?}", b[r]);
        }
        // Replicas: ranks 0 and 2 (local 0), ranks 1 and 3 (local 1); rank 4 has none.
        let mut b = input.clone();
        run_group(
            OpKind::AllReduce,
            Group::Replica,
            &t,
            &mut b,
            &|_| 0..30,
            true,
        );
        for (r, w) in [6.0, 12.0, 6.0, 12.0, 24.0].iter().enumerate() {
            assert!(b[r].iter().all(|x| x == w), "rank {r}: {:?}", b[r]);
        }
    }

    #[test]
    fn p2p_is_not_a_program() {
        assert_eq!(Program::of(OpKind::P2p), None);
        assert!(KINDS.iter().all(|&k| Program::of(k).is_some()));
    }
}
