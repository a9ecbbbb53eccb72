//! The adapters of this machine and which one each local rank trains on.
//!
//! [`enumerate`] lists every wgpu adapter of the native graphics API (the `wgpu:N` index space,
//! in the API's enumeration order, which is the order Burn selects `DeviceKind::X(n)` from).
//! [`assign`] is the pure mapping from device specs to adapters: `wgpu` (and `auto` where a
//! GPU exists) on a node with k local ranks gives local rank i the i-th hardware adapter
//! (discrete first), torchrun's `LOCAL_RANK` → `cuda:i`; two ranks never share a hardware
//! adapter unless the caller allows it (`--share-device`). CPU devices (`cpu`, `wgpu:cpu`) are
//! asked for by name and may be shared.

use burn::tensor::DeviceKind;
use burn::tensor::wgpu::{WgpuBackend, wgpu};
use serde::Serialize;

/// What a device spec names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The local rank's hardware adapter where the machine has any, else Burn's CPU backend.
    Auto,
    /// The local rank's hardware adapter (the i-th for local rank i).
    Wgpu,
    /// Adapter N of `wiretrain devices`.
    WgpuIndex(usize),
    /// A software Vulkan adapter (Mesa's lavapipe).
    WgpuCpu,
    /// Burn's CPU backend (`flex`).
    Cpu,
    /// Burn's CUDA backend (`cuda` feature): `cuda:N`, or `cuda` for local rank i on `cuda:i`.
    Cuda(Option<usize>),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "auto" => Self::Auto,
            "wgpu" => Self::Wgpu,
            "wgpu:cpu" => Self::WgpuCpu,
            "cpu" => Self::Cpu,
            "cuda" => Self::Cuda(None),
            other => match (
                other.strip_prefix("wgpu:").map(str::parse::<usize>),
                other.strip_prefix("cuda:").map(str::parse::<usize>),
            ) {
                (Some(Ok(n)), _) if n < 4096 => Self::WgpuIndex(n),
                (_, Some(Ok(n))) if n < 4096 => Self::Cuda(Some(n)),
                _ => {
                    return Err(format!(
                        "{other:?} is not a device (auto, wgpu, wgpu:N, wgpu:cpu, cpu, cuda, \
                         cuda:N; `wiretrain devices` lists them)"
                    ));
                }
            },
        })
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Wgpu => f.write_str("wgpu"),
            Self::WgpuIndex(n) => write!(f, "wgpu:{n}"),
            Self::WgpuCpu => f.write_str("wgpu:cpu"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(None) => f.write_str("cuda"),
            Self::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// Parses a comma-separated list: one spec for every local rank, or one per local rank.
pub fn parse_specs(list: &str) -> Result<Vec<DeviceSpec>, String> {
    list.split(',').map(|d| d.trim().parse()).collect()
}

/// The kind of an adapter, as its graphics API reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum AdapterKind {
    /// A GPU with its own memory (preferred first).
    DiscreteGpu,
    /// A GPU sharing the host's memory.
    IntegratedGpu,
    /// A virtualized GPU (a VM's passthrough or paravirtual device).
    VirtualGpu,
    /// A kind the API does not name.
    Other,
    /// A software adapter running on the CPU (e.g. lavapipe).
    Cpu,
}

/// One adapter of the native graphics API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Adapter {
    /// Position in the enumeration: the N of `wgpu:N`.
    pub index: usize,
    /// The name the driver reports ("NVIDIA H200", "llvmpipe (LLVM ...)").
    pub name: String,
    /// PCI vendor id (0x10de NVIDIA, 0x1002 AMD, 0x8086 Intel, ...).
    pub vendor_id: u32,
    /// What kind of device it is.
    pub kind: AdapterKind,
    /// Graphics API ("Vulkan", "Dx12", "Metal").
    pub api: String,
    /// The n-th adapter of its kind on this API: what Burn's `DeviceKind::DiscreteGpu(n)` (and
    /// the other indexed kinds) selects.
    pub kind_index: usize,
    /// Device memory in bytes where the OS tells (Linux amdgpu sysfs); wgpu itself does not.
    pub memory_bytes: Option<u64>,
    /// PCI bus id as the driver reports it ("0000:01:00.0"); empty when it reports none.
    pub pci_bus_id: String,
}

impl Adapter {
    /// A GPU (anything the API does not call a CPU).
    pub fn is_hardware(&self) -> bool {
        self.kind != AdapterKind::Cpu
    }

