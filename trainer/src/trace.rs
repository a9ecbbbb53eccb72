//! Per-rank timeline traces in Chrome Trace Event Format (loadable in Perfetto or
//! chrome://tracing).
//!
//! Every rank is a thread, so the recorder is thread-local: [`span`] returns a guard that
//! records a complete ("X") event when dropped, nested by construction. When tracing is off a
//! span costs one thread-local check. Times are wall-clock microseconds moved onto node 0's
//! clock by the offset [`estimate_offset`] measures with three collectives at start, and
//! counted from a base rank 0 chooses, so traces of every node line up.
//!
//! Each rank's file holds its compute thread's spans (tid = rank) and a communication track
//! (tid = 1000 + rank) from the process group's collective history: submission to completion
//! of every collective with its op, sequence number and bytes.

use serde::Serialize;
use std::cell::RefCell;
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use wiretrain_comm::ProcessGroup;

/// Events one rank keeps at most (a trace of a long run is cut, with a count of the rest).
pub const MAX_EVENTS: usize = 2_000_000;

/// One trace event.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Event {
    /// Its label: a span's name, a collective's op, a heal marker, or a metadata kind.
    pub name: String,
    /// Its category: a span's own ("compute", "step", ...), "collective", "elastic" or
    /// "__metadata".
    pub cat: String,
    /// Its phase: "X" a complete event, "i" an instant, "M" metadata.
    pub ph: String,
    /// Microseconds on node 0's clock since the trace base.
    pub ts: f64,
    /// Duration in microseconds (complete events only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// The track's process: the node.
    pub pid: usize,
    /// The track's thread: the rank (compute), or 1000 + the rank (communication).
    pub tid: usize,
    /// Extra fields shown with the event (null: none).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub args: serde_json::Value,
}

struct Recorder {
    rank: usize,
    node: usize,
    /// (this thread's Instant, wall µs) at enable: the Instant → wall conversion.
    anchor: (Instant, f64),
    /// Node 0's clock minus ours, µs, and the base subtracted from every timestamp.
    offset_us: f64,
    base_us: f64,
    accuracy_us: f64,
    events: Vec<Event>,
    dropped: usize,
    depth: usize,
    /// The rank's device, as the rank table records it.
    device: Option<String>,
    /// The epoch and restarts of the latest heal (`otherData.elastic`).
    healed: Option<serde_json::Value>,
}

thread_local! {
    static REC: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

fn wall_us() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e6)
        .unwrap_or(0.0)
}

impl Recorder {
    fn ts(&self, t: Instant) -> f64 {
        let wall = if t >= self.anchor.0 {
            self.anchor.1 + (t - self.anchor.0).as_secs_f64() * 1e6
        } else {
            self.anchor.1 - (self.anchor.0 - t).as_secs_f64() * 1e6
        };
        wall + self.offset_us - self.base_us
    }

    fn push(&mut self, e: Event) {
        if self.events.len() < MAX_EVENTS {
            self.events.push(e);
        } else {
            self.dropped += 1;
        }
    }
}

/// Whether this thread records a trace.
pub fn enabled() -> bool {
    REC.with(|r| r.borrow().is_some())
}

/// A span in progress; recorded when dropped.
#[must_use = "a span ends when this guard is dropped"]
pub struct Span {
    live: Option<(String, &'static str, Instant, serde_json::Value)>,
}

impl Span {
    /// Attaches arguments shown with the event.
    pub fn args(mut self, v: serde_json::Value) -> Self {
        self.set_args(v);
        self
    }

