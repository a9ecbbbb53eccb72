//! Module state that is not trained (`flat::buffers`: BatchNorm's running statistics): kept
//! in step across the ranks after every step, saved in checkpoints and loaded back.

use super::{TrainError, Trainer};
use crate::checkpoint::{
    BUFFERS_FILE, BuffersManifest, Checkpoint, LayoutEntry, ShardData, write_named,
};
use crate::flat::{BufferSync, FlatLayout, buffers};
use crate::transfer;
use burn::module::Module;
use std::path::Path;
use wiretrain_comm::{CallOpts, ReduceOp};

/// A flat layout as a manifest records it.
pub(super) fn manifest_entries(layout: &FlatLayout) -> Vec<LayoutEntry> {
    layout
        .entries()
        .iter()
        .map(|e| LayoutEntry {
            path: e.path.clone(),
            shape: e.shape.clone(),
            offset: e.offset,
            len: e.len,
        })
        .collect()
}

fn read_back(reason: burn::tensor::TensorReadError) -> crate::optim::OptimError {
    crate::optim::OptimError::ReadBack {
        what: "the module's running state".into(),
        reason,
    }
}

impl<M: Module> Trainer<M> {
    /// Keeps the module state that is not trained (flat::buffers) in step across the ranks,
    /// after a step, as the configuration's [`crate::flat::BufferSync`] says (a collective).
    pub(super) fn sync_buffers(&mut self) -> Result<(), TrainError> {
        let policy = self.cfg.buffer_sync;
        if !self.has_buffers || policy == BufferSync::Local || self.pg.world() == 1 {
            return Ok(());
        }
        let model = self.model.as_ref().expect("model present between steps");
        let Some(mine) = buffers::read_host(model).map_err(read_back)? else {
            return Ok(());
        };
        let agreed = match policy {
            BufferSync::Mean => self
                .pg
                .call(CallOpts::default().tag("buffers"))
                .all_reduce(mine, ReduceOp::Mean)
                .wait()?,
            _ => self.pg.broadcast(mine, 0).wait()?,
        };
        let model = self.model.take().expect("model present between steps");
        let up = transfer::upload(agreed, &self.device);
        self.model = Some(buffers::write(model, up));
        Ok(())
    }

    /// Rank 0, at a checkpoint: writes the module state that is not trained into `dir`, as
    /// this rank holds it after the step's sync (every rank's value, but with
    /// `BufferSync::Local`, where it is rank 0's own); `None` when the model has none.
    pub(super) fn write_buffers(&self, dir: &Path) -> Result<Option<BuffersManifest>, TrainError> {
        if !self.has_buffers {
            return Ok(None);
        }
        let model = self.model.as_ref().expect("model present between steps");
        let Some(values) = buffers::read_host(model).map_err(read_back)? else {
            return Ok(None);
        };
        let layout = FlatLayout::buffers_of(model);
        let data = ShardData {
            ranges: std::iter::once(0..values.len()).collect(),
            params: values,
            state: Vec::new(),
        };
        let file = write_named(dir, BUFFERS_FILE, 0, &data)?;
        Ok(Some(BuffersManifest {
            layout: manifest_entries(&layout),
            total: layout.total(),
            file,
        }))
    }

    /// Loads the checkpoint's module state that is not trained into the model, after
    /// checking it fits this model's. A checkpoint of an older release holds none: the model
    /// keeps its own, with a warning.
    pub(super) fn load_buffers(&mut self, ck: &Checkpoint) -> Result<(), TrainError> {
        let model = self.model.as_ref().expect("model present between steps");
        ck.check_buffer_layout(&manifest_entries(&FlatLayout::buffers_of(model)))?;
        match ck.read_buffers()? {
            Some(values) if !values.is_empty() => {
                let model = self.model.take().expect("model present between steps");
                let up = transfer::upload(values, &self.device);
                self.model = Some(buffers::write(model, up));
            }
            None if self.has_buffers && self.pg.rank() == 0 => tracing::warn!(
                "{}: the checkpoint holds no running statistics (an older release wrote it); \
                 the model's own are kept",
                ck.dir.display()
            ),
            _ => {}
        }
        Ok(())
    }
}
