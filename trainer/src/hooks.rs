//! Fault-injection hooks of the test suite. They read `WIRETRAIN_TEST_*` environment variables
//! only in builds with the `test-hooks` cargo feature (`scripts/test.sh` builds with it); in
//! every other build each hook is a constant `None`, so no variable can change a real run.

/// `WIRETRAIN_TEST_STALL_CHECKPOINT=step:ms[:rank]` stalls the checkpoint of `step` (and later
/// ones) between the shard files and the manifest, on every rank or only on `rank`.
pub fn stall_checkpoint_ms(step: usize, rank: usize) -> Option<u64> {
    let v = var("WIRETRAIN_TEST_STALL_CHECKPOINT")?;
    let mut it = v.split(':');
    let (s, ms) = (it.next()?.parse::<usize>().ok()?, it.next()?.parse().ok()?);
    let only = it.next().map(|r| r.parse::<usize>().ok());
    (step >= s && only.is_none_or(|r| r == Some(rank))).then_some(ms)
}

/// `WIRETRAIN_TEST_SLOW_STEP=node:step:ms` makes every rank of node `node` spend `ms` more on
/// step `step`: a slow (not dead) node.
pub fn slow_step_ms(node: usize, step: usize) -> Option<u64> {
    let v = var("WIRETRAIN_TEST_SLOW_STEP")?;
    let mut it = v.split(':').map(|x| x.parse::<u64>().ok());
    let (n, s, ms) = (it.next()??, it.next()??, it.next()??);
    (n == node as u64 && s == step as u64).then_some(ms)
}

/// `WIRETRAIN_TEST_SLOW_RANK=rank:ms` makes rank `rank` spend `ms` more in every step: the
/// straggler of the trace report's test.
pub fn slow_rank_ms(rank: usize) -> Option<u64> {
    let v = var("WIRETRAIN_TEST_SLOW_RANK")?;
    let (r, ms) = v.split_once(':')?;
    (r.parse::<usize>().ok()? == rank).then(|| ms.parse().ok())?
}

/// `WIRETRAIN_TEST_STALL_PRUNE=ms` stalls checkpoint pruning after an old checkpoint was renamed
/// aside and before it is deleted: the window a kill during pruning hits.
pub fn stall_prune_ms() -> Option<u64> {
    var("WIRETRAIN_TEST_STALL_PRUNE")?.parse().ok()
}

#[cfg(feature = "test-hooks")]
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

#[cfg(not(feature = "test-hooks"))]
fn var(_name: &str) -> Option<String> {
    None
}
