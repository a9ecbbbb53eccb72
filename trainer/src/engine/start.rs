//! A ZeRO-3 or HSDP trainer's start, unit by unit: each unit's parameters are read, rank 0's
//! broadcast, this rank's shard of them kept, and the unit freed from the module before the
//! next is read. A rank holds the user's model (freed as it goes) and one unit besides, never
//! a flat copy of the whole model as the other strategies' start does.

use super::TrainError;
use crate::flat::FlatLayout;
use burn::module::Module;
use std::ops::Range;
use wiretrain_comm::ProcessGroup;

/// The module with every unit freed (placeholders) and this rank's shard of rank 0's
/// parameters (the concatenation of `owned`, each range within one unit, in order).
pub(super) fn shard_units<M: Module>(
    mut model: M,
    layout: &FlatLayout,
    units: &[Range<usize>],
    owned: &[Range<usize>],
    pg: &mut ProcessGroup,
) -> Result<(M, Vec<f32>), TrainError> {
    let mut shard = Vec::with_capacity(owned.iter().map(|r| r.len()).sum());
    for unit in units {
        let values = layout.flatten_range(&model, unit.clone());
        let values = pg.broadcast(values, 0).wait()?;
        for r in owned {
            let (lo, hi) = (r.start.max(unit.start), r.end.min(unit.end));
            if lo < hi {
                shard.extend_from_slice(&values[lo - unit.start..hi - unit.start]);
            }
        }
        model = super::units::free_unit(model, layout, unit);
    }
    Ok((model, shard))
}
