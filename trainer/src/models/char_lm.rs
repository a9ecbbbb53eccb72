//! `char-lm`: a small causal transformer that predicts the next character of a text.
//!
//! The corpus is the public-domain Shakespeare excerpt shipped in `examples/data/` (compiled
//! into the binary, so nothing is downloaded at run time). Sample `i` is the window of
//! [`CharLmConfig::seq`] characters starting at offset `i`; its targets are the same window
//! shifted by one character. The vocabulary is the set of characters of the text.

use crate::units::{Act, UnitMap, Units};
use burn::config::Config;
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// The shipped corpus (see `examples/data/README.md`).
pub const SHIPPED_TEXT: &str = include_str!("../../../examples/data/shakespeare.txt");

/// Sizes of the model.
#[derive(Config, Debug)]
pub struct CharLmConfig {
    /// Characters in the vocabulary.
    pub vocab: usize,
    /// Context length in characters.
    #[config(default = 64)]
    pub seq: usize,
    /// Width of the embeddings and of every layer's input and output.
    #[config(default = 64)]
    pub d_model: usize,
    /// Attention heads per layer.
    #[config(default = 4)]
    pub n_heads: usize,
    /// Transformer layers.
    #[config(default = 2)]
    pub n_layers: usize,
    /// Hidden width of each layer's feed-forward block.
    #[config(default = 256)]
    pub d_ff: usize,
}

/// Token and position embeddings, pre-norm transformer layers with a causal mask, a final
/// norm and a linear head over the vocabulary. No dropout, so a seed fixes the whole run.
#[derive(Module, Debug)]
pub struct CharLm {
    tok: Embedding,
    pos: Embedding,
    blocks: TransformerEncoder,
    norm: LayerNorm,
    head: Linear,
}

impl CharLmConfig {
    /// A model with deterministic parameters (the same on every device kind for a seed).
    pub fn init(&self, device: &Device, seed: u64) -> CharLm {
        let m = CharLm {
            tok: EmbeddingConfig::new(self.vocab, self.d_model).init(device),
            pos: EmbeddingConfig::new(self.seq, self.d_model).init(device),
            blocks: TransformerEncoderConfig::new(
                self.d_model,
                self.d_ff,
                self.n_heads,
                self.n_layers,
            )
            .with_dropout(0.0)
            .with_norm_first(true)
            .init(device),
            norm: LayerNormConfig::new(self.d_model).init(device),
            head: LinearConfig::new(self.d_model, self.vocab).init(device),
        };
        crate::flat::init_deterministic(m, seed)
    }
}

