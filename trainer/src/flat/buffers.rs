//! Module state that is not trained: Burn's `RunningState` (BatchNorm's running mean and
//! variance) and frozen parameters, which on an autodiff device are the float tensors that
//! require no gradient. They stay out of the flat vector (no gradient, no optimizer, no
//! unflatten overwriting them), so each rank's forward passes advance them as plain Burn's do;
//! the trainer then keeps them in step across ranks after every step ([`BufferSync`]).

use crate::transfer;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use serde::Serialize;

/// How a job keeps its ranks' non-trained module state (BatchNorm's running statistics) in
/// step after every step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BufferSync {
    /// Every rank takes rank 0's values (PyTorch DDP's `broadcast_buffers`).
    #[default]
    Broadcast,
    /// Every rank takes the mean over the ranks.
    Mean,
    /// Each rank keeps its own.
    Local,
}

/// Whether a visited float tensor is state that is not trained (see the module doc). Off an
/// autodiff device nothing requires a gradient, so nothing counts as one there.
pub(crate) fn is_buffer<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    let t = param.val();
    t.is_autodiff() && !t.is_require_grad()
}

/// The current values of `module`'s non-trained state as one flat tensor on its device (a
/// `RunningState`'s pending update folded in first, as Burn's `valid()` does); `None` when it
/// has none.
pub(crate) fn read<M: Module>(module: &M) -> Option<Tensor<1>> {
    // Folds every RunningState's pending update into its value (the state is shared with
    // `module`); the returned module is not needed.
    drop(module.valid());
    super::gather_flat(module, true)
}

/// `module` with its non-trained state replaced by the slices of `flat` (what [`read`] gave,
/// in the same order).
pub(crate) fn write<M: Module>(module: M, flat: Tensor<1>) -> M {
    super::write_flat(module, flat, true)
}

/// Elements of `module`'s non-trained state.
pub(crate) fn count<M: Module>(module: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if is_buffer(param) {
                self.0 += param.lazy_shape().iter().product::<usize>();
            }
        }
    }
    let mut c = Count(0);
    module.visit(&mut c);
    c.0
}

/// Reads the state to the host (one wait), for a collective.
pub(crate) fn read_host<M: Module>(
    module: &M,
) -> Result<Option<Vec<f32>>, burn::tensor::TensorReadError> {
    read(module).map(transfer::read_f32).transpose()
}
