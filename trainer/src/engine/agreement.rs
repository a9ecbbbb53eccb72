//! The start-up agreement: every rank trains the same model (rank 0's parameter list).

use crate::error::ModelMismatch;
use crate::error::TrainError;
use crate::flat::FlatLayout;
use wiretrain_comm::ProcessGroup;

/// Compares rank 0's parameter list (paths and shapes) with every rank's; a mismatch names
/// the first differing parameter.
pub(crate) fn check_agreement(
    pg: &mut ProcessGroup,
    layout: &FlatLayout,
) -> Result<(), TrainError> {
    let sig = layout.signature();
    let n = sig.len();
    let counts = pg.all_gather_bytes(&(n as u64).to_le_bytes())?;
    let count = |b: &[u8]| b.try_into().map(u64::from_le_bytes).unwrap_or(u64::MAX) as usize;
    if let Some((r, c)) = counts.iter().enumerate().find(|(_, c)| count(c) != n) {
        return Err(ModelMismatch::Count {
            rank: pg.rank(),
            count: n,
            other: r,
            other_count: count(c),
        }
        .into());
    }
    let mine: Vec<u8> = sig.iter().flat_map(|h| h.to_le_bytes()).collect();
    let root = pg.broadcast_bytes(&mine, 0)?;
    if let Some(i) = (0..n).find(|&i| root.get(4 * i..4 * i + 4) != mine.get(4 * i..4 * i + 4)) {
        let e = &layout.entries()[i];
        return Err(ModelMismatch::Parameter {
            index: i,
            rank: pg.rank(),
            path: e.path.clone(),
            shape: e.shape.clone(),
        }
        .into());
    }
    Ok(())
}
