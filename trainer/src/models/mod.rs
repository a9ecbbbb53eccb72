//! The built-in examples: `mlp` (synthetic classification) and `char-lm` (a small causal
//! transformer over the shipped text).

pub mod char_lm;
pub mod mlp;

/// A built-in example by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Example {
    /// `mlp`: synthetic classification ([`mlp::Mlp`]).
    Mlp,
    /// `char-lm`: a small causal transformer over the shipped text ([`char_lm::CharLm`]).
    CharLm,
}

impl Example {
    /// Learning rate the example trains well with under AdamW.
    pub fn default_lr(self) -> f64 {
        match self {
            Self::Mlp => 1e-2,
            Self::CharLm => 3e-3,
        }
    }
}

impl std::str::FromStr for Example {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mlp" => Ok(Self::Mlp),
            "char-lm" => Ok(Self::CharLm),
            other => Err(format!(
                "{other:?} is not a built-in example (mlp, char-lm)"
            )),
        }
    }
}

impl std::fmt::Display for Example {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Mlp => "mlp",
            Self::CharLm => "char-lm",
        })
    }
}
