//! Units: a model declared as a sequence of pieces, for ZeRO-3.
//!
//! ZeRO-3 keeps only a shard of every parameter at rest; a unit's full parameters exist only
//! while that unit runs (FSDP's "wrapping units"). A model opts in by implementing [`Units`]:
//! how many units it has, which unit each parameter belongs to (by field path), and how to run
//! one unit on the activation the previous one produced. Activations crossing unit boundaries
//! are [`Act`]s: a float or integer tensor of rank 1 to 3.
//!
//! The backward pass needs nothing beyond Burn's public autodiff API: for unit `i` with saved
//! input `x` and incoming gradient `g`, recompute `y = unit_i(x')` from `x' = x.detach()`
//! (require-grad), and backpropagate the surrogate loss `sum(y * g)`; its gradient with respect
//! to the unit's parameters and to `x'` is exactly the vector-Jacobian product.

use burn::module::Module;
use burn::tensor::{Gradients, Int, Tensor};

/// An activation at a unit boundary.
#[derive(Debug, Clone)]
pub enum Act {
    F1(Tensor<1>),
    F2(Tensor<2>),
    F3(Tensor<3>),
    I1(Tensor<1, Int>),
    I2(Tensor<2, Int>),
}

impl Act {
    /// A graph-free copy that records gradients again (float) or the same ids (int).
    pub fn fresh_leaf(&self) -> Self {
        match self {
            Self::F1(t) => Self::F1(t.clone().detach().require_grad()),
            Self::F2(t) => Self::F2(t.clone().detach().require_grad()),
            Self::F3(t) => Self::F3(t.clone().detach().require_grad()),
            Self::I1(t) => Self::I1(t.clone()),
            Self::I2(t) => Self::I2(t.clone()),
        }
    }

    /// Cut from its graph (what is saved between the forward and the backward pass).
    pub fn detached(self) -> Self {
        match self {
            Self::F1(t) => Self::F1(t.detach()),
            Self::F2(t) => Self::F2(t.detach()),
            Self::F3(t) => Self::F3(t.detach()),
            other => other,
        }
    }

    /// `sum(self * g)` as a 1-element tensor, `g` treated as a constant; `None` for integer
    /// activations or mismatched kinds.
    pub fn surrogate(&self, g: &Act) -> Option<Tensor<1>> {
        match (self, g) {
            (Self::F1(y), Self::F1(g)) => Some((y.clone() * g.clone().inner()).sum()),
            (Self::F2(y), Self::F2(g)) => Some((y.clone() * g.clone().inner()).sum()),
            (Self::F3(y), Self::F3(g)) => Some((y.clone() * g.clone().inner()).sum()),
            _ => None,
        }
    }

    /// The gradient of this leaf in `grads` (float activations only).
    pub fn grad(&self, grads: &Gradients) -> Option<Act> {
        match self {
            Self::F1(t) => t.grad(grads).map(Self::F1),
            Self::F2(t) => t.grad(grads).map(Self::F2),
            Self::F3(t) => t.grad(grads).map(Self::F3),
            _ => None,
        }
    }

    /// Bytes of the activation's elements (for memory reports).
    pub fn bytes(&self) -> usize {
        let n = |s: burn::tensor::Shape| s.num_elements();
        match self {
            Self::F1(t) => 4 * n(t.shape()),
            Self::F2(t) => 4 * n(t.shape()),
            Self::F3(t) => 4 * n(t.shape()),
            Self::I1(t) => 8 * n(t.shape()),
            Self::I2(t) => 8 * n(t.shape()),
        }
    }
}

/// A model cut into units, run one after the other. Parameters of one unit must be contiguous
/// in module (field) order, and units numbered in that order; the trainer checks this.
pub trait Units: Module {
    /// Number of units.
    fn num_units(&self) -> usize;
    /// The unit owning the parameter at field path `path` (e.g. `"blocks.layers.0.mha.query.weight"`).
    fn unit_of(&self, path: &str) -> usize;
    /// Runs unit `unit` on its input: the batch input for unit 0, the previous unit's output
    /// after that. The last unit's output goes to the step's loss function.
    fn forward_unit(&self, unit: usize, x: Act) -> Act;
}
