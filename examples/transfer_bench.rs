//! Host <-> device bandwidth of the three ways bytes can cross, measured in one run on one
//! device: the per-tensor path wiretrain used before its transfer engine (one blocking
//! `into_data` per tensor; one `from_data` per tensor), the engine (`wiretrain::transfer`: one
//! batched read of every tensor, one upload), one whole tensor through Burn's own read and
//! upload (`burn-1-tensor`) against wiretrain's, which on a wgpu device go through its staging
//! ring straight from and into the tensor's storage (`ring-1-tensor`), and raw wgpu buffers of wiretrain's own kernels
//! (a wgpu device only) through staging made per call (`fresh-staging`: a new `MAP_READ`
//! buffer per read, `queue.write_buffer` per write) and through the persistent staging ring
//! (`staging-ring`: chunks in flight, read straight into the caller's buffer). Each size is cut into `TENSORS` tensors, as a model's
//! gradients are; GB/s = bytes / median time (GB = 1e9 bytes), after one warm-up round.
//!
//! `cargo run --release --example transfer_bench -- [DEVICE] [SIZES] [TENSORS] [ROUNDS]`
//! (defaults: auto 1M,16M,64M,256M 64 5). Prints a table, then one JSON object per row.
//! lavapipe binds at most 128 MiB: pass smaller sizes there.

use burn::tensor::{Device, Distribution, Tensor, TensorData};
use std::time::{Duration, Instant};
use wiretrain::transfer;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn parse_size(s: &str) -> Res<usize> {
    let (n, mul) = match s.as_bytes().last() {
        Some(b'K') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(n.parse::<usize>()? * mul)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Times `f` `rounds` times after one warm-up; the median.
fn time(rounds: usize, mut f: impl FnMut() -> Res<()>) -> Res<Duration> {
    f()?;
    let mut v = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        f()?;
        v.push(t.elapsed());
    }
    Ok(median(v))
}

/// Times `read` of a tensor `fresh` computes anew for each round (untimed, and finished on
/// the device first), so that no path can return an earlier round's read; the median.
fn time_reads(
    rounds: usize,
    device: &Device,
    mut fresh: impl FnMut(usize) -> Tensor<1>,
    mut read: impl FnMut(Tensor<1>) -> Res<()>,
) -> Res<Duration> {
    let mut v = Vec::with_capacity(rounds);
    for i in 0..=rounds {
        let t = fresh(i);
        device.sync()?;
        let start = Instant::now();
        read(t)?;
        if i > 0 {
            v.push(start.elapsed());
        }
    }
    Ok(median(v))
}

struct Row {
    op: &'static str,
    path: &'static str,
    bytes: usize,
    t: Duration,
}

fn main() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let spec = args.next().unwrap_or_else(|| "auto".into()).parse()?;
    let sizes: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "1M,16M,64M,256M".into())
        .split(',')
        .map(parse_size)
        .collect::<Res<_>>()?;
    let tensors: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(64);
    let rounds: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5);
    let rd = wiretrain::device::select(spec)?;
    let device = rd.device.clone();
    eprintln!("device: {}", rd.description);
    let mut rows = Vec::new();
    for &bytes in &sizes {
        rows.extend(measure(&device, &rd, bytes, tensors.max(1), rounds.max(1))?);
    }
    println!(
        "{:>6} {:>12} {:>12} {:>10} {:>8}",
        "op", "path", "bytes", "time_ms", "GB/s"
    );
    for r in &rows {
        println!(
            "{:>6} {:>12} {:>12} {:>10.3} {:>8.2}",
            r.op,
            r.path,
            r.bytes,
            r.t.as_secs_f64() * 1e3,
            r.bytes as f64 / r.t.as_secs_f64() / 1e9
        );
    }
    for r in &rows {
        let line = serde_json::json!({
            "op": r.op, "path": r.path, "bytes": r.bytes, "tensors": tensors,
            "time_ms": r.t.as_secs_f64() * 1e3,
            "gb_s": r.bytes as f64 / r.t.as_secs_f64() / 1e9, "device": rd.description,
        });
        println!("{line}");
    }
    Ok(())
}

