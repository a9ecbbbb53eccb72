//! Fused AdamW (wiretrain's WGSL kernel) against the same update written with Burn tensor ops
//! (Burn's own AdamW: `Optimizer::step` on a 1-D tensor), on the same wgpu device, for the
//! kernel figure in docs/BENCHMARKS.md. Both keep param, grad, m and v resident on the device;
//! each timed step ends with a device sync. Median of 9 steps after 3 warm-up steps.
//!
//! `cargo run --example kernel_bench -- [elements, default 16M] [device: wgpu:cpu | wgpu]`

use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::{Tensor, TensorData};
use std::time::Instant;
use wiretrain::device::{DeviceSpec, select};
use wiretrain_shaders::AdamWHyper;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).map_or(Ok(16 << 20), |s| s.parse())?;
    let spec: DeviceSpec = args
        .get(2)
        .map_or("wgpu:cpu", String::as_str)
        .parse()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let rd = select(spec).map_err(|e| anyhow::anyhow!("{e}"))?;
    let k = rd
        .kernels
        .clone()
        .ok_or_else(|| anyhow::anyhow!("{} is not a wgpu device", rd.description))?;
    let device = rd.device.clone();
    let params: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let grads: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect();
    let (warm, timed) = (3, 9);
    let h = AdamWHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };

    // Fused: one dispatch per step on resident buffers.
    let mut shard = k.adamw_shard(&params)?;
    let g = k.upload(&grads)?;
    k.sync()?;
    let mut fused = vec![];
    for i in 0..warm + timed {
        let t = Instant::now();
        k.adamw_step(&mut shard, &g, &h)?;
        k.sync()?;
        if i >= warm {
            fused.push(t.elapsed().as_secs_f64());
        }
    }

    // Burn's AdamW on the same device, tensors resident.
    let opt = AdamWConfig::new()
        .with_beta_1(h.beta1)
        .with_beta_2(h.beta2)
        .with_epsilon(h.eps)
        .with_weight_decay(h.weight_decay)
        .build();
    let mut p = Tensor::<1>::from_data(TensorData::new(params.clone(), [n]), &device);
    let gt = Tensor::<1>::from_data(TensorData::new(grads.clone(), [n]), &device);
    let mut state = None;
    device.sync().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let mut burn = vec![];
    for i in 0..warm + timed {
        let t = Instant::now();
        let (np, ns) = opt.step(h.lr, p, gt.clone(), state.take());
        p = np;
        state = ns;
        device.sync().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        if i >= warm {
            burn.push(t.elapsed().as_secs_f64());
        }
    }
    // Same math: the two results agree.
    let a: Vec<f32> = k.read(&shard.param, n)?;
    let b = p
        .try_into_vec_as::<f32>()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0f32, f32::max);
    let (f, bu) = (median(fused), median(burn));
    let bytes = 7.0 * 4.0 * n as f64; // reads p, g, m, v; writes p, m, v
    println!(
        "{{\"device\":{:?},\"elements\":{n},\"fused_ms\":{:.3},\"burn_ms\":{:.3},\"speedup\":{:.2},\"fused_gbps\":{:.2},\"worst_rel_diff\":{worst:e}}}",
        rd.description,
        f * 1e3,
        bu * 1e3,
        bu / f,
        bytes / f / 1e9
    );
    Ok(())
}