    /// The vendor's name, from the PCI vendor id.
    pub fn vendor(&self) -> &'static str {
        match self.vendor_id {
            0x10de => "NVIDIA",
            0x1002 | 0x1022 => "AMD",
            0x8086 => "Intel",
            0x106b => "Apple",
            0x13b5 => "ARM",
            0x5143 => "Qualcomm",
            0x1414 => "Microsoft",
            0x10005 => "Mesa",
            _ => "other",
        }
    }

    /// Burn's selector for this adapter.
    pub fn device_kind(&self) -> DeviceKind {
        match self.kind {
            AdapterKind::DiscreteGpu => DeviceKind::DiscreteGpu(self.kind_index),
            AdapterKind::IntegratedGpu => DeviceKind::IntegratedGpu(self.kind_index),
            AdapterKind::VirtualGpu => DeviceKind::VirtualGpu(self.kind_index),
            AdapterKind::Other => DeviceKind::DefaultDevice,
            AdapterKind::Cpu => DeviceKind::Cpu,
        }
    }

    /// "wgpu:0 NVIDIA H200 (DiscreteGpu, Vulkan)".
    pub fn describe(&self) -> String {
        format!(
            "wgpu:{} {} ({:?}, {})",
            self.index, self.name, self.kind, self.api
        )
    }
}

/// What a local rank trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assigned {
    /// Adapter `index` of the enumeration.
    Adapter(usize),
    /// Burn's CPU backend.
    Cpu,
    /// CUDA device `index` through Burn's CUDA backend.
    Cuda(usize),
}

/// Why the ranks of a node cannot get their devices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The number of specs is neither 1 nor the number of local ranks.
    #[error("{given} device specs for {ranks} local ranks (give one, or one per local rank)")]
    SpecCount {
        /// The number of specs given.
        given: usize,
        /// The number of local ranks.
        ranks: usize,
    },
    /// More ranks ask for a GPU (`wgpu`, `auto`) than there are hardware adapters left by
    /// the explicit `wgpu:N` specs, and sharing is off.
    #[error(
        "{ranks} local ranks ask for a GPU adapter each, but this machine has {have}: {found}; \
         run fewer ranks per node, or pass --share-device to put several ranks on one adapter"
    )]
    TooManyRanks {
        /// The ranks asking for a GPU.
        ranks: usize,
        /// The hardware adapters free for them.
        have: usize,
        /// The adapters found, in words.
        found: String,
    },
    /// A rank asks for a GPU (`wgpu`) and the machine has no hardware adapter.
    #[error(
        "no GPU adapter found ({found}); use --device wgpu:cpu (software Vulkan) or --device cpu"
    )]
    NoHardware {
        /// The adapters found, in words.
        found: String,
    },
    /// A rank asks for `wgpu:cpu` and the machine has no software adapter.
    #[error(
        "no software Vulkan adapter found ({found}); apt-get install mesa-vulkan-drivers gives \
         lavapipe, or use --device cpu"
    )]
    NoSoftware {
        /// The adapters found, in words.
        found: String,
    },
    /// A rank asks for `wgpu:N` and the enumeration has no adapter N.
    #[error("wgpu:{index}: there is no adapter {index} ({found})")]
    NoSuchAdapter {
        /// The N asked for.
        index: usize,
        /// The adapters found, in words.
        found: String,
    },
    /// Two local ranks would train on the same GPU (hardware adapter or CUDA device) and
    /// sharing is off.
    #[error(
        "local ranks {first} and {second} would share adapter {adapter}; give each rank its own \
         (wgpu:N) or pass --share-device"
    )]
    Shared {
        /// The first local rank on it.
        first: usize,
        /// The second local rank on it.
        second: usize,
        /// The adapter or CUDA device, in words.
        adapter: String,
    },
    /// A rank asks for a CUDA device and this build lacks the `cuda` feature.
    #[error(
        "CUDA devices need Burn's CUDA backend, which this binary was built without: build with \
         `--features cuda` (its build downloads an LLVM bundle, so on a machine with internet), \
         or train on the same GPU through Vulkan with --device wgpu"
    )]
    CudaNotBuilt,
    /// A rank asks for a CUDA device and probing the CUDA devices failed.
    #[error("CUDA devices: {why}")]
    CudaUnavailable {
        /// The probe's error, in words.
        why: String,
    },
    /// A rank asks for a CUDA device index at or above the machine's device count.
    #[error("cuda:{index}: there is no CUDA device {index} (this machine has {count})")]
    NoSuchCuda {
        /// The highest index asked for.
        index: usize,
        /// The number of CUDA devices on this machine.
        count: usize,
    },
}

