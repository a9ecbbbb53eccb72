//! The `wiretrain` binary: `bench`, `train`, `launch`, `plan`, `report`, `export`, `devices`.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "wiretrain",
    version,
    about = "Portable distributed training for Burn models"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Measure collectives nccl-tests style (algbw/busbw), over shared buffers and QUIC.
    Bench(Box<cli::bench::BenchArgs>),
    /// Train a built-in example on this node's ranks (one node of a job).
    Train(Box<cli::train::TrainArgs>),
    /// Start several local node processes of a job on 127.0.0.x (e.g. `-- train ...`).
    Launch(cli::launch::LaunchArgs),
    /// Predict memory, communication and speed per strategy for a model on a cluster.
    Plan(Box<cli::plan::PlanArgs>),
    /// Summarise a traced run (`train --trace DIR`): step split per rank, straggler,
    /// bandwidth per collective, longest waits.
    Report(cli::report::ReportArgs),
    /// Write one consolidated safetensors model from a sharded checkpoint.
    Export(cli::export::ExportArgs),
    /// List the devices (wgpu adapters, CPU backend) wiretrain can train on, and which one
    /// each local rank gets.
    Devices(cli::devices::DevicesArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,cubecl_runtime::throughput=error")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let res = match &cli.cmd {
        Cmd::Bench(a) => cli::bench::run(a),
        Cmd::Train(a) => cli::train::run(a),
        Cmd::Launch(a) => cli::launch::run(a),
        Cmd::Export(a) => cli::export::run(a),
        Cmd::Plan(a) => cli::plan::run(a),
        Cmd::Report(a) => cli::report::run(a),
        Cmd::Devices(a) => cli::devices::run(a),
    };
    if let Err(e) = res {
        if let Some(i) = e.downcast_ref::<cli::Interrupted>() {
            eprintln!("wiretrain: {i}");
            std::process::exit(wiretrain::signal::INTERRUPTED_EXIT);
        }
        if let Some(f) = e.downcast_ref::<cli::launch::NodeFailed>() {
            eprintln!("wiretrain: launch: {f}");
            std::process::exit(f.code);
        }
        eprintln!("wiretrain: error: {e:#}");
        let usage = e.chain().any(|c| {
            let s = c.to_string();
            s.starts_with("--") || s.contains("configuration")
        });
        std::process::exit(if usage { 2 } else { 1 });
    }
}
