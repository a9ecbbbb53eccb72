//! Collectives across nodes joined in one test process (real QUIC sockets on loopback, real
//! shared buffers): fast coverage of every op and shape. The multi-process tests in the
//! top-level tests/ run the same checks between real processes.

use std::net::SocketAddr;
use std::thread;
use std::time::Duration;
use wiretrain_comm::bench::{BenchOp, BenchSpec, run_rank};
use wiretrain_comm::{Error, Node, NodeConfig, ProcessGroup, ReduceOp};

/// Starts `shape.len()` nodes (node i hosts shape[i] ranks) and runs `f` on every rank.
pub fn cluster<T: Send + 'static>(
    shape: &[usize],
    token: &str,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<Result<Vec<T>, Error>> {
    let dir = tempdir();
    let addr_file = dir.join("addr");
    let nn = shape.len();
    let mut handles = Vec::new();
    for (i, &k) in shape.iter().enumerate() {
        let f = f.clone();
        let addr_file = addr_file.clone();
        let token = token.to_string();
        handles.push(thread::spawn(move || -> Result<Vec<T>, Error> {
            let master: SocketAddr = if i == 0 {
                "127.0.0.1:0".parse().unwrap()
            } else {
                let mut waited = 0;
                loop {
                    if let Ok(s) = std::fs::read_to_string(&addr_file) {
                        break s.trim().parse().unwrap();
                    }
                    thread::sleep(Duration::from_millis(20));
                    waited += 1;
                    assert!(waited < 500, "node 0 never wrote its address");
                }
            };
            let mut cfg = NodeConfig::new(nn, Some(i), master, k, token.into())?;
            cfg.rendezvous_timeout(Duration::from_secs(20))
                .collective_timeout(Duration::from_secs(60));
            if i == 0 {
                cfg.addr_file(addr_file.clone());
            } else {
                cfg.bind(format!("127.0.0.{}:0", i + 1).parse().unwrap());
            }
            let mut node = Node::join(cfg)?;
            let groups = node.take_groups();
            let hs: Vec<_> = groups
                .into_iter()
                .map(|pg| {
                    let f = f.clone();
                    thread::spawn(move || f(pg))
                })
                .collect();
            let out = hs.into_iter().map(|h| h.join().unwrap()).collect();
            node.shutdown()?;
            Ok(out)
        }));
    }
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "wiretrain-test-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
}

fn check_shape(shape: &[usize], sizes: &[usize], iters: usize) {
    let spec = BenchSpec {
        ops: vec![
            BenchOp::AllReduce,
            BenchOp::ReduceScatter,
            BenchOp::AllGather,
            BenchOp::Broadcast,
        ],
        sizes: sizes.to_vec(),
        iters,
        warmup: 0,
        check: true,
        reduce: ReduceOp::Sum,
    };
    for reduce in [ReduceOp::Sum, ReduceOp::Mean] {
        let mut spec = spec.clone();
        spec.reduce = reduce;
        let res = cluster(shape, "test-token", move |mut pg| {
            run_rank(&mut pg, &spec, |_| {}).map_err(|e| e.to_string())
        });
        for node in res {
            for rank in node.expect("node failed") {
                let rows = rank.expect("rank failed");
                assert_eq!(rows.len(), 4 * sizes.len());
                for r in rows {
                    assert_eq!(
                        r.wrong, 0,
                        "{shape:?} {reduce:?} {} {} bytes",
                        r.op, r.bytes
                    );
                }
            }
        }
    }
}

#[test]
fn single_node_four_ranks() {
    check_shape(&[4], &[0, 4, 28, 4 * 1_000_003], 3);
}

#[test]
fn two_nodes_two_ranks() {
    check_shape(&[2, 2], &[0, 4, 28, 4 * 100_003], 3);
}

#[test]
fn uneven_nodes() {
    check_shape(&[1, 3, 2], &[0, 4, 28, 4000], 3);
}

#[test]
fn many_back_to_back_mixed_collectives() {
    let res = cluster(&[2, 1], "tok", |mut pg| -> Result<(), String> {
        let world = pg.world() as f32;
        for i in 0..1000usize {
            let len = [1usize, 7, 64, 1000, 3][i % 5];
            let w = pg.all_reduce(vec![pg.rank() as f32 + i as f32; len], ReduceOp::Sum);
            let out = w.wait().map_err(|e| e.to_string())?;
            let want = (0..pg.world()).map(|r| r as f32 + i as f32).sum::<f32>();
            if out.iter().any(|&x| x != want) {
                return Err(format!("iteration {i}: got {:?} want {want}", &out[..1]));
            }
            if i % 100 == 0 {
                let g = pg.all_gather(vec![i as f32; pg.shard_range(pg.world()).len()], pg.world());
                let g = g.wait().map_err(|e| e.to_string())?;
                assert_eq!(g.len(), world as usize);
            }
        }
        Ok(())
    });
    for n in res {
        for r in n.unwrap() {
            r.unwrap();
        }
    }
}

#[test]
fn overlapping_submissions_complete_in_order() {
    let res = cluster(&[2, 2], "tok", |mut pg| -> Result<(), String> {
        let works: Vec<_> = (0..20)
            .map(|i| pg.all_reduce(vec![i as f32; 5000], ReduceOp::Mean))
            .collect();
        for (i, w) in works.into_iter().enumerate() {
            let v = w.wait().map_err(|e| e.to_string())?;
            if v.iter().any(|&x| x != i as f32) {
                return Err(format!("op {i} mixed"));
            }
        }
        Ok(())
    });
    for n in res {
        for r in n.unwrap() {
            r.unwrap();
        }
    }
}

#[test]
fn invalid_calls_are_errors_not_panics() {
    let res = cluster(&[2], "tok", |mut pg| {
        let e1 = pg.broadcast(vec![1.0], 5).wait().unwrap_err().to_string();
        let e2 = pg
            .all_gather(vec![1.0, 2.0], 1)
            .wait()
            .unwrap_err()
            .to_string();
        // Rejected calls take no sequence number: the group keeps working.
        let ok = pg.all_reduce(vec![1.0; 3], ReduceOp::Sum).wait().unwrap();
        assert_eq!(ok, vec![2.0; 3]);
        (e1, e2)
    });
    let (e1, e2) = &res.into_iter().next().unwrap().unwrap()[0];
    assert!(e1.contains("root 5"), "{e1}");
    assert!(e2.contains("shard has 2 elements"), "{e2}");
}
