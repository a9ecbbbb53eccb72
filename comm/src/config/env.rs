//! What a launcher's environment says about the job: torchrun's variables (`MASTER_ADDR`,
//! `NNODES`/`WORLD_SIZE`, `NODE_RANK`) or Slurm's (`SLURM_NNODES`, `SLURM_NODEID`,
//! `SLURM_JOB_NODELIST`), read as one process per node; several processes per node are refused
//! with the flags that give one.

use crate::error::ConfigError;
use std::net::{SocketAddr, ToSocketAddrs};

/// Rendezvous settings found in the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvRendezvous {
    /// Where the variables came from ("torchrun" or "slurm").
    pub source: &'static str,
    /// The coordinator's host: `MASTER_ADDR`, or the first host of `SLURM_JOB_NODELIST`.
    pub master_host: String,
    /// The coordinator's port: `MASTER_PORT`, else [`Self::DEFAULT_PORT`].
    pub master_port: u16,
    /// Number of nodes (`NNODES`, `WORLD_SIZE` or `SLURM_NNODES`).
    pub nnodes: usize,
    /// This node's node rank (`NODE_RANK`, `GROUP_RANK` or `SLURM_NODEID`), below `nnodes`.
    pub node_rank: usize,
}

impl EnvRendezvous {
    /// Default port when MASTER_PORT is unset (torchrun's default).
    pub const DEFAULT_PORT: u16 = 29500;

    /// Reads torchrun-style (MASTER_ADDR, MASTER_PORT, NNODES or WORLD_SIZE, NODE_RANK) or
    /// Slurm (SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST) variables. `Ok(None)` when
    /// neither set is present. WORLD_SIZE counts node processes here: one process per node.
    ///
    /// Several processes per node (torchrun's `--nproc-per-node` > 1, Slurm's
    /// `--ntasks-per-node` > 1) are refused: wiretrain runs one process per node with a
    /// thread per device, and the message says which flags give that.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, ConfigError> {
        one_process_per_node(&get)?;
        let num = |field: &'static str, v: String| -> Result<usize, ConfigError> {
            v.trim().parse().map_err(|_| ConfigError::Invalid {
                field,
                reason: format!("{v:?} is not a non-negative integer"),
            })
        };
        let port = match get("MASTER_PORT") {
            Some(p) => p.trim().parse().map_err(|_| ConfigError::Invalid {
                field: "MASTER_PORT",
                reason: format!("{p:?} is not a port number"),
            })?,
            None => Self::DEFAULT_PORT,
        };
        if let Some(host) = get("MASTER_ADDR") {
            let nnodes = match (get("NNODES"), get("WORLD_SIZE")) {
                (Some(n), _) => num("NNODES", n)?,
                (None, Some(w)) => num("WORLD_SIZE", w)?,
                (None, None) => {
                    return Err(ConfigError::Missing {
                        field: "NNODES",
                        hint: "MASTER_ADDR is set, so NNODES or WORLD_SIZE must be too",
                    });
                }
            };
            let node_rank = match get("NODE_RANK").or_else(|| get("GROUP_RANK")) {
                Some(r) => num("NODE_RANK", r)?,
                None => {
                    return Err(ConfigError::Missing {
                        field: "NODE_RANK",
                        hint: "MASTER_ADDR is set, so NODE_RANK must be too",
                    });
                }
            };
            return Self::checked("torchrun", host, port, nnodes, node_rank).map(Some);
        }
        if let (Some(n), Some(id), Some(list)) = (
            get("SLURM_NNODES"),
            get("SLURM_NODEID"),
            get("SLURM_JOB_NODELIST"),
        ) {
            let host = first_slurm_host(&list).ok_or_else(|| ConfigError::Invalid {
                field: "SLURM_JOB_NODELIST",
                reason: format!("cannot read a host name from {list:?}"),
            })?;
            return Self::checked(
                "slurm",
                host,
                port,
                num("SLURM_NNODES", n)?,
                num("SLURM_NODEID", id)?,
            )
            .map(Some);
        }
        Ok(None)
    }

    fn checked(
        source: &'static str,
        master_host: String,
        master_port: u16,
        nnodes: usize,
        node_rank: usize,
    ) -> Result<Self, ConfigError> {
        if nnodes == 0 || node_rank >= nnodes {
            return Err(ConfigError::Invalid {
                field: "NODE_RANK",
                reason: format!("node rank {node_rank} is not below {nnodes} nodes"),
            });
        }
        Ok(Self {
            source,
            master_host,
            master_port,
            nnodes,
            node_rank,
        })
    }

    /// Resolves the master host name.
    pub fn master_addr(&self) -> Result<SocketAddr, ConfigError> {
        resolve(&format!("{}:{}", self.master_host, self.master_port))
    }
}

/// Refuses a launch of several processes on one node, naming the flags that give one.
fn one_process_per_node(get: &impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
    if let Some(v) = get("LOCAL_WORLD_SIZE")
        && v.trim().parse::<usize>().is_ok_and(|n| n > 1)
    {
        return Err(ConfigError::Invalid {
            field: "LOCAL_WORLD_SIZE",
            reason: format!(
                "torchrun started {} processes on this node, but wiretrain runs one process per \
                 node with one thread per device: start it with `torchrun --nproc-per-node 1` \
                 and give wiretrain `--ranks-per-node {}` (or WIRETRAIN_RANKS_PER_NODE)",
                v.trim(),
                v.trim()
            ),
        });
    }
    let slurm = get("SLURM_STEP_TASKS_PER_NODE").or_else(|| get("SLURM_TASKS_PER_NODE"));
    if let Some(list) = slurm
        && let Some(most) = most_tasks_per_node(&list)
        && most > 1
    {
        return Err(ConfigError::Invalid {
            field: "SLURM_STEP_TASKS_PER_NODE",
            reason: format!(
                "Slurm started {most} tasks on a node ({list}), but wiretrain runs one task per \
                 node with one thread per device: use `srun --ntasks-per-node=1` (or \
                 `#SBATCH --ntasks-per-node=1`, with `--gpus-per-task` or `--cpus-per-task` for \
                 the node's devices) and give wiretrain `--ranks-per-node {most}`"
            ),
        });
    }
    Ok(())
}

