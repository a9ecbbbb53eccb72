//! `wiretrain devices`: the adapters wiretrain can train on, and which one `--device auto`
//! picks.

use anyhow::Result;
use burn::tensor::wgpu::wgpu;

pub fn run() -> Result<()> {
    let backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    let inst = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapters = burn::tensor::read_sync(inst.enumerate_adapters(backends));
    println!("{:<8} {:<10} {:<14} name", "spec", "api", "type");
    for a in &adapters {
        let i = a.get_info();
        let spec = if i.device_type == wgpu::DeviceType::Cpu {
            "wgpu:cpu"
        } else {
            "wgpu"
        };
        println!(
            "{:<8} {:<10} {:<14} {}",
            spec,
            format!("{:?}", i.backend),
            format!("{:?}", i.device_type),
            i.name
        );
    }
    println!(
        "{:<8} {:<10} {:<14} burn flex (CPU backend)",
        "cpu", "-", "Cpu"
    );
    #[cfg(feature = "nccl")]
    match wiretrain_comm::nccl::probe() {
        Ok(n) => {
            for d in 0..n {
                println!(
                    "{:<8} {:<10} {:<14} CUDA device {d} (collectives: `bench --backend nccl`)",
                    format!("cuda:{d}"),
                    "CUDA",
                    "DiscreteGpu"
                );
            }
        }
        Err(e) => println!("# cuda: {e}"),
    }
    if adapters.is_empty() {
        println!(
            "# no Vulkan/Metal/DX12 adapter: `--device auto` uses the CPU backend (apt-get install mesa-vulkan-drivers gives lavapipe)"
        );
    }
    Ok(())
}
