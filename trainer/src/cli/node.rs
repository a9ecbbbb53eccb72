//! Flags every node-level subcommand shares: how to find the other nodes (flags, torchrun or
//! Slurm environment), the job token, and transport tuning. Turned into a `NodeConfig`.

use anyhow::{Context, Result, bail};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use wiretrain_comm::NodeConfig;
use wiretrain_comm::config::{EnvRendezvous, resolve};
use wiretrain_comm::tls::Token;

#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// Number of node processes in the job (default: from torchrun/Slurm env, else 1).
    #[arg(long)]
    pub nnodes: Option<usize>,
    /// This node's rank; 0 hosts the coordinator. Others may omit it to be assigned one.
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Coordinator address host:port (node 0 listens there).
    #[arg(long)]
    pub master: Option<String>,
    /// Local address to bind (default: the master address on node 0, any port elsewhere).
    #[arg(long)]
    pub bind: Option<SocketAddr>,
    /// Ranks (devices) this node hosts, one thread each.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_node: usize,
    /// File holding the job token (else WIRETRAIN_TOKEN; single-node jobs make one up).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Seconds to wait for every node at rendezvous.
    #[arg(long, default_value_t = 60.0)]
    pub rendezvous_timeout: f64,
    /// Seconds any one collective may take before it fails naming what it waited for.
    #[arg(long, default_value_t = 120.0)]
    pub collective_timeout: f64,
    /// Seconds of silence after which a peer node is declared dead.
    #[arg(long, default_value_t = 10.0)]
    pub idle_timeout: f64,
    /// Upper bound of QUIC path-MTU discovery (UDP payload bytes; default 8952, jumbo frames:
    /// discovery settles on what the path carries, 1452+ on 1500-byte Ethernet).
    #[arg(long)]
    pub mtu: Option<u16>,
    /// Payload bytes per data frame.
    #[arg(long)]
    pub frame_bytes: Option<usize>,
    /// Threads for QUIC packet processing and crypto in this node process (at least one per
    /// local rank: each rank's inter-node transfers run there too).
    #[arg(long, default_value_t = 2)]
    pub net_threads: usize,
    /// QUIC congestion controller: cubic, bbr or newreno.
    #[arg(long, default_value = "cubic")]
    pub congestion: String,
    /// Node 0 writes its bound address here (used by local launchers).
    #[arg(long, hide = true)]
    pub addr_file: Option<PathBuf>,
    /// Announce another protocol version (testing only).
    #[arg(long, hide = true)]
    pub protocol_version_override: Option<u32>,
}

fn secs(field: &str, v: f64) -> Result<Duration> {
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
        bail!("--{field}: {v} is not a number of seconds in (0, 86400]");
    }
    Ok(Duration::from_secs_f64(v))
}

impl NodeArgs {
    /// Builds the node configuration from flags, then environment.
    pub fn config(&self) -> Result<NodeConfig> {
        let (nnodes, node_rank, master) = match &self.master {
            Some(m) => {
                let nnodes = self.nnodes.context("--nnodes is required with --master")?;
                let addr = resolve(m).with_context(|| format!("--master {m}"))?;
                (nnodes, self.node_rank, addr)
            }
            None => match EnvRendezvous::from_env(|k| std::env::var(k).ok())
                .context("reading rendezvous environment")?
            {
                Some(env) => {
                    tracing::info!(source = env.source, "rendezvous from environment");
                    let addr = env.master_addr()?;
                    (
                        self.nnodes.unwrap_or(env.nnodes),
                        Some(self.node_rank.unwrap_or(env.node_rank)),
                        addr,
                    )
                }
                None => {
                    let n = self.nnodes.unwrap_or(1);
                    if n != 1 {
                        bail!(
                            "--nnodes {n} needs --master host:port (or MASTER_ADDR / Slurm environment)"
                        );
                    }
                    (1, Some(0), "127.0.0.1:0".parse().expect("static address"))
                }
            },
        };
        let token = match (
            std::env::var("WIRETRAIN_TOKEN")
                .ok()
                .filter(|t| !t.is_empty()),
            &self.token_file,
        ) {
            (Some(t), _) => Token::from(t),
            (None, Some(p)) => {
                let t = std::fs::read_to_string(p)
                    .with_context(|| format!("--token-file {}", p.display()))?;
                let t = t.trim();
                if t.is_empty() {
                    bail!("--token-file {}: the file is empty", p.display());
                }
                Token::from(t)
            }
            (None, None) if nnodes == 1 => Token::generate(),
            (None, None) => bail!(
                "a multi-node job needs a shared secret: set WIRETRAIN_TOKEN or pass --token-file on every node"
            ),
        };
        let mut cfg = NodeConfig::new(nnodes, node_rank, master, self.ranks_per_node, token)
            .context("node configuration")?;
        if let Some(b) = self.bind {
            cfg.bind(b);
        }
        if let Some(p) = &self.addr_file {
            cfg.addr_file(p.clone());
        }
        cfg.rendezvous_timeout(secs("rendezvous-timeout", self.rendezvous_timeout)?)
            .collective_timeout(secs("collective-timeout", self.collective_timeout)?);
        cfg.quic()
            .idle_timeout(secs("idle-timeout", self.idle_timeout)?)
            .context("--idle-timeout")?;
        cfg.quic()
            .net_threads(self.net_threads)
            .context("--net-threads")?;
        cfg.quic().congestion(
            self.congestion
                .parse()
                .map_err(|e| anyhow::anyhow!("--congestion: {e}"))?,
        );
        if let Some(m) = self.mtu {
            cfg.quic().mtu_upper_bound(m).context("--mtu")?;
        }
        if let Some(f) = self.frame_bytes {
            cfg.quic().frame_bytes(f).context("--frame-bytes")?;
        }
        if let Some(v) = self.protocol_version_override {
            cfg.protocol_version_override(v);
        }
        Ok(cfg)
    }
}
