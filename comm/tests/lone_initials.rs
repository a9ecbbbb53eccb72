//! Lone QUIC Initials from anyone (no token is needed to send one) while the node mesh forms:
//! each starts a handshake that never completes. Node 1 is flooded before node 2 dials it; the
//! job must still form within the rendezvous timeout and reduce correctly (incoming
//! connections are handled concurrently, each with its own handshake bound).

mod common;

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use wiretrain_comm::tls::{JobIdentity, SERVER_NAME, Token};
use wiretrain_comm::{Node, NodeConfig, ReduceOp};

/// The first datagram a QUIC client sends (its Initial, with a ClientHello), captured on a
/// plain UDP socket: replayed from other sockets, each copy opens a handshake nobody finishes.
fn captured_initial() -> Vec<u8> {
    let sink = UdpSocket::bind("127.0.0.9:0").unwrap();
    sink.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let to = sink.local_addr().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let identity = JobIdentity::from_token(&Token::generate()).unwrap();
    let cc = quinn::ClientConfig::new(Arc::new(
        identity.client_config(Arc::default(), None).unwrap(),
    ));
    let _client = rt.block_on(async {
        let ep = quinn::Endpoint::client("127.0.0.9:0".parse().unwrap()).unwrap();
        let connecting = ep.connect_with(cc, to, SERVER_NAME).unwrap();
        // Let the endpoint's driver put the Initial on the wire.
        tokio::time::sleep(Duration::from_millis(200)).await;
        (ep, connecting)
    });
    let mut buf = vec![0u8; 65_536];
    let (n, _) = sink.recv_from(&mut buf).expect("the client's Initial");
    buf.truncate(n);
    assert!(n >= 1200, "an Initial is padded to 1200 bytes, got {n}");
    buf
}

fn free_port(ip: &str) -> SocketAddr {
    UdpSocket::bind(format!("{ip}:0"))
        .unwrap()
        .local_addr()
        .unwrap()
}

#[test]
fn lone_initials_during_mesh_formation_do_not_stall_the_job() {
    let initial = captured_initial();
    let node1 = free_port("127.0.0.2");
    let dir = std::env::temp_dir().join(format!("wiretrain-lone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let addr_file = dir.join("addr");
    let _ = std::fs::remove_file(&addr_file);
    let token = "lone-initials";
    let spawn = |i: usize, master: SocketAddr, af: Option<std::path::PathBuf>| {
        thread::spawn(move || -> Result<f32, String> {
            let mut cfg = NodeConfig::new(3, Some(i), master, 1, common::strong(token))
                .map_err(|e| e.to_string())?;
            cfg.rendezvous_timeout(Duration::from_secs(8))
                .collective_timeout(Duration::from_secs(20));
            match (i, af) {
                (0, Some(af)) => {
                    cfg.addr_file(af);
                }
                (1, _) => {
                    cfg.bind(node1);
                }
                _ => {
                    cfg.bind("127.0.0.3:0".parse().unwrap());
                }
            }
            let mut node = Node::join(cfg).map_err(|e| e.to_string())?;
            let mut pg = node.take_groups().pop().unwrap();
            let v = pg
                .all_reduce(vec![pg.rank() as f32 + 1.0; 1000], ReduceOp::Sum)
                .wait()
                .map_err(|e| e.to_string())?;
            drop(pg);
            node.shutdown().map_err(|e| e.to_string())?;
            Ok(v[999])
        })
    };
    let t0 = Instant::now();
    let n0 = spawn(0, "127.0.0.1:0".parse().unwrap(), Some(addr_file.clone()));
    let master = common::node0_addr(&addr_file);
    let n1 = spawn(1, master, None);
    // Flood node 1 with lone Initials from 40 sockets before node 2 exists; keep the sockets
    // open (the server's answers land there and are never answered).
    let probe = Instant::now();
    while UdpSocket::bind(node1).is_ok() {
        assert!(
            probe.elapsed() < Duration::from_secs(10),
            "node 1 never bound"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let flood: Vec<UdpSocket> = (0..40)
        .map(|_| {
            let s = UdpSocket::bind("127.0.0.9:0").unwrap();
            s.send_to(&initial, node1).unwrap();
            s
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    let n2 = spawn(2, master, None);
    let results: Vec<Result<f32, String>> = [n0, n1, n2]
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let took = t0.elapsed();
    drop(flood);
    let _ = std::fs::remove_dir_all(&dir);
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r.as_ref(), Ok(&6.0), "node {i} after {took:?}: {r:?}");
    }
    assert!(took < Duration::from_secs(8), "formed in {took:?}");
}
