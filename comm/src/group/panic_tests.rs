//! Ranks that end abnormally, 2 nodes x 2 ranks in one process:
//! - a communication thread that panics between barriers (an injected panic after the first
//!   barrier of a collective, while the other local ranks use its buffer): the buffer is
//!   leaked, not freed (36 MB: a free would unmap it under the peers);
//! - a rank thread that panics, or returns early and drops its process group.
//!
//! Every other rank of every node fails within 5 s naming what happened.

use crate::{Node, NodeConfig, ProcessGroup, ReduceOp, tls::Token};
use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

/// Each rank's outcome: (rank, when it ended, its error or "no error").
type Outcome = (usize, Instant, String);

/// Runs `rank` on every rank of a 2x2 job (`tune` applies to node 0's configuration).
fn two_by_two(
    tune: impl Fn(&mut NodeConfig) + Send + Clone + 'static,
    rank: impl Fn(ProcessGroup) -> Outcome + Send + Sync + Clone + 'static,
) -> Vec<Outcome> {
    let dir = std::env::temp_dir().join(format!(
        "wiretrain-ranks-{}-{:x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let addr_file = dir.join("addr");
    let token = Token::generate();
    let mut nodes = Vec::new();
    for i in 0..2usize {
        let (addr_file, token) = (addr_file.clone(), token.clone());
        let (tune, rank) = (tune.clone(), rank.clone());
        nodes.push(thread::spawn(move || {
            let master: SocketAddr = if i == 0 {
                "127.0.0.1:0".parse().unwrap()
            } else {
                let t0 = Instant::now();
                loop {
                    if let Ok(s) = std::fs::read_to_string(&addr_file) {
                        break s.trim().parse().unwrap();
                    }
                    assert!(t0.elapsed() < Duration::from_secs(10));
                    thread::sleep(Duration::from_millis(10));
                }
            };
            let mut cfg = NodeConfig::new(2, Some(i), master, 2, token).unwrap();
            cfg.rendezvous_timeout(Duration::from_secs(20))
                .collective_timeout(Duration::from_secs(60));
            if i == 0 {
                cfg.addr_file(addr_file);
                tune(&mut cfg);
            } else {
                cfg.bind("127.0.0.2:0".parse().unwrap());
            }
            let mut node = Node::join(cfg).unwrap();
            let ranks: Vec<_> = node
                .take_groups()
                .into_iter()
                .map(|pg| {
                    let rank = rank.clone();
                    thread::spawn(move || rank(pg))
                })
                .collect();
            let out: Vec<Outcome> = ranks
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| (1, Instant::now(), "panicked".into()))
                })
                .collect();
            drop(node);
            out
        }));
    }
    let mut all: Vec<Outcome> = nodes.into_iter().flat_map(|n| n.join().unwrap()).collect();
    all.sort_by_key(|x| x.0);
    let _ = std::fs::remove_dir_all(&dir);
    all
}

/// `steps` all-reduces of `len` elements; the first error ends the rank.
fn reduce(pg: &mut ProcessGroup, steps: usize, len: usize) -> Outcome {
    for _ in 0..steps {
        if let Err(e) = pg.all_reduce(vec![1.0; len], ReduceOp::Sum).wait() {
            return (pg.rank(), Instant::now(), crate::error::report(&e));
        }
    }
    (pg.rank(), Instant::now(), "no error".to_string())
}

/// Every rank but `except` failed naming `what`, within 5 s of the first outcome (the injected
/// fault's rank), and all well before the 60 s collective timeout counted from `start` (the
/// test's start: rendezvous and the three collectives before the fault take about a second).
fn all_fail_naming(start: Instant, all: &[Outcome], except: Option<usize>, what: &[&str]) {
    assert_eq!(all.len(), 4);
    let first = all.iter().map(|x| x.1).min().unwrap();
    for (rank, at, err) in all.iter().filter(|x| Some(x.0) != except) {
        assert!(what.iter().all(|w| err.contains(w)), "rank {rank}: {err}");
        let after = at.duration_since(first);
        assert!(
            after < Duration::from_secs(5),
            "rank {rank} after {after:?}: {err}"
        );
        let since_start = at.duration_since(start);
        assert!(
            since_start < Duration::from_secs(20),
            "rank {rank} failed {since_start:?} into the test: {err}"
        );
    }
}

#[test]
fn a_panic_between_barriers_fails_every_rank_of_every_node_naming_it() {
    // Global rank 1 (node 0, local rank 1) panics in its third collective.
    let start = Instant::now();
    let all = two_by_two(
        |cfg| cfg.test_panic_at = Some((1, 3)),
        |mut pg| reduce(&mut pg, 6, 9_000_000),
    );
    all_fail_naming(
        start,
        &all,
        None,
        &["local rank 1 panicked", "injected panic"],
    );
}

#[test]
fn a_rank_thread_that_panics_fails_every_rank_naming_it() {
    crate::abort::note_panics();
    let start = Instant::now();
    let all = two_by_two(
        |_| {},
        |mut pg| {
            if pg.rank() == 1 {
                let _ = reduce(&mut pg, 3, 1000);
                panic!("boom at step 3");
            }
            reduce(&mut pg, 6, 1000)
        },
    );
    all_fail_naming(start, &all, Some(1), &["boom at step 3"]);
}

#[test]
fn a_rank_that_returns_early_fails_the_others_at_once() {
    let start = Instant::now();
    let all = two_by_two(
        |_| {},
        |mut pg| {
            if pg.rank() == 1 {
                let r = reduce(&mut pg, 3, 1000);
                return (r.0, r.1, "left".into());
            }
            reduce(&mut pg, 6, 1000)
        },
    );
    all_fail_naming(
        start,
        &all,
        Some(1),
        &["rank 1", "left the job after its collective #3"],
    );
}
