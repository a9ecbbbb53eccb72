//! Healing a trainer from live replicas: after its node joined the next job epoch
//! ([`crate::heal`]), the trainer takes the new process group ([`Trainer::rebind`]) and the
//! ranks agree on one state ([`Trainer::agree_state`]): every rank's step count and state
//! digest are gathered; where ranks holding the same replica differ, the rank with the most
//! steps sends its state (parameters, f32 master, optimizer tensors and scalars) over the
//! new epoch's links, and every receiver checks the SHA-256 digest of what it got against
//! the sender's. Nothing is read from a checkpoint. DiLoCo's nodes hold inner states of
//! their own: only the outer state must agree ([`diloco`]).

use super::Trainer;
use crate::checkpoint::ScalarValue;
use crate::optim::ExportedState;
use crate::strategy::Replicas;
use burn::module::Module;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use wiretrain_comm::ProcessGroup;

mod diloco;

/// What the ranks agreed on in a heal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Agreed {
    /// Steps the agreed state holds.
    pub steps: usize,
    /// Whether some rank received its state from another.
    pub transferred: bool,
    /// DiLoCo: the round's outer step, which the failure cut off on every rank, ran on the
    /// healed world.
    pub outer_step_ran: bool,
}

/// One rank's entry in the heal's exchange: its step count and state digest, and under
/// DiLoCo its outer state's digest and counters.
struct Entry {
    steps: usize,
    digest: [u8; 32],
    outer: [u8; 32],
    rounds: usize,
    inner_done: usize,
    /// The rank joined the job in this heal ([`Trainer::join_state`]): it holds no state.
    joined: bool,
}

/// An entry's bytes: steps, digest, step shape, outer digest, rounds, inner steps, joined.
const ENTRY_LEN: usize = 8 + 32 + 8 + 32 + 8 + 8 + 1;
/// Where the step shape sits in an entry.
const SHAPE: std::ops::Range<usize> = 40..48;

impl Entry {
    fn parse(b: &[u8]) -> Option<Self> {
        let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8")) as usize;
        (b.len() == ENTRY_LEN).then(|| Entry {
            steps: u(0),
            digest: b[8..40].try_into().expect("32"),
            outer: b[48..80].try_into().expect("32"),
            rounds: u(80),
            inner_done: u(88),
            joined: b[96] == 1,
        })
    }
}

/// Optimizer state tensors a state may hold at most (AdamW has two, SGD one).
const MAX_STATE_TENSORS: usize = 4;
/// The longest optimizer tensor name a state header may carry.
const MAX_NAME_LEN: usize = 128;
/// The largest state header (tensor names, scalars, lengths) a rank accepts.
const MAX_HEADER_BYTES: usize = 64 << 10;
/// The largest run id rank 0 may send.
const MAX_RUN_ID_BYTES: usize = 256;

/// A state header: the optimizer's tensor names and scalars, and the lengths of the
/// parameters, the f32 master and each optimizer tensor.
type Header = (
    Vec<String>,
    BTreeMap<String, ScalarValue>,
    (usize, usize, usize),
);

impl<M: Module> Trainer<M> {
    /// Why this trainer cannot go on from live replicas after losing a node (`None`: it
    /// can). DDP, hybrid and HSDP hold every element of their state on more than one node;
    /// DiLoCo's nodes go on with their own inner states and agree on the outer state;
    /// ZeRO-1/2/3 restart from the newest checkpoint.
    pub fn heal_unsupported(&self) -> Option<String> {
        match self.sync.replicas(self.pg.table()) {
            Replicas::None(why) => Some(format!("{} {why}", self.cfg.strategy)),
            Replicas::Groups(_) | Replicas::NodesApart => None,
        }
    }

    /// Takes `pg` (the next epoch's) in place of the process group the job lost. Fails when
    /// this rank would own other elements in the new world (its state does not fit it) or
    /// when the step cut off lost the model.
    pub(crate) fn rebind(&mut self, pg: ProcessGroup) -> Result<(), String> {
        if let Some(why) = self.heal_unsupported() {
            return Err(why);
        }
        if self.model.is_none() {
            return Err("the model was lost in the step cut off".into());
        }
        // Everything a heal sends, digests or compares is the host vector.
        self.sync_host().map_err(|e| e.to_string())?;
        let owned = self
            .sync
            .owned(&pg, &self.held.buckets, self.layout.total());
        if owned != self.held.owned {
            return Err(format!(
                "rank {} of the new world owns other elements than this rank held",
                pg.rank()
            ));
        }
        self.pg = pg;
        Ok(())
    }

