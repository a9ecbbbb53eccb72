//! The `wiretrain` binary: `bench` today; `train`, `launch` and `plan` build on the same
//! node flags.

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
    Bench(cli::bench::BenchArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let res = match &cli.cmd {
        Cmd::Bench(a) => cli::bench::run(a),
    };
    if let Err(e) = res {
        eprintln!("wiretrain: error: {e:#}");
        let usage = e.chain().any(|c| {
            let s = c.to_string();
            s.starts_with("--") || s.contains("configuration")
        });
        std::process::exit(if usage { 2 } else { 1 });
    }
}
