//! `wiretrain train`'s settings: flags over `run.toml` over defaults, each checked once with a
//! clear one-line error naming the flag (the trainer's own settings through its builder).

use super::TrainArgs;
use crate::cli::usage;
use anyhow::Result;
use serde::Deserialize;
use std::path::PathBuf;
use wiretrain::balance::Balance;
use wiretrain::checkpoint::{CheckpointError, DirLock};
use wiretrain::device::{DeviceSpec, parse_specs};
use wiretrain::engine::{ConfigError, Diloco, Overlap, TrainerConfig};
use wiretrain::fit::CheckpointPlan;
use wiretrain::models::Example;
use wiretrain::strategy::Strategy;
use wiretrain_comm::WireDtype;

/// `run.toml`: the same names as the flags, with underscores.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    example: Option<String>,
    strategy: Option<String>,
    steps: Option<usize>,
    global_batch: Option<usize>,
    lr: Option<f64>,
    seed: Option<u64>,
    device: Option<String>,
    share_device: Option<bool>,
    bucket_bytes: Option<usize>,
    accumulate: Option<usize>,
    prefetch: Option<usize>,
    overlap: Option<String>,
    wire_dtype: Option<String>,
    fused_optimizer: Option<bool>,
    balance: Option<String>,
    shares: Option<String>,
    inner_steps: Option<usize>,
    inner_strategy: Option<String>,
    allow: Option<String>,
    outer_lr: Option<f32>,
    outer_momentum: Option<f32>,
    plot: Option<PathBuf>,
    d_model: Option<usize>,
    layers: Option<usize>,
    checkpoint_every: Option<usize>,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_keep: Option<usize>,
    resume: Option<bool>,
}

/// The resolved run settings.
#[derive(Debug, Clone)]
pub(super) struct Run {
    pub(super) example: Example,
    /// The trainer's settings, checked once by its builder.
    pub(super) trainer: TrainerConfig,
    pub(super) steps: usize,
    pub(super) global_batch: usize,
    pub(super) seed: u64,
    /// One per local rank, or a single one for all.
    pub(super) device: Vec<DeviceSpec>,
    pub(super) share_device: bool,
    pub(super) accumulate: usize,
    pub(super) balance: Balance,
    pub(super) plot: Option<PathBuf>,
    pub(super) d_model: usize,
    pub(super) layers: usize,
    pub(super) checkpoint: Option<CheckpointPlan>,
    /// Node 0's lock on the checkpoint directory, taken before the job starts (so a second
    /// run there is refused at once) and held while the run lasts.
    #[expect(dead_code, reason = "held, never read: dropping it releases the lock")]
    pub(super) lock: Option<DirLock>,
    /// `--strategy auto`: the strategy is measured and planned at start (`trainer` holds the
    /// other settings).
    pub(super) auto: Option<AutoRun>,
}

/// `--strategy auto`'s settings.
#[derive(Debug, Clone)]
pub(super) struct AutoRun {
    /// `--allow diloco`: DiLoCo may be picked, with these inner steps (`--inner-steps`).
    pub(super) allow_diloco: Option<u64>,
    /// `--show-plan` with a named strategy: measure and print the table, train with the
    /// strategy given.
    pub(super) keep: bool,
}

impl Run {
    /// The strategy as the user named it (diloco runs on top of ddp).
    pub(super) fn strategy_name(&self) -> String {
        if self.auto.as_ref().is_some_and(|a| !a.keep) {
            "auto".into()
        } else if self.trainer.diloco().is_some() {
            "diloco".into()
        } else {
            self.trainer.strategy().to_string()
        }
    }
}

/// The flag behind a trainer configuration error (the builder checks what the flags set).
fn flag_of(e: &ConfigError) -> &'static str {
    match e {
        ConfigError::Lr(_) => "--lr",
        ConfigError::BucketTooSmall(_) => "--bucket-bytes",
        ConfigError::Prefetch(_) => "--prefetch",
        ConfigError::DilocoStrategy(_) => "--inner-strategy",
        ConfigError::DilocoInnerSteps => "--inner-steps",
        ConfigError::OuterLr(_) => "--outer-lr",
        ConfigError::OuterMomentum(_) => "--outer-momentum",
        _ => "the configuration",
    }
}

