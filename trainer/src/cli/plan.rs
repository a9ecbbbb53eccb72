//! `wiretrain plan`: per strategy, bytes per device, whether it fits, communication per step,
//! predicted step time and tokens/s, and a recommendation; `--table interconnects` prints the
//! 70B-on-16-GPUs table for five wirings. The model is in `wiretrain::plan`.

use crate::cli::usage;
use anyhow::Result;
use clap::Args;
use wiretrain::plan::{
    DilocoPlan, Link, PLANNED, PRESETS, PlanInput, Precision, Shape, WireDtype, reason,
};
use wiretrain::strategy::Strategy;

#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// Parameter count (e.g. 7.5e9); or give the transformer shape instead.
    #[arg(long)]
    pub params: Option<f64>,
    /// Transformer layers (with --hidden, --heads, --vocab: counts parameters and activations).
    #[arg(long)]
    pub layers: Option<u64>,
    #[arg(long)]
    pub hidden: Option<u64>,
    #[arg(long)]
    pub heads: Option<u64>,
    #[arg(long, default_value_t = 50_257)]
    pub vocab: u64,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    pub seq: u64,
    /// Sequences per device per micro-step.
    #[arg(long, default_value_t = 1)]
    pub micro_batch: u64,
    /// Sequences per optimizer step over all devices (default: one micro-batch per device).
    #[arg(long)]
    pub global_batch: Option<u64>,
    #[arg(long, default_value_t = 1)]
    pub nodes: u64,
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: u64,
    /// Device memory in GB (1e9 bytes).
    #[arg(long, default_value_t = 80.0)]
    pub device_mem: f64,
    /// f32, or mixed (16-bit params and grads, f32 master weights and Adam state: K = 12).
    #[arg(long, default_value = "mixed")]
    pub precision: String,
    /// Element type on the wire: f32, bf16, f16, int8 (default: 16-bit with mixed precision),
    /// and rows of their own as ROW=DTYPE (`--wire f32,diloco=int8`).
    #[arg(long)]
    pub wire: Option<String>,
    /// Achieved TFLOP/s per device (not the datasheet peak).
    #[arg(long, default_value_t = 400.0)]
    pub tflops: f64,
    /// Intra-node link preset (pcie4, pcie5, nvlink4, ib-ndr, ib-hdr, roce-100g, eth-100g, eth-10g).
    #[arg(long, default_value = "nvlink4")]
    pub intra: String,
    /// Inter-node link preset (the node's total network rate).
    #[arg(long, default_value = "ib-ndr")]
    pub inter: String,
    /// Intra-node rate in Gbit/s per direction (overrides --intra).
    #[arg(long)]
    pub intra_gbps: Option<f64>,
    #[arg(long, default_value_t = 2.0)]
    pub intra_latency_us: f64,
    /// Inter-node rate in Gbit/s per direction (overrides --inter).
    #[arg(long)]
    pub inter_gbps: Option<f64>,
    #[arg(long, default_value_t = 10.0)]
    pub inter_latency_us: f64,
    /// Activations recomputed in backward (8Ψ FLOPs per token, 2·s·b·h bytes per layer kept).
    #[arg(long)]
    pub recompute: bool,
    /// DDP, ZeRO-1/2, hybrid: gradient reductions overlap backward unit by unit, as `train
    /// --overlap` runs them (auto: on across nodes; on; off). ZeRO-3 and HSDP always do.
    #[arg(long, default_value = "auto")]
    pub overlap: String,
    /// Effective units the model is cut into ((Σ size)² / Σ size²; a transformer's layers
    /// plus 2 by default with a shape, else 1: one unit overlaps nothing).
    #[arg(long)]
    pub units: Option<f64>,
    /// ZeRO-3 without prefetch (its all-gathers then wait in line with compute).
    #[arg(long)]
    pub no_prefetch: bool,
    /// Ring order of the ranks: node-major (wiretrain's: ring neighbours inside the node) or
    /// scrambled (a flat ring whose every neighbour is on another node).
    #[arg(long, default_value = "node-major")]
    pub rank_order: String,
    /// Also plan DiLoCo (inner ddp and inner hybrid) with H inner steps per outer step.
    #[arg(long, value_name = "H")]
    pub diloco: Option<u64>,
    /// Strategies that change the optimization which the recommendation may pick: `diloco`
    /// (comma-separated; its cost in loss is not predicted).
    #[arg(long)]
    pub allow: Option<String>,
    /// One JSON object per strategy.
    #[arg(long)]
    pub json: bool,
    /// Print a ready-made table instead: `interconnects` (70B on 2 x 8 80 GB GPUs).
    #[arg(long)]
    pub table: Option<String>,
    /// Compare a wiring-lab CSV (`scripts/lab.sh`) with its predictions: a markdown table of
    /// predicted beside measured, and a PNG of throughput against link rate (--lab-plot).
    #[arg(long)]
    pub lab_csv: Option<std::path::PathBuf>,
    /// Where --lab-csv draws its PNG (default: the CSV path with .png).
    #[arg(long)]
    pub lab_plot: Option<std::path::PathBuf>,
}

