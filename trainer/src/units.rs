//! Units: a model declared as a sequence of pieces, for ZeRO-3.
//!
//! ZeRO-3 keeps only a shard of every parameter at rest; a unit's full parameters exist only
//! while that unit runs (FSDP's "wrapping units"). A model opts in by implementing [`Units`]:
//! how many units it has, which unit each parameter belongs to (by field path), and how to run
//! one unit on the activation the previous one produced. Activations crossing unit boundaries
//! are [`Act`]s: a float tensor of rank 1 to 4, an integer one of rank 1 to 3, or a tuple.
//!
//! The backward pass needs nothing beyond Burn's public autodiff API: for unit `i` with saved
//! input `x` and incoming gradient `g`, recompute `y = unit_i(x')` from `x' = x.detach()`
//! (require-grad), and backpropagate the surrogate loss `sum(y * g)`; its gradient with respect
//! to the unit's parameters and to `x'` is exactly the vector-Jacobian product.

use burn::module::Module;
use burn::tensor::{Gradients, Int, Tensor};

/// An activation at a unit boundary: a float tensor of rank 1 to 4 (a convolution's
/// `[batch, channels, height, width]` is rank 4), an integer tensor of rank 1 to 3 (token
/// ids, masks), or a tuple of them for a boundary that carries more than one (hidden state
/// and mask, encoder output and decoder state).
#[derive(Debug, Clone)]
pub enum Act {
    /// A float tensor of rank 1.
    F1(Tensor<1>),
    /// A float tensor of rank 2.
    F2(Tensor<2>),
    /// A float tensor of rank 3.
    F3(Tensor<3>),
    /// A float tensor of rank 4.
    F4(Tensor<4>),
    /// An integer tensor of rank 1.
    I1(Tensor<1, Int>),
    /// An integer tensor of rank 2.
    I2(Tensor<2, Int>),
    /// An integer tensor of rank 3.
    I3(Tensor<3, Int>),
    /// Several activations crossing the boundary together.
    Tuple(Vec<Act>),
}

/// Applies `$f` to the float tensor of any rank in `$act`, rebuilding the same variant;
/// integer tensors are passed through as `$int`.
macro_rules! map_float {
    ($act:expr, |$t:ident| $f:expr, $int:expr) => {
        match $act {
            Act::F1($t) => Act::F1($f),
            Act::F2($t) => Act::F2($f),
            Act::F3($t) => Act::F3($f),
            Act::F4($t) => Act::F4($f),
            other => $int(other),
        }
    };
}

impl Act {
    /// A graph-free copy that records gradients again (float) or the same ids (int).
    pub fn fresh_leaf(&self) -> Self {
        if let Self::Tuple(v) = self {
            return Self::Tuple(v.iter().map(Self::fresh_leaf).collect());
        }
        map_float!(self.clone(), |t| t.detach().require_grad(), |o| o)
    }

    /// Cut from its graph (what is saved between the forward and the backward pass).
    pub fn detached(self) -> Self {
        if let Self::Tuple(v) = self {
            return Self::Tuple(v.into_iter().map(Self::detached).collect());
        }
        map_float!(self, |t| t.detach(), |o| o)
    }

    /// `sum(self * g)` as a 1-element tensor, `g` treated as a constant (for a tuple, the sum
    /// over its float parts); `None` when no float part matches `g`'s kind.
    pub fn surrogate(&self, g: &Act) -> Option<Tensor<1>> {
        match (self, g) {
            (Self::F1(y), Self::F1(g)) => Some((y.clone() * g.clone().inner()).sum()),
            (Self::F2(y), Self::F2(g)) => Some((y.clone() * g.clone().inner()).sum()),
            (Self::F3(y), Self::F3(g)) => Some((y.clone() * g.clone().inner()).sum()),
            (Self::F4(y), Self::F4(g)) => Some((y.clone() * g.clone().inner()).sum()),
            (Self::Tuple(ys), Self::Tuple(gs)) if ys.len() == gs.len() => ys
                .iter()
                .zip(gs)
                .filter_map(|(y, g)| y.surrogate(g))
                .reduce(|a, b| a + b),
            _ => None,
        }
    }

    /// The gradient of this leaf in `grads` (float activations only). For a tuple: each
    /// float part's gradient (zeros where the part did not reach the loss) and each integer
    /// part as it is, so the tuple lines up with the unit's output; `None` when no part is a
    /// float.
    pub fn grad(&self, grads: &Gradients) -> Option<Act> {
        match self {
            Self::F1(t) => t.grad(grads).map(Self::F1),
            Self::F2(t) => t.grad(grads).map(Self::F2),
            Self::F3(t) => t.grad(grads).map(Self::F3),
            Self::F4(t) => t.grad(grads).map(Self::F4),
            Self::Tuple(v) if v.iter().any(Self::is_float) => Some(Self::Tuple(
                v.iter()
                    .map(|a| match a.grad(grads) {
                        Some(g) => g,
                        None if a.is_float() => a.zeros_like(),
                        None => a.clone(),
                    })
                    .collect(),
            )),
            _ => None,
        }
    }

    fn is_float(&self) -> bool {
        match self {
            Self::F1(_) | Self::F2(_) | Self::F3(_) | Self::F4(_) => true,
            Self::Tuple(v) => v.iter().any(Self::is_float),
            _ => false,
        }
    }

    pub(crate) fn zeros_like(&self) -> Self {
        if let Self::Tuple(v) = self {
            return Self::Tuple(v.iter().map(Self::zeros_like).collect());
        }
        map_float!(self.clone(), |t| t.inner().zeros_like(), |o| o)
    }

