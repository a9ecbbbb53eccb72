//! Every collective, and point-to-point messages around the ring of ranks (`sendrecv`), against
//! a serial reference, over real QUIC sockets between real node
//! processes (`wiretrain bench --local N --check`), for the node x rank shapes
//! 1x1, 1x4, 2x1, 2x2, 3x1 and 4x2; sizes 0, 1, 7 and a prime above 1M elements with 100
//! repeated calls each, plus 64 MiB; sum and mean; lanes over three channels.

mod common;

use std::time::Duration;

const OPS: &str = "all-reduce,reduce-scatter,all-gather,broadcast,sendrecv";

fn check(nodes: usize, ranks: usize, bytes: &str, iters: usize, reduce: &str) {
    let nodes_s = nodes.to_string();
    let ranks_s = ranks.to_string();
    let iters_s = iters.to_string();
    let mut args = vec!["bench", "--op", OPS, "--bytes", bytes, "--iters", &iters_s];
    args.extend(["--warmup", "0", "--check", "--json", "--reduce", reduce]);
    args.extend(["--local", &nodes_s, "--ranks-per-node", &ranks_s]);
    args.extend(["--collective-timeout", "120"]);
    let sizes = bytes.split(',').count();
    // sendrecv needs a second rank.
    let ops = if nodes * ranks > 1 { 5 } else { 4 };
    let rows = common::json_rows(&args, Duration::from_secs(600), ops * sizes);
    for r in &rows {
        assert_eq!(r["wrong"], 0, "wrong elements in {r}");
        assert_eq!(r["nodes"], nodes as u64);
        assert_eq!(r["ranks"], (nodes * ranks) as u64);
        assert_eq!(r["iters"], iters as u64);
        for f in ["op", "bytes", "time_us", "algbw_gbps", "busbw_gbps"] {
            assert!(r.get(f).is_some(), "row lacks {f}: {r}");
        }
    }
}

/// 0, 1, 7 and 1_000_003 (prime) elements, 100 calls each.
const SMALL: &str = "0,4,28,4000012";

/// One test per shape `NODES x RANKS`, each running `check` for every (bytes, iters, reduce).
macro_rules! shapes {
    ($(
        $name:ident: $nodes:literal x $ranks:literal =>
            [$(($bytes:expr, $iters:literal, $reduce:literal)),+]
    )+) => {
        $(
            #[test]
            fn $name() {
                $(check($nodes, $ranks, $bytes, $iters, $reduce);)+
            }
        )+
    };
}

shapes! {
    shape_1x1: 1 x 1 => [(SMALL, 100, "sum"), ("64M", 1, "mean")]
    shape_1x4: 1 x 4 => [(SMALL, 100, "sum"), (SMALL, 100, "mean"), ("64M", 2, "sum")]
    shape_2x1: 2 x 1 => [(SMALL, 100, "sum"), (SMALL, 100, "mean"), ("64M", 1, "mean")]
    shape_2x2: 2 x 2 => [(SMALL, 100, "sum"), (SMALL, 100, "mean"), ("64M", 1, "sum")]
    shape_3x1: 3 x 1 => [(SMALL, 100, "mean"), ("64M", 1, "sum")]
    shape_4x2: 4 x 2 => [(SMALL, 100, "sum"), ("64M", 1, "mean")]
}

#[test]
fn bench_prints_an_nccl_tests_table() {
    let out = common::run(
        &[
            "bench",
            "--op",
            "all-reduce,p2p",
            "--bytes",
            "1M",
            "--iters",
            "3",
            "--local",
            "2",
        ],
        &[],
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", common::text(&out));
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("algbw(GB/s)") && s.contains("busbw(GB/s)"),
        "{s}"
    );
    assert!(s.contains("Avg bus bandwidth"), "{s}");
    assert!(
        s.lines()
            .any(|l| l.trim_start().starts_with("all-reduce") && l.contains("1048576")),
        "{s}"
    );
    assert!(s.lines().any(|l| l.trim_start().starts_with("p2p")), "{s}");
}

/// `--op p2p --check`: every lane owner holds what the same lane of the previous node sent, and
/// the rest of every buffer is untouched (3 nodes, so the previous and the next node differ).
#[test]
fn p2p_rows_are_checked() {
    let mut args = vec![
        "bench",
        "--op",
        "p2p",
        "--bytes",
        "4,28,4000012",
        "--iters",
        "5",
    ];
    args.extend(["--warmup", "0", "--check", "--json"]);
    args.extend(["--local", "3", "--ranks-per-node", "2"]);
    let rows = common::json_rows(&args, Duration::from_secs(300), 3);
    for r in &rows {
        assert_eq!(r["op"], "p2p", "{r}");
        assert_eq!(r["wrong"], 0, "wrong elements in {r}");
        assert_eq!(r["nodes"], 3, "{r}");
    }
}

/// `--channels 3` between real node processes: each lane's passes split over three QUIC
/// connections per peer, every collective and p2p still exact (3 nodes x 2 ranks, so every
/// node dials and accepts lane links; sizes that leave some channels an empty slice).
#[test]
fn channels_between_processes() {
    let mut args = vec![
        "bench",
        "--op",
        "all-reduce,reduce-scatter,all-gather,broadcast,p2p",
    ];
    args.extend(["--bytes", "4,28,4000012", "--iters", "20", "--warmup", "0"]);
    args.extend(["--check", "--json", "--channels", "3"]);
    args.extend(["--local", "3", "--ranks-per-node", "2"]);
    let rows = common::json_rows(&args, Duration::from_secs(300), 15);
    for r in &rows {
        assert_eq!(r["wrong"], 0, "wrong elements in {r}");
        assert_eq!(r["nodes"], 3, "{r}");
    }
}

/// A channel count out of range (or any bad transport flag) is refused by `bench --local`
/// itself, once, before any node process starts, naming the flag.
#[test]
fn channel_count_out_of_range_is_refused() {
    common::refused_each(&[
        (&["bench", "--local", "2", "--channels", "0"], "--channels"),
        (&["bench", "--local", "2", "--channels", "17"], "1..=16"),
        (
            &["bench", "--local", "2", "--net-threads", "0"],
            "--net-threads",
        ),
        (
            &["bench", "--local", "2", "--idle-timeout", "0"],
            "--idle-timeout",
        ),
    ]);
}

/// A local launch's nodes share the host's cores: without `--net-threads` each node's network
/// runtime gets its share (the cores over the node count, 1 or 2); the flag still wins.
#[test]
fn local_nodes_take_their_share_of_the_cores_for_network_threads() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let share = (cores / 2).clamp(1, 2);
    for (flag, want) in [(None, share), (Some("2"), 2)] {
        let mut args = vec!["bench", "--op", "all-reduce", "--bytes", "1M"];
        args.extend(["--iters", "2", "--local", "2"]);
        if let Some(n) = flag {
            args.extend(["--net-threads", n]);
        }
        let out = common::run(
            &args,
            &[("RUST_LOG", "wiretrain_comm=info")],
            Duration::from_secs(120),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        let said: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("network runtime:"))
            .collect();
        assert_eq!(said.len(), 2, "one line per node expected: {err}");
        for l in said {
            assert!(
                l.contains(&format!("network runtime: {want} threads")),
                "{args:?} on {cores} cores: {l}"
            );
        }
    }
}