impl TrainArgs {
    pub(super) fn resolve(&self) -> Result<Run> {
        let file = self.file()?;
        let example: Example = self
            .example
            .clone()
            .or(file.example.clone())
            .unwrap_or_else(|| "mlp".into())
            .parse()
            .map_err(|e| crate::cli::usage_error(format!("--example: {e}")))?;
        let auto = self.auto(&file)?;
        let (strategy, diloco) = match auto {
            Some(AutoRun { keep: false, .. }) => (Strategy::Ddp, None),
            _ => self.strategy(&file)?,
        };
        let device = self.device(&file)?;
        let share_device = self.share_device || file.share_device.unwrap_or(false);
        let lr = self.lr.or(file.lr).unwrap_or(example.default_lr());
        let steps = self.steps.or(file.steps).unwrap_or(100);
        if steps == 0 {
            usage!("--steps must be at least 1");
        }
        let bucket_bytes = self.bucket_bytes.or(file.bucket_bytes).unwrap_or(25 << 20);
        let accumulate = self.accumulate.or(file.accumulate).unwrap_or(1);
        if accumulate == 0 {
            usage!("--accumulate must be at least 1");
        }
        wiretrain::fit::check_accumulate(accumulate, strategy)
            .map_err(|e| crate::cli::usage_error(format!("--accumulate: {e}")))?;
        let (d_model, layers) = self.model_size(&file)?;
        let prefetch = self.prefetch.or(file.prefetch).unwrap_or(1);
        let overlap = self.overlap(&file, accumulate)?;
        let wire: WireDtype = self
            .wire_dtype
            .clone()
            .or(file.wire_dtype.clone())
            .unwrap_or_else(|| "f32".into())
            .parse()
            .map_err(|e| crate::cli::usage_error(format!("--wire-dtype: {e}")))?;
        let balance = self.balance(&file, accumulate)?;
        let plot = self
            .plot
            .clone()
            .or(file.plot.clone())
            .or_else(|| self.metrics.as_ref().map(|m| m.with_extension("png")));
        let (checkpoint, lock) = self.checkpoint(&file)?;
        let checkpoint_timeout = self.checkpoint_timeout()?;
        let trainer = TrainerConfig::builder(strategy)
            .lr(lr)
            .bucket_bytes(bucket_bytes)
            .prefetch(prefetch)
            .overlap(overlap)
            .wire(wire)
            .fused_optimizer(!self.no_fused_optimizer && file.fused_optimizer.unwrap_or(true))
            .device_resident(!self.host_path)
            .trust_rank0_checkpoints(self.trust_rank0_checkpoints)
            .diloco(diloco)
            .checkpoint_timeout(checkpoint_timeout)
            // The binary is where the environment's injected faults enter (wiretrain::faults).
            .faults(wiretrain::faults::Faults::from_env())
            .build()
            .map_err(|e| crate::cli::usage_error(format!("{}: {e}", flag_of(&e))))?;
        Ok(Run {
            checkpoint,
            lock,
            example,
            trainer,
            steps,
            global_batch: self.global_batch.or(file.global_batch).unwrap_or(64),
            seed: self.seed.or(file.seed).unwrap_or(1),
            device,
            share_device,
            accumulate,
            balance,
            plot,
            d_model,
            layers,
            auto,
        })
    }

    /// `--checkpoint-timeout` in seconds (default 600), within 1..=86400.
    fn checkpoint_timeout(&self) -> Result<std::time::Duration> {
        Ok(match self.checkpoint_timeout {
            None => std::time::Duration::from_secs(600),
            Some(t) if t.is_finite() && (1.0..=86_400.0).contains(&t) => {
                std::time::Duration::from_secs_f64(t)
            }
            Some(t) => usage!("--checkpoint-timeout: {t} is outside 1..=86400 seconds"),
        })
    }

