//! The model that DDP cannot hold: the GPT-2-style example at GPT-2 small's shapes (163M
//! parameters with its own head) on 2 nodes x 2 ranks, each node process in a memory cgroup
//! of its own that this test makes (v1 `memory.limit_in_bytes` or v2 `memory.max`). The
//! planner predicts that DDP does not fit and ZeRO-3 does; DDP is refused at start with the
//! planner's figure and the cap; ZeRO-3 trains under the same cap, its peak read from the
//! kernel's own accounting of each cgroup.

mod common;

use std::path::PathBuf;
use std::time::Duration;

/// Each node process's cap: between ZeRO-3's measured peak (about 3.2 GB a node) and DDP's
/// model state as the planner counts it (2 ranks x 2.61 GB).
const CAP: u64 = 4_500_000_000;

/// One memory cgroup per node, removed when dropped.
struct Cgroups {
    dirs: Vec<PathBuf>,
    /// The kernel's peak usage file (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`).
    peak: &'static str,
}

impl Cgroups {
    /// `n` cgroups limited to `cap` bytes each, or why they cannot be made here.
    fn make(n: usize, cap: u64) -> Result<Self, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let name = format!("wiretrain-cap-{}", std::process::id());
        // v1: children of this process's memory cgroup.
        let v1 = own.lines().find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, c, path) = (p.next()?, p.next()?, p.next()?);
            c.split(',')
                .any(|c| c == "memory")
                .then(|| PathBuf::from("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')))
        });
        // v2: siblings of this process's cgroup (one with processes has no child cgroups).
        let v2 = own.lines().find_map(|l| l.strip_prefix("0::")).map(|p| {
            let own = PathBuf::from("/sys/fs/cgroup").join(p.trim_start_matches('/'));
            own.parent().map_or(own.clone(), |d| d.to_path_buf())
        });
        let (base, limit, peak) = match (v1, v2) {
            (Some(b), _) if b.exists() => (b, "memory.limit_in_bytes", "memory.max_usage_in_bytes"),
            (_, Some(b)) if b.join("cgroup.subtree_control").exists() => {
                (b, "memory.max", "memory.peak")
            }
            _ => return Err("no memory cgroup hierarchy is mounted".into()),
        };
        let mut made = Self {
            dirs: Vec::new(),
            peak,
        };
        for i in 0..n {
            let d = base.join(format!("{name}-node{i}"));
            std::fs::create_dir(&d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
            made.dirs.push(d.clone());
            std::fs::write(d.join(limit), cap.to_string())
                .map_err(|e| format!("{}: {e}", d.join(limit).display()))?;
        }
        Ok(made)
    }

    /// The prefix the node wrapper appends its node rank to.
    fn prefix(&self) -> String {
        let s = self.dirs[0].to_string_lossy();
        s.strip_suffix('0').unwrap().to_string()
    }

    fn peaks(&self) -> Vec<u64> {
        self.dirs
            .iter()
            .map(|d| {
                let t = std::fs::read_to_string(d.join(self.peak)).unwrap();
                t.trim().parse().unwrap()
            })
            .collect()
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// `launch --local 2 --ranks-per-node 2` of the example at the small preset under
/// `strategy`, each node moved into its cgroup before it starts.
fn capped(cg: &Cgroups, strategy: &str, metrics: &std::path::Path) -> std::process::Output {
    let ex = common::example("gpt2");
    let wrapper =
        r#"echo $$ > "$WIRETRAIN_TEST_CGROUP$WIRETRAIN_NODE_RANK/cgroup.procs" && exec "$0" "$@""#;
    let args = common::local(
        "2",
        "2",
        &[
            "/bin/sh",
            "-c",
            wrapper,
            ex.to_str().unwrap(),
            "--preset",
            "small",
            "--seq",
            "64",
            "--batch",
            "4",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--strategy",
            strategy,
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    );
    let prefix = cg.prefix();
    common::run(
        &args,
        &[("WIRETRAIN_TEST_CGROUP", prefix.as_str())],
        Duration::from_secs(600),
    )
}

#[test]
fn gpt2_small_trains_under_zero3_in_a_memory_cap_where_ddp_is_refused() {
    let cg = match Cgroups::make(2, CAP) {
        Ok(cg) => cg,
        Err(why) => return common::skip_unless_ci(&format!("memory cgroups: {why} (needs root)")),
    };
    // The planner: per device (2 per node), DDP's model state is above half the cap, ZeRO-3's
    // below it (163,037,184 parameters at 1,024 positions; the run's 64 make 162,299,904).
    let per_device = format!("{}", CAP as f64 / 2.0 / 1e9);
    let rows = common::json_rows(
        &[
            "plan",
            "--params",
            "163037184",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
        ]
        .into_iter()
        .chain(["--device-mem", &per_device, "--precision", "f32", "--json"])
        .collect::<Vec<_>>(),
        Duration::from_secs(30),
        6,
    );
    let fits = |name: &str| rows.iter().find(|r| r["name"] == name).unwrap()["fits"].clone();
    assert_eq!(fits("ddp"), false, "{rows:?}");
    assert_eq!(fits("zero3"), true, "{rows:?}");

    let d = common::fresh_dir("wiretrain-memory-cap", "run");
    let out = capped(&cg, "ddp", &d.join("ddp.jsonl"));
    let text = common::text(&out);
    assert!(
        !out.status.success(),
        "ddp must not run under the cap: {text}"
    );
    assert!(
        text.contains("ddp needs about 5.19 GB of model state in this process (2 rank(s)")
            && text.contains("above its memory cap of 4.50 GB")
            && text.contains("zero3 (about 1.30 GB)"),
        "ddp is refused with the planner's figure and the cap: {text}"
    );
    assert!(
        !text.contains("SIGKILL") && !text.contains("signal: 9"),
        "refused, not killed: {text}"
    );
    let refusal = text
        .lines()
        .find(|l| l.contains("ddp needs about"))
        .unwrap();
    eprintln!("ddp under the same cap: {refusal}");

    let metrics = d.join("zero3.jsonl");
    let out = capped(&cg, "zero3", &metrics);
    assert!(
        out.status.success(),
        "zero3 under the cap: {}",
        common::text(&out)
    );
    let rows = common::jsonl(&metrics);
    let summary = rows.last().unwrap();
    assert_eq!(summary["world"], 4, "{summary}");
    let losses: Vec<f64> = rows.iter().filter_map(|r| r["loss"].as_f64()).collect();
    assert_eq!(losses.len(), 2, "{rows:?}");
    assert!(losses[1] < losses[0], "it learns: {losses:?}");
    let peaks = cg.peaks();
    let rss: Vec<u64> = summary["memory_per_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["peak_rss_bytes"].as_u64().unwrap())
        .collect();
    let heap: Vec<u64> = summary["memory_per_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["peak_heap_bytes"].as_u64().unwrap_or(0))
        .collect();
    eprintln!(
        "zero3, 163M parameters, 2x2 under a {CAP} B cap per node: kernel peaks {peaks:?} B, \
         peak RSS per rank {rss:?} B, peak heap per process (counting allocator, during the \
         steps) {heap:?} B, losses {losses:?}, {} samples/s, median step {} ms",
        summary["samples_per_s"], summary["median"]["step_ms"]
    );
    assert!(peaks.iter().all(|&p| p > 0 && p <= CAP), "{peaks:?}");
    let _ = std::fs::remove_dir_all(&d);
}
