//! The planner's inputs that are not numbers: links and their presets, the precision of the
//! model states, the element type on the wire, the rank order, and a transformer's shape.

use serde::Serialize;
use std::str::FromStr;

/// A link: bandwidth per direction (bytes/s) and per-message latency (s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bandwidth per direction, in bytes per second.
    pub bytes_per_s: f64,
    /// Latency per message, in seconds.
    pub latency_s: f64,
}

/// The interconnect presets and their per-direction rates.
pub const PRESETS: &[(&str, f64, f64, &str)] = &[
    // name, GB/s per direction, latency in µs, note
    ("pcie4", 32.0, 2.0, "PCIe Gen4 x16"),
    ("pcie5", 64.0, 2.0, "PCIe Gen5 x16"),
    (
        "nvlink4",
        450.0,
        1.0,
        "NVLink 4: 900 GB/s bidirectional per GPU",
    ),
    ("ib-ndr", 50.0, 3.0, "InfiniBand NDR, 400 Gbit/s"),
    ("ib-hdr", 25.0, 3.0, "InfiniBand HDR, 200 Gbit/s"),
    ("roce-100g", 12.5, 5.0, "RoCE 100 Gbit/s"),
    ("eth-100g", 12.5, 30.0, "100 GbE over UDP/QUIC"),
    ("eth-10g", 1.25, 50.0, "10 GbE over UDP/QUIC"),
];

impl Link {
    /// The link of the preset called `name` (see [`PRESETS`]), if there is one.
    pub fn preset(name: &str) -> Option<Self> {
        PRESETS
            .iter()
            .find(|p| p.0 == name)
            .map(|p| Self::gbytes(p.1, p.2))
    }

    /// From GB/s and µs.
    pub fn gbytes(gb_per_s: f64, latency_us: f64) -> Self {
        Self {
            bytes_per_s: gb_per_s * 1e9,
            latency_s: latency_us * 1e-6,
        }
    }

    /// From Gbit/s and µs.
    pub fn gbits(gbit_per_s: f64, latency_us: f64) -> Self {
        Self::gbytes(gbit_per_s / 8.0, latency_us)
    }
}

/// Numeric precision of the model states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32: 4 bytes of parameters, 4 of gradients, 8 of optimizer state.
    F32,
    /// 16-bit parameters and gradients (2 bytes each) with 12 bytes of f32 optimizer state
    /// (master copy, m, v).
    Mixed,
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "mixed" => Ok(Self::Mixed),
            o => Err(format!("unknown precision {o:?} (f32, mixed)")),
        }
    }
}

/// Element type on the wire: the one `wiretrain_comm` carries (its bytes per element are
/// [`WireDtype::bytes_per_element`]).
pub use wiretrain_comm::WireDtype;

/// How ranks are placed on the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RankOrder {
    /// Node-major: ring neighbours inside the node (wiretrain's hierarchical collectives).
    #[default]
    NodeMajor,
    /// A flat ring whose every neighbour is on another node.
    Scrambled,
}

impl FromStr for RankOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "node-major" => Ok(Self::NodeMajor),
            "scrambled" => Ok(Self::Scrambled),
            o => Err(format!("unknown rank order {o:?} (node-major, scrambled)")),
        }
    }
}

/// A transformer's shape (for the parameter count and activation memory).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Shape {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size h.
    pub hidden: u64,
    /// Attention heads.
    pub heads: u64,
    /// Vocabulary size, in tokens.
    pub vocab: u64,
}

impl Shape {
    /// GPT-style count: per layer 12h² + 13h (attention, MLP, two norms), plus embeddings
    /// (vocabulary, and `seq` learned positions).
    pub fn params(&self, seq: u64) -> f64 {
        let (l, h) = (self.layers as f64, self.hidden as f64);
        l * (12.0 * h * h + 13.0 * h) + (self.vocab + seq) as f64 * h
    }
}
