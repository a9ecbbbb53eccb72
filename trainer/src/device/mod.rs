//! Device selection: a wgpu adapter pinned to a real graphics API, lavapipe on CPU-only
//! machines, or Burn's CPU backend (`flex`).
//!
//! Spec strings (the same everywhere): `auto` (the local rank's own hardware wgpu adapter, else
//! Burn's CPU backend with a one-line warning: on a CPU-only machine the CPU backend trains the
//! examples ~20x faster than a software Vulkan adapter), `wgpu` (local rank i gets the i-th
//! hardware adapter), `wgpu:N` (adapter N of `wiretrain devices`), `wgpu:cpu` (a software Vulkan
//! adapter such as Mesa's lavapipe), `cpu` (Burn's flex backend), `cuda` / `cuda:N` (Burn's CUDA
//! backend, `cuda` feature; local rank i on `cuda:i` for `cuda`). [`NodeDevices::plan`] maps the
//! specs of a node's ranks to adapters ([`adapters::assign`]); wgpu devices are pinned to the
//! native APIs (Vulkan on Linux; DX12, then Vulkan, on Windows; Metal on macOS) so wiretrain
//! never silently falls back to GL.

use burn::tensor::Device;
use burn::tensor::DeviceKind;
use burn::tensor::wgpu::WgpuBackend;
use std::sync::{Arc, Mutex, OnceLock};
use wiretrain_shaders::Kernels;

pub mod adapters;
mod cuda;

pub use adapters::{Adapter, AdapterKind, Assigned, DeviceError, DeviceSpec, parse_specs};

/// The device a rank trains on, with a human description.
#[derive(Debug, Clone)]
pub struct RankDevice {
    /// The Burn device (wgpu, flex or CUDA).
    pub device: Device,
    /// The device in words, e.g. "wgpu Vulkan NVIDIA H200 (DiscreteGpu)".
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

/// Initialized wgpu devices (or why they failed), by selector.
type DeviceCache = Mutex<Vec<(String, Result<RankDevice, String>)>>;

/// Burn allows one initialization per wgpu selector and process: cache each result.
fn wgpu_cached(kind: DeviceKind, apis: &[WgpuBackend]) -> Result<RankDevice, String> {
    static CACHE: OnceLock<DeviceCache> = OnceLock::new();
    let key = format!("{kind:?} on {apis:?}");
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, r)) = c.iter().find(|(k, _)| *k == key) {
        return r.clone();
    }
    let mut failures = Vec::new();
    let mut r = Err(String::new());
    for &api in apis {
        r = init_wgpu(kind.clone(), api);
        match &r {
            Ok(_) => break,
            Err(e) => failures.push(e.clone()),
        }
    }
    let r = r.map_err(|_| failures.join("; "));
    c.push((key, r.clone()));
    r
}

/// Initializes Burn's wgpu device of `kind` on `api` and our kernels on the same device.
fn init_wgpu(kind: DeviceKind, api: WgpuBackend) -> Result<RankDevice, String> {
    let software = kind == DeviceKind::Cpu;
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
        .map_err(|e| init_failure(&e, software, api))
}

/// A failed wgpu initialization in words, with what to install or pass instead (never the
/// raw `Debug` of Burn's error).
pub(crate) fn init_failure(
    e: &burn::tensor::wgpu::WgpuInitError,
    software: bool,
    api: WgpuBackend,
) -> String {
    use burn::tensor::wgpu::WgpuInitError as E;
    match e {
        E::AdapterUnavailable { .. } if software => format!(
            "no software {api:?} adapter: wgpu:cpu needs Mesa's lavapipe (Debian/Ubuntu: \
             apt-get install mesa-vulkan-drivers; Fedora: dnf install mesa-vulkan-drivers), \
             or use --device cpu"
        ),
        E::AdapterUnavailable { .. } => format!(
            "no GPU adapter on {api:?}: install the GPU vendor's {api:?} driver \
             (`vulkaninfo --summary` shows what Vulkan sees), or use --device wgpu:cpu or \
             --device cpu"
        ),
        other => other.to_string(),
    }
}

/// The devices of one node's local ranks: the adapters found and which one each rank gets.
#[derive(Debug, Clone)]
pub struct NodeDevices {
    api: Option<WgpuBackend>,
    adapters: Vec<Adapter>,
    assigned: Vec<Assigned>,
    /// `auto` found no GPU adapter: its ranks train on the CPU backend (warned once).
    auto_on_cpu: bool,
}

