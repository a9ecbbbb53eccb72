//! This process's memory cap, and the start-up check that a strategy's model state fits
//! under it.
//!
//! The cap is the smallest limit of the process's cgroup and its ancestors: cgroup v2's
//! `memory.max`, or v1's `memory.limit_in_bytes` (Slurm's `--mem`, a container's limit, a
//! cgroup made for the job). A trainer whose model state (the planner's figure:
//! [`crate::plan::PlanInput::model_states`] in f32, for every rank this process holds) is
//! already above the cap is refused before it allocates anything of its own, with both
//! figures and the strategies that would fit, rather than killed by the kernel mid-run.

use crate::error::ConfigError;
use crate::plan::{Link, PLANNED, PlanInput, Precision};
use crate::strategy::Strategy;
use std::path::Path;

/// This process's memory cap in bytes; `None` where there is none (or it is not readable).
pub fn process_memory_cap() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let v2_root = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        Path::new("/sys/fs/cgroup")
    } else {
        Path::new("/sys/fs/cgroup/unified")
    };
    cap_from(&cgroups, v2_root, Path::new("/sys/fs/cgroup/memory"))
}

/// The cap that `/proc/self/cgroup`'s text `cgroups` gives, with the v2 hierarchy mounted at
/// `v2_root` and v1's memory controller at `v1_root`: the smallest limit on the way from the
/// process's cgroup up to the root, over both hierarchies.
pub fn cap_from(cgroups: &str, v2_root: &Path, v1_root: &Path) -> Option<u64> {
    let mut cap: Option<u64> = None;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, file) = if id == "0" && controllers.is_empty() {
            (v2_root, "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (v1_root, "memory.limit_in_bytes")
        } else {
            continue;
        };
        let mut dir = root.join(path.trim_start_matches('/'));
        loop {
            if let Some(limit) = read_limit(&dir.join(file)) {
                cap = Some(cap.map_or(limit, |c| c.min(limit)));
            }
            if dir.as_path() == root || !dir.pop() || !dir.starts_with(root) {
                break;
            }
        }
    }
    cap
}

/// A limit file's value; `None` for "max", a missing file, or v1's "no limit" (2^63 rounded
/// down to a page, and anything above 2^62).
fn read_limit(p: &Path) -> Option<u64> {
    let v: u64 = std::fs::read_to_string(p).ok()?.trim().parse().ok()?;
    (v < 1 << 62).then_some(v)
}

/// The planner's model-state bytes per rank of `strategy` (f32 parameters, gradients and
/// AdamW state) for `params` parameters on `nodes` nodes of `ranks_per_node` ranks.
pub fn model_state_bytes(
    strategy: Strategy,
    params: usize,
    nodes: usize,
    ranks_per_node: usize,
) -> f64 {
    let link = Link {
        bytes_per_s: 1.0,
        latency_s: 0.0,
    };
    let n = (nodes * ranks_per_node).max(1) as u64;
    let input = PlanInput {
        params: params as f64,
        shape: None,
        seq: 1,
        micro_batch: 1,
        global_batch: n,
        nodes: nodes.max(1) as u64,
        gpus_per_node: ranks_per_node.max(1) as u64,
        device_mem: f64::MAX,
        precision: Precision::F32,
        wire: crate::plan::WireDtype::F32,
        wire_rows: Vec::new(),
        tflops: 1.0,
        intra: link,
        inter: link,
        recompute: false,
        overlap: false,
        prefetch: false,
        rank_order: Default::default(),
        units: None,
        diloco: None,
    };
    let (p, g, o) = input.model_states(strategy);
    p + g + o
}

/// Refuses `strategy` when the model state of the `local` ranks this process holds (the
/// planner's figure) is above `cap`, naming both and the strategies that would fit.
pub fn check(
    strategy: Strategy,
    params: usize,
    (nodes, ranks_per_node, local): (usize, usize, usize),
    cap: Option<u64>,
) -> Result<(), ConfigError> {
    let Some(cap) = cap else { return Ok(()) };
    let need = |st| local as f64 * model_state_bytes(st, params, nodes, ranks_per_node);
    if need(strategy) <= cap as f64 {
        return Ok(());
    }
    let fits: Vec<String> = PLANNED
        .iter()
        .filter(|&&st| need(st) <= cap as f64)
        .map(|&st| format!("{st} (about {})", gb(need(st))))
        .collect();
    Err(ConfigError::MemoryCap {
        strategy,
        need: gb(need(strategy)),
        local,
        cap: gb(cap as f64),
        instead: if fits.is_empty() {
            "no strategy fits: raise the cap or add nodes".into()
        } else {
            format!("use {}, or raise the cap", fits.join(" or "))
        },
    })
}

/// [`check`] for a trainer on `pg`, under this process's cap.
pub(crate) fn check_group(
    strategy: Strategy,
    params: usize,
    pg: &wiretrain_comm::ProcessGroup,
) -> Result<(), ConfigError> {
    let table = pg.table();
    let local = table.ranks_on(pg.node());
    let nodes = table.nodes().len();
    check(
        strategy,
        params,
        (nodes, local, local),
        process_memory_cap(),
    )
}

fn gb(bytes: f64) -> String {
    format!("{:.2} GB", bytes / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_the_smallest_limit_up_the_hierarchy_in_either_version() {
        let d = std::env::temp_dir().join(format!("wiretrain-memcap-{}", std::process::id()));
        let (v1, v2) = (d.join("v1"), d.join("v2"));
        std::fs::create_dir_all(v1.join("job/step")).unwrap();
        std::fs::create_dir_all(v2.join("a/b")).unwrap();
        std::fs::write(v1.join("job/memory.limit_in_bytes"), "4000000000\n").unwrap();
        std::fs::write(
            v1.join("job/step/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        std::fs::write(v2.join("a/memory.max"), "3000000000\n").unwrap();
        std::fs::write(v2.join("a/b/memory.max"), "max\n").unwrap();
        let v1_only = "4:memory:/job/step\n1:cpu:/\n0::/\n";
        assert_eq!(cap_from(v1_only, &v2, &v1), Some(4_000_000_000));
        assert_eq!(cap_from("0::/a/b\n", &v2, &v1), Some(3_000_000_000));
        assert_eq!(cap_from("0::/\n3:cpu,cpuacct:/x\n", &v2, &v1), None);
        assert_eq!(cap_from("garbage\n", &v2, &v1), None);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_strategy_above_the_cap_is_refused_naming_what_fits() {
        // 100M parameters, 2 nodes x 2 ranks, 2 ranks in this process: DDP's state is 16 B a
        // parameter per rank (3.2 GB for two), ZeRO-3's a quarter of it (0.8 GB).
        let job = (2, 2, 2);
        let cap = Some(1_900_000_000);
        assert!(check(Strategy::Zero3, 100_000_000, job, cap).is_ok());
        assert!(check(Strategy::Ddp, 100_000_000, job, None).is_ok());
        let e = check(Strategy::Ddp, 100_000_000, job, cap)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3.20 GB") && e.contains("1.90 GB"), "{e}");
        assert!(e.contains("zero3 (about 0.80 GB)"), "{e}");
        assert!(e.contains("zero2 (about 1.40 GB)"), "{e}");
        assert!(
            !e.contains("zero1 ("),
            "zero1 needs 2 x 10 B a parameter: {e}"
        );
        let e = check(Strategy::Zero3, 100_000_000, job, Some(100_000_000)).unwrap_err();
        assert!(e.to_string().contains("no strategy fits"), "{e}");
    }
}