/// The unshaped rows of a lab CSV are drawn at this rate.
const UNSHAPED_MBIT: f64 = 10_000.0;

fn lab(csv: &std::path::Path, png: &std::path::Path) -> Result<()> {
    let text = std::fs::read_to_string(csv)
        .map_err(|e| crate::cli::usage_error(format!("--lab-csv {}: {e}", csv.display())))?;
    let mut lines = text.lines();
    let head: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let col = |name: &str| {
        head.iter().position(|h| *h == name).ok_or_else(|| {
            crate::cli::usage_error(format!("--lab-csv {}: no column {name}", csv.display()))
        })
    };
    let (c_rate, c_st, c_step, c_pred, c_ratio, c_sps) = (
        col("rate_mbit")?,
        col("strategy")?,
        col("step_ms")?,
        col("predicted_step_ms")?,
        col("predicted_over_measured")?,
        col("samples_per_s")?,
    );
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    println!(
        "| link | strategy | measured step ms | predicted step ms | predicted / measured | samples/s |"
    );
    println!("|---|---|---|---|---|---|");
    for (i, l) in lines.enumerate() {
        let f: Vec<&str> = l.split(',').collect();
        let num = |c: usize| -> Result<f64> {
            f.get(c).and_then(|v| v.parse::<f64>().ok()).ok_or_else(|| {
                anyhow::anyhow!(
                    "--lab-csv {}: line {}: bad number in column {}",
                    csv.display(),
                    i + 2,
                    head[c]
                )
            })
        };
        let rate = f.get(c_rate).copied().unwrap_or("?");
        let st = f.get(c_st).copied().unwrap_or("?").to_string();
        let (step, pred, ratio, sps) = (num(c_step)?, num(c_pred)?, num(c_ratio)?, num(c_sps)?);
        let link = if rate == "none" {
            "unshaped".to_string()
        } else {
            format!("{rate} Mbit/s")
        };
        println!("| {link} | {st} | {step:.1} | {pred:.1} | {ratio:.2} | {sps:.1} |");
        let x = if rate == "none" {
            UNSHAPED_MBIT
        } else {
            rate.parse().unwrap_or(f64::NAN)
        };
        match series.iter_mut().find(|s| s.0 == st) {
            Some(s) => s.1.push((x, sps)),
            None => series.push((st, vec![(x, sps)])),
        }
    }
    wiretrain::plot::plot_lab(
        png,
        "wiring lab: throughput by link rate",
        &series,
        UNSHAPED_MBIT,
    )?;
    println!("plot: {}", png.display());
    Ok(())
}

fn link(preset: &str, gbps: Option<f64>, latency_us: f64, which: &str) -> Result<Link> {
    if let Some(g) = gbps {
        return Ok(Link::gbits(g, latency_us));
    }
    match Link::preset(preset) {
        Some(l) => Ok(l),
        None => usage!(
            "--{which}: unknown preset {preset:?}; one of {}",
            PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
        ),
    }
}