    /// `--strategy auto` and `--allow`: what the planner may pick. Fixed shares are refused
    /// (the plan is for equal ones), and so is `--allow` without auto.
    fn auto(&self, file: &FileConfig) -> Result<Option<AutoRun>> {
        let strategy = self.strategy.clone().or(file.strategy.clone());
        let allow = self.allow.clone().or(file.allow.clone());
        if strategy.as_deref() != Some("auto") {
            if allow.is_some() {
                usage!("--allow belongs to --strategy auto (what the planner may pick)");
            }
            // With a DiLoCo run given, its rows are planned (with its inner steps) so that
            // the table shows what it costs.
            let diloco = strategy.as_deref() == Some("diloco");
            let inner = self.inner_steps.or(file.inner_steps);
            return Ok(self.show_plan.then(|| AutoRun {
                allow_diloco: diloco.then(|| inner.unwrap_or(Diloco::default().inner_steps) as u64),
                keep: true,
            }));
        }
        if self.shares.is_some() || file.shares.is_some() {
            usage!(
                "--strategy auto plans equal shares of the batch; it cannot go with --shares \
                 (name a strategy, or drop --shares)"
            );
        }
        let diloco = crate::cli::plan::allowed(allow.as_deref())?;
        let inner = self.inner_steps.or(file.inner_steps);
        if self.inner_strategy.is_some()
            || self.outer_lr.is_some()
            || self.outer_momentum.is_some()
            || (inner.is_some() && !diloco)
        {
            usage!(
                "--strategy auto sets DiLoCo's inner strategy itself; --inner-steps goes with \
                 --allow diloco, --outer-lr and --outer-momentum with --strategy diloco"
            );
        }
        Ok(Some(AutoRun {
            allow_diloco: diloco.then(|| inner.unwrap_or(Diloco::default().inner_steps) as u64),
            keep: false,
        }))
    }

    /// `--overlap`: `on` needs one micro-batch per step (gradients accumulate before any
    /// reduction), so `auto` is off with more.
    fn overlap(&self, file: &FileConfig, accumulate: usize) -> Result<Overlap> {
        let overlap: Overlap = self
            .overlap
            .clone()
            .or(file.overlap.clone())
            .unwrap_or_else(|| "auto".into())
            .parse()
            .map_err(|e| crate::cli::usage_error(format!("--overlap: {e}")))?;
        Ok(match (overlap, accumulate) {
            (Overlap::On, 2..) => usage!(
                "--overlap on needs --accumulate 1: micro-batches accumulate their gradients \
                 before any reduction (use --overlap off or auto)"
            ),
            (Overlap::Auto, 2..) => Overlap::Off,
            (o, _) => o,
        })
    }

    /// One device spec for every rank of the node, or one per local rank ("wgpu:cpu,cpu").
    fn device(&self, file: &FileConfig) -> Result<Vec<DeviceSpec>> {
        let device = self
            .device
            .clone()
            .or(file.device.clone())
            .unwrap_or_else(|| "auto".into());
        parse_specs(&device).map_err(|e| crate::cli::usage_error(format!("--device: {e}")))
    }

    /// The char-lm example's width and depth.
    fn model_size(&self, file: &FileConfig) -> Result<(usize, usize)> {
        let d_model = self.d_model.or(file.d_model).unwrap_or(64);
        if d_model == 0 || !d_model.is_multiple_of(4) || d_model > 8192 {
            usage!(
                "--d-model: {d_model} must be a positive multiple of 4 (the heads), at most 8192"
            );
        }
        let layers = self.layers.or(file.layers).unwrap_or(2);
        if !(1..=64).contains(&layers) {
            usage!("--layers: {layers} is outside 1..=64");
        }
        Ok((d_model, layers))
    }

    /// `--config`'s settings (none without it).
    fn file(&self) -> Result<FileConfig> {
        let Some(p) = &self.config else {
            return Ok(FileConfig::default());
        };
        let text = std::fs::read_to_string(p)
            .map_err(|e| crate::cli::usage_error(format!("--config {}: {e}", p.display())))?;
        toml::from_str(&text).map_err(|e| {
            crate::cli::usage_error(format!("--config {}: {}", p.display(), e.message()))
        })
    }

    /// The strategy, and DiLoCo's settings when it wraps it (`--strategy diloco` runs
    /// `--inner-strategy` inside each node).
    fn strategy(&self, file: &FileConfig) -> Result<(Strategy, Option<Diloco>)> {
        let strategy = self
            .strategy
            .clone()
            .or(file.strategy.clone())
            .unwrap_or_else(|| "ddp".into());
        let diloco = (strategy == "diloco").then(|| {
            let d = Diloco::default();
            Diloco {
                inner_steps: self
                    .inner_steps
                    .or(file.inner_steps)
                    .unwrap_or(d.inner_steps),
                outer_lr: self.outer_lr.or(file.outer_lr).unwrap_or(d.outer_lr),
                outer_momentum: self
                    .outer_momentum
                    .or(file.outer_momentum)
                    .unwrap_or(d.outer_momentum),
            }
        });
        if diloco.is_none()
            && (self.inner_steps.is_some()
                || self.outer_lr.is_some()
                || self.outer_momentum.is_some()
                || self.inner_strategy.is_some())
        {
            usage!(
                "--inner-steps, --inner-strategy, --outer-lr and --outer-momentum belong to \
                 --strategy diloco"
            );
        }
        let strategy: Strategy = if diloco.is_some() {
            self.inner_strategy
                .clone()
                .or(file.inner_strategy.clone())
                .as_deref()
                .unwrap_or("ddp")
                .parse()
                .map_err(|e| crate::cli::usage_error(format!("--inner-strategy: {e}")))?
        } else {
            strategy
                .parse()
                .map_err(|e| crate::cli::usage_error(format!("--strategy: {e} (or diloco)")))?
        };
        Ok((strategy, diloco))
    }

