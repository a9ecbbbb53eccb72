//! `wiretrain report`: reads the per-rank traces of a run (`train --trace DIR`) and answers
//! "why is my step slow?": the step split per rank (compute, exposed communication, optimizer,
//! data), the slowest rank and by how much, achieved bandwidth per collective, and the longest
//! waits with the rank that was waited for (the last to submit that collective).

use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use wiretrain::trace::Event;

/// Trace files larger than this are refused unread.
pub const MAX_TRACE_BYTES: u64 = 2 << 30;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("trace directory {0}: {1}")]
    Dir(PathBuf, std::io::Error),
    #[error("no trace files (trace-rank*.json) in {0}; run `train --trace DIR` first")]
    Empty(PathBuf),
    #[error("trace file {path}: {reason}")]
    Bad { path: PathBuf, reason: String },
}

/// One rank's trace.
#[derive(Debug, Clone)]
pub struct RankTrace {
    pub rank: usize,
    pub node: usize,
    pub world: usize,
    pub clock_accuracy_us: f64,
    pub events: Vec<Event>,
}

/// Reads every `trace-rank*.json` under `dir`, checking each one.
pub fn load(dir: &Path) -> Result<Vec<RankTrace>, ReportError> {
    let rd = std::fs::read_dir(dir).map_err(|e| ReportError::Dir(dir.to_path_buf(), e))?;
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| ReportError::Dir(dir.to_path_buf(), e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("trace-rank") && name.ends_with(".json")) {
            continue;
        }
        out.push(load_file(&ent.path())?);
    }
    if out.is_empty() {
        return Err(ReportError::Empty(dir.to_path_buf()));
    }
    out.sort_by_key(|t| t.rank);
    let world = out[0].world;
    let ranks: Vec<usize> = out.iter().map(|t| t.rank).collect();
    if ranks != (0..world).collect::<Vec<_>>() {
        return Err(ReportError::Bad {
            path: dir.to_path_buf(),
            reason: format!("traces of ranks {ranks:?} found, a world of {world} expected"),
        });
    }
    Ok(out)
}

fn load_file(path: &Path) -> Result<RankTrace, ReportError> {
    let bad = |reason: String| ReportError::Bad {
        path: path.to_path_buf(),
        reason,
    };
    let len = std::fs::metadata(path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if len > MAX_TRACE_BYTES {
        return Err(bad(format!("{len} bytes is more than a trace may have")));
    }
    let text = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(rename = "traceEvents")]
        trace_events: Vec<Event>,
        #[serde(rename = "otherData")]
        other: Other,
    }
    #[derive(serde::Deserialize)]
    struct Other {
        rank: usize,
        node: usize,
        world: usize,
        clock_accuracy_us: f64,
    }
    let f: File = serde_json::from_slice(&text).map_err(|e| {
        bad(format!(
            "not a wiretrain trace (truncated or corrupted?): {e}"
        ))
    })?;
    if f.other.rank >= f.other.world {
        return Err(bad(format!(
            "rank {} is not below world {}",
            f.other.rank, f.other.world
        )));
    }
    if let Some(e) = f
        .trace_events
        .iter()
        .find(|e| e.ph == "X" && !(e.ts.is_finite() && e.dur.is_some_and(|d| d >= 0.0)))
    {
        return Err(bad(format!("event {:?} has no valid time span", e.name)));
    }
    Ok(RankTrace {
        rank: f.other.rank,
        node: f.other.node,
        world: f.other.world,
        clock_accuracy_us: f.other.clock_accuracy_us,
        events: f.trace_events,
    })
}

/// Mean milliseconds per step of one rank.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Split {
    pub rank: usize,
    pub node: usize,
    pub steps: usize,
    pub step_ms: f64,
    pub compute_ms: f64,
    pub comm_ms: f64,
    pub optim_ms: f64,
    pub data_ms: f64,
    /// Step time outside any span.
    pub other_ms: f64,
    /// Time within steps when the rank's communication thread had a collective in flight
    /// (the union of their spans, from start to completion).
    pub comm_busy_ms: f64,
    /// The share of that time the rank did not wait for (it computed meanwhile):
    /// 1 − exposed / busy, in [0, 1]; 0 without communication.
    pub hidden_share: f64,
}

impl Split {
    /// Time the rank was busy (not waiting for others).
    pub fn busy_ms(&self) -> f64 {
        self.compute_ms + self.optim_ms + self.data_ms
    }
}