/// "wgpu:0 A (DiscreteGpu, Vulkan), wgpu:1 B (Cpu, Vulkan)", or "none".
pub fn found(adapters: &[Adapter]) -> String {
    if adapters.is_empty() {
        return "no wgpu adapter at all".into();
    }
    adapters
        .iter()
        .map(Adapter::describe)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Maps `specs` (one for all, or one per local rank) to a device per local rank. Pure: the
/// same adapters and specs always give the same answer.
pub fn assign(
    specs: &[DeviceSpec],
    ranks: usize,
    adapters: &[Adapter],
    share: bool,
) -> Result<Vec<Assigned>, DeviceError> {
    if specs.is_empty() || (specs.len() != 1 && specs.len() != ranks) {
        return Err(DeviceError::SpecCount {
            given: specs.len(),
            ranks,
        });
    }
    let per_rank: Vec<DeviceSpec> = (0..ranks)
        .map(|i| specs[if specs.len() == 1 { 0 } else { i }])
        .collect();
    // Hardware adapters in preference order (discrete first; the API's order within a kind).
    let mut hardware: Vec<&Adapter> = adapters.iter().filter(|a| a.is_hardware()).collect();
    hardware.sort_by_key(|a| a.kind);
    let pool = gpu_pool(&per_rank, &hardware, adapters, share)?;
    let mut next = 0;
    let mut out = Vec::with_capacity(ranks);
    for (i, &spec) in per_rank.iter().enumerate() {
        out.push(match spec {
            DeviceSpec::Cpu => Assigned::Cpu,
            DeviceSpec::Auto if hardware.is_empty() => Assigned::Cpu,
            DeviceSpec::Auto | DeviceSpec::Wgpu => {
                next += 1;
                Assigned::Adapter(pool[(next - 1) % pool.len()])
            }
            DeviceSpec::WgpuCpu => match adapters.iter().find(|a| !a.is_hardware()) {
                Some(a) => Assigned::Adapter(a.index),
                None => {
                    return Err(DeviceError::NoSoftware {
                        found: found(adapters),
                    });
                }
            },
            DeviceSpec::Cuda(n) => Assigned::Cuda(n.unwrap_or(i)),
            DeviceSpec::WgpuIndex(n) => match adapters.iter().find(|a| a.index == n) {
                Some(a) => Assigned::Adapter(a.index),
                None => {
                    return Err(DeviceError::NoSuchAdapter {
                        index: n,
                        found: found(adapters),
                    });
                }
            },
        });
    }
    if !share {
        refuse_shared(&out, adapters)?;
    }
    Ok(out)
}

/// The adapter indices that the ranks asking for "a GPU" (`wgpu`, or `auto` on a machine with
/// one) take in turn, given each rank's spec and the `hardware` adapters in preference order.
/// Refuses when no GPU exists, or when there are fewer free ones than such ranks and `share`
/// is off.
fn gpu_pool(
    per_rank: &[DeviceSpec],
    hardware: &[&Adapter],
    adapters: &[Adapter],
    share: bool,
) -> Result<Vec<usize>, DeviceError> {
    let explicit: Vec<usize> = per_rank
        .iter()
        .filter_map(|&s| match s {
            DeviceSpec::WgpuIndex(n) => Some(n),
            _ => None,
        })
        .collect();
    // Adapters left for ranks that ask for "a GPU": those no rank names explicitly.
    let free: Vec<usize> = hardware
        .iter()
        .map(|a| a.index)
        .filter(|i| !explicit.contains(i))
        .collect();
    let implicit = per_rank
        .iter()
        .filter(|&&s| {
            matches!(s, DeviceSpec::Wgpu) || (s == DeviceSpec::Auto && !hardware.is_empty())
        })
        .count();
    if implicit > 0 && hardware.is_empty() {
        return Err(DeviceError::NoHardware {
            found: found(adapters),
        });
    }
    if implicit > free.len() && !share {
        return Err(DeviceError::TooManyRanks {
            ranks: implicit,
            have: free.len(),
            found: found(adapters),
        });
    }
    Ok(if free.is_empty() {
        hardware.iter().map(|a| a.index).collect()
    } else {
        free
    })
}

/// Two ranks on one GPU (a hardware adapter or a CUDA device) are refused, naming both.
fn refuse_shared(out: &[Assigned], adapters: &[Adapter]) -> Result<(), DeviceError> {
    for (second, b) in out.iter().enumerate() {
        let adapter = match *b {
            Assigned::Cuda(n) => format!("cuda:{n}"),
            Assigned::Adapter(n) => {
                let a = adapters.iter().find(|a| a.index == n).expect("assigned");
                if !a.is_hardware() {
                    continue;
                }
                a.describe()
            }
            _ => continue,
        };
        if let Some(first) = out[..second].iter().position(|x| *x == *b) {
            return Err(DeviceError::Shared {
                first,
                second,
                adapter,
            });
        }
    }
    Ok(())
}

/// The graphics APIs to try, in order. Pinning one keeps wgpu from falling back to GL.
pub fn native_apis() -> &'static [WgpuBackend] {
    // Metal is the only native API on macOS (Vulkan there is MoltenVK, a translation layer).
    #[cfg(target_os = "macos")]
    return &[WgpuBackend::Metal];
    // Windows: every Windows 10+ machine has DX12; Vulkan only where a GPU vendor's driver
    // installed it, so it is the second choice.
    #[cfg(windows)]
    return &[WgpuBackend::Dx12, WgpuBackend::Vulkan];
    // Linux, BSDs: Vulkan (Mesa's lavapipe on CPU-only machines).
    #[cfg(not(any(target_os = "macos", windows)))]
    return &[WgpuBackend::Vulkan];
}