    /// Attaches arguments shown with the event, in place.
    pub fn set_args(&mut self, v: serde_json::Value) {
        if let Some(l) = self.live.as_mut() {
            l.3 = v;
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some((name, cat, t0, args)) = self.live.take() else {
            return;
        };
        let t1 = Instant::now();
        REC.with(|r| {
            if let Some(rec) = r.borrow_mut().as_mut() {
                rec.depth = rec.depth.saturating_sub(1);
                let (ts, end) = (rec.ts(t0), rec.ts(t1));
                let (pid, tid) = (rec.node, rec.rank);
                rec.push(Event {
                    name,
                    cat: cat.into(),
                    ph: "X".into(),
                    ts,
                    dur: Some(end - ts),
                    pid,
                    tid,
                    args,
                });
            }
        });
    }
}

/// Opens a span named `name` in category `cat` (compute, comm, optim, data, step).
pub fn span(name: impl Into<String>, cat: &'static str) -> Span {
    let on = REC.with(|r| r.borrow_mut().as_mut().map(|rec| rec.depth += 1).is_some());
    Span {
        live: on.then(|| (name.into(), cat, Instant::now(), serde_json::Value::Null)),
    }
}

/// Estimates node 0's clock minus this rank's (µs) with three collectives, bounded by
/// causality: rank 0's time T0 was read before any rank received it, and every rank's time t_s
/// was read before rank 0 saw the gather complete (T1). Returns (offset, ± accuracy, base),
/// the base being T0 on node 0's clock. Every rank must call it.
pub fn estimate_offset(pg: &mut ProcessGroup) -> Result<(f64, f64, f64), wiretrain_comm::Error> {
    let world = pg.world();
    pg.barrier()?;
    let t0 = pg
        .broadcast(u64_to_f32s(wall_us() as u64).to_vec(), 0)
        .wait()?;
    let t_recv = wall_us();
    let big_t0 = f32s_to_u64(&t0) as f64;
    let t_send = wall_us();
    let mine: Vec<f32> = u64_to_f32s(t_send as u64).to_vec();
    let _ = pg.all_gather(mine, 4 * world).wait()?;
    let t1 = pg
        .broadcast(u64_to_f32s(wall_us() as u64).to_vec(), 0)
        .wait()?;
    let big_t1 = f32s_to_u64(&t1) as f64;
    if pg.node() == 0 {
        // One process, one clock.
        return Ok((0.0, 0.0, big_t0));
    }
    // offset ∈ [T0 − t_recv, T1 − t_send] (1 µs of rounding either side).
    let (lo, hi) = (big_t0 - t_recv - 1.0, big_t1 - t_send + 1.0);
    Ok(((lo + hi) / 2.0, (hi - lo).abs() / 2.0, big_t0))
}

/// A wall-clock time through f32 broadcasts as four exact 16-bit pieces (one collective each
/// way, which is what the estimate times; the bytes collective would take two).
fn u64_to_f32s(v: u64) -> [f32; 4] {
    [
        (v >> 48) as u16 as f32,
        (v >> 32) as u16 as f32,
        (v >> 16) as u16 as f32,
        v as u16 as f32,
    ]
}

/// The inverse of [`u64_to_f32s`].
fn f32s_to_u64(c: &[f32]) -> u64 {
    c.iter().take(4).fold(0u64, |a, &x| (a << 16) | x as u64)
}

/// Starts recording on this thread (one rank), with the clock correction of
/// [`estimate_offset`].
pub fn enable(rank: usize, node: usize, (offset_us, accuracy_us, base_us): (f64, f64, f64)) {
    REC.with(|r| {
        *r.borrow_mut() = Some(Recorder {
            rank,
            node,
            anchor: (Instant::now(), wall_us()),
            offset_us,
            base_us,
            accuracy_us,
            events: Vec::new(),
            dropped: 0,
            depth: 0,
            device: None,
            healed: None,
        })
    });
}

/// A heal from live replicas: from now on this thread is `rank` of node `node` (of the new
/// epoch), and an instant event "elastic heal: epoch N" marks the moment; `elastic` (the epoch
/// and the launch's restarts) goes into `otherData.elastic`.
pub fn heal_marker(rank: usize, node: usize, epoch: u64, elastic: serde_json::Value) {
    REC.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            rec.rank = rank;
            rec.node = node;
            let ts = rec.ts(Instant::now());
            rec.push(Event {
                name: format!("elastic heal: epoch {epoch}"),
                cat: "elastic".into(),
                ph: "i".into(),
                ts,
                dur: None,
                pid: node,
                tid: rank,
                args: elastic.clone(),
            });
            rec.healed = Some(elastic);
        }
    });
}

/// Records this rank's device in its trace file (`otherData.device`).
pub fn set_device(device: &str) {
    REC.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            rec.device = Some(device.to_string());
        }
    });
}

