//! A communication thread that panics between barriers (an injected panic after the first
//! barrier of a collective, while the other local ranks use its buffer): the buffer is leaked,
//! not freed, and every rank of every node fails within 5 s naming the panic.

use crate::{Node, NodeConfig, ReduceOp, tls::Token};
use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

#[test]
fn a_panic_between_barriers_fails_every_rank_of_every_node_naming_it() {
    let dir = std::env::temp_dir().join(format!("wiretrain-panic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let addr_file = dir.join("addr");
    let _ = std::fs::remove_file(&addr_file);
    let token = Token::generate();
    let mut nodes = Vec::new();
    for i in 0..2usize {
        let (addr_file, token) = (addr_file.clone(), token.clone());
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
                // Global rank 1 (node 0, local rank 1) panics in its third collective.
                cfg.test_panic_at = Some((1, 3));
            } else {
                cfg.bind("127.0.0.2:0".parse().unwrap());
            }
            let mut node = Node::join(cfg).unwrap();
            let ranks: Vec<_> = node
                .take_groups()
                .into_iter()
                .map(|mut pg| {
                    thread::spawn(move || {
                        for _ in 0..6 {
                            if let Err(e) = pg.all_reduce(vec![1.0; 100_000], ReduceOp::Sum).wait()
                            {
                                return (pg.rank(), Instant::now(), crate::error::report(&e));
                            }
                        }
                        (pg.rank(), Instant::now(), "no error".to_string())
                    })
                })
                .collect();
            let out: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            drop(node);
            out
        }));
    }
    let mut all: Vec<(usize, Instant, String)> =
        nodes.into_iter().flat_map(|n| n.join().unwrap()).collect();
    all.sort_by_key(|x| x.0);
    let first = all.iter().map(|x| x.1).min().unwrap();
    for (rank, at, err) in &all {
        assert!(
            err.contains("local rank 1 panicked") && err.contains("injected panic"),
            "rank {rank}: {err}"
        );
        assert!(
            at.duration_since(first) < Duration::from_secs(5),
            "rank {rank} failed {:?} after the first: {err}",
            at.duration_since(first)
        );
    }
    assert_eq!(all.len(), 4);
    let _ = std::fs::remove_dir_all(&dir);
}
