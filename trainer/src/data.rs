//! DistributedSampler semantics: every epoch a seeded shuffle of the whole dataset, cut into
//! global batches; rank r takes the r-th equal slice of each global batch, so ranks see
//! disjoint samples and together exactly the global batch. The last, incomplete global batch
//! of an epoch is dropped (like `drop_last=True`), so every step has the same global batch and
//! the update equals single-process training on that batch.
//!
//! Uneven shares ([`DistributedSampler::indices_shared`]): rank r takes the r-th run of
//! `shares[r]` samples of the same global batch, so the ranks still see exactly the global
//! batch together, whatever the split (see `balance`).

use rand::SeedableRng;
use rand::seq::SliceRandom;

/// One rank's sample indices for each step: its slice (or share) of the step's global batch
/// in a seeded per-epoch shuffle.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    global_batch: usize,
    world: usize,
    rank: usize,
    seed: u64,
    /// Every rank takes an equal slice ([`Self::new`]), not a share ([`Self::uneven`]).
    even: bool,
    /// The permutation of the epoch last asked for.
    cached: Option<(usize, Vec<usize>)>,
}

impl DistributedSampler {
    /// Fails when the global batch does not divide by the world size or exceeds the dataset.
    pub fn new(
        len: usize,
        global_batch: usize,
        world: usize,
        rank: usize,
        seed: u64,
    ) -> Result<Self, String> {
        Self::build(len, global_batch, world, rank, seed, true)
    }

    /// For uneven shares ([`Self::indices_shared`]): the global batch need only hold one
    /// sample per rank.
    pub fn uneven(
        len: usize,
        global_batch: usize,
        world: usize,
        rank: usize,
        seed: u64,
    ) -> Result<Self, String> {
        Self::build(len, global_batch, world, rank, seed, false)
    }

    fn build(
        len: usize,
        global_batch: usize,
        world: usize,
        rank: usize,
        seed: u64,
        even: bool,
    ) -> Result<Self, String> {
        if global_batch < world {
            return Err(format!(
                "--global-batch {global_batch} is smaller than the world size {world}"
            ));
        }
        if even && !global_batch.is_multiple_of(world) {
            return Err(format!(
                "--global-batch {global_batch} must be a positive multiple of the world size {world}"
            ));
        }
        if global_batch > len {
            return Err(format!(
                "--global-batch {global_batch} exceeds the dataset size {len}"
            ));
        }
        Ok(Self {
            len,
            global_batch,
            world,
            rank,
            seed,
            even,
            cached: None,
        })
    }

    /// The same sampler for rank `rank` of a world of `world` (after an elastic heal): the
    /// global batches stay the same, only this rank's slice of them changes. Fails as
    /// [`Self::new`] does when the global batch does not divide by the new world.
    pub fn rebind(&mut self, rank: usize, world: usize) -> Result<(), String> {
        let checked = Self::build(
            self.len,
            self.global_batch,
            world,
            rank,
            self.seed,
            self.even,
        )?;
        self.world = checked.world;
        self.rank = checked.rank;
        Ok(())
    }

    /// Steps per epoch: the whole global batches in the dataset (the rest is dropped).
    pub fn steps_per_epoch(&self) -> usize {
        self.len / self.global_batch
    }

    /// Samples per step on each rank under equal slices: the global batch / the world size.
    pub fn local_batch(&self) -> usize {
        self.global_batch / self.world
    }

    /// This rank's run of the global batch of `step` when the ranks take `shares[r]` samples
    /// each (`shares` sums to the global batch, one entry per rank).
    pub fn indices_shared(&mut self, step: usize, shares: &[usize]) -> Vec<usize> {
        debug_assert_eq!(shares.iter().sum::<usize>(), self.global_batch);
        let start: usize = shares[..self.rank].iter().sum();
        let end = start + shares[self.rank];
        self.global(step)[start..end].to_vec()
    }

    /// The whole global batch of `step`, in order.
    fn global(&mut self, step: usize) -> &[usize] {
        let spe = self.steps_per_epoch();
        let (epoch, i) = (step / spe, step % spe);
        if self.cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut perm: Vec<usize> = (0..self.len).collect();
            perm.shuffle(&mut rand::rngs::StdRng::seed_from_u64(
                self.seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            ));
            self.cached = Some((epoch, perm));
        }
        let perm = &self.cached.as_ref().expect("just cached").1;
        &perm[i * self.global_batch..(i + 1) * self.global_batch]
    }

    /// The sample indices this rank trains on at global step `step`.
    pub fn indices(&mut self, step: usize) -> Vec<usize> {
        let (b, rank) = (self.local_batch(), self.rank);
        let batch = self.global(step);
        batch[rank * b..(rank + 1) * b].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_partition_each_global_batch() {
        let mut single = DistributedSampler::new(100, 8, 1, 0, 7).unwrap();
        for step in 0..30 {
            let mut all: Vec<usize> = (0..4)
                .flat_map(|r| {
                    DistributedSampler::new(100, 8, 4, r, 7)
                        .unwrap()
                        .indices(step)
                })
                .collect();
            assert_eq!(all, single.indices(step));
            all.sort();
            all.dedup();
            assert_eq!(all.len(), 8);
        }
        assert_eq!(single.steps_per_epoch(), 12);
    }

    #[test]
    fn epochs_reshuffle_and_bad_batches_are_refused() {
        let mut s = DistributedSampler::new(16, 16, 2, 0, 1).unwrap();
        let (e0, e1, again) = (s.indices(0), s.indices(1), s.indices(0));
        assert_ne!(e0, e1);
        assert_eq!(e0, again);
        assert!(DistributedSampler::new(100, 10, 4, 0, 1).is_err());
        assert!(DistributedSampler::new(4, 8, 2, 0, 1).is_err());
        assert!(DistributedSampler::uneven(100, 1, 2, 0, 1).is_err());
    }

    #[test]
    fn uneven_shares_still_partition_the_global_batch() {
        let mut single = DistributedSampler::new(100, 10, 1, 0, 9).unwrap();
        let shares = [6, 1, 3];
        for step in 0..25 {
            let all: Vec<usize> = (0..3)
                .flat_map(|r| {
                    let mut s = DistributedSampler::uneven(100, 10, 3, r, 9).unwrap();
                    let v = s.indices_shared(step, &shares);
                    assert_eq!(v.len(), shares[r]);
                    v
                })
                .collect();
            assert_eq!(all, single.indices(step));
        }
    }
}
