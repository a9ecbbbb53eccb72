//! A token holder that grants no stream credit (its QUIC flow-control windows are 0), in each
//! phase of forming a job: the coordinator's Welcome to it, a joiner's hello to a coordinator
//! that grants none, refusals, and a mesh peer's PeerHello. Every side must end by its deadline
//! with an error naming the node it waited for, not wait forever.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};
use wiretrain_comm::{Node, NodeConfig};

/// Starts node 0 of a 2-node job with token `name` on a thread of its own, running `run` on
/// its configuration (which writes the address file); returns its address and the temporary
/// directory to remove.
fn coordinator(
    name: &'static str,
    run: impl FnOnce(NodeConfig) + Send + 'static,
) -> (SocketAddr, PathBuf) {
    let dir = std::env::temp_dir().join(format!("wiretrain-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let addr_file = dir.join("addr");
    let _ = std::fs::remove_file(&addr_file);
    let af = addr_file.clone();
    thread::spawn(move || {
        let mut cfg = NodeConfig::new(
            2,
            Some(0),
            "127.0.0.1:0".parse().unwrap(),
            1,
            common::strong(name),
        )
        .unwrap();
        cfg.addr_file(af);
        run(cfg);
    });
    (common::node0_addr(&addr_file), dir)
}

#[test]
fn a_peer_granting_no_stream_credit_fails_rendezvous_by_its_deadline() {
    let (tx, rx) = mpsc::channel();
    let t0 = Instant::now();
    let (master, dir) = coordinator("credit", move |mut cfg| {
        cfg.rendezvous_timeout(Duration::from_secs(3));
        let _ = tx.send(Node::join(cfg).map(|_| ()).map_err(|e| e.to_string()));
    });
    // The rogue: a member of the job (it holds the token) whose windows are zero.
    let rogue = thread::spawn(move || {
        let mut cfg = NodeConfig::new(2, Some(1), master, 1, common::strong("credit")).unwrap();
        // It would wait 45 s for its Welcome: the coordinator must not wait with it.
        cfg.bind("127.0.0.2:0".parse().unwrap())
            .rendezvous_timeout(Duration::from_secs(20));
        cfg.quic().stream_window(0).conn_window(0);
        Node::join(cfg).map(|_| ()).map_err(|e| e.to_string())
    });
    let coordinator = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the coordinator ended rendezvous by its deadline");
    let took = t0.elapsed();
    let err = coordinator.expect_err("the rogue cannot be welcomed");
    assert!(err.contains("node 1") && err.contains("stalled"), "{err}");
    assert!(took < Duration::from_secs(15), "{took:?}: {err}");
    // The rogue gives up too (its own deadline), naming the coordinator.
    let r = rogue.join().unwrap();
    assert!(r.is_err(), "{r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Refusals run side by side: five token holders with zero windows and the wrong node count
/// (each refusal can only time out, 2.5 s) do not hold up the real node behind them.
#[test]
fn refusals_that_stall_do_not_delay_the_real_node() {
    let (tx, rx) = mpsc::channel();
    let (master, dir) = coordinator("refusals", move |mut cfg| {
        cfg.rendezvous_timeout(Duration::from_secs(30));
        let r = Node::join(cfg).map_err(|e| e.to_string());
        let _ = tx.send((Instant::now(), r.as_ref().map(|_| ()).map_err(Clone::clone)));
        if let Ok(node) = r {
            let _ = node.shutdown();
        }
    });
    let rogues: Vec<_> = (0..5)
        .map(|i| {
            thread::spawn(move || {
                // Told 3 nodes where the job has 2: refused, and the refusal cannot be written.
                let mut cfg =
                    NodeConfig::new(3, None, master, 1, common::strong("refusals")).unwrap();
                cfg.bind(format!("127.0.0.{}:0", 10 + i).parse().unwrap())
                    .rendezvous_timeout(Duration::from_secs(3));
                cfg.quic().stream_window(0).conn_window(0);
                Node::join(cfg).map(|_| ()).map_err(|e| e.to_string())
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(500));
    let t_real = Instant::now();
    let real = thread::spawn(move || {
        let mut cfg = NodeConfig::new(2, Some(1), master, 1, common::strong("refusals")).unwrap();
        cfg.bind("127.0.0.2:0".parse().unwrap())
            .rendezvous_timeout(Duration::from_secs(30));
        Node::join(cfg).map(|n| {
            let _ = n.shutdown();
        })
    });
    let (joined_at, coordinator) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("coordinator");
    coordinator.expect("the job forms");
    real.join().unwrap().expect("the real node joins");
    let took = joined_at.duration_since(t_real);
    assert!(
        took < Duration::from_secs(4),
        "the real node waited {took:?} behind refusals"
    );
    for r in rogues {
        assert!(r.join().unwrap().is_err());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The other way round: a coordinator (a token holder) that grants no stream credit. The
/// joiner's hello can never be written; the joiner fails by its own deadline, saying so.
#[test]
fn a_coordinator_granting_no_stream_credit_fails_the_joiner_by_its_deadline() {
    let (master, dir) = coordinator("credit0", |mut cfg| {
        // It would wait 30 s for the joiner: the joiner must not wait with it.
        cfg.rendezvous_timeout(Duration::from_secs(30));
        cfg.quic().stream_window(0).conn_window(0);
        let _ = Node::join(cfg);
    });
    let t0 = Instant::now();
    let mut cfg = NodeConfig::new(2, Some(1), master, 1, common::strong("credit0")).unwrap();
    cfg.bind("127.0.0.2:0".parse().unwrap())
        .rendezvous_timeout(Duration::from_secs(3));
    let err = Node::join(cfg)
        .map(|_| ())
        .expect_err("the hello cannot be written");
    let err = wiretrain_comm::error::report(&err);
    let took = t0.elapsed();
    assert!(err.contains("hello") && err.contains("stalled"), "{err}");
    assert!(took < Duration::from_secs(10), "{took:?}: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The mesh phase: in a 3-node job, node 1 (a token holder) grants no stream credit on the
/// connections it accepts, so node 2's PeerHello to it can never be written. Rendezvous with
/// the coordinator goes through (node 1 dials it); node 2 must then fail by its deadline
/// naming node 1, not wait forever.
#[test]
fn a_mesh_peer_granting_no_stream_credit_fails_the_mesh_by_its_deadline() {
    let dir = std::env::temp_dir().join(format!("wiretrain-mesh-credit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let addr_file = dir.join("addr");
    let _ = std::fs::remove_file(&addr_file);
    let af = addr_file.clone();
    let token = || common::strong("mesh-credit");
    let node0 = thread::spawn(move || {
        let mut cfg =
            NodeConfig::new(3, Some(0), "127.0.0.1:0".parse().unwrap(), 1, token()).unwrap();
        cfg.addr_file(af)
            .rendezvous_timeout(Duration::from_secs(20));
        Node::join(cfg).map(|_| ()).map_err(|e| e.to_string())
    });
    let master = common::node0_addr(&addr_file);
    let rogue = thread::spawn(move || {
        let mut cfg = NodeConfig::new(3, Some(1), master, 1, token()).unwrap();
        cfg.bind("127.0.0.2:0".parse().unwrap())
            .rendezvous_timeout(Duration::from_secs(8));
        cfg.quic().accepted_windows(0, 0);
        Node::join(cfg).map(|_| ()).map_err(|e| e.to_string())
    });
    let t0 = Instant::now();
    let mut cfg = NodeConfig::new(3, Some(2), master, 1, token()).unwrap();
    cfg.bind("127.0.0.3:0".parse().unwrap())
        .rendezvous_timeout(Duration::from_secs(4));
    let err = Node::join(cfg)
        .map(|_| ())
        .expect_err("node 2's PeerHello cannot be written");
    let err = wiretrain_comm::error::report(&err);
    let took = t0.elapsed();
    eprintln!("node 2 gave up after {took:?}: {err}");
    assert!(err.contains("node 1") && err.contains("stalled"), "{err}");
    assert!(took < Duration::from_secs(12), "{took:?}: {err}");
    // The others give up by their own deadlines (node 1 waits for node 2, which left).
    assert!(rogue.join().unwrap().is_err());
    let _ = node0.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The goodbye phase: node 1 stays alive but never says goodbye (it never calls shutdown).
/// Node 0's shutdown is bounded by the collective timeout (its goodbye deadline) and names
/// node 1, instead of waiting for it.
#[test]
fn a_peer_that_never_says_goodbye_bounds_shutdown() {
    let (tx, rx) = mpsc::channel();
    let (master, dir) = coordinator("goodbye", move |mut cfg| {
        cfg.rendezvous_timeout(Duration::from_secs(10))
            .collective_timeout(Duration::from_secs(2));
        let node = Node::join(cfg).expect("the job forms");
        let t0 = Instant::now();
        let r = node
            .shutdown()
            .map_err(|e| wiretrain_comm::error::report(&e));
        let _ = tx.send((t0.elapsed(), r));
    });
    let silent = thread::spawn(move || {
        let mut cfg = NodeConfig::new(2, Some(1), master, 1, common::strong("goodbye")).unwrap();
        cfg.bind("127.0.0.2:0".parse().unwrap())
            .rendezvous_timeout(Duration::from_secs(10));
        let node = Node::join(cfg).expect("joins");
        // Alive, connected, silent: no goodbye until long after node 0's deadline.
        thread::sleep(Duration::from_secs(8));
        drop(node);
    });
    let (took, r) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("node 0 shut down");
    let e = r.expect_err("node 1 said no goodbye");
    assert!(
        e.contains("node 1") && e.contains("no goodbye within 2s"),
        "{e}"
    );
    assert!(took < Duration::from_secs(6), "shutdown took {took:?}: {e}");
    silent.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
