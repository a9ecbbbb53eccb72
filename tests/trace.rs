//! Timeline traces and `wiretrain report` through the real binary (2 nodes x 2 ranks over
//! QUIC, Burn's CPU backend): the files are valid trace-event JSON, each step's events nest
//! inside it without overlapping and cover at least 90 % of its wall time, the communication
//! track carries op, sequence number and bytes; a deliberately slow rank is named the
//! straggler and the rank waited for; missing or truncated traces give a clear error.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

/// `wiretrain report args...`, bounded by `limit`.
fn report(args: &[&str], limit: Duration) -> std::process::Output {
    let mut a = vec!["report"];
    a.extend_from_slice(args);
    common::run(&a, &[], limit)
}

fn dir(name: &str) -> PathBuf {
    common::fresh_dir("trace", name)
}

/// 12 steps of `example` on 2 nodes x 2 ranks with `--trace d/trace`.
fn traced_run(d: &Path, example: &str, strategy: &str, envs: &[(&str, &str)]) {
    let t = d.join("trace");
    let out = common::run(
        &common::train_2x2(
            example,
            strategy,
            "12",
            &[
                "--global-batch",
                "32",
                "--device",
                "cpu",
                "--trace",
                t.to_str().unwrap(),
            ],
        ),
        envs,
        Duration::from_secs(300),
    );
    assert!(out.status.success(), "{}", common::text(&out));
}

fn check_nesting(path: &Path, zero3: bool) {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let rank = v["otherData"]["rank"].as_u64().unwrap();
    // The rank's device, as the rank table records it.
    assert_eq!(
        v["otherData"]["device"], "cpu (burn flex backend)",
        "{path:?}"
    );
    let evs = v["traceEvents"].as_array().unwrap();
    for e in evs {
        for f in ["name", "ph", "ts", "pid", "tid"] {
            assert!(e.get(f).is_some(), "{path:?}: event lacks {f}: {e}");
        }
        if e["ph"] == "X" {
            assert!(e["dur"].as_f64().unwrap() >= 0.0, "{e}");
        }
    }
    let x = |e: &&serde_json::Value| e["ph"] == "X" && e["tid"].as_u64() == Some(rank);
    let steps: Vec<&serde_json::Value> = evs
        .iter()
        .filter(x)
        .filter(|e| e["cat"] == "step")
        .collect();
    assert_eq!(steps.len(), 12, "{path:?}");
    let kids: Vec<&serde_json::Value> = evs
        .iter()
        .filter(x)
        .filter(|e| e["cat"] != "step")
        .collect();
    let span = |e: &serde_json::Value| {
        let ts = e["ts"].as_f64().unwrap();
        (ts, ts + e["dur"].as_f64().unwrap())
    };
    let mut worst = 1.0f64;
    for s in &steps {
        let (a, b) = span(s);
        let mut inside: Vec<(f64, f64)> = kids
            .iter()
            .map(|k| span(k))
            .filter(|(x, y)| *x >= a - 0.5 && *y <= b + 0.5)
            .collect();
        inside.sort_by(|p, q| p.0.total_cmp(&q.0));
        for w in inside.windows(2) {
            assert!(
                w[1].0 >= w[0].1 - 0.5,
                "{path:?}: overlapping siblings {w:?}"
            );
        }
        let covered: f64 = inside.iter().map(|(x, y)| y - x).sum();
        worst = worst.min(covered / (b - a));
    }
    // Every event of the compute thread is inside some step (none straddles a boundary).
    for k in &kids {
        let (x, y) = span(k);
        let n = steps
            .iter()
            .filter(|s| {
                let (a, b) = span(s);
                x >= a - 0.5 && y <= b + 0.5
            })
            .count();
        assert!(n <= 1, "{k}");
    }
    eprintln!("{path:?}: worst step coverage {worst:.3}");
    assert!(worst >= 0.9, "{path:?}: a step is only {worst:.3} covered");
    let coll: Vec<&serde_json::Value> = evs.iter().filter(|e| e["cat"] == "collective").collect();
    assert!(!coll.is_empty());
    for c in &coll {
        assert!(
            c["args"]["seq"].as_u64().is_some() && c["args"]["bytes"].as_u64().is_some(),
            "{c}"
        );
        assert_eq!(c["args"]["wire_dtype"], "f32", "{c}");
        // 2 nodes x 2 ranks: every rank carries a lane to the other node.
        assert_eq!(c["args"]["peer_nodes"].as_array().unwrap().len(), 1, "{c}");
    }
    // The trainer tags its calls: every step reduces gradients and agrees on the loss.
    for tag in ["grads", "loss"] {
        assert!(
            coll.iter()
                .any(|c| c["args"]["tag"] == tag
                    && c["name"].as_str().is_some_and(|n| n.ends_with(tag))),
            "{path:?}: no collective tagged {tag}"
        );
    }
    let named = |p: &str| {
        evs.iter()
            .any(|e| e["name"].as_str().is_some_and(|n| n.starts_with(p)))
    };
    // Both run unit by unit (ZeRO-2 overlaps its reductions: the job spans two nodes); ZeRO-3
    // frees each unit's gathered parameters after use, ZeRO-2 keeps its units whole.
    assert!(named("forward unit"), "{path:?}: unit forwards");
    assert!(named("backward unit"), "{path:?}: unit backwards");
    assert_eq!(
        named("free unit"),
        zero3,
        "{path:?}: ZeRO-3 traces show each unit's free"
    );
}

