//! Which ranks form which stage ([`Placement`]) in a world of `S` stages × `R` replicas, chosen
//! from the rank table: with replicas, a stage's ranks share a node when the nodes are the
//! stages (its gradient averaging stays on the node's shared memory, the lighter activation
//! traffic crosses nodes), else the stages share a node when the nodes are the replicas.

use super::PipelineError;
use wiretrain_comm::{Group, RankTable};

/// How stages and replicas map onto the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// One replica: stage `s` is rank `s`.
    Chain,
    /// Node `s` is stage `s`; its local rank `r` is replica `r` (stages cross nodes; a
    /// stage's replicas average their gradients inside the node).
    StagesAcrossNodes,
    /// Local rank `s` of every node is stage `s`; node `r` is replica `r` (the activations
    /// stay inside the node; the gradient averaging crosses nodes).
    StagesInNode,
}

impl Placement {
    /// The placement of `stages` stages on `table`'s ranks, or why none fits.
    pub fn choose(stages: usize, table: &RankTable) -> Result<Self, PipelineError> {
        let world = table.world();
        let replicas = world / stages;
        if replicas == 1 {
            return Ok(Self::Chain);
        }
        let nodes = table.num_nodes();
        let every = |k: usize| (0..nodes).all(|n| table.ranks_on(n) == k);
        if nodes == stages && every(replicas) {
            return Ok(Self::StagesAcrossNodes);
        }
        if nodes == replicas && every(stages) {
            return Ok(Self::StagesInNode);
        }
        Err(PipelineError::Config(format!(
            "{stages} stages x {replicas} replicas on {nodes} node(s) of {:?} ranks: place one \
             stage per node ({stages} nodes of {replicas} ranks) or one replica per node \
             ({replicas} nodes of {stages} ranks)",
            (0..nodes).map(|n| table.ranks_on(n)).collect::<Vec<_>>()
        )))
    }

    /// (stage, replica) of global rank `rank`.
    pub fn locate(self, table: &RankTable, rank: usize) -> (usize, usize) {
        let (node, local) = table.locate(rank);
        match self {
            Self::Chain => (rank, 0),
            Self::StagesAcrossNodes => (node, local),
            Self::StagesInNode => (local, node),
        }
    }

    /// The global rank of stage `stage` in replica `replica`.
    pub fn rank_of(self, table: &RankTable, stage: usize, replica: usize) -> usize {
        match self {
            Self::Chain => stage,
            Self::StagesAcrossNodes => table.global_rank(stage, replica),
            Self::StagesInNode => table.global_rank(replica, stage),
        }
    }

    /// The sub-group a stage's replicas average their gradients over (none with one replica).
    pub fn replica_group(self) -> Option<Group> {
        match self {
            Self::Chain => None,
            Self::StagesAcrossNodes => Some(Group::Node),
            Self::StagesInNode => Some(Group::Replica),
        }
    }

    /// What was chosen and why, in words (said at start).
    pub fn describe(self) -> &'static str {
        match self {
            Self::Chain => "one rank per stage, in rank order",
            Self::StagesAcrossNodes => {
                "a stage per node, its replicas the node's ranks: gradient averaging stays on \
                 the node's shared memory, only activations cross nodes"
            }
            Self::StagesInNode => {
                "the stages inside each node, a replica per node: activations stay inside the \
                 node, each stage's gradient averaging crosses nodes"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wiretrain_comm::NodeInfo;

    fn table_of(shape: &[usize]) -> RankTable {
        let node = |(i, &k): (usize, &usize)| NodeInfo {
            node: i,
            addr: format!("127.0.0.{}:1000", i + 1).parse().unwrap(),
            devices: vec!["cpu".into(); k],
            cert_sha256: String::new(),
        };
        RankTable::new(shape.iter().enumerate().map(node).collect()).unwrap()
    }

    #[test]
    fn stages_and_replicas_map_onto_the_table_or_say_what_fits() {
        let t = table_of(&[2, 2]);
        let p = Placement::choose(2, &t).unwrap();
        assert_eq!(p, Placement::StagesAcrossNodes);
        assert_eq!(p.locate(&t, 1), (0, 1));
        assert_eq!(p.rank_of(&t, 1, 0), 2);
        assert_eq!(Placement::choose(4, &t).unwrap(), Placement::Chain);
        let t = table_of(&[3, 3]);
        let p = Placement::choose(3, &t).unwrap();
        assert_eq!(p, Placement::StagesInNode);
        assert_eq!((p.locate(&t, 4), p.rank_of(&t, 1, 1)), ((1, 1), 4));
        let e = Placement::choose(2, &table_of(&[3, 1]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("place one stage per node"), "{e}");
    }
}