impl CharLm {
    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]`.
    pub fn forward(&self, x: Tensor<2, Int>) -> Tensor<3> {
        let [b, s] = x.dims();
        let device = x.device();
        let pos = Tensor::<1, Int>::arange(0..s as i64, &device)
            .reshape([1, s])
            .repeat_dim(0, b);
        let h = self.tok.forward(x) + self.pos.forward(pos);
        let mask = generate_autoregressive_mask(b, s, &device);
        let h = self
            .blocks
            .forward(TransformerEncoderInput::new(h).mask_attn(mask));
        self.head.forward(self.norm.forward(h))
    }

    /// The unit-model form of [`CharLm::loss`]: unit 0's input and the loss of the last
    /// unit's output.
    pub fn unit_io(
        corpus: &Corpus,
        idx: &[usize],
        device: &Device,
    ) -> (Act, impl FnOnce(Act) -> Tensor<1> + use<>) {
        let (x, y) = corpus.batch(idx, device);
        let device = device.clone();
        (Act::I2(x), move |out: Act| {
            let Act::F3(logits) = out else {
                unreachable!("the char-lm's last unit returns logits [batch, seq, vocab]")
            };
            let [b, s, v] = logits.dims();
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(logits.reshape([b * s, v]), y.reshape([b * s]))
        })
    }

    /// Mean next-character cross-entropy over the samples `idx` of `corpus`.
    pub fn loss(&self, corpus: &Corpus, idx: &[usize], device: &Device) -> Tensor<1> {
        let (x, y) = corpus.batch(idx, device);
        let logits = self.forward(x);
        let [b, s, v] = logits.dims();
        CrossEntropyLossConfig::new()
            .init(device)
            .forward(logits.reshape([b * s, v]), y.reshape([b * s]))
    }
}

/// Units: the embeddings, each transformer block, then the final norm with the head.
impl Units for CharLm {
    fn unit_map(&self) -> UnitMap {
        UnitMap::new()
            .unit(&["tok", "pos"])
            .each("blocks.layers", self.blocks.layers.len())
            .unit(&["norm", "head"])
    }
    fn forward_unit(&self, unit: usize, x: Act) -> Act {
        let n = self.blocks.layers.len();
        match (unit, x) {
            (0, Act::I2(ids)) => {
                let [b, s] = ids.dims();
                let pos = Tensor::<1, Int>::arange(0..s as i64, &ids.device())
                    .reshape([1, s])
                    .repeat_dim(0, b);
                Act::F3(self.tok.forward(ids) + self.pos.forward(pos))
            }
            (u, Act::F3(h)) if (1..=n).contains(&u) => {
                let [b, s, _] = h.dims();
                let mask = generate_autoregressive_mask(b, s, &h.device());
                Act::F3(self.blocks.layers[u - 1].forward(h, None, Some(mask)))
            }
            (u, Act::F3(h)) if u == n + 1 => Act::F3(self.head.forward(self.norm.forward(h))),
            (u, x) => unreachable!("char-lm unit {u} cannot take {x:?}"),
        }
    }
}

/// A text as token ids, cut into overlapping windows.
#[derive(Debug, Clone)]
pub struct Corpus {
    tokens: Vec<u16>,
    vocab: Vec<char>,
    seq: usize,
}

impl Corpus {
    /// The shipped text with windows of `seq` characters.
    pub fn shipped(seq: usize) -> Self {
        Self::from_text(SHIPPED_TEXT, seq).expect("the shipped text is long enough")
    }

    /// Fails when the text is shorter than one window plus its target, or has more distinct
    /// characters than a u16 id holds.
    pub fn from_text(text: &str, seq: usize) -> Result<Self, String> {
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        if vocab.len() > u16::MAX as usize {
            return Err(format!("{} distinct characters (max 65535)", vocab.len()));
        }
        let tokens: Vec<u16> = text
            .chars()
            .map(|c| vocab.binary_search(&c).expect("char in vocab") as u16)
            .collect();
        if seq == 0 || tokens.len() <= seq {
            return Err(format!(
                "a text of {} characters holds no window of {seq}",
                tokens.len()
            ));
        }
        Ok(Self { tokens, vocab, seq })
    }

    /// Number of samples (windows with a full target).
    pub fn len(&self) -> usize {
        self.tokens.len() - self.seq
    }

    /// Whether the corpus has no sample (text no longer than the window).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Distinct characters of the text.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// Characters per sample (the window length).
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// The text of token ids.
    pub fn decode(&self, ids: &[u16]) -> String {
        ids.iter().map(|&i| self.vocab[i as usize]).collect()
    }

    /// Inputs and targets `[idx.len(), seq]`.
    pub fn batch(&self, idx: &[usize], device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let s = self.seq;
        let mut xs = Vec::with_capacity(idx.len() * s);
        let mut ys = Vec::with_capacity(idx.len() * s);
        for &i in idx {
            xs.extend(self.tokens[i..i + s].iter().map(|&t| t as i64));
            ys.extend(self.tokens[i + 1..i + s + 1].iter().map(|&t| t as i64));
        }
        (
            Tensor::<2, Int>::from_data(TensorData::new(xs, [idx.len(), s]), device),
            Tensor::<2, Int>::from_data(TensorData::new(ys, [idx.len(), s]), device),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_and_targets_are_shifted_by_one() {
        let c = Corpus::from_text("abcabd", 3).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c.vocab_size(), 4);
        let device = Device::flex();
        let (x, y) = c.batch(&[0, 2], &device);
        let x: Vec<i64> = x.try_into_vec_as::<i64>().unwrap();
        let y: Vec<i64> = y.try_into_vec_as::<i64>().unwrap();
        let ids = |v: &[i64]| v.iter().map(|&i| i as u16).collect::<Vec<_>>();
        assert_eq!(c.decode(&ids(&x)), "abccab");
        assert_eq!(c.decode(&ids(&y)), "bcaabd");
        assert!(Corpus::from_text("ab", 2).is_err());
        assert!(Corpus::shipped(64).len() > 200_000);
    }

    #[test]
    fn the_model_predicts_every_position() {
        let device = Device::flex();
        let c = Corpus::shipped(16);
        let m = CharLmConfig::new(c.vocab_size())
            .with_seq(16)
            .with_d_model(16)
            .with_d_ff(32)
            .init(&device, 1);
        let (x, _) = c.batch(&[0, 100, 5000], &device);
        assert_eq!(m.forward(x).dims(), [3, 16, c.vocab_size()]);
        let loss = m.loss(&c, &[0, 1], &device).into_scalar::<f32>();
        // Near ln(vocab) at initialisation.
        assert!((loss - (c.vocab_size() as f32).ln()).abs() < 1.0, "{loss}");
    }

    /// Causal: changing the last character changes no earlier position's logits; and the
    /// units run in order give the model's forward.
    #[test]
    fn causal_mask_and_units_agree_with_forward() {
        let device = Device::flex();
        let c = Corpus::shipped(8);
        let m = CharLmConfig::new(c.vocab_size())
            .with_seq(8)
            .with_d_model(16)
            .with_d_ff(32)
            .init(&device, 2);
        let (x, _) = c.batch(&[10], &device);
        let mut ids: Vec<i64> = x.clone().try_into_vec_as::<i64>().unwrap();
        let a: Vec<f32> = m.forward(x.clone()).try_into_vec_as::<f32>().unwrap();
        ids[7] = (ids[7] + 1) % c.vocab_size() as i64;
        let x2 = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, 8]), &device);
        let b: Vec<f32> = m.forward(x2).try_into_vec_as::<f32>().unwrap();
        let v = c.vocab_size();
        assert_eq!(a[..7 * v], b[..7 * v], "positions before the change");
        assert_ne!(a[7 * v..], b[7 * v..], "the changed position");
        let out = (0..m.num_units()).fold(Act::I2(x), |h, u| m.forward_unit(u, h));
        let Act::F3(out) = out else { panic!("logits") };
        let u: Vec<f32> = out.try_into_vec_as::<f32>().unwrap();
        let worst = a
            .iter()
            .zip(&u)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-5, "units vs forward: {worst}");
        assert_eq!(m.unit_of("blocks.layers.1.mha.query.weight"), 2);
        assert_eq!(m.unit_of("head.weight"), 3);
    }
}
