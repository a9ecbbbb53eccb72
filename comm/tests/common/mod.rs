//! Test helper: several nodes of one job inside one test process (real QUIC sockets on
//! loopback between them, real shared buffers inside each).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::thread;
use std::time::Duration;
use wiretrain_comm::{Error, LinkStats, Node, NodeConfig, ProcessGroup};

/// Starts `shape.len()` nodes (node i hosts shape[i] ranks) and runs `f` on every rank.
pub fn cluster<T: Send + 'static>(
    shape: &[usize],
    token: &str,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<Result<Vec<T>, Error>> {
    cluster_tuned(shape, token, |_| {}, f)
        .into_iter()
        .map(|n| n.map(|(out, _)| out))
        .collect()
}

/// One node's outcome: every rank's result and the node's link counters.
pub type NodeOutcome<T> = Result<(Vec<T>, Vec<LinkStats>), Error>;

/// As [`cluster`], with `tune` applied to every node's configuration; also returns each node's
/// link counters (one row per peer node) taken after its ranks finished.
pub fn cluster_tuned<T: Send + 'static>(
    shape: &[usize],
    token: &str,
    tune: impl Fn(&mut NodeConfig) + Send + Sync + Clone + 'static,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<NodeOutcome<T>> {
    cluster_with(shape, token, tune, f, Node::link_stats)
}

/// As [`cluster_tuned`], with one row of counters per connection ([`Node::connection_stats`]).
pub fn cluster_each<T: Send + 'static>(
    shape: &[usize],
    token: &str,
    tune: impl Fn(&mut NodeConfig) + Send + Sync + Clone + 'static,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<NodeOutcome<T>> {
    cluster_with(shape, token, tune, f, Node::connection_stats)
}

fn cluster_with<T: Send + 'static>(
    shape: &[usize],
    token: &str,
    tune: impl Fn(&mut NodeConfig) + Send + Sync + Clone + 'static,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
    stats: fn(&Node) -> Vec<LinkStats>,
) -> Vec<NodeOutcome<T>> {
    let dir = tempdir();
    let addr_file = dir.join("addr");
    let nn = shape.len();
    let mut handles = Vec::new();
    for (i, &k) in shape.iter().enumerate() {
        let f = f.clone();
        let tune = tune.clone();
        let addr_file = addr_file.clone();
        let token = token.to_string();
        handles.push(thread::spawn(
            move || -> Result<(Vec<T>, Vec<LinkStats>), Error> {
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
                let mut cfg = NodeConfig::new(nn, Some(i), master, k, strong(&token))?;
                cfg.rendezvous_timeout(Duration::from_secs(20))
                    .collective_timeout(Duration::from_secs(60));
                tune(&mut cfg);
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
                let stats = stats(&node);
                node.shutdown()?;
                Ok((out, stats))
            },
        ));
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

/// A token strong enough for `NodeConfig::new`, derived from a test's short name (the same
/// name gives the same token, different names different ones).
pub fn strong(name: &str) -> wiretrain_comm::tls::Token {
    format!("{name}-0123456789abcdef0123456789abcdef").into()
}

/// Node 0's address, once it has written it to `addr_file` (within 10 s).
pub fn node0_addr(addr_file: &std::path::Path) -> SocketAddr {
    let t0 = std::time::Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(addr_file) {
            return s.trim().parse().unwrap();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "node 0 never listened"
        );
        thread::sleep(Duration::from_millis(10));
    }
}
