//! Burn tensors on a wgpu device (lavapipe) cross to and from the host through wiretrain's
//! staging ring, straight from and into the tensors' own storage (`transfer::read_f32`,
//! `transfer::upload`): what the ring uploads, Burn's own read returns; what Burn computes
//! or uploads itself, the ring reads back; for sizes that do not divide the ring's 8 MiB
//! chunk (1 element, odd sizes, several chunks), for views at an offset into their storage
//! (slices), on an autodiff device; and the ring's staging buffers are made once, however
//! many more transfers there are. The ring's counters prove the path was taken.

mod common;

use burn::tensor::{Device, Tensor, TensorData};
use wiretrain::device::DeviceSpec;
use wiretrain::transfer;

fn values(n: usize, k: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + k) % 1013) as f32 - 500.0)
        .collect()
}

/// Burn's own read, not the ring.
fn burn_read(t: Tensor<1>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

fn round(device: &Device, k: usize) {
    for n in [1, 3, 1000, 65_537, 3 * (2 << 20) + 5] {
        let vals = values(n, k);
        let t = transfer::upload(vals.clone(), device);
        assert_eq!(burn_read(t.clone()), vals, "{n}: ring upload, Burn read");
        let doubled: Vec<f32> = vals.iter().map(|x| x * 2.0).collect();
        assert_eq!(
            transfer::read_f32(t.clone() * 2.0).unwrap(),
            doubled,
            "{n}: a Burn op on the upload, ring read"
        );
        let theirs = Tensor::<1>::from_data(TensorData::new(vals.clone(), [n]), device);
        assert_eq!(
            transfer::read_f32(theirs).unwrap(),
            vals,
            "{n}: Burn upload, ring read"
        );
        if n > 10 {
            let view = t.slice(3..n - 2);
            assert_eq!(
                transfer::read_f32(view).unwrap(),
                vals[3..n - 2],
                "{n}: a view at an offset"
            );
        }
    }
}

#[test]
fn burn_tensors_cross_through_the_staging_ring() {
    let rd = match wiretrain::device::select(DeviceSpec::WgpuCpu) {
        Ok(rd) => rd,
        Err(e) => {
            return common::skip_unless_ci(&format!(
                "no lavapipe: {e} (install mesa-vulkan-drivers)"
            ));
        }
    };
    let k = rd.kernels.clone().expect("a wgpu device has kernels");
    let before = k.counters();
    round(&rd.device, 0);
    let after = k.counters();
    // 5 sizes: one upload each, and 2 or 3 reads.
    assert_eq!(after.staging_writes - before.staging_writes, 5, "{after:?}");
    assert_eq!(
        after.staging_reads - before.staging_reads,
        5 * 2 + 3,
        "{after:?}"
    );
    let made = after.staging_buffers;
    assert!(made <= 6, "two rings of 3 at most: {made}");
    for k2 in 1..4 {
        round(&rd.device, k2);
    }
    round(&rd.device.clone().autodiff(), 9);
    assert_eq!(
        k.counters().staging_buffers,
        made,
        "no staging buffer made after the first round"
    );
}
