//! Jumbo datagrams: with path-MTU discovery allowed up to 8952 bytes (the default) and 16000,
//! loopback (MTU 65536) settles above 1500, segment offload still batches them (each batch
//! within one UDP payload), and a 32 MiB all-reduce, repeated, is exact. Before batches were
//! capped, quinn's 10-datagram batches of 8952 bytes exceeded 65 535 bytes, Linux refused
//! every one, and the connection died of its idle timeout.

mod common;

use common::cluster_tuned;
use std::time::{Duration, Instant};
use wiretrain_comm::ReduceOp;

fn all_reduce_with_mtu(mtu: Option<u16>) {
    let len = 8 << 20; // 32 MiB of f32
    let t0 = Instant::now();
    let res = cluster_tuned(
        &[1, 1],
        "jumbo-token",
        move |cfg| {
            cfg.collective_timeout(Duration::from_secs(30));
            if let Some(m) = mtu {
                cfg.quic().mtu_upper_bound(m).unwrap();
            }
        },
        move |mut pg| {
            let r = pg.rank() as f32;
            let mut out = Vec::new();
            for it in 0..4 {
                let v: Vec<f32> = (0..len).map(|i| r + ((i + it) % 7) as f32).collect();
                let sum = pg
                    .all_reduce(v, ReduceOp::Sum)
                    .wait()
                    .map_err(|e| e.to_string())?;
                out.push(sum);
            }
            Ok::<_, String>(out)
        },
    );
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "{:?}",
        t0.elapsed()
    );
    for node in res {
        let (ranks, stats) = node.expect("node");
        for rank in ranks {
            for (it, sum) in rank.expect("rank").iter().enumerate() {
                for (i, x) in sum.iter().enumerate() {
                    assert_eq!(
                        *x,
                        1.0 + 2.0 * ((i + it) % 7) as f32,
                        "call {it} element {i}"
                    );
                }
            }
        }
        let s = &stats[0];
        eprintln!("mtu bound {mtu:?}: {s:?}");
        assert!(
            s.mtu > 1500,
            "path MTU stayed at {} on loopback: {s:?}",
            s.mtu
        );
        // The plain-socket fallback sends one datagram per call by design.
        if std::env::var("WIRETRAIN_PLAIN_UDP").as_deref() != Ok("1") {
            assert!(
                s.udp_tx_datagrams > s.udp_tx_ios,
                "segment offload did not batch: {s:?}"
            );
        }
    }
}

#[test]
fn jumbo_datagrams_by_default() {
    all_reduce_with_mtu(None);
}

#[test]
fn jumbo_datagrams_at_16000() {
    all_reduce_with_mtu(Some(16000));
}