/// Every path's read and write of `bytes` cut into `n` tensors.
fn measure(
    device: &Device,
    rd: &wiretrain::device::RankDevice,
    bytes: usize,
    n: usize,
    rounds: usize,
) -> Res<Vec<Row>> {
    let elems = (bytes / 4).max(n);
    let per = elems / n;
    let parts: Vec<Tensor<1>> = (0..n)
        .map(|i| {
            let len = if i + 1 == n {
                elems - per * (n - 1)
            } else {
                per
            };
            Tensor::random([len], Distribution::Default, device)
        })
        .collect();
    let host: Vec<f32> = (0..elems).map(|i| i as f32).collect();
    device.sync()?;
    let mut timed = Vec::new();
    measure_many(device, &parts, &host, rounds, &mut timed)?;
    measure_whole(device, &parts, &host, rounds, &mut timed)?;
    if let Some(k) = &rd.kernels {
        measure_staging(k, &host, rounds, &mut timed)?;
    }
    Ok(timed
        .into_iter()
        .map(|(op, path, t)| Row {
            op,
            path,
            bytes: 4 * elems,
            t,
        })
        .collect())
}

/// What one path took: (op, path, time per round).
type Timed = Vec<(&'static str, &'static str, Duration)>;

/// The `parts` read and written one tensor at a time (Burn) against the engine's batched
/// read and single upload.
fn measure_many(
    device: &Device,
    parts: &[Tensor<1>],
    host: &[f32],
    rounds: usize,
    timed: &mut Timed,
) -> Res<()> {
    let mut row = |op, path, t| timed.push((op, path, t));
    row(
        "d2h",
        "per-tensor",
        time(rounds, || {
            for t in parts {
                t.clone().try_into_data()?;
            }
            Ok(())
        })?,
    );
    row(
        "d2h",
        "engine",
        time(rounds, || {
            transfer::read_many(parts.to_vec())?;
            Ok(())
        })?,
    );
    row(
        "h2d",
        "per-tensor",
        time(rounds, || {
            let mut at = 0;
            for t in parts {
                let len = t.dims()[0];
                let d = TensorData::new(host[at..at + len].to_vec(), [len]);
                drop(Tensor::<1>::from_data(d, device));
                at += len;
            }
            device.sync()?;
            Ok(())
        })?,
    );
    row(
        "h2d",
        "engine",
        time(rounds, || {
            drop(transfer::upload(host.to_vec(), device));
            device.sync()?;
            Ok(())
        })?,
    );
    Ok(())
}

/// One tensor of the whole size: Burn's own read and upload against wiretrain's.
fn measure_whole(
    device: &Device,
    parts: &[Tensor<1>],
    host: &[f32],
    rounds: usize,
    timed: &mut Timed,
) -> Res<()> {
    let elems = host.len();
    let mut row = |op, path, t| timed.push((op, path, t));
    // Through the staging ring on a wgpu device, straight from and into the tensor's storage.
    let whole = Tensor::cat(parts.to_vec(), 0);
    let fresh = |i: usize| whole.clone() + i as f32;
    row(
        "d2h",
        "burn-1-tensor",
        time_reads(rounds, device, fresh, |t| {
            // Into a Vec, as wiretrain's read gives (Burn's bytes may be a mapped view).
            t.try_into_data()?.try_into_vec::<f32>()?;
            Ok(())
        })?,
    );
    row(
        "d2h",
        "ring-1-tensor",
        time_reads(rounds, device, fresh, |t| {
            transfer::read_f32(t)?;
            Ok(())
        })?,
    );
    row(
        "h2d",
        "burn-1-tensor",
        time(rounds, || {
            let d = TensorData::new(host.to_vec(), [elems]);
            drop(Tensor::<1>::from_data(d, device));
            device.sync()?;
            Ok(())
        })?,
    );
    row(
        "h2d",
        "ring-1-tensor",
        time(rounds, || {
            drop(transfer::upload(host.to_vec(), device));
            device.sync()?;
            Ok(())
        })?,
    );
    Ok(())
}

/// The device's own buffers: a staging buffer made per call against the persistent ring.
fn measure_staging(
    k: &wiretrain_shaders::Kernels,
    host: &[f32],
    rounds: usize,
    timed: &mut Timed,
) -> Res<()> {
    let elems = host.len();
    let mut row = |op, path, t| timed.push((op, path, t));
    let buf = k.upload(host)?;
    let mut out = vec![0.0f32; elems];
    row(
        "d2h",
        "fresh-staging",
        time(rounds, || {
            k.read_unstaged::<f32>(&buf, elems)?;
            Ok(())
        })?,
    );
    row(
        "d2h",
        "staging-ring",
        time(rounds, || {
            k.read_into(&buf, &mut out)?;
            Ok(())
        })?,
    );
    row(
        "h2d",
        "fresh-staging",
        time(rounds, || {
            k.write_unstaged(&buf, host)?;
            k.sync()?;
            Ok(())
        })?,
    );
    row(
        "h2d",
        "staging-ring",
        time(rounds, || {
            k.write(&buf, host)?;
            k.sync()?;
            Ok(())
        })?,
    );
    Ok(())
}