    /// Whether a failure (`comm`: of communication; nothing else heals) may heal from live
    /// replicas under this trainer's strategy (logging why not).
    pub(crate) fn may_heal_after(&self, comm: bool) -> bool {
        if !comm {
            return false;
        }
        let why = self.heal_unsupported();
        if let Some(why) = &why {
            tracing::info!(
                "no heal from live replicas ({why}): the launcher restarts from a checkpoint"
            );
        }
        why.is_none()
    }

    /// The `heal_diverge` test fault on a rank of `old_node` (its node before the heal): its
    /// state is nudged and it claims a step fewer than `done`, so that another replica's
    /// state is sent to it. Returns the steps to claim.
    pub(crate) fn heal_test_fault(&mut self, old_node: usize, done: usize) -> usize {
        if self.cfg.faults.heal_diverge != Some(old_node) || self.sync_host().is_err() {
            return done;
        }
        self.diverge_for_test();
        done.saturating_sub(1)
    }

    /// Nudges this rank's parameters (and master) away from the other replicas' (the
    /// `heal_diverge` test fault: the heal must send it a replica's state).
    fn diverge_for_test(&mut self) {
        for v in [&mut self.held.params, &mut self.held.master] {
            if let Some(x) = v.first_mut() {
                *x += 0.5;
            }
        }
        self.opt.forget_master();
        if !self.cfg.strategy.shards_params()
            && let Some(model) = self.model.take()
        {
            self.model = Some(self.layout.unflatten(model, &self.held.params));
        }
    }

    /// The collectives a trainer's construction makes (the model check and rank 0's
    /// parameters), made by the ranks already in a job that nodes join in place, so that they
    /// meet the newcomers' [`Trainer::new`] / [`Trainer::with_units`]; what this rank holds
    /// is unchanged (the state then comes from [`Trainer::agree_state`]).
    pub(crate) fn welcome_joiners(&mut self) -> Result<(), super::TrainError> {
        self.sync_host()?;
        super::check_agreement(&mut self.pg, &self.layout)?;
        let total = self.layout.total();
        let params = if self.cfg.strategy.shards_params() {
            // Rank 0 holds only its shards: the newcomers' placeholder values (replaced by
            // the agreed state).
            vec![0.0; total]
        } else {
            self.held.params.clone()
        };
        self.pg.broadcast(params, 0).wait()?;
        Ok(())
    }

    /// Optimizer steps this trainer applied (counted when the optimizer stepped, before the
    /// gather that may follow it).
    pub fn updates(&self) -> usize {
        self.held.optimizer_steps
    }

    /// A collective of the new epoch: every rank states that its state holds `steps` steps;
    /// ranks of the same replica (the same local rank under hybrid, every rank under DDP)
    /// whose state differs from the one with the most steps receive that one's, checked
    /// against its SHA-256 digest. Returns the steps of the agreed state.
    pub(crate) fn agree_state(&mut self, steps: usize) -> Result<Agreed, super::TrainError> {
        self.agree_as(steps, false)
    }

    /// [`Trainer::agree_state`] on a rank that joins a running job in place (its trainer just
    /// built): it holds no state of its own and receives the others'.
    pub(crate) fn join_state(&mut self) -> Result<Agreed, super::TrainError> {
        self.agree_as(0, true)
    }

    fn agree_as(&mut self, steps: usize, joined: bool) -> Result<Agreed, super::TrainError> {
        let (entries, exported) = self.exchange_entries(steps, joined)?;
        match self.sync.replicas(self.pg.table()) {
            Replicas::NodesApart => self.agree_diloco(&entries, &exported),
            Replicas::Groups(group_of) => self.agree_replicas(&group_of, &entries, &exported),
            Replicas::None(why) => Err(super::TrainError::Heal(format!(
                "{} {why}",
                self.cfg.strategy
            ))),
        }
    }