fn wgpu_backend(api: WgpuBackend) -> Option<wgpu::Backend> {
    match api {
        WgpuBackend::Vulkan => Some(wgpu::Backend::Vulkan),
        WgpuBackend::Metal => Some(wgpu::Backend::Metal),
        WgpuBackend::Dx12 => Some(wgpu::Backend::Dx12),
        _ => None,
    }
}

/// The adapters one graphics API reports, in its enumeration order, with the per-kind index
/// Burn selects them by.
pub fn enumerate_api(api: WgpuBackend) -> Vec<Adapter> {
    let Some(backend) = wgpu_backend(api) else {
        return Vec::new();
    };
    let inst = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backend.into(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let infos: Vec<wgpu::AdapterInfo> =
        burn::tensor::read_sync(inst.enumerate_adapters(backend.into()))
            .iter()
            .map(wgpu::Adapter::get_info)
            .collect();
    from_infos(&infos, &format!("{api:?}"))
}

/// Numbers adapter infos as Burn counts them: every kind from zero on its own.
fn from_infos(infos: &[wgpu::AdapterInfo], api: &str) -> Vec<Adapter> {
    let mut counts = [0usize; 5];
    infos
        .iter()
        .enumerate()
        .map(|(index, i)| {
            let kind = match i.device_type {
                wgpu::DeviceType::DiscreteGpu => AdapterKind::DiscreteGpu,
                wgpu::DeviceType::IntegratedGpu => AdapterKind::IntegratedGpu,
                wgpu::DeviceType::VirtualGpu => AdapterKind::VirtualGpu,
                wgpu::DeviceType::Cpu => AdapterKind::Cpu,
                wgpu::DeviceType::Other => AdapterKind::Other,
            };
            let kind_index = counts[kind as usize];
            counts[kind as usize] += 1;
            Adapter {
                index,
                name: i.name.clone(),
                vendor_id: i.vendor,
                kind,
                api: api.to_string(),
                kind_index,
                memory_bytes: vram_bytes(&i.device_pci_bus_id),
                pci_bus_id: i.device_pci_bus_id.clone(),
            }
        })
        .collect()
}

/// Device memory from Linux sysfs (amdgpu publishes it; other drivers do not).
fn vram_bytes(pci_bus_id: &str) -> Option<u64> {
    if pci_bus_id.is_empty() || !cfg!(target_os = "linux") {
        return None;
    }
    let p = format!("/sys/bus/pci/devices/{pci_bus_id}/mem_info_vram_total");
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// The `wgpu:N` index space: the adapters of the first native API that has any, and that API.
pub fn enumerate() -> (Option<WgpuBackend>, Vec<Adapter>) {
    for &api in native_apis() {
        let a = enumerate_api(api);
        if !a.is_empty() {
            return (Some(api), a);
        }
    }
    (None, Vec::new())
}

#[cfg(test)]
mod tests;
