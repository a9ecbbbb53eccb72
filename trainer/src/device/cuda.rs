//! CUDA devices for training (`--device cuda`, `cuda:N`) through Burn's CUDA backend, in
//! binaries built with the `cuda` feature. Without it the specs still parse, and planning
//! refuses them before anything starts, saying how to build.

use super::RankDevice;
use super::adapters::{Assigned, DeviceError};

/// The rank's device in words, as the rank table records it.
pub(super) fn describe(n: usize) -> String {
    format!("cuda:{n} (burn cuda backend)")
}

/// Refuses CUDA assignments this binary or machine cannot honour: no `cuda` feature, no
/// driver, or an index past the machine's devices.
pub(super) fn check(assigned: &[Assigned]) -> Result<(), DeviceError> {
    let Some(highest) = assigned
        .iter()
        .filter_map(|a| match a {
            Assigned::Cuda(n) => Some(*n),
            _ => None,
        })
        .max()
    else {
        return Ok(());
    };
    let count = device_count()?;
    if highest >= count {
        return Err(DeviceError::NoSuchCuda {
            index: highest,
            count,
        });
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn device_count() -> Result<usize, DeviceError> {
    wiretrain_comm::nccl::probe().map_err(|e| DeviceError::CudaUnavailable { why: e.to_string() })
}

#[cfg(not(feature = "cuda"))]
fn device_count() -> Result<usize, DeviceError> {
    Err(DeviceError::CudaNotBuilt)
}

/// Burn's CUDA device `n`.
#[cfg(feature = "cuda")]
pub(super) fn open(n: usize) -> Result<RankDevice, String> {
    Ok(RankDevice {
        device: burn::tensor::Device::cuda(n),
        description: describe(n),
        kernels: None,
    })
}

/// Unreachable through [`super::NodeDevices::plan`], which refuses CUDA specs here.
#[cfg(not(feature = "cuda"))]
pub(super) fn open(_n: usize) -> Result<RankDevice, String> {
    Err(DeviceError::CudaNotBuilt.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DeviceSpec, NodeDevices, parse_specs};

    #[test]
    fn cuda_specs_parse_and_print_back() {
        for (s, want) in [
            ("cuda", DeviceSpec::Cuda(None)),
            ("cuda:3", DeviceSpec::Cuda(Some(3))),
        ] {
            let got: DeviceSpec = s.parse().unwrap();
            assert_eq!(got, want);
            assert_eq!(got.to_string(), s);
        }
        for bad in ["cuda:", "cuda:x", "cuda:-1", "cuda:99999"] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains("cuda:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn cuda_ranks_get_their_local_index_and_never_share_unasked() {
        let specs = parse_specs("cuda").unwrap();
        let d = NodeDevices::with_adapters(None, Vec::new(), &specs, 3, false).unwrap();
        let got: Vec<Assigned> = (0..3).map(|i| d.assigned(i)).collect();
        assert_eq!(
            got,
            [Assigned::Cuda(0), Assigned::Cuda(1), Assigned::Cuda(2)]
        );
        assert_eq!(d.describe(1), "cuda:1 (burn cuda backend)");

        let mixed = parse_specs("cuda:1,cpu").unwrap();
        let d = NodeDevices::with_adapters(None, Vec::new(), &mixed, 2, false).unwrap();
        assert_eq!(d.assigned(0), Assigned::Cuda(1));
        assert_eq!(d.assigned(1), Assigned::Cpu);

        let same = parse_specs("cuda:0,cuda:0").unwrap();
        let e = NodeDevices::with_adapters(None, Vec::new(), &same, 2, false).unwrap_err();
        assert_eq!(
            e,
            DeviceError::Shared {
                first: 0,
                second: 1,
                adapter: "cuda:0".into()
            }
        );
        assert!(NodeDevices::with_adapters(None, Vec::new(), &same, 2, true).is_ok());
    }

    #[test]
    fn planning_cuda_says_what_this_binary_or_machine_lacks() {
        let planned = NodeDevices::plan(&[DeviceSpec::Cuda(Some(0))], 1, false);
        if cfg!(feature = "cuda") {
            // Built with CUDA: a machine with a device plans; one without says why.
            if let Err(e) = planned {
                assert!(
                    matches!(
                        e,
                        DeviceError::CudaUnavailable { .. } | DeviceError::NoSuchCuda { .. }
                    ),
                    "{e}"
                );
            }
        } else {
            let e = planned.unwrap_err();
            assert_eq!(e, DeviceError::CudaNotBuilt);
            assert!(e.to_string().contains("--features cuda"), "{e}");
            assert!(e.to_string().contains("--device wgpu"), "{e}");
        }
        // CPU-only specs never touch CUDA.
        assert!(check(&[Assigned::Cpu]).is_ok());
    }
}
