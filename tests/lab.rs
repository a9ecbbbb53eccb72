//! Collectives between two network namespaces joined by a tbf-shaped veth pair (the wiring
//! lab's smallest form): correctness across a real shaped link. Throughput figures are in
//! docs/BENCHMARKS.md (a benchmark, not this test). Skipped, with the reason printed, where
//! namespaces cannot be created (not root, no iproute2).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn collectives_across_a_shaped_link() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/lab-tbf.sh");
    let t0 = Instant::now();
    let out = Command::new("bash")
        .arg(script)
        .args([
            "--op",
            "all-reduce,reduce-scatter,all-gather,broadcast,p2p",
            "--bytes",
            "0,28,4000012",
            "--iters",
            "3",
            "--warmup",
            "0",
            "--check",
            "--json",
            "--reduce",
            "mean",
        ])
        .env("BIN", common::bin())
        .env("RATE", "1gbit")
        .env("LIMIT", "120")
        .output()
        .expect("run lab script");
    let text = common::text(&out);
    if out.status.code() == Some(77) {
        println!("skipped: {}", String::from_utf8_lossy(&out.stdout).trim());
        return;
    }
    assert!(out.status.success(), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(240), "{text}");
    let rows = common::rows(&out);
    assert_eq!(rows.len(), 15, "{text}");
    for r in rows {
        assert_eq!(r["wrong"], 0, "{r}");
        assert_eq!(r["nodes"], 2);
    }
}
