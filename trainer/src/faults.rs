//! Injected faults and slowdowns ([`Faults`]): a value the caller puts in
//! [`crate::engine::TrainerConfig`], read by the training loop and the checkpoint code. The
//! library never reads the environment for them; the binary fills one with
//! [`Faults::from_env`]: the test suite's `WIRETRAIN_TEST_*` variables only when built with the
//! `test-hooks` feature (`scripts/test.sh` builds with it), and the documented balance demo's
//! `WIRETRAIN_DEBUG_SLOWDOWN` always.

use std::time::Duration;

/// What to slow down or stall. The default injects nothing.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Faults {
    /// Stall checkpoints between the shard files and the manifest (the window a crash during
    /// a checkpoint hits).
    pub stall_checkpoint: Option<StallCheckpoint>,
    /// Every rank of one node spends longer on one step: a slow (not dead) node.
    pub slow_step: Option<SlowStep>,
    /// One rank spends longer in every step: a straggler.
    pub slow_rank: Option<SlowRank>,
    /// Stall checkpoint pruning after an old checkpoint was renamed aside and before it is
    /// deleted (the window a kill during pruning hits).
    pub stall_prune: Option<Duration>,
    /// One rank computes `factor` times slower (it sleeps its compute time again), as a
    /// slower device would: the `--balance speed` demo.
    pub slowdown: Option<Slowdown>,
    /// The ranks of this node (numbered in the epoch before) hold a state that differs from
    /// the other replicas' when they heal (their parameters nudged), so the heal must send
    /// them a replica's state.
    pub heal_diverge: Option<usize>,
    /// (node, step): the process of this node kills itself with SIGKILL at the start of the
    /// step, as `kill -9` would (a death at a chosen point of the run, e.g. just before a
    /// DiLoCo round's outer step); in an elastic launch's first epoch only.
    pub die_at: Option<(usize, usize)>,
    /// (node, step): a rank of this node fails the job's connections at the start of the
    /// step (as a cut link would) while every process stays alive; once per process, in an
    /// elastic launch's first epoch only.
    pub cut_at: Option<(usize, usize)>,
}

/// Stall the checkpoint of `from_step` and later ones, on every rank or only on `rank`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StallCheckpoint {
    /// The first step whose checkpoint stalls.
    pub from_step: usize,
    /// How long each stalls.
    pub stall: Duration,
    /// The only rank that stalls; `None`: every rank.
    pub rank: Option<usize>,
}

/// Every rank of `node` spends `extra` more on `step`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlowStep {
    /// The slow node.
    pub node: usize,
    /// The step it is slow on.
    pub step: usize,
    /// The time added to that step.
    pub extra: Duration,
}

/// `rank` spends `extra` more in every step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlowRank {
    /// The straggling rank.
    pub rank: usize,
    /// The time added to each of its steps.
    pub extra: Duration,
}

/// `rank` computes `factor` (≥ 1) times slower.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slowdown {
    /// The slow rank.
    pub rank: usize,
    /// What its compute time is multiplied by (1: no slowdown).
    pub factor: f64,
}

impl Faults {
    /// The stall of the checkpoint of `step` on `rank`, if any.
    pub fn checkpoint_stall(&self, step: usize, rank: usize) -> Option<Duration> {
        let s = self.stall_checkpoint?;
        (step >= s.from_step && s.rank.is_none_or(|r| r == rank)).then_some(s.stall)
    }

    /// The extra time of `step` on a rank of `node`, if any.
    pub fn step_delay(&self, node: usize, step: usize) -> Option<Duration> {
        let s = self.slow_step?;
        (s.node == node && s.step == step).then_some(s.extra)
    }

    /// The extra time of every step on `rank`, if any.
    pub fn rank_delay(&self, rank: usize) -> Option<Duration> {
        let s = self.slow_rank?;
        (s.rank == rank).then_some(s.extra)
    }

    /// The compute slowdown factor of `rank`, if any.
    pub fn slowdown_of(&self, rank: usize) -> Option<f64> {
        let s = self.slowdown?;
        (s.rank == rank).then_some(s.factor)
    }

    /// The faults the environment asks for (see the module doc); malformed values inject
    /// nothing.
    pub fn from_env() -> Self {
        Self::parse(|name| std::env::var(name).ok())
    }

