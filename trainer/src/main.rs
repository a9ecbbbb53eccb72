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

/// Counts live heap bytes, for the measured `peak_heap_bytes` of the training summary.
#[global_allocator]
static ALLOC: wiretrain::heap::CountingAlloc = wiretrain::heap::CountingAlloc;

fn main() {
    ALLOC.mark_installed();
    private_runtime_dir();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                // The Vulkan loader's own messages ("Found no drivers!") come through
                // wgpu_hal as errors; wiretrain's device errors say what is missing and how
                // to install it instead (RUST_LOG=wgpu_hal=debug shows them).
                tracing_subscriber::EnvFilter::new(
                    "warn,cubecl_runtime::throughput=error,wgpu_hal::vulkan::instance=off",
                )
            }),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: logs sent to a file or a pipe stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::Plan(_) | Cmd::Report(_) | Cmd::Devices(_)) {
        quiet_on_closed_stdout();
    }
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
        eprintln!("wiretrain: error: {}", render(&e));
        std::process::exit(if is_usage(&e) { 2 } else { 1 });
    }
}

/// Without a usable `XDG_RUNTIME_DIR` (ssh, cron, containers, Slurm) the graphics stack's
/// Wayland probe prints "error: XDG_RUNTIME_DIR is invalid or not set" while wgpu looks for
/// adapters, though nothing is wrong. Such a process gets a private one (mode 0700, owned by
/// this user, under the temporary directory) before any thread starts.
#[cfg(unix)]
fn private_runtime_dir() {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let usable =
        std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| std::path::Path::new(&d).is_dir());
    if usable {
        return;
    }
    let uid = unsafe { libc::getuid() };
    let dir = std::env::temp_dir().join(format!("wiretrain-runtime-{uid}"));
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    let ours = std::fs::symlink_metadata(&dir)
        .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o077 == 0);
    if ours {
        // SAFETY: called first thing in main, before any other thread exists.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
    }
}

#[cfg(not(unix))]
fn private_runtime_dir() {}

/// Whether the command line is at fault (exit 2): a bad flag, configuration or combination,
/// told by the error's type anywhere in its chain.
fn is_usage(e: &anyhow::Error) -> bool {
    use wiretrain::TrainError;
    use wiretrain::checkpoint::CheckpointError;
    let in_use = |c: &CheckpointError| {
        matches!(
            c,
            CheckpointError::InUse { .. } | CheckpointError::Locked { .. }
        )
    };
    e.chain().any(|c| {
        c.is::<cli::Usage>()
            || c.is::<wiretrain::job::JobError>()
            || c.is::<wiretrain_comm::ConfigError>()
            || c.is::<wiretrain::device::DeviceError>()
            || c.downcast_ref::<CheckpointError>().is_some_and(in_use)
            || matches!(
                c.downcast_ref::<wiretrain::RunError>(),
                Some(wiretrain::RunError::Job(_) | wiretrain::RunError::Device(_))
            )
            || matches!(
                c.downcast_ref::<wiretrain::engine::OtherRank>(),
                Some(wiretrain::engine::OtherRank::DirLocked { .. })
            )
            || match c.downcast_ref::<TrainError>() {
                Some(TrainError::Config(_)) => true,
                Some(TrainError::OtherRank(wiretrain::engine::OtherRank::DirLocked { .. })) => true,
                Some(TrainError::Checkpoint(ck)) => in_use(ck),
                _ => false,
            }
    })
}

/// An error and its causes on one line, each cause once: a cause whose text its parent's
/// message already ends with (thiserror's `"{context}: {source}"`) is not printed again.
fn render(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let msg = cause.to_string();
        if out.ends_with(&msg) || out.contains(&format!("{msg}:")) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&msg);
    }
    out
}

/// The read-only commands end quietly when their reader goes away (`wiretrain report DIR |
/// head`), as Unix tools do, instead of panicking on the failed print: SIGPIPE gets its
/// default action back (Rust ignores it). Training and launching keep ignoring it.
fn quiet_on_closed_stdout() {
    #[cfg(unix)]
    // SAFETY: resets one signal's disposition before any thread of ours starts; no handler
    // of ours is replaced (wiretrain installs none for SIGPIPE).
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::render;

    #[test]
    fn a_cause_is_printed_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let inner = wiretrain::checkpoint::CheckpointError::Io {
            path: "ckpt".into(),
            source: io,
        };
        let e = anyhow::Error::new(inner).context("export");
        let text = render(&e);
        assert_eq!(text.matches("not found").count(), 1, "{text}");
        assert!(text.starts_with("export: checkpoint ckpt: "), "{text}");
        let plain = anyhow::anyhow!("outer").context("top");
        assert_eq!(render(&plain), "top: outer");
    }
}