/// Achieved bandwidth of one collective kind (medians over its calls).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Bandwidth {
    pub op: String,
    pub calls: usize,
    pub bytes: f64,
    pub median_ms: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    /// The inter-node link: median GB/s a lane sent at while on it (None when the op never
    /// crossed nodes), and the share of the collective's time spent there (the rest is the
    /// shared-memory phases inside the node and waiting for peers).
    pub inter_gbs: Option<f64>,
    pub inter_share: f64,
    /// The phases inside the node: busbw over the ranks of a node, on the time not spent on
    /// the inter-node lane (an upper bound on time, so a lower bound on bandwidth: waiting for
    /// peers counts as intra-node time).
    pub intra_busbw_gbs: f64,
    /// `wiretrain bench`'s busbw for this op at the nearest size, when a bench file was given.
    pub bench_busbw_gbs: Option<f64>,
}

/// Fills [`Bandwidth::bench_busbw_gbs`] from `wiretrain bench --json` rows (op names with
/// dashes or underscores; the row of the nearest size on a log scale).
pub fn add_bench(report: &mut Report, rows: &[serde_json::Value]) {
    for b in &mut report.bandwidth {
        b.bench_busbw_gbs = rows
            .iter()
            .filter(|r| {
                r["op"].as_str().map(|o| o.replace('-', "_")) == Some(b.op.clone())
                    && r["bytes"].as_f64().is_some_and(|x| x > 0.0)
            })
            .min_by(|x, y| {
                let d = |r: &serde_json::Value| {
                    (r["bytes"].as_f64().unwrap_or(1.0).ln() - b.bytes.max(1.0).ln()).abs()
                };
                d(x).total_cmp(&d(y))
            })
            .and_then(|r| r["busbw_gbps"].as_f64());
    }
}

/// One long wait.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Wait {
    pub rank: usize,
    pub what: String,
    pub ms: f64,
    /// The rank that submitted this collective last, and how much later than this rank.
    pub waited_for: Option<usize>,
    pub late_by_ms: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    pub world: usize,
    pub splits: Vec<Split>,
    /// The rank busy the longest per step, and its busy time over the median rank's.
    pub slowest_rank: usize,
    pub slowest_ratio: f64,
    pub slowest_extra_ms: f64,
    pub bandwidth: Vec<Bandwidth>,
    pub waits: Vec<Wait>,
    /// Worst clock-offset uncertainty between nodes (µs).
    pub clock_accuracy_us: f64,
}

/// The middle element (upper median) of `v`; 0 when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// nccl-tests' bus-bandwidth factor.
fn bus_factor(op: &str, n: f64) -> f64 {
    // "replica.all_reduce": the factor of its kind, over its group's ranks.
    match op.rsplit('.').next().unwrap_or(op) {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "reduce_scatter" | "all_gather" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// A collective event's name in the report, its kind prefixed by its group unless it spans
/// the world ("replica.all_reduce"), and that group's size (`world` in traces written before
/// calls named their group).
fn call_of(e: &Event, world: f64) -> (String, f64) {
    let op = e.args.get("op").and_then(|v| v.as_str()).unwrap_or("?");
    let ranks = e
        .args
        .get("ranks")
        .and_then(|v| v.as_f64())
        .unwrap_or(world);
    match e.args.get("group").and_then(|v| v.as_str()) {
        None | Some("world") => (op.to_string(), ranks),
        Some(g) => (format!("{g}.{op}"), ranks),
    }
}

/// Bus bandwidth over time of each collective kind, from rank 0's communication track:
/// (op, [(seconds since the trace base, GB/s)]).
pub fn busbw_series(traces: &[RankTrace]) -> Vec<(String, Vec<(f64, f64)>)> {
    let world = traces.len() as f64;
    let mut by: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for e in traces.first().map_or(&[][..], |t| &t.events[..]) {
        if e.cat != "collective" {
            continue;
        }
        let (op, ranks) = call_of(e, world);
        let bytes = e.args.get("bytes").and_then(|v| v.as_f64()).unwrap_or(0.0);
        if op.ends_with("barrier") || bytes <= 0.0 {
            continue;
        }
        let start = e
            .args
            .get("started_us")
            .and_then(|v| v.as_f64())
            .unwrap_or(e.ts);
        let dur_s = ((e.ts + e.dur.unwrap_or(0.0) - start) / 1e6).max(1e-9);
        let busbw = bytes / dur_s / 1e9 * bus_factor(&op, ranks);
        by.entry(op).or_default().push((start / 1e6, busbw));
    }
    by.into_iter().collect()
}

/// Analyses the traces of one run.
pub fn analyse(traces: &[RankTrace]) -> Report {
    let world = traces.len();
    let mut calls = Calls::default();
    let mut waits = Vec::new();
    let splits: Vec<Split> = traces
        .iter()
        .map(|t| {
            calls.add(t, world as f64);
            split_of(t, &mut waits)
        })
        .collect();
    let busy: Vec<f64> = splits.iter().map(Split::busy_ms).collect();
    let (slowest_rank, slowest_busy) = busy
        .iter()
        .copied()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, 0.0));
    let med = median(busy.clone());
    let per_node = traces.iter().filter(|t| t.node == 0).count().max(1) as f64;
    let waits = calls.top_waits(waits);
    Report {
        world,
        splits,
        slowest_rank,
        slowest_ratio: if med > 0.0 { slowest_busy / med } else { 1.0 },
        slowest_extra_ms: slowest_busy - med,
        bandwidth: calls.bandwidth(world as f64, per_node),
        waits,
        clock_accuracy_us: traces
            .iter()
            .map(|t| t.clock_accuracy_us)
            .fold(0.0, f64::max),
    }
}

