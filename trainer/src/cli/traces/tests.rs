//! Tests of the trace analysis on synthetic traces and broken files.

use super::*;

#[test]
fn medians_take_the_middle() {
    assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(vec![]), 0.0);
}

fn x(name: &str, cat: &str, ts: f64, dur: f64, tid: usize, args: serde_json::Value) -> Event {
    Event {
        name: name.into(),
        cat: cat.into(),
        ph: "X".into(),
        ts,
        dur: Some(dur),
        pid: 0,
        tid,
        args,
    }
}

/// Two ranks; rank 1 computes 3x longer, so rank 0 waits for it in the all-reduce.
#[test]
fn names_the_straggler_and_who_was_waited_for() {
    let mk = |rank: usize, compute: f64| {
        let mut ev = vec![];
        for s in 0..3 {
            let t = s as f64 * 10_000.0;
            ev.push(x("step", "step", t, 9_000.0, rank, serde_json::Value::Null));
            ev.push(x(
                "fb",
                "compute",
                t,
                compute,
                rank,
                serde_json::Value::Null,
            ));
            let seq = s as u64 + 1;
            // A replica-group call with the same number, at another time: another call.
            ev.push(x(
                &format!("replica.all_reduce#{seq}"),
                "collective",
                t,
                1_000.0,
                1000 + rank,
                serde_json::json!({"op": "all_reduce", "group": "replica", "ranks": 2,
                    "seq": seq, "bytes": 1e6}),
            ));
            ev.push(x(
                &format!("wait all_reduce#{seq}"),
                "comm",
                t + compute,
                9_000.0 - compute,
                rank,
                serde_json::Value::Null,
            ));
            ev.push(x(
                &format!("all_reduce#{seq}"),
                "collective",
                t + compute,
                9_000.0 - compute,
                1000 + rank,
                serde_json::json!({"op": "all_reduce", "seq": seq, "bytes": 4e6}),
            ));
        }
        RankTrace {
            rank,
            node: rank,
            world: 2,
            clock_accuracy_us: 50.0,
            events: ev,
        }
    };
    let r = analyse(&[mk(0, 2_000.0), mk(1, 6_000.0)]);
    assert_eq!(r.slowest_rank, 1);
    assert!((r.splits[0].comm_ms - 7.0).abs() < 1e-9);
    // Rank 0's comm thread carried 1 ms during its compute (hidden) and 7 ms it waited
    // for: 8 ms busy, 1/8 hidden; rank 1: 1 + 3 ms, 1/4 hidden.
    assert!((r.splits[0].comm_busy_ms - 8.0).abs() < 1e-9);
    assert!((r.splits[0].hidden_share - 0.125).abs() < 1e-9);
    assert!((r.splits[1].hidden_share - 0.25).abs() < 1e-9);
    assert_eq!(r.waits[0].rank, 0);
    assert_eq!(r.waits[0].waited_for, Some(1));
    assert!((r.waits[0].late_by_ms - 4.0).abs() < 1e-9);
    assert_eq!(r.bandwidth[0].op, "all_reduce");
    assert_eq!(r.bandwidth[1].op, "replica.all_reduce");
    assert_eq!(r.bandwidth[1].calls, 6);
    // 1 MB in 1 ms: 1 GB/s algbw, bus factor 2(n-1)/n = 1 over its 2 ranks.
    assert!((r.bandwidth[1].busbw_gbs - 1.0).abs() < 1e-9);
    assert_eq!(r.clock_accuracy_us, 50.0);
}

#[test]
fn missing_and_truncated_traces_are_named() {
    let d = std::env::temp_dir().join(format!("wt-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    assert!(matches!(load(&d), Err(ReportError::Empty(_))));
    std::fs::write(d.join("trace-rank0.json"), b"{\"traceEvents\": [{\"name\":").unwrap();
    let e = load(&d).unwrap_err().to_string();
    assert!(
        e.contains("trace-rank0.json") && e.contains("truncated"),
        "{e}"
    );
    let e = load(&d.join("nope")).unwrap_err().to_string();
    assert!(e.contains("nope"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}
