//! Library use in one file: a 2-rank ZeRO-2 run of the `mlp` example inside this process
//! (ranks are threads sharing the node's buffers). For multi-node runs use
//! `wiretrain launch --local 2 --ranks-per-node 2 -- train --example mlp`.
//!
//! `cargo run --release --example mlp [-- STEPS [DEVICE]]` (DEVICE: auto, wgpu, wgpu:cpu, cpu)

use wiretrain::comm::{Node, NodeConfig};
use wiretrain::data::DistributedSampler;
use wiretrain::models::mlp::{Dataset, Mlp};
use wiretrain::{Strategy, Trainer, TrainerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(100);
    let spec = args.next().unwrap_or_else(|| "auto".into()).parse()?;
    let ranks = 2;
    let mut node = Node::join(NodeConfig::single_node(
        ranks,
        wiretrain::comm::tls::Token::generate(),
    ))?;
    let data = std::sync::Arc::new(Dataset::synthetic(4096, 1));
    let handles: Vec<_> = node
        .take_groups()
        .into_iter()
        .map(|pg| {
            let data = data.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let rank = pg.rank();
                let device = wiretrain::device::select(spec)?.device.autodiff();
                let mut sampler = DistributedSampler::new(data.len(), 64, pg.world(), rank, 1)?;
                let cfg = TrainerConfig::builder(Strategy::Zero2)
                    .lr(1e-2)
                    .build()
                    .map_err(|e| e.to_string())?;
                let mut trainer = Trainer::new(Mlp::new(&device, 1), &device, cfg, pg)
                    .map_err(|e| e.to_string())?;
                for step in 0..steps {
                    let idx = sampler.indices(step);
                    let r = trainer
                        .step(|m| m.loss(&data, &idx, &device))
                        .map_err(|e| e.to_string())?;
                    if rank == 0 && step % 10 == 0 {
                        println!("step {step:4}  loss {:.4}  {:.1} ms", r.loss, r.step_ms);
                    }
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| "rank panicked")??;
    }
    node.shutdown()?;
    Ok(())
}