    /// How the global batch is shared: equal, fixed (`--shares`) or by speed.
    fn balance(&self, file: &FileConfig, accumulate: usize) -> Result<Balance> {
        let balance = match (
            self.shares.clone().or(file.shares.clone()),
            self.balance.clone().or(file.balance.clone()).as_deref(),
        ) {
            (Some(list), None | Some("fixed")) => Balance::Fixed(
                list.split(',')
                    .map(|x| x.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| crate::cli::usage_error(format!("--shares {list:?}: {e}")))?,
            ),
            (Some(_), Some(b)) => {
                usage!("--shares sets fixed shares; it cannot go with --balance {b}")
            }
            (None, None | Some("equal")) => Balance::Equal,
            (None, Some("speed")) => Balance::Speed,
            (None, Some(other)) => usage!("--balance: {other:?} is not equal or speed"),
        };
        if balance != Balance::Equal && accumulate > 1 {
            usage!("--balance/--shares: uneven shares need --accumulate 1");
        }
        Ok(balance)
    }

    /// Where and how often checkpoints go, checked before the job starts.
    fn checkpoint(&self, file: &FileConfig) -> Result<(Option<CheckpointPlan>, Option<DirLock>)> {
        let every = self.checkpoint_every.or(file.checkpoint_every);
        let keep = self.checkpoint_keep.or(file.checkpoint_keep).unwrap_or(2);
        let resume = self.resume || file.resume.unwrap_or(false);
        if every == Some(0) {
            usage!("--checkpoint-every must be at least 1");
        }
        if keep == 0 {
            usage!("--checkpoint-keep must be at least 1");
        }
        let checkpoint = match self.checkpoint_dir.clone().or(file.checkpoint_dir.clone()) {
            Some(dir) => {
                if resume && self.overwrite_checkpoints {
                    usage!("--overwrite-checkpoints starts afresh; it cannot go with --resume");
                }
                // A node joining a running job in place writes into that job's directory.
                let joining = std::env::var(wiretrain::job::env::HEAL_JOIN).is_ok_and(|v| v == "1");
                let lock = match joining {
                    true => None,
                    false => self.lock_as_node0(&dir)?,
                };
                if !resume && !self.overwrite_checkpoints && !joining {
                    // Refused here, before joining, with exit 2; the trainer checks again.
                    wiretrain::checkpoint::ensure_unused(&dir)
                        .map_err(|e| crate::cli::usage_error(format!("--checkpoint-dir: {e}")))?;
                }
                let plan = CheckpointPlan {
                    dir,
                    every,
                    keep,
                    resume,
                    overwrite: self.overwrite_checkpoints,
                };
                (Some(plan), lock)
            }
            None if every.is_some() || resume => {
                usage!("--checkpoint-every and --resume need --checkpoint-dir")
            }
            None => (None, None),
        };
        Ok(checkpoint)
    }

    /// On node 0 (where the job says so before it starts), the lock on `dir`: a directory
    /// another run holds is refused (exit 2), naming the holder.
    fn lock_as_node0(&self, dir: &std::path::Path) -> Result<Option<DirLock>> {
        let node = self.node.options()?.node_config().ok();
        if node.and_then(|c| c.node_rank()) != Some(0) {
            return Ok(None);
        }
        match DirLock::acquire(dir) {
            Ok(l) => Ok(Some(l)),
            Err(e @ CheckpointError::Locked { .. }) => {
                Err(crate::cli::usage_error(format!("--checkpoint-dir: {e}")))
            }
            Err(e) => Err(anyhow::Error::new(e).context("--checkpoint-dir")),
        }
    }
}