/// One rank's mean step split by span category; its comm spans join `waits` as (rank, name,
/// ms).
fn split_of(t: &RankTrace, waits: &mut Vec<(usize, String, f64)>) -> Split {
    let spans: Vec<&Event> = t.events.iter().filter(|e| e.ph == "X").collect();
    let steps: Vec<&&Event> = spans.iter().filter(|e| e.cat == "step").collect();
    let mut sum = BTreeMap::<&str, f64>::new();
    for e in spans.iter().filter(|e| e.tid == t.rank && e.cat != "step") {
        *sum.entry(e.cat.as_str()).or_default() += e.dur.unwrap_or(0.0);
        if e.cat == "comm" {
            waits.push((t.rank, e.name.clone(), e.dur.unwrap_or(0.0) / 1e3));
        }
    }
    let n = steps.len().max(1) as f64;
    let step_total: f64 = steps.iter().map(|e| e.dur.unwrap_or(0.0)).sum();
    let get = |k: &str| sum.get(k).copied().unwrap_or(0.0) / n / 1e3;
    let (compute, comm, optim, data) = (get("compute"), get("comm"), get("optim"), get("data"));
    let step_ms = step_total / n / 1e3;
    let busy = comm_busy_us(t, &steps) / n / 1e3;
    Split {
        rank: t.rank,
        node: t.node,
        steps: steps.len(),
        step_ms,
        compute_ms: compute,
        comm_ms: comm,
        optim_ms: optim,
        data_ms: data,
        other_ms: (step_ms - compute - comm - optim - data).max(0.0),
        comm_busy_ms: busy,
        hidden_share: wiretrain::engine::hidden_share(comm, busy),
    }
}

