//! One instrumentation mechanism for a step: entering a phase opens its trace span and, when
//! the guard drops, adds the phase's time to the step's figure of that kind (compute,
//! communication wait, optimizer, parameter-gather wait), so the step code says what a phase
//! is once instead of keeping a span and a stopwatch side by side.

use crate::trace::{Span, span};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// What a stretch of a step is counted as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Forward, backward, flattening and unflattening on this rank.
    Compute,
    /// Waiting for (or running) communication.
    Comm,
    /// The optimizer step.
    Optim,
    /// ZeRO-3: waiting for a unit's parameter gather (reported in both `gather_ms` and
    /// `comm_ms`).
    Gather,
}

impl Phase {
    fn cat(self) -> &'static str {
        match self {
            Self::Compute => "compute",
            Self::Comm | Self::Gather => "comm",
            Self::Optim => "optim",
        }
    }
}

/// The times of one step, by phase.
#[derive(Debug)]
pub(crate) struct StepClock {
    t0: Instant,
    times: [Cell<Duration>; 4],
}

/// A phase in progress: its trace span is open and its time counts until it drops.
#[must_use = "a phase lasts as long as its guard"]
pub(crate) struct PhaseGuard<'a> {
    cell: &'a Cell<Duration>,
    since: Instant,
    span: Span,
}

impl PhaseGuard<'_> {
    /// Attaches arguments to the phase's trace event.
    pub(crate) fn args(mut self, v: serde_json::Value) -> Self {
        self.span.set_args(v);
        self
    }
}

impl Drop for PhaseGuard<'_> {
    fn drop(&mut self) {
        self.cell.set(self.cell.get() + self.since.elapsed());
    }
}

impl StepClock {
    /// A clock whose step began at `t0`.
    pub(crate) fn since(t0: Instant) -> Self {
        Self {
            t0,
            times: Default::default(),
        }
    }

    fn cell(&self, phase: Phase) -> &Cell<Duration> {
        &self.times[phase as usize]
    }

    /// Enters `phase`, traced as `name`.
    pub(crate) fn enter(&self, phase: Phase, name: impl Into<String>) -> PhaseGuard<'_> {
        PhaseGuard {
            cell: self.cell(phase),
            since: Instant::now(),
            span: span(name, phase.cat()),
        }
    }

    /// Counts `d` as `phase` (time measured elsewhere, e.g. before the clock existed).
    pub(crate) fn add(&self, phase: Phase, d: Duration) {
        let c = self.cell(phase);
        c.set(c.get() + d);
    }

    /// The time counted as `phase` so far.
    pub(crate) fn total(&self, phase: Phase) -> Duration {
        self.cell(phase).get()
    }

    /// Time since the step began.
    pub(crate) fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_phase_counts_its_own_guards_only() {
        let clock = StepClock::since(Instant::now());
        {
            let _c = clock.enter(Phase::Comm, "wait");
            std::thread::sleep(Duration::from_millis(20));
            // A nested phase counts for its own kind too.
            let _o = clock.enter(Phase::Optim, "optimizer");
            std::thread::sleep(Duration::from_millis(10));
        }
        clock.add(Phase::Compute, Duration::from_millis(5));
        assert!(clock.total(Phase::Comm) >= Duration::from_millis(30));
        let optim = clock.total(Phase::Optim);
        assert!(optim >= Duration::from_millis(10) && optim < clock.total(Phase::Comm));
        assert_eq!(clock.total(Phase::Compute), Duration::from_millis(5));
        assert_eq!(clock.total(Phase::Gather), Duration::ZERO);
        assert!(clock.elapsed() >= Duration::from_millis(30));
    }
}
