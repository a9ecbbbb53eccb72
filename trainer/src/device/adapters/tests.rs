//! Tests of `adapters`.

use super::*;

fn fake(kinds: &[AdapterKind]) -> Vec<Adapter> {
    let mut counts = [0usize; 5];
    kinds
        .iter()
        .enumerate()
        .map(|(index, &kind)| {
            let kind_index = counts[kind as usize];
            counts[kind as usize] += 1;
            Adapter {
                index,
                name: format!("card{index}"),
                vendor_id: 0x10de,
                kind,
                api: "Vulkan".into(),
                kind_index,
                memory_bytes: None,
                pci_bus_id: String::new(),
            }
        })
        .collect()
}

use AdapterKind as K;
use Assigned as A;
use DeviceSpec as S;

#[test]
fn each_local_rank_gets_its_own_gpu_discrete_first() {
    let a = fake(&[
        K::IntegratedGpu,
        K::Cpu,
        K::DiscreteGpu,
        K::DiscreteGpu,
        K::DiscreteGpu,
        K::DiscreteGpu,
    ]);
    let got = assign(&[S::Wgpu], 4, &a, false).unwrap();
    assert_eq!(
        got,
        vec![A::Adapter(2), A::Adapter(3), A::Adapter(4), A::Adapter(5)]
    );
    // Burn selects them as the 0th..3rd discrete GPU.
    let kinds: Vec<_> = got
        .iter()
        .map(|g| match g {
            A::Adapter(n) => a[*n].device_kind(),
            A::Cpu | A::Cuda(_) => DeviceKind::Cpu,
        })
        .collect();
    assert_eq!(
        kinds,
        (0..4).map(DeviceKind::DiscreteGpu).collect::<Vec<_>>()
    );
    // A fifth rank takes the integrated GPU; `auto` maps the same way.
    let got = assign(&[S::Auto], 5, &a, false).unwrap();
    assert_eq!(got[4], A::Adapter(0));
    assert_eq!(a[0].device_kind(), DeviceKind::IntegratedGpu(0));
}

#[test]
fn more_ranks_than_gpus_is_refused_unless_shared() {
    let a = fake(&[K::DiscreteGpu, K::DiscreteGpu, K::Cpu]);
    let e = assign(&[S::Wgpu], 3, &a, false).unwrap_err();
    assert!(matches!(
        e,
        DeviceError::TooManyRanks {
            ranks: 3,
            have: 2,
            ..
        }
    ));
    let msg = e.to_string();
    assert!(
        msg.contains("wgpu:0 card0") && msg.contains("--share-device"),
        "{msg}"
    );
    let got = assign(&[S::Wgpu], 3, &a, true).unwrap();
    assert_eq!(got, vec![A::Adapter(0), A::Adapter(1), A::Adapter(0)]);
}

#[test]
fn explicit_indices_are_kept_and_never_silently_shared() {
    let a = fake(&[K::DiscreteGpu, K::DiscreteGpu, K::DiscreteGpu]);
    let got = assign(&[S::Wgpu, S::WgpuIndex(0), S::Wgpu], 3, &a, false).unwrap();
    assert_eq!(got, vec![A::Adapter(1), A::Adapter(0), A::Adapter(2)]);
    let e = assign(&[S::WgpuIndex(1), S::WgpuIndex(1)], 2, &a, false).unwrap_err();
    assert!(
        matches!(
            e,
            DeviceError::Shared {
                first: 0,
                second: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(assign(&[S::WgpuIndex(1), S::WgpuIndex(1)], 2, &a, true).is_ok());
    let e = assign(&[S::WgpuIndex(7)], 1, &a, false).unwrap_err();
    assert!(
        matches!(e, DeviceError::NoSuchAdapter { index: 7, .. }),
        "{e}"
    );
}

#[test]
fn cpu_machines_fall_back_or_refuse_by_spec() {
    let lavapipe = fake(&[K::Cpu]);
    assert_eq!(
        assign(&[S::Auto], 2, &lavapipe, false).unwrap(),
        vec![A::Cpu, A::Cpu]
    );
    assert_eq!(
        assign(&[S::WgpuCpu], 2, &lavapipe, false).unwrap(),
        vec![A::Adapter(0), A::Adapter(0)]
    );
    assert!(matches!(
        assign(&[S::Wgpu], 1, &lavapipe, false),
        Err(DeviceError::NoHardware { .. })
    ));
    assert!(matches!(
        assign(&[S::WgpuCpu], 1, &[], false),
        Err(DeviceError::NoSoftware { .. })
    ));
    assert_eq!(
        assign(&[S::WgpuCpu, S::Cpu], 2, &lavapipe, false).unwrap(),
        vec![A::Adapter(0), A::Cpu]
    );
    assert!(matches!(
        assign(&[S::Cpu, S::Cpu, S::Cpu], 2, &lavapipe, false),
        Err(DeviceError::SpecCount { given: 3, ranks: 2 })
    ));
}

#[test]
fn specs_parse() {
    assert_eq!(
        parse_specs("wgpu:3, cpu,wgpu:cpu,auto,wgpu").unwrap(),
        vec![S::WgpuIndex(3), S::Cpu, S::WgpuCpu, S::Auto, S::Wgpu]
    );
    for bad in ["gpu", "wgpu:x", "wgpu:-1", "cuda:x", ""] {
        let e = bad.parse::<DeviceSpec>().unwrap_err();
        assert!(e.contains("not a device"), "{bad}: {e}");
    }
    assert_eq!(S::WgpuIndex(2).to_string(), "wgpu:2");
}

#[test]
fn burn_counts_each_kind_from_zero() {
    let infos: Vec<wgpu::AdapterInfo> = [
        wgpu::DeviceType::DiscreteGpu,
        wgpu::DeviceType::Cpu,
        wgpu::DeviceType::DiscreteGpu,
        wgpu::DeviceType::IntegratedGpu,
    ]
    .iter()
    .map(|&t| wgpu::AdapterInfo {
        name: "x".into(),
        vendor: 0x1002,
        device: 0,
        device_type: t,
        device_pci_bus_id: String::new(),
        driver: String::new(),
        driver_info: String::new(),
        backend: wgpu::Backend::Vulkan,
        subgroup_min_size: 0,
        subgroup_max_size: 0,
        transient_saves_memory: None,
        limit_bucket: None,
    })
    .collect();
    let a = from_infos(&infos, "Vulkan");
    assert_eq!(
        a.iter().map(Adapter::device_kind).collect::<Vec<_>>(),
        vec![
            DeviceKind::DiscreteGpu(0),
            DeviceKind::Cpu,
            DeviceKind::DiscreteGpu(1),
            DeviceKind::IntegratedGpu(0)
        ]
    );
    assert_eq!(a[0].vendor(), "AMD");
}