    /// Bytes of the activation's elements (for memory reports).
    pub fn bytes(&self) -> usize {
        let n = |s: burn::tensor::Shape| s.num_elements();
        match self {
            Self::F1(t) => 4 * n(t.shape()),
            Self::F2(t) => 4 * n(t.shape()),
            Self::F3(t) => 4 * n(t.shape()),
            Self::F4(t) => 4 * n(t.shape()),
            Self::I1(t) => 8 * n(t.shape()),
            Self::I2(t) => 8 * n(t.shape()),
            Self::I3(t) => 8 * n(t.shape()),
            Self::Tuple(v) => v.iter().map(Self::bytes).sum(),
        }
    }
}

/// A model cut into units, run one after the other. Parameters of one unit must be contiguous
/// in module (field) order, and units numbered in that order; the trainer checks this.
///
/// A model of the common shape implements [`Units::unit_map`] (and [`Units::forward_unit`]):
/// the numbering follows from it. A model numbered another way implements
/// [`Units::num_units`] and [`Units::unit_of`] instead.
pub trait Units: Module {
    /// The numbering of the common shape ([`UnitMap`]); empty unless implemented.
    fn unit_map(&self) -> UnitMap {
        UnitMap::new()
    }
    /// Number of units (by default, [`Units::unit_map`]'s).
    fn num_units(&self) -> usize {
        self.unit_map().num_units()
    }
    /// The unit owning the parameter at field path `path` (e.g.
    /// `"blocks.layers.0.mha.query.weight"`). By default [`Units::unit_map`]'s, where a
    /// parameter under no declared field joins the last unit.
    fn unit_of(&self, path: &str) -> usize {
        let map = self.unit_map();
        map.unit_of(path)
            .unwrap_or_else(|| map.num_units().saturating_sub(1))
    }
    /// Runs unit `unit` on its input: the batch input for unit 0, the previous unit's output
    /// after that. The last unit's output goes to the step's loss function.
    fn forward_unit(&self, unit: usize, x: Act) -> Act;
}

/// The unit numbering of the common shape, for [`Units::num_units`] and [`Units::unit_of`]:
/// groups of fields in module order, each group one unit, and `Vec`s of blocks whose every
/// element is a unit. Paths are Burn's field paths (`blocks.layers.3.mha.query.weight`: the
/// element 3 of the `Vec` at `blocks.layers`).
///
/// ```
/// use wiretrain::units::UnitMap;
/// // An embedding, 12 blocks, then the final norm with the head.
/// let map = UnitMap::new()
///     .unit(&["tok", "pos"])
///     .each("blocks.layers", 12)
///     .unit(&["norm", "head"]);
/// assert_eq!(map.num_units(), 14);
/// assert_eq!(map.unit_of("blocks.layers.3.mha.query.weight"), Some(4));
/// assert_eq!(map.unit_of("head.weight"), Some(13));
/// ```
#[derive(Debug, Clone, Default)]
pub struct UnitMap {
    parts: Vec<Part>,
}

#[derive(Debug, Clone)]
enum Part {
    Fields(Vec<String>),
    Each { path: String, count: usize },
}

/// Whether `path` is `prefix` or lies below it (at a `.`).
fn under<'a>(path: &'a str, prefix: &str) -> Option<&'a str> {
    match path.strip_prefix(prefix)? {
        "" => Some(""),
        rest => rest.strip_prefix('.'),
    }
}

impl UnitMap {
    /// A map with no unit yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// One unit: the fields at `paths` (dotted for nested ones) and everything below them.
    pub fn unit(mut self, paths: &[&str]) -> Self {
        let fields = paths.iter().map(|p| p.to_string()).collect();
        self.parts.push(Part::Fields(fields));
        self
    }

    /// `count` units: element i of the `Vec` at `path` is the next unit but i.
    pub fn each(mut self, path: &str, count: usize) -> Self {
        self.parts.push(Part::Each {
            path: path.to_string(),
            count,
        });
        self
    }

    /// Units declared.
    pub fn num_units(&self) -> usize {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Fields(_) => 1,
                Part::Each { count, .. } => *count,
            })
            .sum()
    }

    /// The unit of the parameter at `path`; `None` when no declared field holds it (or the
    /// element index is past the `Vec`'s declared count).
    pub fn unit_of(&self, path: &str) -> Option<usize> {
        let mut first = 0;
        for part in &self.parts {
            match part {
                Part::Fields(fields) => {
                    if fields.iter().any(|f| under(path, f).is_some()) {
                        return Some(first);
                    }
                    first += 1;
                }
                Part::Each { path: vec, count } => {
                    if let Some(rest) = under(path, vec) {
                        let i: usize = rest.split('.').next()?.parse().ok()?;
                        return (i < *count).then_some(first + i);
                    }
                    first += count;
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::UnitMap;

    #[test]
    fn fields_and_vec_elements_map_to_units_in_order() {
        let map = UnitMap::new()
            .unit(&["tok", "pos"])
            .each("blocks.layers", 3)
            .unit(&["norm", "head"]);
        assert_eq!(map.num_units(), 5);
        let cases = [
            ("tok.weight", Some(0)),
            ("pos.weight", Some(0)),
            ("blocks.layers.0.ffn.linear_inner.weight", Some(1)),
            ("blocks.layers.2.norm_1.gamma", Some(3)),
            ("norm.gamma", Some(4)),
            ("head.bias", Some(4)),
            // Past the declared count, a field not declared, a name that only starts alike.
            ("blocks.layers.3.norm_1.gamma", None),
            ("extra.weight", None),
            ("tokens.weight", None),
            ("blocks.layers.x.weight", None),
        ];
        for (path, want) in cases {
            assert_eq!(map.unit_of(path), want, "{path}");
        }
    }
}
