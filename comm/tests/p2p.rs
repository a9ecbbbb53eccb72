//! Point-to-point messages (`ProcessGroup::send`/`recv`) through real node processes' paths:
//! 2 nodes x 2 ranks in one test process, QUIC on loopback between the nodes and the mailbox
//! inside each. Messages cross nodes and stay inside them, keep their order per pair and tag,
//! meet receives posted before or after them, carry large payloads; a receive that nobody
//! answers times out naming its peer and fails every rank of the job; a message of the wrong
//! length and a call to no rank are refused with one line.

mod common;

use common::{cluster, cluster_tuned};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use wiretrain_comm::{ProcessGroup, error::report};

/// What rank `from` sends in its `i`-th message of `len` elements.
fn payload(from: usize, i: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|j| (from * 1_000_000 + i * 1000 + j) as f32)
        .collect()
}

#[test]
fn messages_cross_nodes_and_stay_inside_them_in_order_per_pair_and_tag() {
    let out = cluster(&[2, 2], "p2p-order", |mut pg: ProcessGroup| {
        let (me, world) = (pg.rank(), pg.world());
        let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
        // Receives posted before their sends: the reverse-tag ones, then a large one.
        let early: Vec<_> = [3u64, 2, 1]
            .iter()
            .map(|&t| (t, pg.recv(5, prev, t)))
            .collect();
        let big = pg.recv(4 << 20, prev, 99);
        let mut sends = Vec::new();
        for t in 1..=3u64 {
            sends.push(pg.send(payload(me, t as usize, 5), next, t));
        }
        for i in 0..10 {
            sends.push(pg.send(payload(me, 100 + i, 64), next, 7));
        }
        sends.push(pg.send(payload(me, 0, 4 << 20), next, 99));
        for s in sends {
            s.wait().map_err(|e| report(&e))?;
        }
        for (t, w) in early {
            let got = w.wait().map_err(|e| report(&e))?;
            assert_eq!(got, payload(prev, t as usize, 5), "rank {me} tag {t}");
        }
        // Receives posted after their messages came: in the order sent.
        for i in 0..10 {
            let got = pg.recv(64, prev, 7).wait().map_err(|e| report(&e))?;
            assert_eq!(got, payload(prev, 100 + i, 64), "rank {me} message {i}");
        }
        let got = big.wait().map_err(|e| report(&e))?;
        assert!(
            got == payload(prev, 0, 4 << 20),
            "rank {me}'s 16 MiB message"
        );
        // The collectives' numbering is untouched by the messages.
        let sum = pg.all_reduce(vec![1.0; 8], wiretrain_comm::ReduceOp::Sum);
        assert_eq!(sum.wait().map_err(|e| report(&e))?, vec![world as f32; 8]);
        Ok::<usize, String>(me)
    });
    let ranks: Vec<usize> = out
        .into_iter()
        .flat_map(|n| n.expect("every node shuts down cleanly"))
        .map(|r| r.expect("every rank's messages arrive"))
        .collect();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
}

#[test]
fn a_receive_nobody_answers_times_out_naming_its_peer_and_fails_every_rank() {
    let seen: Arc<Mutex<Vec<(usize, f64, String)>>> = Arc::default();
    let t0 = Instant::now();
    let s = seen.clone();
    let tune = |c: &mut wiretrain_comm::NodeConfig| {
        c.collective_timeout(Duration::from_secs(2));
    };
    cluster_tuned(&[2, 2], "p2p-timeout", tune, move |mut pg: ProcessGroup| {
        let me = pg.rank();
        if me != 0 {
            // Waits from 1 s on, so its own timeout would only end it at 3 s.
            std::thread::sleep(Duration::from_secs(1));
        }
        let e = pg.recv(4, (me + 2) % 4, 9).wait().unwrap_err();
        s.lock()
            .unwrap()
            .push((me, t0.elapsed().as_secs_f64(), report(&e)));
    });
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_by_key(|s| s.0);
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert!(
        seen[0].2.contains(
            "recv (tag 9) between rank 0 and rank 2 timed out after 2s: no message from rank 2 \
             with this tag"
        ),
        "{:?}",
        seen[0]
    );
    for (rank, at, e) in &seen[1..] {
        assert!(
            e.contains("rank 0"),
            "rank {rank} names the rank that failed: {e}"
        );
        assert!(
            *at < 2.9,
            "rank {rank} failed at {at:.2} s, before its own timeout: {e}"
        );
    }
}

#[test]
fn a_message_of_another_length_and_a_call_to_no_rank_are_refused_in_one_line() {
    let seen: Arc<Mutex<Vec<(usize, String)>>> = Arc::default();
    let s = seen.clone();
    cluster(&[2, 2], "p2p-bad", move |mut pg: ProcessGroup| {
        let me = pg.rank();
        let say = |e: wiretrain_comm::Error| s.lock().unwrap().push((me, report(&e)));
        say(pg.send(vec![1.0], me, 0).wait().unwrap_err());
        say(pg.recv(1, 17, 0).wait().unwrap_err());
        if me == 2 {
            pg.send(vec![1.0; 5], 0, 3).wait().unwrap();
        }
        if me == 0 {
            say(pg.recv(6, 2, 3).wait().unwrap_err());
        }
    });
    let seen = seen.lock().unwrap().clone();
    let has = |rank: usize, what: &str| seen.iter().any(|(r, e)| *r == rank && e.contains(what));
    assert!(
        has(
            1,
            "rank 1 cannot exchange a message with rank 1: the peer must be another rank of \
                the job's 4"
        ),
        "{seen:?}"
    );
    assert!(has(3, "cannot exchange a message with rank 17"), "{seen:?}");
    assert!(
        has(
            0,
            "recv (tag 3) on rank 0: rank 2 sent 5 elements, this receive expects 6"
        ),
        "{seen:?}"
    );
}