impl PlanArgs {
    /// `--wire`: one dtype for every row, and `ROW=DTYPE` entries for rows of their own
    /// (`--wire f32,diloco=int8`); the default is bf16 with mixed precision, else f32.
    fn wires(&self, precision: Precision) -> Result<(WireDtype, Vec<(String, WireDtype)>)> {
        let mut wire = if precision == Precision::Mixed {
            WireDtype::Bf16
        } else {
            WireDtype::F32
        };
        let mut rows = Vec::new();
        let known = |r: &str| {
            PLANNED.iter().any(|st| st.to_string() == r) || ["diloco", "diloco-hybrid"].contains(&r)
        };
        for e in self
            .wire
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
        {
            let parse = |w: &str| {
                w.parse::<WireDtype>()
                    .map_err(|err| crate::cli::usage_error(format!("--wire {w:?}: {err}")))
            };
            match e.split_once('=') {
                None if e.is_empty() => {}
                None => wire = parse(e)?,
                Some((r, w)) if known(r.trim()) => {
                    rows.push((r.trim().to_string(), parse(w.trim())?))
                }
                Some((r, _)) => usage!(
                    "--wire: {r:?} is not a row (ddp, zero1, zero2, zero3, hybrid, hsdp, diloco, \
                     diloco-hybrid)"
                ),
            }
        }
        Ok((wire, rows))
    }

    fn input(&self) -> Result<PlanInput> {
        let shape = match (self.layers, self.hidden, self.heads) {
            (Some(layers), Some(hidden), Some(heads)) => Some(Shape {
                layers,
                hidden,
                heads,
                vocab: self.vocab,
            }),
            (None, None, None) => None,
            _ => usage!("--layers, --hidden and --heads go together"),
        };
        let params = match (self.params, shape) {
            (Some(p), _) => p,
            (None, Some(sh)) => sh.params(self.seq),
            (None, None) => {
                usage!("--params N or a transformer shape (--layers --hidden --heads) is required")
            }
        };
        let precision: Precision = self
            .precision
            .parse()
            .map_err(|e| crate::cli::usage_error(format!("--precision: {e}")))?;
        let (wire, wire_rows) = self.wires(precision)?;
        let devices = self.nodes.max(1) * self.gpus_per_node.max(1);
        let allowed = allowed(self.allow.as_deref())?;
        if allowed && self.diloco.is_none() {
            usage!("--allow diloco needs --diloco H (DiLoCo's inner steps per outer step)");
        }
        if self.diloco == Some(0) {
            usage!("--diloco: DiLoCo needs at least 1 inner step per outer step");
        }
        let input = PlanInput {
            params,
            shape,
            seq: self.seq,
            micro_batch: self.micro_batch,
            global_batch: self
                .global_batch
                .unwrap_or(devices * self.micro_batch.max(1)),
            nodes: self.nodes,
            gpus_per_node: self.gpus_per_node,
            device_mem: self.device_mem * 1e9,
            precision,
            wire,
            wire_rows,
            tflops: self.tflops,
            intra: link(&self.intra, self.intra_gbps, self.intra_latency_us, "intra")?,
            inter: link(&self.inter, self.inter_gbps, self.inter_latency_us, "inter")?,
            recompute: self.recompute,
            overlap: match self.overlap.parse::<wiretrain::engine::Overlap>() {
                Ok(wiretrain::engine::Overlap::Auto) => self.nodes > 1,
                Ok(o) => o == wiretrain::engine::Overlap::On,
                Err(e) => crate::cli::usage!("--overlap: {e}"),
            },
            prefetch: !self.no_prefetch,
            rank_order: self
                .rank_order
                .parse()
                .map_err(|e| crate::cli::usage_error(format!("--rank-order: {e}")))?,
            units: Some(match (self.units, shape) {
                (Some(u), _) if u.is_finite() && u >= 1.0 => u,
                (Some(u), _) => usage!("--units: {u} is not a number of units (at least 1)"),
                (None, Some(sh)) => sh.layers as f64 + 2.0,
                (None, None) => 1.0,
            }),
            diloco: self.diloco.map(|inner_steps| DilocoPlan {
                inner_steps,
                allowed,
            }),
        };
        input.validate().map_err(crate::cli::usage_error)?;
        Ok(input)
    }
}