impl NodeDevices {
    /// Enumerates this machine's adapters and maps `specs` (one for all ranks, or one per
    /// local rank) to `ranks` local ranks; `share` lets several ranks use one GPU adapter.
    pub fn plan(specs: &[DeviceSpec], ranks: usize, share: bool) -> Result<Self, DeviceError> {
        // Only specs that name wgpu need the (slow-ish) enumeration.
        let (api, adapters) = if specs
            .iter()
            .all(|s| matches!(s, DeviceSpec::Cpu | DeviceSpec::Cuda(_)))
        {
            (None, Vec::new())
        } else {
            adapters::enumerate()
        };
        let planned = Self::with_adapters(api, adapters, specs, ranks, share)?;
        cuda::check(&planned.assigned)?;
        Ok(planned)
    }

    /// [`Self::plan`] over a given adapter list (tests; machines enumerated elsewhere).
    pub fn with_adapters(
        api: Option<WgpuBackend>,
        adapters: Vec<Adapter>,
        specs: &[DeviceSpec],
        ranks: usize,
        share: bool,
    ) -> Result<Self, DeviceError> {
        let assigned = adapters::assign(specs, ranks, &adapters, share)?;
        let auto_on_cpu =
            specs.contains(&DeviceSpec::Auto) && !adapters.iter().any(Adapter::is_hardware);
        Ok(Self {
            api,
            adapters,
            assigned,
            auto_on_cpu,
        })
    }

    /// The wgpu adapters enumerated on this machine (empty when no spec names wgpu).
    pub fn adapters(&self) -> &[Adapter] {
        &self.adapters
    }

    /// What local rank `local` gets.
    pub fn assigned(&self, local: usize) -> Assigned {
        self.assigned[local]
    }

    /// The rank's device in words, as the rank table records it ("wgpu:0 NVIDIA H200
    /// (DiscreteGpu, Vulkan)", "cpu (burn flex backend)").
    pub fn describe(&self, local: usize) -> String {
        match self.assigned[local] {
            Assigned::Cpu => CPU_DESCRIPTION.into(),
            Assigned::Cuda(n) => cuda::describe(n),
            Assigned::Adapter(n) => self.adapters[n].describe(),
        }
    }

    /// One description per local rank.
    pub fn descriptions(&self) -> Vec<String> {
        (0..self.assigned.len()).map(|i| self.describe(i)).collect()
    }

    /// Initializes local rank `local`'s device (wgpu devices once per process; later calls
    /// for the same adapter return the same device).
    pub fn open(&self, local: usize) -> Result<RankDevice, String> {
        match self.assigned[local] {
            Assigned::Cpu => {
                if self.auto_on_cpu {
                    warn_cpu_fallback(&adapters::found(&self.adapters));
                }
                Ok(cpu_device())
            }
            Assigned::Cuda(n) => cuda::open(n),
            Assigned::Adapter(n) => {
                let a = &self.adapters[n];
                let api = self.api.expect("adapters come from an API");
                let d = wgpu_cached(a.device_kind(), &[api])?;
                // Burn selects by kind and index; make sure it opened the adapter we mean.
                if !d.description.contains(&a.name) {
                    return Err(format!(
                        "asked for {} but Burn opened {}",
                        a.describe(),
                        d.description
                    ));
                }
                Ok(RankDevice {
                    description: a.describe(),
                    ..d
                })
            }
        }
    }
}

const CPU_DESCRIPTION: &str = "cpu (burn flex backend)";

fn cpu_device() -> RankDevice {
    RankDevice {
        device: Device::flex(),
        description: CPU_DESCRIPTION.into(),
        kernels: None,
    }
}

fn warn_cpu_fallback(why: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::info!("no usable wgpu adapter ({why}); using the CPU backend");
        eprintln!(
            "wiretrain: warning: no GPU adapter, training on the CPU backend \
             (--device wgpu:cpu for a software Vulkan adapter)"
        );
    });
}

/// Resolves one rank's spec to a device: local rank 0's device of [`NodeDevices::plan`]
/// (`wgpu` and `auto` take the first hardware adapter).
pub fn select(spec: DeviceSpec) -> Result<RankDevice, String> {
    NodeDevices::plan(&[spec], 1, false)
        .map_err(|e| e.to_string())?
        .open(0)
}