    /// Every rank's [`Entry`] (steps, digests, step shape), after every rank took rank 0's
    /// run id (a node that joined takes it: checkpoints' pruning keys on it); and this rank's
    /// exported optimizer state. Fails when a rank would step differently from rank 0.
    fn exchange_entries(
        &mut self,
        steps: usize,
        joined: bool,
    ) -> Result<(Vec<Entry>, ExportedState), super::TrainError> {
        self.sync_host()?;
        let heal_err = |m: String| super::TrainError::Heal(m);
        let id = self
            .pg
            .broadcast_bytes_within(self.run_id.as_bytes(), 0, MAX_RUN_ID_BYTES)?;
        self.run_id =
            String::from_utf8(id).map_err(|_| heal_err("rank 0's run id is not UTF-8".into()))?;
        let exported = self.opt.export_state()?;
        let digest = self.state_digest(&exported);
        let mut mine = (steps as u64).to_le_bytes().to_vec();
        mine.extend_from_slice(&digest);
        mine.extend_from_slice(&self.step_shape());
        let outer = self.sync.outer();
        mine.extend_from_slice(&outer.map_or([0; 32], |o| o.digest()));
        for n in [
            outer.map_or(0, |o| o.rounds),
            outer.map_or(0, |o| o.inner_done),
        ] {
            mine.extend_from_slice(&(n as u64).to_le_bytes());
        }
        mine.push(u8::from(joined));
        let all = self.pg.all_gather_bytes_within(&mine, ENTRY_LEN)?;
        let entries: Vec<Entry> = all
            .iter()
            .enumerate()
            .map(|(r, b)| {
                Entry::parse(b)
                    .ok_or_else(|| heal_err(format!("rank {r} sent a malformed state entry")))
            })
            .collect::<Result<_, _>>()?;
        // Every rank must step alike: the same strategy, buckets and overlap (a newcomer
        // resolves `--overlap auto` from its own world, which may differ from the others').
        if let Some(r) = all.iter().position(|b| b[SHAPE] != all[0][SHAPE]) {
            return Err(heal_err(format!(
                "rank {r} would step differently from rank 0 (another strategy, buckets or \
                 overlap; e.g. `--overlap auto` resolved on another world size): set --overlap \
                 on or off for elastic launches"
            )));
        }
        Ok((entries, exported))
    }

    /// The agreement of replicated state (`group_of[r]`: rank r's replica group; DDP: one
    /// group; hybrid/HSDP: a group per local rank): in each group, the ranks whose state
    /// differs from the one with the most steps receive that one's.
    fn agree_replicas(
        &mut self,
        group_of: &[usize],
        entries: &[Entry],
        exported: &ExportedState,
    ) -> Result<Agreed, super::TrainError> {
        let groups = group_of.iter().copied().max().map_or(0, |m| m + 1);
        let sources: Vec<usize> = (0..groups)
            .filter_map(|g| {
                (0..entries.len())
                    .filter(|&r| group_of[r] == g)
                    .max_by_key(|&r| (entries[r].steps, usize::MAX - r))
            })
            .collect();
        let agreed = sources.first().map_or(0, |&s| entries[s].steps);
        if let Some(&s) = sources.iter().find(|&&s| entries[s].steps != agreed) {
            return Err(super::TrainError::Heal(format!(
                "the replicas stopped at different steps (local rank {} at {}, local rank {} \
                 at {agreed}): no live state holds one step for every shard",
                group_of[s], entries[s].steps, group_of[sources[0]]
            )));
        }
        let me = self.pg.rank();
        let mut transferred = false;
        for (g, &src) in sources.iter().enumerate() {
            let want = &entries[src];
            let same =
                |r: usize| entries[r].steps == want.steps && entries[r].digest == want.digest;
            if (0..entries.len()).filter(|&r| group_of[r] == g).all(same) {
                continue;
            }
            transferred = true;
            self.receive_state(src, group_of[me] == g, exported, want)?;
        }
        // Hybrid: what the model computes with is the node's gather of the masters (a rank
        // whose optimizer stepped before the gather was cut off holds stale parameters).
        self.finish_load()?;
        Ok(Agreed {
            steps: agreed,
            transferred,
            outer_step_ran: false,
        })
    }