/// A link rate in GB/s, or MB/s below 0.1 GB/s (a shaped link would read 0.00 GB/s).
fn rate(bytes_per_s: f64) -> String {
    if bytes_per_s >= 1e8 {
        format!("{:.2} GB/s", bytes_per_s / 1e9)
    } else {
        format!("{:.2} MB/s", bytes_per_s / 1e6)
    }
}

/// The human table: the inputs, one row per strategy, DiLoCo's caveat.
fn print_table(input: &PlanInput, plans: &[wiretrain::plan::StrategyPlan]) {
    println!(
        "# {:.3e} parameters, {} node(s) x {} device(s) of {:.0} GB, {} precision, {} on the wire",
        input.params,
        input.nodes,
        input.gpus_per_node,
        input.device_mem / 1e9,
        format!("{:?}", input.precision).to_lowercase(),
        format!("{:?}", input.wire).to_lowercase()
    );
    println!(
        "# global batch {} x {} tokens; {:.0} TFLOP/s per device; intra {}, inter {} per direction",
        input.global_batch,
        input.seq,
        input.tflops,
        rate(input.intra.bytes_per_s),
        rate(input.inter.bytes_per_s)
    );
    println!(
        "{:>13} {:>9} {:>9} {:>9} {:>9} {:>9} {:>5} {:>10} {:>10} {:>9} {:>12}",
        "strategy",
        "params",
        "grads",
        "optim",
        "activ",
        "total GB",
        "fits",
        "intra GB",
        "inter GB",
        "step s",
        "tokens/s"
    );
    for p in plans {
        println!(
            "{:>13} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>5} {:>10.2} {:>10.2} {:>9.3} {:>12.0}{}",
            p.name,
            p.params_bytes / 1e9,
            p.grads_bytes / 1e9,
            p.optim_bytes / 1e9,
            p.activation_bytes / 1e9,
            p.bytes_per_device / 1e9,
            if p.fits { "yes" } else { "no" },
            p.comm_bytes_intra / 1e9,
            p.comm_bytes_inter / 1e9,
            p.step_s,
            p.tokens_per_s,
            if p.recommended {
                "  <- recommended"
            } else {
                ""
            }
        );
    }
    if let Some(d) = input.diloco {
        println!(
            "# diloco rows: {} inner steps per outer step; they change the optimization (its cost \
             in loss is not predicted){}",
            d.inner_steps,
            if d.allowed {
                ""
            } else {
                ", so they are not recommended without --allow diloco"
            }
        );
    }
}

/// `--allow`'s list: whether it allows DiLoCo (the only strategy that changes the
/// optimization); anything else is refused.
pub(crate) fn allowed(list: Option<&str>) -> Result<bool> {
    let mut diloco = false;
    for s in list.unwrap_or_default().split(',').map(str::trim) {
        match s {
            "" => {}
            "diloco" => diloco = true,
            o => usage!("--allow: unknown strategy {o:?} (diloco is the only one to allow)"),
        }
    }
    Ok(diloco)
}

pub fn run(args: &PlanArgs) -> Result<()> {
    if let Some(csv) = &args.lab_csv {
        let png = args
            .lab_plot
            .clone()
            .unwrap_or_else(|| csv.with_extension("png"));
        return lab(csv, &png);
    }
    if let Some(t) = &args.table {
        return match t.as_str() {
            "interconnects" => {
                print!("{}", interconnects_table(args.json));
                Ok(())
            }
            o => usage!("--table: unknown table {o:?} (interconnects)"),
        };
    }
    let input = args.input()?;
    let plans = input.plan();
    if args.json {
        for p in &plans {
            println!("{}", serde_json::to_string(p)?);
        }
        return Ok(());
    }
    print_table(&input, &plans);
    println!("recommendation: {}", reason(&plans, input.device_mem));
    Ok(())
}

