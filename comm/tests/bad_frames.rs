//! A peer that passed the handshake (it knows the token) but sends garbage or an oversized
//! frame: the receiving node closes that connection with a protocol error, the collective
//! fails with a message that says so, nothing panics and nothing large is allocated.

use std::thread;
use std::time::Duration;
use wiretrain_comm::tls::JobIdentity;
use wiretrain_comm::transport::quic;
use wiretrain_comm::wire::{FrameHeader, WireDtype};
use wiretrain_comm::{Node, NodeConfig, ReduceOp, rendezvous};

/// The job token of the honest node and the rogue peer (it passes the strength check).
const TOKEN: &str = "bad-frames-0123456789abcdef0123456789abcdef";

fn rogue_run(payload: Vec<u8>) -> (String, String) {
    let dir = std::env::temp_dir().join(format!(
        "wiretrain-rogue-{}-{}",
        std::process::id(),
        payload.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let addr_file = dir.join("addr");
    let _ = std::fs::remove_file(&addr_file);
    let af = addr_file.clone();
    let honest = thread::spawn(move || {
        let mut cfg =
            NodeConfig::new(2, Some(0), "127.0.0.1:0".parse().unwrap(), 1, TOKEN.into()).unwrap();
        cfg.addr_file(af)
            .rendezvous_timeout(Duration::from_secs(20))
            .collective_timeout(Duration::from_secs(20));
        let mut node = Node::join(cfg).expect("honest node joins");
        let mut pg = node.take_groups().pop().unwrap();
        let err = pg
            .all_reduce(vec![1.0; 1000], ReduceOp::Sum)
            .wait()
            .expect_err("must fail");
        wiretrain_comm::error::report(&err)
    });
    let master = loop {
        if let Ok(s) = std::fs::read_to_string(&addr_file) {
            break s.trim().parse().unwrap();
        }
        thread::sleep(Duration::from_millis(10));
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let closed = rt.block_on(async {
        let mut cfg = NodeConfig::new(2, Some(1), master, 1, TOKEN.into()).unwrap();
        cfg.bind("127.0.0.2:0".parse().unwrap())
            .rendezvous_timeout(Duration::from_secs(20));
        let identity = JobIdentity::from_token(&TOKEN.into()).unwrap();
        let ep = quic::endpoint("127.0.0.2:0".parse().unwrap(), &identity, cfg.quic()).unwrap();
        let (table, me, p0) = rendezvous::join(&ep, &identity, &cfg).await.unwrap();
        let mut peers = rendezvous::mesh(&ep, &identity, &cfg, &table, me, vec![p0])
            .await
            .unwrap();
        let mut lanes = rendezvous::open_lanes(&ep, &identity, &cfg, &table, me, &mut peers)
            .await
            .unwrap();
        let s = lanes.raw_send(0, 0).unwrap();
        s.write_all(&payload).await.unwrap();
        let conn = lanes.raw_conn(0, 0).unwrap().clone();
        let why = tokio::time::timeout(Duration::from_secs(20), conn.closed())
            .await
            .expect("node 0 closes the connection");
        quic::describe_conn_error(&why)
    });
    (honest.join().unwrap(), closed)
}

#[test]
fn garbage_frame_closes_the_connection() {
    let (err, closed) =
        rogue_run(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n and some more garbage".to_vec());
    assert!(
        err.contains("protocol violation") && err.contains("bad magic"),
        "{err}"
    );
    assert!(err.contains("node 1"), "{err}");
    assert!(closed.contains("protocol violation"), "{closed}");
}

#[test]
fn oversized_frame_is_rejected_before_allocation() {
    let mut h = FrameHeader {
        op: 1,
        group: 0,
        dtype: WireDtype::F32,
        seq: 1,
        step: 0,
        chunk: 0,
        len: 0,
    }
    .encode();
    h[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    let (err, closed) = rogue_run(h.to_vec());
    assert!(err.contains("exceeds the limit"), "{err}");
    assert!(closed.contains("protocol violation"), "{closed}");
}

#[test]
fn frame_from_another_collective_is_rejected() {
    // Well-formed, but for sequence number 7 where the receiver expects 1.
    let h = FrameHeader {
        op: 1,
        group: 0,
        dtype: WireDtype::F32,
        seq: 7,
        step: 0,
        chunk: 0,
        len: 2000,
    }
    .encode();
    let (err, _) = rogue_run(h.to_vec());
    assert!(
        err.contains("unexpected frame") && err.contains("seq 7"),
        "{err}"
    );
}
