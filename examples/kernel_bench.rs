//! Fused AdamW (wiretrain's WGSL kernel) against the same update written with Burn tensor ops
//! (Burn's own AdamW: `Optimizer::step` on a 1-D tensor), on the same wgpu device, for the
//! kernel figure in docs/BENCHMARKS.md, two ways:
//! * on the device: param, grad, m and v resident, each timed step ends with a device sync;
//! * the trainer's step (`ShardOptimizer::step_with`, host gradient in, host parameters out):
//!   fused keeps the master on the device and uploads only the gradient; Burn's path uploads
//!   parameters and gradient and reads the result back; also fused with a bf16 read-back (the
//!   cast kernel), as ZeRO with `--wire-dtype bf16` runs it.
//!
//! In both, the two alternate step by step. Median of 21
//! steps after 3 warm-up steps.
//!
//! `cargo run --example kernel_bench -- [elements, default 16M] [device: wgpu:cpu | wgpu]`

use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::{Tensor, TensorData};
use std::time::Instant;
use wiretrain::device::{DeviceSpec, select};
use wiretrain::optim::{ShardOptimizer, StepOpts};
use wiretrain_shaders::AdamWHyper;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Iterations before timing, and timed.
const WARM: usize = 3;
const TIMED: usize = 21;

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
    let params: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let grads: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect();
    let h = AdamWHyper::default();
    let (f, bu, worst) = kernel_vs_burn(&k, &rd.device, &params, &grads, &h)?;
    let (tf, tb, th) = trainer_steps(&k, &rd.device, &params, &grads, h.lr)?;
    let bytes = 7.0 * 4.0 * n as f64; // reads p, g, m, v; writes p, m, v
    println!(
        "{{\"device\":{:?},\"elements\":{n},\"fused_ms\":{:.3},\"burn_ms\":{:.3},\"speedup\":{:.2},\"fused_gbps\":{:.2},\"worst_rel_diff\":{worst:e},\"step_fused_ms\":{:.3},\"step_fused_bf16_ms\":{:.3},\"step_burn_ms\":{:.3},\"step_speedup\":{:.2},\"step_speedup_bf16\":{:.2}}}",
        rd.description,
        f * 1e3,
        bu * 1e3,
        bu / f,
        bytes / f / 1e9,
        tf * 1e3,
        th * 1e3,
        tb * 1e3,
        tb / tf,
        tb / th
    );
    Ok(())
}

/// The fused kernel against Burn's AdamW on device tensors, alternating so drift on a noisy
/// machine hits both alike: (fused s, Burn s, worst relative difference of the results).
fn kernel_vs_burn(
    k: &std::sync::Arc<wiretrain_shaders::Kernels>,
    device: &burn::tensor::Device,
    params: &[f32],
    grads: &[f32],
    h: &AdamWHyper,
) -> anyhow::Result<(f64, f64, f32)> {
    let n = params.len();
    let opt = AdamWConfig::new()
        .with_beta_1(h.beta1)
        .with_beta_2(h.beta2)
        .with_epsilon(h.eps)
        .with_weight_decay(h.weight_decay)
        .build();
    let mut shard = k.adamw_shard(params)?;
    let g = k.upload(grads)?;
    k.sync()?;
    let mut p = Tensor::<1>::from_data(TensorData::new(params.to_vec(), [n]), device);
    let gt = Tensor::<1>::from_data(TensorData::new(grads.to_vec(), [n]), device);
    let mut state = None;
    device.sync().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let (mut fused, mut burn) = (vec![], vec![]);
    for i in 0..WARM + TIMED {
        let t = Instant::now();
        k.adamw_step(&mut shard, &g, h)?;
        k.sync()?;
        let tf = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (np, ns) = opt.step(h.lr, p, gt.clone(), state.take());
        p = np;
        state = ns;
        device.sync().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let tb = t.elapsed().as_secs_f64();
        if i >= WARM {
            fused.push(tf);
            burn.push(tb);
        }
    }
    // Same math: the two results agree.
    let a: Vec<f32> = k.read(shard.param(), n)?;
    let b = p
        .try_into_vec_as::<f32>()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0f32, f32::max);
    Ok((median(fused), median(burn), worst))
}

/// The trainer's optimizer step, host to host: (fused s, Burn's s, fused with a bf16
/// read-back s).
fn trainer_steps(
    k: &std::sync::Arc<wiretrain_shaders::Kernels>,
    device: &burn::tensor::Device,
    params: &[f32],
    grads: &[f32],
    lr: f64,
) -> anyhow::Result<(f64, f64, f64)> {
    let n = params.len();
    let cfg = wiretrain::optim::OptimConfig::default();
    let mut host = params.to_vec();
    let mut opt_f = ShardOptimizer::new(&cfg, device.clone(), n, Some(k.clone()));
    let mut opt_b = ShardOptimizer::new(&cfg, device.clone(), n, None);
    let (mut hf, mut hb, mut hh) = (vec![], vec![], vec![]);
    let bf16 = StepOpts {
        grad_scale: 1.0,
        readback: wiretrain_comm::WireDtype::Bf16,
    };
    for i in 0..WARM + TIMED {
        let t = Instant::now();
        opt_f
            .step_with(lr, &mut host, grads, StepOpts::default())
            .map_err(|e| anyhow::anyhow!(e))?;
        let a = t.elapsed().as_secs_f64();
        let t = Instant::now();
        opt_f
            .step_with(lr, &mut host, grads, bf16)
            .map_err(|e| anyhow::anyhow!(e))?;
        let c = t.elapsed().as_secs_f64();
        let t = Instant::now();
        opt_b
            .step(lr, &mut host, grads)
            .map_err(|e| anyhow::anyhow!(e))?;
        let b = t.elapsed().as_secs_f64();
        if i >= WARM {
            hf.push(a);
            hh.push(c);
            hb.push(b);
        }
    }
    Ok((median(hf), median(hb), median(hh)))
}
