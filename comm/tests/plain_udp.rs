//! The plain UDP fallback (used where a UDP stack refuses quinn-udp's socket options, as
//! Wine's does): forced with WIRETRAIN_PLAIN_UDP=1, QUIC between nodes still carries every
//! collective correctly, 1 MiB frames and 8 MiB buffers included.

mod common;

use common::cluster;
use wiretrain_comm::ReduceOp;

#[test]
fn collectives_run_over_the_plain_udp_socket() {
    // SAFETY: this test binary holds this one test, and no other thread runs yet.
    unsafe { std::env::set_var("WIRETRAIN_PLAIN_UDP", "1") };
    let len = 2 << 20; // 8 MiB of f32: many frames, many datagrams
    let res = cluster(&[1, 2], "plain-udp-token", move |mut pg| {
        let r = pg.rank() as f32;
        let v: Vec<f32> = (0..len).map(|i| r + (i % 5) as f32).collect();
        let sum = pg
            .all_reduce(v, ReduceOp::Sum)
            .wait()
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(sum)
    });
    // Both nodes' endpoints took the fallback.
    assert_eq!(wiretrain_comm::transport::plain_udp::sockets_made(), 2);
    let world = 3.0f32;
    for node in res {
        for rank in node.expect("node") {
            let sum = rank.expect("rank");
            for (i, x) in sum.iter().enumerate() {
                assert_eq!(*x, 3.0 + world * (i % 5) as f32, "element {i}");
            }
        }
    }
}