/// The largest count of Slurm's tasks-per-node list (`2(x3),1` -> 2); `None` when it does
/// not parse.
pub(crate) fn most_tasks_per_node(list: &str) -> Option<usize> {
    list.split(',')
        .map(|part| {
            let count = part.split('(').next().unwrap_or(part);
            count.trim().parse::<usize>().ok()
        })
        .try_fold(0, |most, n| n.map(|n| most.max(n)))
}

/// Resolves "host:port" to the first address.
pub fn resolve(hostport: &str) -> Result<SocketAddr, ConfigError> {
    hostport
        .to_socket_addrs()
        .map_err(|e| ConfigError::Invalid {
            field: "master",
            reason: format!("cannot resolve {hostport:?}: {e}"),
        })?
        .next()
        .ok_or_else(|| ConfigError::Invalid {
            field: "master",
            reason: format!("{hostport:?} resolves to no address"),
        })
}

/// The first host of a Slurm node list such as `gpu[01-04,07],cpu1`: `gpu01`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let first_end = {
        let mut depth = 0;
        let mut end = list.len();
        for (i, c) in list.char_indices() {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        end
    };
    let first = &list[..first_end];
    let host = match first.find('[') {
        None => first.to_string(),
        Some(open) => {
            let inner = first[open + 1..].trim_end_matches(']');
            let range = inner.split(',').next()?;
            let start = range.split('-').next()?;
            format!("{}{}", &first[..open], start)
        }
    };
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn several_processes_per_node_are_refused_with_the_flags_that_give_one() {
        // Node 1 of a two-node Slurm step, with one more variable.
        let slurm_with = |k: &'static str, v: &'static str| {
            EnvRendezvous::from_env(env(&[
                ("SLURM_NNODES", "2"),
                ("SLURM_NODEID", "1"),
                ("SLURM_JOB_NODELIST", "n[1-2]"),
                (k, v),
            ]))
        };
        let refused = |r: Result<Option<EnvRendezvous>, ConfigError>| r.unwrap_err().to_string();
        let torchrun = refused(slurm_with("LOCAL_WORLD_SIZE", "4"));
        assert!(torchrun.contains("--nproc-per-node 1"), "{torchrun}");
        assert!(torchrun.contains("--ranks-per-node 4"), "{torchrun}");
        let slurm = refused(slurm_with("SLURM_STEP_TASKS_PER_NODE", "1,2"));
        assert!(slurm.contains("--ntasks-per-node=1"), "{slurm}");
        assert!(slurm.contains("--ranks-per-node 2"), "{slurm}");
        let slurm = refused(slurm_with("SLURM_TASKS_PER_NODE", "2(x2)"));
        assert!(slurm.contains("--ranks-per-node 2"), "{slurm}");
        // One process per node passes, with the counts Slurm and torchrun write.
        for (k, v) in [
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
            ("LOCAL_WORLD_SIZE", "1"),
        ] {
            assert_eq!(slurm_with(k, v).unwrap().unwrap().node_rank, 1);
        }
        assert_eq!(most_tasks_per_node("2(x3),1"), Some(2));
        assert_eq!(most_tasks_per_node("1(x16)"), Some(1));
        assert_eq!(most_tasks_per_node("x"), None);
    }

    #[test]
    fn torchrun_env() {
        let e = EnvRendezvous::from_env(env(&[
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("WORLD_SIZE", "2"),
            ("NODE_RANK", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.source, e.nnodes, e.node_rank, e.master_port),
            ("torchrun", 2, 1, 1234)
        );
        assert_eq!(e.master_addr().unwrap(), "127.0.0.1:1234".parse().unwrap());
        assert!(EnvRendezvous::from_env(env(&[("MASTER_ADDR", "h")])).is_err());
        assert!(
            EnvRendezvous::from_env(env(&[
                ("MASTER_ADDR", "h"),
                ("NNODES", "2"),
                ("NODE_RANK", "2")
            ]))
            .is_err()
        );
        assert!(
            EnvRendezvous::from_env(env(&[("MASTER_PORT", "x"), ("MASTER_ADDR", "h")])).is_err()
        );
        assert_eq!(EnvRendezvous::from_env(env(&[])).unwrap(), None);
    }

    #[test]
    fn slurm_env() {
        let e = EnvRendezvous::from_env(env(&[
            ("SLURM_NNODES", "4"),
            ("SLURM_NODEID", "3"),
            ("SLURM_JOB_NODELIST", "gpu[07-10],cpu1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.master_host.as_str(), e.nnodes, e.node_rank),
            ("gpu07", 4, 3)
        );
        assert_eq!(e.master_port, EnvRendezvous::DEFAULT_PORT);
    }

    #[test]
    fn slurm_lists() {
        assert_eq!(first_slurm_host("node1").as_deref(), Some("node1"));
        assert_eq!(first_slurm_host("a[3,5-7],b").as_deref(), Some("a3"));
        assert_eq!(first_slurm_host("x1,x2").as_deref(), Some("x1"));
        assert_eq!(first_slurm_host(""), None);
    }
}
