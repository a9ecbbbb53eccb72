//! The cost of one trace span when tracing is on and when it is off (ns per span, median of
//! 7 rounds of 200k spans), for the tracing-overhead figure in docs/BENCHMARKS.md: spans per
//! step x cost per span, against the step time. `cargo run --example trace_cost`.

use std::time::Instant;
use wiretrain::trace;

fn round(n: usize, seq: &mut u64) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        *seq += 1;
        // The two kinds the trainer records: a fixed name, and one formatted with an OpId.
        let a = trace::span("optimizer", "optim");
        drop(a);
        let b = trace::span(format!("wait all_gather#{seq}"), "comm");
        drop(b);
    }
    t.elapsed().as_secs_f64() * 1e9 / (2 * n) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let n = 100_000;
    let mut seq = 0;
    let off = median((0..7).map(|_| round(n, &mut seq)).collect());
    trace::enable(0, 0, (0.0, 0.0, 0.0));
    let on = median(
        (0..7)
            .map(|_| {
                let c = round(n, &mut seq);
                // Keep memory flat between rounds: the events go to a file in real runs.
                let _ = trace::finish(&std::env::temp_dir().join("wiretrain-trace-cost"), 1);
                trace::enable(0, 0, (0.0, 0.0, 0.0));
                c
            })
            .collect(),
    );
    println!(
        "span cost: {on:.0} ns traced, {off:.1} ns untraced (median of 7 x {} spans)",
        2 * n
    );
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join("wiretrain-trace-cost"));
}
