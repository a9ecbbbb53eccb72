//! The elastic policy on plain member lists: each rule of the module doc, and the MIN re-check
//! after a join window and after members left during an epoch (issue 42, item 7).

use super::*;

const LIMITS: Limits = Limits {
    min: 2,
    max: 3,
    max_restarts: 2,
};

fn next(d: Decision) -> NextEpoch {
    match d {
        Decision::Next(n) => n,
        other => panic!("expected a next epoch, got {other:?}"),
    }
}

fn why(d: Decision) -> String {
    match d {
        Decision::End { why: Some(w) } => w,
        other => panic!("expected an end with a reason, got {other:?}"),
    }
}

const FAILED: EpochEnd<'static> = EpochEnd::Failed { restartable: true };

#[test]
fn members_keep_their_order_and_newcomers_queue_up_to_max() {
    // Member 20 left; 40 and 50 wait, 40 came first; MAX 3 takes 40 only.
    assert_eq!(
        next_members(&[10, 20, 30], &[30, 10, 40, 50], 3),
        [10, 30, 40]
    );
    assert_eq!(next_members(&[], &[7, 5], 3), [7, 5]);
    assert!(next_members(&[1, 2], &[], 3).is_empty());
}

#[test]
fn a_join_window_that_ends_below_min_gathers_again() {
    assert_eq!(gathered(&[4, 5, 6, 7], &LIMITS), Some(vec![4, 5, 6]));
    assert_eq!(gathered(&[4, 5], &LIMITS), Some(vec![4, 5]));
    // One of the two agents left during the window: no epoch of one (the old code's empty
    // or short member list), the host gathers again.
    assert_eq!(gathered(&[4], &LIMITS), None);
    assert_eq!(gathered(&[], &LIMITS), None);
}

#[test]
fn a_failure_restarts_from_a_checkpoint_while_restarts_and_min_last() {
    let n = next(decide(&LIMITS, 0, &[1, 2, 3], &[1, 3], FAILED));
    assert_eq!(n.members, [1, 3]);
    assert_eq!((n.left, n.joined), (vec![1], vec![]));
    assert_eq!((n.recovery, n.uses_restart), (Recovery::Checkpoint, true));
    // A member waiting to join comes in at the restart.
    let n = next(decide(&LIMITS, 1, &[1, 2, 3], &[1, 3, 9], FAILED));
    assert_eq!(
        (n.members, n.left, n.joined),
        (vec![1, 3, 9], vec![1], vec![2])
    );
    // No restart left.
    let w = why(decide(&LIMITS, 2, &[1, 2, 3], &[1, 3], FAILED));
    assert!(w.contains("no restart left (2 made)"), "{w}");
    // Fewer than MIN left.
    let w = why(decide(&LIMITS, 0, &[1, 2, 3], &[3], FAILED));
    assert!(w.contains("1 node(s) left, fewer than the 2"), "{w}");
    // A launch without restarts ends with its failure alone.
    let none = Limits {
        max_restarts: 0,
        ..LIMITS
    };
    assert_eq!(
        decide(&none, 0, &[1, 2], &[1], FAILED),
        Decision::End { why: None }
    );
    // A usage error never restarts, and needs no reason of the policy's.
    let usage = EpochEnd::Failed { restartable: false };
    assert_eq!(
        decide(&LIMITS, 0, &[1, 2], &[1, 2], usage),
        Decision::End { why: None }
    );
}

#[test]
fn a_heal_needs_a_restart_and_min_survivors() {
    let heal = EpochEnd::Heal { survivors: &[1, 3] };
    let n = next(decide(&LIMITS, 0, &[1, 2, 3], &[1, 3, 8], heal));
    // The healed epoch is the survivors' alone: the waiting member comes at the next point.
    assert_eq!((n.members, n.left, n.joined), (vec![1, 3], vec![1], vec![]));
    assert_eq!((n.recovery, n.uses_restart), (Recovery::Live, true));
    let one = EpochEnd::Heal { survivors: &[1] };
    let w = why(decide(&LIMITS, 0, &[1, 2, 3], &[1], one));
    assert!(
        w.starts_with("no heal") && w.contains("fewer than the 2"),
        "{w}"
    );
    let two = EpochEnd::Heal { survivors: &[1, 2] };
    let w = why(decide(&LIMITS, 2, &[1, 2], &[1, 2], two));
    assert_eq!(w, "no heal: 2 restart(s) of 2 made");
}

#[test]
fn a_growth_uses_no_restart_and_still_needs_min() {
    // From a checkpoint, with every restart already used: growing is not a failure.
    let grow = EpochEnd::Grow { in_place: None };
    let n = next(decide(&LIMITS, 2, &[1, 2], &[1, 2, 5], grow));
    assert_eq!((n.members, n.joined), (vec![1, 2, 5], vec![2]));
    assert_eq!((n.recovery, n.uses_restart), (Recovery::Checkpoint, false));
    // In place: the regrouped members first, then the newcomer.
    let in_place = EpochEnd::Grow {
        in_place: Some(&[2, 1]),
    };
    let n = next(decide(&LIMITS, 0, &[1, 2], &[1, 2, 5], in_place));
    assert_eq!((n.members, n.joined), (vec![2, 1, 5], vec![2]));
    assert_eq!(n.recovery, Recovery::Live);
    // A member joined, but two of the three left meanwhile (MIN re-checked).
    let w = why(decide(&LIMITS, 0, &[1, 2, 3], &[3], grow));
    assert!(
        w.contains("others left") && w.contains("1 node(s) left"),
        "{w}"
    );
}

#[test]
fn a_finished_epoch_ends_the_job() {
    assert_eq!(
        decide(&LIMITS, 0, &[1, 2], &[], EpochEnd::Finished),
        Decision::Done
    );
}