/// Microseconds within `steps` during which some collective of `t` was in flight.
fn comm_busy_us(t: &RankTrace, steps: &[&&Event]) -> f64 {
    let mut spans: Vec<(f64, f64)> = t
        .events
        .iter()
        .filter(|e| e.ph == "X" && e.cat == "collective")
        .map(|e| {
            let start = e
                .args
                .get("started_us")
                .and_then(|v| v.as_f64())
                .unwrap_or(e.ts);
            (start, e.ts + e.dur.unwrap_or(0.0))
        })
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::new();
    for (a, b) in spans {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    steps
        .iter()
        .map(|s| {
            let (s0, s1) = (s.ts, s.ts + s.dur.unwrap_or(0.0));
            merged
                .iter()
                .map(|&(a, b)| (b.min(s1) - a.max(s0)).max(0.0))
                .sum::<f64>()
        })
        .sum()
}

/// The collectives of every rank's communication track.
#[derive(Default)]
struct Calls {
    /// "replica.all_reduce#3" -> (rank, submission ts) of every rank: each group numbers its
    /// own calls.
    submitted: BTreeMap<String, Vec<(usize, f64)>>,
    /// The size of each call name's group.
    ranks_of: BTreeMap<String, f64>,
    /// Call name -> (bytes, duration us) of each call.
    by_op: BTreeMap<String, Vec<(f64, f64)>>,
    /// Call name -> (inter ms, inter bytes) of each call.
    inter: BTreeMap<String, Vec<(f64, f64)>>,
}

impl Calls {
    fn add(&mut self, t: &RankTrace, world: f64) {
        let spans = t.events.iter().filter(|e| e.ph == "X");
        for e in spans.filter(|e| e.cat == "collective") {
            let seq = e.args.get("seq").and_then(|v| v.as_u64()).unwrap_or(0);
            let (op, ranks) = call_of(e, world);
            self.submitted
                .entry(format!("{op}#{seq}"))
                .or_default()
                .push((t.rank, e.ts));
            self.ranks_of.insert(op.clone(), ranks);
            let num = |k: &str| e.args.get(k).and_then(|v| v.as_f64());
            let bytes = num("bytes").unwrap_or(0.0);
            let start = num("started_us").unwrap_or(e.ts);
            let dur = (e.ts + e.dur.unwrap_or(0.0) - start).max(1e-3);
            if !op.ends_with("barrier") && bytes > 0.0 {
                self.by_op.entry(op.clone()).or_default().push((bytes, dur));
                let inter = (
                    num("inter_ms").unwrap_or(0.0),
                    num("inter_bytes").unwrap_or(0.0),
                );
                self.inter.entry(op).or_default().push(inter);
            }
        }
    }

    /// Achieved bandwidth of each call name (medians over its calls).
    fn bandwidth(&self, world: f64, per_node: f64) -> Vec<Bandwidth> {
        self.by_op
            .iter()
            .map(|(op, v)| {
                let bytes = median(v.iter().map(|x| x.0).collect());
                let ms = median(v.iter().map(|x| x.1 / 1e3).collect());
                let algbw = bytes / (ms / 1e3) / 1e9;
                let calls = self.inter.get(op).cloned().unwrap_or_default();
                let crossing: Vec<f64> = calls
                    .iter()
                    .filter(|c| c.0 > 0.0 && c.1 > 0.0)
                    .map(|c| c.1 / (c.0 / 1e3) / 1e9)
                    .collect();
                let total_ms: f64 = v.iter().map(|x| x.1 / 1e3).sum();
                let inter_ms: f64 = calls.iter().map(|c| c.0).sum();
                let intra_ms = median(
                    v.iter()
                        .zip(&calls)
                        .map(|(x, c)| (x.1 / 1e3 - c.0).max(1e-6))
                        .collect(),
                );
                let ranks = self.ranks_of.get(op).copied().unwrap_or(world);
                Bandwidth {
                    intra_busbw_gbs: bytes / (intra_ms / 1e3) / 1e9 * bus_factor(op, per_node),
                    bench_busbw_gbs: None,
                    inter_gbs: (!crossing.is_empty()).then(|| median(crossing)),
                    inter_share: if total_ms > 0.0 {
                        inter_ms / total_ms
                    } else {
                        0.0
                    },
                    busbw_gbs: algbw * bus_factor(op, ranks),
                    op: op.clone(),
                    calls: v.len(),
                    bytes,
                    median_ms: ms,
                    algbw_gbs: algbw,
                }
            })
            .collect()
    }

    /// The five longest waits, each with the rank that submitted the awaited call last and
    /// how much later than the waiting rank.
    fn top_waits(&self, mut waits: Vec<(usize, String, f64)>) -> Vec<Wait> {
        waits.sort_by(|a, b| b.2.total_cmp(&a.2));
        waits
            .into_iter()
            .take(5)
            .map(|(rank, what, ms)| {
                // "wait all_gather#18" -> the call "all_gather#18".
                let call = what.split_whitespace().last().unwrap_or_default();
                let (waited_for, late_by_ms) = self
                    .submitted
                    .get(call)
                    .map(|subs| {
                        let mine = subs.iter().find(|x| x.0 == rank).map_or(0.0, |x| x.1);
                        let last = subs
                            .iter()
                            .max_by(|a, b| a.1.total_cmp(&b.1))
                            .copied()
                            .unwrap_or((rank, mine));
                        (Some(last.0), (last.1 - mine) / 1e3)
                    })
                    .unwrap_or((None, 0.0));
                Wait {
                    rank,
                    what,
                    ms,
                    waited_for,
                    late_by_ms,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
