//! Ring and chain schedules over `n` positions. Position `p` holds `n` pieces; a step sends
//! one piece to position `p + 1` and receives one from position `p - 1`.
//!
//! * reduce-scatter: after `n - 1` steps, position p holds the full sum of piece p.
//! * all-gather: position p starts with piece p and ends with all of them.
//! * all-reduce = reduce-scatter then all-gather: each position sends `2(n-1)/n` of the
//!   buffer, the bandwidth optimum.
//! * broadcast: a chain from the root along the ring, pipelined frame by frame.

/// What a received piece does to the local buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvMode {
    /// Add into the local piece.
    Reduce,
    /// Overwrite the local piece.
    Copy,
}

/// One ring step: send piece `send` to the next position, receive piece `recv` from the
/// previous one. A step's send of a piece never overlaps its receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingStep {
    /// The index of the piece sent to the next position.
    pub send: usize,
    /// The index of the piece received from the previous position.
    pub recv: usize,
    /// Whether the received piece is added or copied in.
    pub mode: RecvMode,
}

fn wrap(x: isize, n: usize) -> usize {
    x.rem_euclid(n as isize) as usize
}

/// Reduce-scatter schedule for position `pos` of `n`; ends with piece `pos` fully reduced.
pub fn reduce_scatter(pos: usize, n: usize) -> Vec<RingStep> {
    let p = pos as isize;
    (0..n.saturating_sub(1) as isize)
        .map(|s| RingStep {
            send: wrap(p - s - 1, n),
            recv: wrap(p - s - 2, n),
            mode: RecvMode::Reduce,
        })
        .collect()
}

/// All-gather schedule for position `pos` of `n`; starts from piece `pos`.
pub fn all_gather(pos: usize, n: usize) -> Vec<RingStep> {
    let p = pos as isize;
    (0..n.saturating_sub(1) as isize)
        .map(|s| RingStep {
            send: wrap(p - s, n),
            recv: wrap(p - s - 1, n),
            mode: RecvMode::Copy,
        })
        .collect()
}

/// All-reduce: reduce-scatter followed by all-gather.
pub fn all_reduce(pos: usize, n: usize) -> Vec<RingStep> {
    let mut s = reduce_scatter(pos, n);
    s.extend(all_gather(pos, n));
    s
}

/// The role of position `pos` in a chain broadcast from `root`: (receives, sends).
pub fn chain_role(pos: usize, root: usize, n: usize) -> (bool, bool) {
    let rel = wrap(pos as isize - root as isize, n);
    (rel != 0, rel + 1 != n)
}

#[cfg(test)]
mod tests {
    //! An in-memory cluster: n positions, FIFO links, and a seeded scheduler that runs any
    //! runnable position next, so every interleaving the real transports could produce is
    //! fair game. A deadlock or a wrong sum fails the test.
    use super::*;
    use std::collections::VecDeque;

    /// A tiny deterministic generator (xorshift) so the test needs no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    enum Action {
        Send(usize),
        Recv(usize, RecvMode),
    }

    /// Runs per-position action lists; `buf[p][piece]` is one value per piece.
    fn simulate(
        n: usize,
        mut buf: Vec<Vec<i64>>,
        plans: Vec<Vec<Action>>,
        seed: u64,
    ) -> Vec<Vec<i64>> {
        let mut links: Vec<VecDeque<i64>> = vec![VecDeque::new(); n]; // link into position p
        let mut pc = vec![0usize; n];
        let mut rng = Rng(seed | 1);
        loop {
            let runnable: Vec<usize> = (0..n)
                .filter(|&p| match plans[p].get(pc[p]) {
                    Some(Action::Send(_)) => true,
                    Some(Action::Recv(..)) => !links[p].is_empty(),
                    None => false,
                })
                .collect();
            if runnable.is_empty() {
                assert!((0..n).all(|p| pc[p] == plans[p].len()), "deadlock");
                assert!(links.iter().all(|l| l.is_empty()), "unconsumed messages");
                return buf;
            }
            let p = runnable[(rng.next() % runnable.len() as u64) as usize];
            match plans[p][pc[p]] {
                Action::Send(piece) => links[(p + 1) % n].push_back(buf[p][piece]),
                Action::Recv(piece, mode) => {
                    let v = links[p].pop_front().unwrap();
                    match mode {
                        RecvMode::Reduce => buf[p][piece] += v,
                        RecvMode::Copy => buf[p][piece] = v,
                    }
                }
            }
            pc[p] += 1;
        }
    }

    fn ring_actions(steps: &[RingStep]) -> Vec<Action> {
        steps
            .iter()
            .flat_map(|s| [Action::Send(s.send), Action::Recv(s.recv, s.mode)])
            .collect()
    }

    fn input(n: usize) -> Vec<Vec<i64>> {
        (0..n)
            .map(|p| (0..n).map(|c| (p * 100 + c * 7 + 1) as i64).collect())
            .collect()
    }

    #[test]
    fn reduce_scatter_leaves_own_piece_summed() {
        for n in 1..9 {
            for seed in 0..20 {
                let inp = input(n);
                let plans = (0..n)
                    .map(|p| ring_actions(&reduce_scatter(p, n)))
                    .collect();
                let out = simulate(n, inp.clone(), plans, seed);
                for p in 0..n {
                    let want: i64 = inp.iter().map(|b| b[p]).sum();
                    assert_eq!(out[p][p], want, "n={n} pos={p}");
                }
            }
        }
    }

    #[test]
    fn all_gather_spreads_every_piece() {
        for n in 1..9 {
            for seed in 0..20 {
                let inp: Vec<Vec<i64>> = (0..n)
                    .map(|p| {
                        (0..n)
                            .map(|c| if c == p { 1000 + c as i64 } else { -1 })
                            .collect()
                    })
                    .collect();
                let plans = (0..n).map(|p| ring_actions(&all_gather(p, n))).collect();
                let out = simulate(n, inp, plans, seed);
                for b in &out {
                    assert_eq!(*b, (0..n).map(|c| 1000 + c as i64).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn all_reduce_sums_everything_everywhere() {
        for n in 1..9 {
            for seed in 0..20 {
                let inp = input(n);
                let plans = (0..n).map(|p| ring_actions(&all_reduce(p, n))).collect();
                let out = simulate(n, inp.clone(), plans, seed);
                let want: Vec<i64> = (0..n).map(|c| inp.iter().map(|b| b[c]).sum()).collect();
                for b in &out {
                    assert_eq!(*b, want);
                }
            }
        }
    }

    #[test]
    fn sends_never_overlap_receives_and_volume_is_optimal() {
        for n in 2..9 {
            for p in 0..n {
                let s = all_reduce(p, n);
                assert_eq!(s.len(), 2 * (n - 1));
                assert!(s.iter().all(|st| st.send != st.recv));
            }
        }
    }

    #[test]
    fn chain_broadcast_reaches_everyone() {
        for n in 1..9 {
            for root in 0..n {
                for seed in 0..5 {
                    let inp: Vec<Vec<i64>> = (0..n)
                        .map(|p| vec![if p == root { 42 } else { 0 }])
                        .collect();
                    let plans = (0..n)
                        .map(|p| {
                            let (recv, send) = chain_role(p, root, n);
                            let mut a = vec![];
                            if recv {
                                a.push(Action::Recv(0, RecvMode::Copy));
                            }
                            if send && n > 1 {
                                a.push(Action::Send(0));
                            }
                            a
                        })
                        .collect();
                    let out = simulate(n, inp, plans, seed);
                    assert!(out.iter().all(|b| b[0] == 42));
                }
            }
        }
    }
}