    /// Whether every receiver of rank `src`'s state (those with `keep`) can take it: buffers
    /// of `theirs` elements (parameters, master, owned) against this rank's `lens`, and the
    /// optimizer tensors `names`. Every rank learns whether any cannot, so that all fail
    /// together rather than leave the others waiting in the transfer (a collective).
    fn check_fit(
        &mut self,
        src: usize,
        keep: bool,
        exported: &ExportedState,
        names: &[String],
        theirs: (usize, usize, usize),
        lens: (usize, usize, usize),
    ) -> Result<(), super::TrainError> {
        let heal_err = |m: String| super::TrainError::Heal(m);
        // (The same optimizer holds the same tensors; a state not made yet holds none.)
        let own: BTreeSet<&String> = exported.tensors.iter().map(|(n, _)| n).collect();
        let other_names = !own.is_empty() && own != names.iter().collect::<BTreeSet<_>>();
        let unfit = keep && (theirs != lens || other_names);
        let any = self
            .pg
            .all_reduce(
                vec![f32::from(u8::from(unfit))],
                wiretrain_comm::ReduceOp::Sum,
            )
            .wait()?;
        if unfit {
            return Err(heal_err(format!(
                "rank {src}'s state has buffers of {}, {}, {} elements and optimizer tensors \
                 {names:?}; this rank holds {}, {}, {} and {own:?}",
                theirs.0, theirs.1, theirs.2, lens.0, lens.1, lens.2
            )));
        }
        if any[0] > 0.0 {
            return Err(heal_err(format!(
                "a rank cannot take rank {src}'s state (its buffers or tensors differ)"
            )));
        }
        Ok(())
    }

    /// The transfer of rank `src`'s state (a collective of the whole world; only ranks with
    /// `mine` set keep what arrives, and check it against `want`'s digest).
    fn receive_state(
        &mut self,
        src: usize,
        mine: bool,
        exported: &ExportedState,
        want: &Entry,
    ) -> Result<(), super::TrainError> {
        let heal_err = |m: String| super::TrainError::Heal(m);
        let lens = (
            self.held.params.len(),
            self.held.master.len(),
            self.held.owned_len(),
        );
        let (names, scalars, (n_params, n_master, n_owned)) =
            self.state_header(src, exported, lens)?;
        let keep = mine && self.pg.rank() != src;
        self.check_fit(
            src,
            keep,
            exported,
            &names,
            (n_params, n_master, n_owned),
            lens,
        )?;
        // What this rank sends (the source) or a buffer of the right length (the others).
        let buf = |own: &[f32], n: usize| {
            if own.len() == n {
                own.to_vec()
            } else {
                vec![0.0; n]
            }
        };
        let mut pull = |own: Vec<f32>| -> Result<Vec<f32>, super::TrainError> {
            if own.is_empty() {
                return Ok(own);
            }
            Ok(self.pg.broadcast(own, src).wait()?)
        };
        let params = pull(buf(&self.held.params, n_params))?;
        let master = pull(buf(&self.held.master, n_master))?;
        let mut tensors = Vec::with_capacity(names.len());
        for name in names {
            let own = exported
                .tensors
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(&[][..], |(_, v)| &v[..]);
            let v = pull(buf(own, n_owned))?;
            tensors.push((name, v));
        }
        if !keep {
            return Ok(());
        }
        let state = ExportedState { tensors, scalars };
        let got = digest_of(&params, &master, &state);
        if got != want.digest {
            return Err(heal_err(format!(
                "the state received from rank {src} does not match its SHA-256 digest \
                 (sent {}, got {}): the transfer was corrupted",
                hex(&want.digest),
                hex(&got)
            )));
        }
        self.opt
            .import_state(state)
            .map_err(|e| heal_err(format!("rank {src}'s optimizer state: {e}")))?;
        self.held.params = params;
        self.held.master = master;
        // Stage 3 holds shards, and a module of placeholders at rest.
        if !self.cfg.strategy.shards_params() {
            let model = self.model.take().expect("checked by rebind");
            self.model = Some(self.layout.unflatten(model, &self.held.params));
        }
        Ok(())
    }

    /// Rank `src`'s state header on every rank: the optimizer's tensor names and scalars and
    /// every buffer's length (`lens`: this rank's). Checked before anything is allocated for
    /// the transfer, alike on every rank: its size, the tensors' count and names (distinct,
    /// short, plain), and each buffer bounded by the model's size (ranks of another replica
    /// may hold other lengths), so a bad header costs a rank at most 2 + MAX_STATE_TENSORS
    /// buffers of the model's size (was 2 + 16).
    fn state_header(
        &mut self,
        src: usize,
        exported: &ExportedState,
        lens: (usize, usize, usize),
    ) -> Result<Header, super::TrainError> {
        let heal_err = |m: String| super::TrainError::Heal(m);
        let total = self.layout.total();
        let names: Vec<&String> = exported.tensors.iter().map(|(n, _)| n).collect();
        let header = serde_json::to_vec(&(names, &exported.scalars, lens))
            .map_err(|e| heal_err(e.to_string()))?;
        let header = self
            .pg
            .broadcast_bytes_within(&header, src, MAX_HEADER_BYTES)?;
        let h: Header = serde_json::from_slice(&header)
            .map_err(|e| heal_err(format!("rank {src}'s state header: {e}")))?;
        check_header(&h, src, total).map_err(heal_err)?;
        Ok(h)
    }

