//! What a step reports ([`StepReport`]) and what a rank holds for model states
//! ([`MemoryReport`]).

use serde::Serialize;

/// Bytes a rank holds for model states (host copies included), as the ZeRO paper counts them.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct MemoryReport {
    /// Peak bytes of f32 parameters held: the whole flat vector, or under ZeRO-3 and HSDP the
    /// rank's shard plus the units gathered at once.
    pub params_bytes: usize,
    /// Peak bytes of flattened gradients held by wiretrain during a step.
    pub grads_bytes: usize,
    /// Bytes of optimizer state for the elements this rank steps.
    pub optim_bytes: usize,
}

/// One step's figures.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// Mean loss over the global batch (all ranks).
    pub loss: f32,
    /// Milliseconds of forward, backward, flattening and unflattening on this rank.
    pub compute_ms: f64,
    /// Time spent waiting for communication (exposed, not overlapped).
    pub comm_ms: f64,
    /// Milliseconds of the optimizer step.
    pub optim_ms: f64,
    /// Milliseconds of the whole step, wall clock.
    pub step_ms: f64,
    /// ZeRO-3: the part of `comm_ms` spent waiting for unit all-gathers (0 otherwise).
    pub gather_ms: f64,
    /// Bytes this rank sent to other nodes during the step (QUIC frames, headers included).
    pub sent_bytes: u64,
    /// Time during the step when this rank's communication thread ran a collective (each
    /// from its start to its end): the step's communication, hidden or not.
    pub comm_busy_ms: f64,
    /// Some rank asked to stop (see [`Trainer::set_stop_flag`]); every rank gets the same
    /// answer after the same step, so all of them can leave the loop together.
    pub stop: bool,
    /// Some rank was asked to regroup (see [`Trainer::set_regroup_flag`]): every rank leaves
    /// its epoch after this step, alive, for the next one.
    pub regroup: bool,
    /// Bytes the trainer moved from this rank's device to the host during the step
    /// (gradients, parameters, the loss; see [`crate::transfer`]).
    pub d2h_bytes: u64,
    /// Bytes the trainer moved from the host to this rank's device during the step.
    pub h2d_bytes: u64,
    /// Blocking device reads during the step (one per batched read).
    pub device_waits: u64,
    /// Bytes in use on this rank's device at the end of the step, where the backend reports
    /// it (wgpu, CUDA; `None` on Burn's CPU backend).
    pub device_mem_bytes: Option<u64>,
    /// The highest reading of device memory in use during the step (read after the backward
    /// pass, after the update and at the end).
    pub device_mem_peak: Option<u64>,
}

impl StepReport {
    /// The share of the step's communication the rank did not wait for (it computed
    /// meanwhile); see [`hidden_share`].
    pub fn hidden_share(&self) -> f64 {
        hidden_share(self.comm_ms, self.comm_busy_ms)
    }
}

/// The share of `busy_ms` of communication that was not among the `waited_ms` a rank spent
/// waiting for it: 1 − waited / busy, in [0, 1]; 0 without communication.
pub fn hidden_share(waited_ms: f64, busy_ms: f64) -> f64 {
    if busy_ms > 0.0 {
        (1.0 - waited_ms / busy_ms).clamp(0.0, 1.0)
    } else {
        0.0
    }
}