#[test]
fn traces_are_valid_nested_and_cover_each_step() {
    // char-lm: steps of a few hundred ms, so a scheduler hiccup between two spans on the
    // 2-core CI machine cannot eat 10 % of a step.
    for strategy in ["zero2", "zero3"] {
        let d = dir(strategy);
        traced_run(&d, "char-lm", strategy, &[]);
        let t = d.join("trace");
        for r in 0..4 {
            check_nesting(&t.join(format!("trace-rank{r}.json")), strategy == "zero3");
        }
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(t.join("trace-rank2.json")).unwrap()).unwrap();
        let acc = v["otherData"]["clock_accuracy_us"].as_f64().unwrap();
        eprintln!(
            "node 1 clock offset {} ± {acc} µs",
            v["otherData"]["clock_offset_us"]
        );
        assert!(acc < 50_000.0, "clock accuracy {acc} µs");
        let _ = std::fs::remove_dir_all(&d);
    }
}

#[test]
#[cfg_attr(
    not(feature = "test-hooks"),
    ignore = "needs the test hooks: --features wiretrain/test-hooks (scripts/test.sh)"
)]
fn report_names_the_straggler_and_who_was_waited_for() {
    let d = dir("straggler");
    traced_run(&d, "mlp", "zero2", &[("WIRETRAIN_TEST_SLOW_RANK", "2:30")]);
    let t = d.join("trace");
    let t_s = t.to_str().unwrap();
    let out = report(&[t_s, "--json"], Duration::from_secs(60));
    assert!(out.status.success(), "{}", common::text(&out));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["slowest_rank"], 2, "{r}");
    assert!(r["slowest_extra_ms"].as_f64().unwrap() > 20.0, "{r}");
    let w = &r["waits"][0];
    assert_eq!(w["waited_for"], 2, "{r}");
    assert_ne!(w["rank"], 2);
    assert_eq!(r["splits"].as_array().unwrap().len(), 4);
    // What each rank's communication thread carried, and the share it did not wait for.
    for sp in r["splits"].as_array().unwrap() {
        let (busy, hidden) = (
            sp["comm_busy_ms"].as_f64().unwrap(),
            sp["hidden_share"].as_f64().unwrap(),
        );
        assert!(busy > 0.0 && (0.0..=1.0).contains(&hidden), "{sp}");
    }
    // Two nodes: the gradient collectives crossed the inter-node link and were timed there.
    let bw = r["bandwidth"].as_array().unwrap();
    assert!(
        bw.iter()
            .any(|b| b["inter_gbs"].as_f64().is_some_and(|g| g > 0.0)
                && b["inter_share"]
                    .as_f64()
                    .is_some_and(|s| s > 0.0 && s <= 1.0)),
        "{r}"
    );
    for f in ["report-split.png", "report-busbw.png"] {
        let png = std::fs::read(t.join(f)).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{f}");
    }
    // With bench figures given, each collective shows the bench busbw of the nearest size.
    let bench = d.join("bench.jsonl");
    std::fs::write(
        &bench,
        "{\"op\":\"reduce-scatter\",\"bytes\":1000,\"busbw_gbps\":9.0}\n\
         {\"op\":\"reduce-scatter\",\"bytes\":30000,\"busbw_gbps\":1.5}\n",
    )
    .unwrap();
    let out = report(
        &[
            t_s,
            "--json",
            "--no-plot",
            "--bench",
            bench.to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", common::text(&out));
    let rb: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rs = rb["bandwidth"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["op"] == "reduce_scatter")
        .unwrap()
        .clone();
    assert_eq!(rs["bench_busbw_gbs"], 1.5, "{rs}");
    assert!(rs["intra_busbw_gbs"].as_f64().unwrap() > 0.0, "{rs}");
    // The human summary says the same.
    let out = report(&[t_s, "--no-plot"], Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("slowest rank: 2") && text.contains("waited for rank 2"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn missing_or_truncated_traces_are_clear_errors() {
    let d = dir("bad");
    let out = report(&[d.join("none").to_str().unwrap()], Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1), "{}", common::text(&out));
    assert!(
        common::text(&out).contains("none"),
        "{}",
        common::text(&out)
    );
    std::fs::write(
        d.join("trace-rank0.json"),
        br#"{"traceEvents": [{"name": "st"#,
    )
    .unwrap();
    let out = report(&[d.to_str().unwrap()], Duration::from_secs(30));
    let text = common::text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("trace-rank0.json") && text.contains("truncated"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Every step's metrics say how long the rank's communication thread ran collectives and
/// which share of that was hidden behind compute: ZeRO-3's prefetched parameter gathers run
/// while a unit computes, and with overlap DDP's and ZeRO-2's unit reductions run while
/// earlier units' backward does (a real share hidden); DDP without overlap communicates after
/// the backward pass.
#[test]
fn metrics_say_how_much_communication_was_hidden() {
    let median_hidden = |strategy: &str, overlap: &str| {
        let args = common::local_train(
            "2",
            "2",
            &[
                "--example",
                "char-lm",
                "--strategy",
                strategy,
                "--overlap",
                overlap,
                "--steps",
                "8",
                "--device",
                "cpu",
                "--no-progress",
            ],
        );
        let rows = common::train_metrics(strategy, &args, &[], Duration::from_secs(240));
        let (steps, summary) = rows.split_at(rows.len() - 1);
        for r in steps {
            let (busy, hidden) = (
                r["comm_busy_ms"].as_f64().unwrap(),
                r["hidden_share"].as_f64().unwrap(),
            );
            assert!(
                busy > 0.0 && (0.0..=1.0).contains(&hidden),
                "{strategy}: {r}"
            );
        }
        // `auto` overlaps here: the job spans two nodes.
        let overlaps = strategy != "zero3" && overlap != "off";
        assert_eq!(summary[0]["overlap"], overlaps, "{strategy} {overlap}");
        summary[0]["median"]["hidden_share"].as_f64().unwrap()
    };
    let zero3 = median_hidden("zero3", "auto");
    let ddp_off = median_hidden("ddp", "off");
    let ddp_on = median_hidden("ddp", "auto");
    let zero2_on = median_hidden("zero2", "on");
    eprintln!("hidden: zero3 {zero3} ddp off {ddp_off} ddp on {ddp_on} zero2 on {zero2_on}");
    assert!(zero3 > 0.1, "zero3 hides {zero3} of its communication");
    assert!(ddp_off < zero3, "ddp {ddp_off} vs zero3 {zero3}");
    assert!(
        ddp_on > 0.1 && ddp_on > ddp_off,
        "ddp overlapped {ddp_on} vs {ddp_off}"
    );
    assert!(zero2_on > 0.1, "zero2 overlapped hides {zero2_on}");
}

/// `--overlap` takes auto, on or off, and `on` refuses micro-batches (they accumulate their
/// gradients before any reduction): one line naming the flag, exit 2.
#[test]
fn bad_overlap_settings_are_refused() {
    common::refused_each(&[
        (
            &["train", "--overlap", "maybe"],
            "\"maybe\" is not auto, on or off",
        ),
        (
            &["train", "--overlap", "on", "--accumulate", "2"],
            "--overlap on needs --accumulate 1",
        ),
    ]);
}