/// The planner's input for 70B parameters (Llama-2-70B's shapes) on 2 nodes x 8 GPUs of
/// 80 GB at 400 achieved TFLOP/s, joined by the preset links `intra` and `inter`.
fn seventy_b(intra: &str, inter: &str) -> PlanInput {
    PlanInput {
        params: 70e9,
        shape: Some(Shape {
            layers: 80,
            hidden: 8192,
            heads: 64,
            vocab: 32_000,
        }),
        seq: 2048,
        micro_batch: 1,
        global_batch: 64,
        nodes: 2,
        gpus_per_node: 8,
        device_mem: 80e9,
        precision: Precision::Mixed,
        wire: WireDtype::Bf16,
        wire_rows: Vec::new(),
        tflops: 400.0,
        intra: Link::preset(intra).expect("preset"),
        inter: Link::preset(inter).expect("preset"),
        recompute: true,
        overlap: true,
        prefetch: true,
        rank_order: Default::default(),
        units: Some(82.0),
        diloco: None,
    }
}

/// 70B parameters on 16 H100-class GPUs (2 nodes x 8, 80 GB, 400 achieved TFLOP/s), mixed
/// precision, activations recomputed, global batch 64 x 2048 tokens, one row per wiring.
pub fn interconnects_table(json: bool) -> String {
    let wirings = [
        ("nvlink4", "ib-ndr", "NVLink in node, IB NDR across"),
        ("nvlink4", "roce-100g", "NVLink in node, RoCE 100G across"),
        ("nvlink4", "eth-100g", "NVLink in node, 100 GbE across"),
        ("nvlink4", "eth-10g", "NVLink in node, 10 GbE across"),
        ("pcie4", "eth-10g", "PCIe Gen4 in node, 10 GbE across"),
    ];
    let mut out = String::new();
    if !json {
        out.push_str(
            "# 70B parameters, 2 nodes x 8 GPUs of 80 GB, 400 TFLOP/s achieved each, mixed precision\n\
             # (K = 12), bf16 on the wire, activations recomputed, 64 x 2048 tokens per step; gradient\n\
             # reductions overlap backward unit by unit, ZeRO-3 and HSDP prefetch their all-gathers.\n\
             # tokens/s per strategy, or \"no fit\" (GB per device needed)\n",
        );
        out.push_str(&format!(
            "| {:<34} | {:>13} | {:>13} | {:>13} | {:>13} | {:>13} | {:>13} | {:<8} |\n",
            "wiring", "ddp", "zero1", "zero2", "zero3", "hybrid", "hsdp", "choose"
        ));
        out.push_str(&format!("|{}|\n", ["-"; 8].map(|_| "---").join("|")));
    }
    for (intra, inter, name) in wirings {
        let input = seventy_b(intra, inter);
        let plans = input.plan();
        if json {
            for p in &plans {
                let mut v = serde_json::to_value(p).expect("serializes");
                v["wiring"] = name.into();
                out.push_str(&format!("{v}\n"));
            }
            continue;
        }
        let cell = |st: Strategy| {
            let p = plans
                .iter()
                .find(|p| p.strategy == st)
                .expect("all strategies");
            if p.fits {
                format!("{:.0}", p.tokens_per_s)
            } else {
                format!("no fit ({:.0})", p.bytes_per_device / 1e9)
            }
        };
        let choose = plans
            .iter()
            .find(|p| p.recommended)
            .map_or("none".to_string(), |p| p.strategy.to_string());
        out.push_str(&format!(
            "| {:<34} | {:>13} | {:>13} | {:>13} | {:>13} | {:>13} | {:>13} | {:<8} |\n",
            name,
            cell(Strategy::Ddp),
            cell(Strategy::Zero1),
            cell(Strategy::Zero2),
            cell(Strategy::Zero3),
            cell(Strategy::Hybrid),
            cell(Strategy::Hsdp),
            choose
        ));
    }
    out
}
