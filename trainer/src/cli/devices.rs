//! `wiretrain devices`: every adapter wgpu can open on each native graphics API (index, name,
//! vendor, type, API, memory where known), Burn's CPU backend, and CUDA devices under the
//! `nccl` feature; then which device each of `--ranks-per-node` local ranks would get.

use anyhow::Result;
use clap::Args;
use wiretrain::device::{DeviceSpec, NodeDevices, adapters};

#[derive(Debug, Clone, Args)]
pub struct DevicesArgs {
    /// Also show which device each of this many local ranks gets with --device.
    #[arg(long)]
    pub ranks_per_node: Option<usize>,
    /// The device spec(s) for --ranks-per-node (as `train --device`).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Allow several ranks on one GPU adapter (as `train --share-device`).
    #[arg(long)]
    pub share_device: bool,
}

fn gib(b: Option<u64>) -> String {
    b.map_or_else(
        || "-".into(),
        |b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
    )
}

pub fn run(args: &DevicesArgs) -> Result<()> {
    let (primary, _) = adapters::enumerate();
    println!(
        "{:<9} {:<10} {:<14} {:<8} {:<9} name",
        "spec", "vendor", "type", "api", "memory"
    );
    let mut any = false;
    for &api in adapters::native_apis() {
        for a in adapters::enumerate_api(api) {
            any = true;
            // `wgpu:N` indexes the first API that has adapters (what training opens).
            let spec = if Some(api) == primary {
                format!("wgpu:{}", a.index)
            } else {
                "-".into()
            };
            println!(
                "{:<9} {:<10} {:<14} {:<8} {:<9} {}",
                spec,
                format!("{} {:#06x}", a.vendor(), a.vendor_id),
                format!("{:?}", a.kind),
                a.api,
                gib(a.memory_bytes),
                a.name
            );
        }
    }
    println!(
        "{:<9} {:<10} {:<14} {:<8} {:<9} burn flex (CPU backend)",
        "cpu", "-", "Cpu", "-", "-"
    );
    #[cfg(feature = "nccl")]
    match wiretrain_comm::nccl::probe() {
        Ok(n) => {
            let what = if cfg!(feature = "cuda") {
                "training through Burn's CUDA backend; collectives: `bench --backend nccl`"
            } else {
                "collectives: `bench --backend nccl`; training needs `--features cuda`"
            };
            for d in 0..n {
                println!(
                    "{:<9} {:<10} {:<14} {:<8} {:<9} CUDA device {d} ({what})",
                    format!("cuda:{d}"),
                    "NVIDIA",
                    "DiscreteGpu",
                    "CUDA",
                    "-"
                );
            }
        }
        Err(e) => println!("# cuda: {e}"),
    }
    if !any {
        println!(
            "# no Vulkan/Metal/DX12 adapter: `--device auto` uses the CPU backend (apt-get install mesa-vulkan-drivers gives lavapipe)"
        );
    }
    if let Some(k) = args.ranks_per_node {
        let specs: Vec<DeviceSpec> = wiretrain::device::parse_specs(&args.device)
            .map_err(|e| crate::cli::usage_error(format!("--device: {e}")))?;
        let plan = NodeDevices::plan(&specs, k, args.share_device)
            .map_err(|e| crate::cli::usage_error(format!("--device: {e}")))?;
        println!("# --device {} with {k} local ranks:", args.device);
        for (i, d) in plan.descriptions().iter().enumerate() {
            println!("local rank {i}: {d}");
        }
    }
    Ok(())
}