    /// What the ranks' steps must agree on (strategy, DiLoCo's settings, overlap, buckets), as
    /// 8 bytes.
    fn step_shape(&self) -> [u8; 8] {
        let mut h = Sha256::new();
        h.update(self.cfg.strategy.to_string().as_bytes());
        if let Some(d) = self.cfg.diloco {
            h.update(format!("{d:?}").as_bytes());
        }
        h.update([u8::from(self.unit_overlap)]);
        for b in &self.held.buckets {
            h.update((b.start as u64).to_le_bytes());
            h.update((b.end as u64).to_le_bytes());
        }
        let d: [u8; 32] = h.finalize().into();
        d[..8].try_into().expect("8 bytes")
    }

    /// SHA-256 over this rank's parameters, f32 master and optimizer state.
    fn state_digest(&self, state: &ExportedState) -> [u8; 32] {
        digest_of(&self.held.params, &self.held.master, state)
    }
}

/// Whether rank `src`'s state header is one a correct rank sends for a model of `total`
/// elements: at most [`MAX_STATE_TENSORS`] optimizer tensors, with distinct, short, plain
/// names, and every buffer within the model's size. A pure function of the header, so every
/// rank decides alike (before anything is allocated for the transfer).
fn check_header(h: &Header, src: usize, total: usize) -> Result<(), String> {
    let (names, _, (n_params, n_master, n_owned)) = h;
    let plain = |n: &String| {
        n.len() <= MAX_NAME_LEN
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
    };
    let distinct = names.iter().collect::<BTreeSet<_>>().len() == names.len();
    if names.len() > MAX_STATE_TENSORS || !distinct || !names.iter().all(plain) {
        return Err(format!(
            "rank {src}'s state header names {} optimizer tensors (at most \
             {MAX_STATE_TENSORS}, distinct, of at most {MAX_NAME_LEN} plain characters)",
            names.len()
        ));
    }
    if [n_params, n_master, n_owned].iter().any(|&&n| n > total) {
        return Err(format!(
            "rank {src}'s state header is out of bounds (buffers of {n_params}, {n_master}, \
             {n_owned} elements, at most {total})"
        ));
    }
    Ok(())
}

/// SHA-256 over parameters, master and optimizer state (each buffer with its length).
fn digest_of(params: &[f32], master: &[f32], state: &ExportedState) -> [u8; 32] {
    let mut h = Sha256::new();
    let mut floats = |v: &[f32]| {
        h.update((v.len() as u64).to_le_bytes());
        h.update(bytemuck::cast_slice::<f32, u8>(v));
    };
    floats(params);
    floats(master);
    for (_, v) in &state.tensors {
        floats(v);
    }
    for (n, _) in &state.tensors {
        h.update(n.as_bytes());
    }
    h.update(serde_json::to_vec(&state.scalars).unwrap_or_default());
    h.finalize().into()
}

fn hex(d: &[u8]) -> String {
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(names: &[&str], lens: (usize, usize, usize)) -> Header {
        let names = names.iter().map(|n| n.to_string()).collect();
        (names, BTreeMap::new(), lens)
    }

    #[test]
    fn a_state_header_is_checked_before_anything_is_allocated() {
        let ok = header(&["moment_1", "moment_2"], (100, 100, 50));
        assert_eq!(check_header(&ok, 1, 100), Ok(()));
        let many: Vec<String> = (0..16).map(|i| format!("t{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        for (bad, why) in [
            (header(&many, (100, 100, 100)), "optimizer tensors"),
            (header(&["m", "m"], (1, 1, 1)), "optimizer tensors"),
            (header(&["../x"], (1, 1, 1)), "optimizer tensors"),
            (header(&["m"], (usize::MAX, 1, 1)), "out of bounds"),
            (header(&["m"], (1, 1, 101)), "out of bounds"),
        ] {
            let e = check_header(&bad, 3, 100).expect_err("refused");
            assert!(
                e.contains("rank 3's state header") && e.contains(why),
                "{e}"
            );
        }
    }
}