    fn parse(var: impl Fn(&str) -> Option<String>) -> Self {
        let test = |name: &str| {
            if cfg!(feature = "test-hooks") {
                var(name)
            } else {
                None
            }
        };
        let ms = |s: &str| s.parse::<u64>().ok().map(Duration::from_millis);
        let first_epoch = var(crate::job::env::EPOCH).is_none_or(|e| e == "0");
        let node_step = |name: &str| -> Option<(usize, usize)> {
            let v = test(name).filter(|_| first_epoch)?;
            let (n, s) = v.split_once(':')?;
            Some((n.parse().ok()?, s.parse().ok()?))
        };
        Self {
            // step:ms[:rank]
            stall_checkpoint: test("WIRETRAIN_TEST_STALL_CHECKPOINT").and_then(|v| {
                let mut it = v.split(':');
                let from_step = it.next()?.parse().ok()?;
                let stall = ms(it.next()?)?;
                let rank = match it.next() {
                    Some(r) => Some(r.parse().ok()?),
                    None => None,
                };
                Some(StallCheckpoint {
                    from_step,
                    stall,
                    rank,
                })
            }),
            // node:step:ms
            slow_step: test("WIRETRAIN_TEST_SLOW_STEP").and_then(|v| {
                let mut it = v.split(':');
                Some(SlowStep {
                    node: it.next()?.parse().ok()?,
                    step: it.next()?.parse().ok()?,
                    extra: ms(it.next()?)?,
                })
            }),
            // rank:ms
            slow_rank: test("WIRETRAIN_TEST_SLOW_RANK").and_then(|v| {
                let (r, t) = v.split_once(':')?;
                Some(SlowRank {
                    rank: r.parse().ok()?,
                    extra: ms(t)?,
                })
            }),
            // ms
            stall_prune: test("WIRETRAIN_TEST_STALL_PRUNE").and_then(|v| ms(&v)),
            // node
            heal_diverge: test("WIRETRAIN_TEST_HEAL_DIVERGE").and_then(|v| v.parse().ok()),
            // node:step, in the job's first epoch only (not again after a restart)
            die_at: node_step("WIRETRAIN_TEST_DIE_AT"),
            cut_at: node_step("WIRETRAIN_TEST_CUT_AT"),
            // rank:factor
            slowdown: var("WIRETRAIN_DEBUG_SLOWDOWN").and_then(|v| {
                let (r, f) = v.split_once(':')?;
                let factor: f64 = f.parse().ok()?;
                (factor.is_finite() && factor >= 1.0).then_some(Slowdown {
                    rank: r.parse().ok()?,
                    factor,
                })
            }),
        }
    }
}

/// The `cut_at` test fault fires once per process (a heal goes on in the same process).
pub(crate) fn first_cut() -> bool {
    static CUT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    !CUT.swap(true, std::sync::atomic::Ordering::SeqCst)
}

/// The `die_at` test fault: this process ends as `kill -9` would end it.
pub(crate) fn die() {
    tracing::warn!("test fault: this node's process kills itself");
    #[cfg(unix)]
    // SAFETY: kill(2) on this process's own pid has no memory effects.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Faults {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Faults::parse(|name| {
            owned
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn the_environment_becomes_a_value_and_nothing_else_reads_it() {
        let f = env(&[
            ("WIRETRAIN_TEST_STALL_CHECKPOINT", "5:6000:1"),
            ("WIRETRAIN_TEST_SLOW_STEP", "1:2:15000"),
            ("WIRETRAIN_TEST_SLOW_RANK", "2:30"),
            ("WIRETRAIN_TEST_STALL_PRUNE", "300"),
            ("WIRETRAIN_TEST_HEAL_DIVERGE", "1"),
            ("WIRETRAIN_TEST_DIE_AT", "2:11"),
            ("WIRETRAIN_TEST_CUT_AT", "1:7"),
            ("WIRETRAIN_DEBUG_SLOWDOWN", "1:3"),
        ]);
        // The documented demo knob works in every build; the test faults only with test-hooks.
        assert_eq!(f.slowdown_of(1), Some(3.0));
        assert_eq!(f.slowdown_of(0), None);
        if cfg!(feature = "test-hooks") {
            assert_eq!(f.checkpoint_stall(4, 1), None);
            assert_eq!(f.checkpoint_stall(7, 1), Some(Duration::from_secs(6)));
            assert_eq!(f.checkpoint_stall(7, 0), None);
            assert_eq!(f.step_delay(1, 2), Some(Duration::from_secs(15)));
            assert_eq!(f.step_delay(0, 2), None);
            assert_eq!(f.rank_delay(2), Some(Duration::from_millis(30)));
            assert_eq!(f.stall_prune, Some(Duration::from_millis(300)));
            assert_eq!(f.heal_diverge, Some(1));
            assert_eq!(f.die_at, Some((2, 11)));
            assert_eq!(f.cut_at, Some((1, 7)));
        } else {
            assert_eq!(
                f,
                Faults {
                    slowdown: f.slowdown,
                    ..Faults::default()
                }
            );
        }
        // Malformed values inject nothing; a factor below 1 is not a slowdown.
        let bad = env(&[
            ("WIRETRAIN_TEST_STALL_CHECKPOINT", "5:x"),
            ("WIRETRAIN_DEBUG_SLOWDOWN", "1:0.5"),
            ("WIRETRAIN_TEST_DIE_AT", "2"),
        ]);
        assert_eq!(bad, Faults::default());
        // A death happens once: not again in the epoch after a restart.
        let later = env(&[("WIRETRAIN_TEST_DIE_AT", "2:11"), ("WIRETRAIN_EPOCH", "1")]);
        assert_eq!(later.die_at, None);
    }
}
