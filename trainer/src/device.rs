//! Device selection: a wgpu adapter pinned to a real graphics API, lavapipe on CPU-only
//! machines, or Burn's CPU backend (`flex`).
//!
//! Spec strings (the same everywhere): `auto` (best hardware wgpu adapter, else Burn's CPU
//! backend with a one-line warning: on a CPU-only machine the CPU backend trains the examples
//! ~20x faster than a software Vulkan adapter), `wgpu` (best hardware adapter), `wgpu:cpu` (a software Vulkan adapter
//! such as Mesa's lavapipe), `cpu` (Burn's flex backend). wgpu devices are pinned to the native
//! APIs (Vulkan on Linux; DX12, then Vulkan, on Windows; Metal on macOS) so wiretrain never
//! silently falls back to GL.

use burn::tensor::Device;
use burn::tensor::DeviceKind;
use burn::tensor::wgpu::WgpuBackend;
use std::sync::{Arc, Mutex, OnceLock};
use wiretrain_shaders::Kernels;

/// A parsed device spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Auto,
    Wgpu,
    WgpuCpu,
    Cpu,
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "auto" => Self::Auto,
            "wgpu" => Self::Wgpu,
            "wgpu:cpu" => Self::WgpuCpu,
            "cpu" => Self::Cpu,
            other => {
                return Err(format!(
                    "{other:?} is not a device (auto, wgpu, wgpu:cpu, cpu)"
                ));
            }
        })
    }
}

/// The device a rank trains on, with a human description.
#[derive(Debug, Clone)]
pub struct RankDevice {
    pub device: Device,
    pub description: String,
    /// wiretrain's own WGSL kernels on the same wgpu device and queue (wgpu devices only).
    pub kernels: Option<Arc<Kernels>>,
}

/// The kernels built for each initialized wgpu device.
type KernelRegistry = Mutex<Vec<(Device, Arc<Kernels>)>>;

fn kernel_registry() -> &'static KernelRegistry {
    static REG: OnceLock<KernelRegistry> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(Vec::new()))
}

/// wiretrain's kernels on `device` (the very wgpu device and queue Burn runs on), when it is a
/// wgpu device this process initialized through [`select`].
pub fn kernels_for(device: &Device) -> Option<Arc<Kernels>> {
    let reg = kernel_registry().lock().unwrap_or_else(|p| p.into_inner());
    let inner = device.clone().inner();
    reg.iter()
        .find(|(d, _)| *d == inner || d == device)
        .map(|(_, k)| k.clone())
}

/// The graphics APIs to try, in order. Pinning one keeps wgpu from falling back to GL.
fn native_apis() -> &'static [WgpuBackend] {
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

/// Initialized wgpu devices (or why they failed), by selector.
type DeviceCache = Mutex<Vec<(&'static str, Result<RankDevice, String>)>>;

/// Burn allows one initialization per wgpu selector and process: cache each result.
fn wgpu_cached(kind: DeviceKind, key: &'static str) -> Result<RankDevice, String> {
    static CACHE: OnceLock<DeviceCache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, r)) = c.iter().find(|(k, _)| *k == key) {
        return r.clone();
    }
    let mut failures = Vec::new();
    let mut r = Err(String::new());
    for &api in native_apis() {
        r = init_wgpu(kind.clone(), api);
        match &r {
            Ok(_) => break,
            Err(e) => failures.push(format!("{api:?}: {e}")),
        }
    }
    let r = r.map_err(|_| failures.join("; "));
    c.push((key, r.clone()));
    r
}

/// Initializes Burn's wgpu device of `kind` on `api` and our kernels on the same device.
fn init_wgpu(kind: DeviceKind, api: WgpuBackend) -> Result<RankDevice, String> {
    Device::wgpu_options()
        .device_kind(kind)
        .graphics_api(api)
        .init_with_setup()
        .map(|(device, setup)| {
            let info = setup.adapter.get_info();
            let description = format!(
                "wgpu {:?} {} ({:?})",
                info.backend, info.name, info.device_type
            );
            // Our kernels share Burn's device and queue (built once per device).
            let kernels = Arc::new(Kernels::new(
                setup.device.clone(),
                setup.queue.clone(),
                description.clone(),
            ));
            kernel_registry()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((device.clone(), kernels.clone()));
            RankDevice {
                device,
                description,
                kernels: Some(kernels),
            }
        })
        .map_err(|e| format!("{e:?}"))
}

/// Resolves a spec to a device (all local ranks of a CPU-only node share lavapipe or the CPU
/// backend; one GPU per rank would be `wgpu` with an index, a later addition).
pub fn select(spec: DeviceSpec) -> Result<RankDevice, String> {
    match spec {
        DeviceSpec::Cpu => Ok(RankDevice {
            device: Device::flex(),
            description: "cpu (burn flex backend)".into(),
            kernels: None,
        }),
        DeviceSpec::Wgpu => wgpu_cached(DeviceKind::DefaultDevice, "default"),
        DeviceSpec::WgpuCpu => wgpu_cached(DeviceKind::Cpu, "cpu"),
        DeviceSpec::Auto => wgpu_cached(DeviceKind::DefaultDevice, "default")
            .and_then(|d| {
                if d.description.contains("(Cpu)") {
                    Err(format!("only a software adapter: {}", d.description))
                } else {
                    Ok(d)
                }
            })
            .or_else(|e| {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::info!("no usable wgpu adapter ({e}); using the CPU backend");
                    eprintln!(
                        "wiretrain: warning: no GPU adapter, training on the CPU backend \
                         (--device wgpu:cpu for a software Vulkan adapter)"
                    );
                });
                select(DeviceSpec::Cpu)
            }),
    }
}