/// Adds the process group's finished collectives as the communication track.
pub fn add_comm_track(pg: &mut ProcessGroup) {
    let epoch = pg.flight_epoch();
    let hist = pg.take_history();
    // The nodes this rank's lane exchanges with (ring neighbours); none in a one-node job.
    let (node, nodes) = (pg.node(), pg.table().num_nodes());
    let lane = pg.local_rank() < pg.table().lanes();
    let peers: Vec<usize> = if nodes > 1 && lane {
        let mut p = vec![(node + nodes - 1) % nodes, (node + 1) % nodes];
        p.dedup();
        p
    } else {
        Vec::new()
    };
    REC.with(|r| {
        let mut r = r.borrow_mut();
        let Some(rec) = r.as_mut() else { return };
        let at = |ms: f64| rec.ts(epoch + std::time::Duration::from_secs_f64(ms.max(0.0) / 1e3));
        let evs: Vec<Event> = hist
            .iter()
            .map(|e| {
                let ts = at(e.submitted_ms);
                let end = at(e.finished_ms.unwrap_or(e.submitted_ms));
                // A sub-group's calls are numbered in that group: "node.reduce_scatter#3".
                let id = match e.group {
                    "world" => format!("{}#{}", e.op, e.seq),
                    g => format!("{g}.{}#{}", e.op, e.seq),
                };
                let name = match e.tag {
                    Some(tag) => format!("{id} {tag}"),
                    None => id,
                };
                Event {
                    name,
                    cat: "collective".into(),
                    ph: "X".into(),
                    ts,
                    dur: Some(end - ts),
                    pid: rec.node,
                    tid: 1000 + rec.rank,
                    args: serde_json::json!({
                        "op": e.op, "group": e.group, "ranks": e.ranks, "seq": e.seq, "bytes": e.bytes, "state": e.state,
                        "started_us": e.started_ms.map(at),
                        "inter_ms": e.inter_ms, "inter_bytes": e.inter_bytes,
                        "peer_nodes": peers, "wire_dtype": e.wire, "tag": e.tag,
                    }),
                }
            })
            .collect();
        for e in evs {
            rec.push(e);
        }
    });
}

/// Stops recording and writes this rank's trace to `dir/trace-rank{rank}.json` (atomically).
pub fn finish(dir: &Path, world: usize) -> std::io::Result<Option<std::path::PathBuf>> {
    let Some(rec) = REC.with(|r| r.borrow_mut().take()) else {
        return Ok(None);
    };
    std::fs::create_dir_all(dir)?;
    let meta = |name: &str, tid: usize, label: String| Event {
        name: name.into(),
        cat: "__metadata".into(),
        ph: "M".into(),
        ts: 0.0,
        dur: None,
        pid: rec.node,
        tid,
        args: serde_json::json!({ "name": label }),
    };
    let mut events = vec![
        meta("process_name", rec.rank, format!("node {}", rec.node)),
        meta(
            "thread_name",
            rec.rank,
            format!("rank {} compute", rec.rank),
        ),
        meta(
            "thread_name",
            1000 + rec.rank,
            format!("rank {} collectives", rec.rank),
        ),
    ];
    events.extend(rec.events);
    // An elastic restart's process says so at the start of its timeline (an instant event
    // that trace viewers draw as a marker) and in the trace's data.
    let elastic = crate::job::Elastic::from_env().ok().flatten();
    if let Some(el) = &elastic {
        events.push(Event {
            name: format!("elastic restart: epoch {}", el.epoch),
            cat: "elastic".into(),
            ph: "i".into(),
            ts: 0.0,
            dur: None,
            pid: rec.node,
            tid: rec.rank,
            args: serde_json::json!({ "restarts": el.restarts }),
        });
    }
    let body = serde_json::json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "rank": rec.rank,
            "node": rec.node,
            "world": world,
            "clock_offset_us": rec.offset_us,
            "clock_accuracy_us": rec.accuracy_us,
            "dropped_events": rec.dropped,
            "device": rec.device,
            "elastic": rec.healed.or_else(|| elastic.map(|e| serde_json::json!({
                "epoch": e.epoch,
                "restarts": e.restarts,
            }))),
        },
    });
    let path = dir.join(format!("trace-rank{}.json", rec.rank));
    let tmp = path.with_extension("json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec(&body).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&tmp, &path)?;
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    #[test]
    fn u64_round_trips_through_f32() {
        for v in [0, 1, 65535, 1 << 40, u64::MAX, 0x0123_4567_89ab_cdef] {
            assert_eq!(super::f32s_to_u64(&super::u64_to_f32s(v)), v);
        }
    }
}
