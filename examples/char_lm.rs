//! Library use with ZeRO-3: the `char-lm` transformer trained by 2 ranks inside this process
//! (threads sharing the node's buffers), parameters sharded and gathered unit by unit, then a
//! short sample of generated text. Multi-node: `wiretrain launch --local 2 --ranks-per-node 2
//! -- train --example char-lm --strategy zero3`.
//!
//! `cargo run --example char-lm [-- STEPS [DEVICE]]` (DEVICE: auto, wgpu, wgpu:cpu, cpu)

use burn::tensor::{Int, Tensor, TensorData};
use wiretrain::comm::{Node, NodeConfig, tls::Token};
use wiretrain::data::DistributedSampler;
use wiretrain::models::char_lm::{CharLm, CharLmConfig, Corpus};
use wiretrain::{Strategy, Trainer, TrainerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(150);
    let spec = args.next().unwrap_or_else(|| "auto".into()).parse()?;
    let corpus = std::sync::Arc::new(Corpus::shipped(64));
    let mut node = Node::join(NodeConfig::single_node(2, Token::generate()))?;
    let handles: Vec<_> = node
        .take_groups()
        .into_iter()
        .map(|pg| {
            let corpus = corpus.clone();
            std::thread::spawn(move || -> Result<Option<String>, String> {
                let rank = pg.rank();
                let device = wiretrain::device::select(spec)?.device.autodiff();
                let mut sampler = DistributedSampler::new(corpus.len(), 32, pg.world(), rank, 1)?;
                let model = CharLmConfig::new(corpus.vocab_size()).init(&device, 1);
                let cfg = TrainerConfig::builder(Strategy::Zero3)
                    .lr(3e-3)
                    .build()
                    .map_err(|e| e.to_string())?;
                let mut trainer =
                    Trainer::with_units(model, &device, cfg, pg).map_err(|e| e.to_string())?;
                for step in 0..steps {
                    let idx = sampler.indices(step);
                    let (input, loss) = CharLm::unit_io(&corpus, &idx, &device);
                    let r = trainer.step_units(input, loss).map_err(|e| e.to_string())?;
                    if rank == 0 && step % 25 == 0 {
                        println!("step {step:4}  loss {:.4}  {:.1} ms", r.loss, r.step_ms);
                    }
                }
                // Every rank gathers the full parameters (a collective), rank 0 samples.
                let full = trainer.gather_params().map_err(|e| e.to_string())?;
                let layout = trainer.layout().clone();
                let plain = CharLmConfig::new(corpus.vocab_size()).init(&device, 1);
                let model = layout.unflatten(plain, &full);
                Ok((rank == 0).then(|| sample(&model, &corpus, &device, 120)))
            })
        })
        .collect();
    for h in handles {
        if let Some(text) = h.join().map_err(|_| "rank panicked")?? {
            println!("--- sample ---\n{text}");
        }
    }
    node.shutdown()?;
    Ok(())
}

/// Greedy continuation of the corpus's first window, `n` characters long.
fn sample(model: &CharLm, corpus: &Corpus, device: &burn::tensor::Device, n: usize) -> String {
    let seq = corpus.seq();
    let (x, _) = corpus.batch(&[0], device);
    let mut ids: Vec<i64> = x.try_into_vec_as::<i64>().unwrap_or_default();
    let start = ids.len();
    for _ in 0..n {
        let window = ids[ids.len() - seq..].to_vec();
        let x = Tensor::<2, Int>::from_data(TensorData::new(window, [1, seq]), device);
        let logits: Vec<f32> = model
            .forward(x)
            .try_into_vec_as::<f32>()
            .unwrap_or_default();
        let last = &logits[(seq - 1) * corpus.vocab_size()..];
        let best = (0..last.len()).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        ids.push(best as i64);
    }
    let out: Vec<u16> = ids[start..].iter().map(|&i| i as u16).collect();
    corpus.decode(&out)
}
