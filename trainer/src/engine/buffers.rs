//! Module state that is not trained (`flat::buffers`: BatchNorm's running statistics),
//! kept in step across the ranks after every step.

use super::{TrainError, Trainer};
use crate::flat::{BufferSync, buffers};
use crate::transfer;
use burn::module::Module;
use wiretrain_comm::{CallOpts, ReduceOp};

impl<M: Module> Trainer<M> {
    /// Keeps the module state that is not trained (flat::buffers) in step across the ranks,
    /// after a step, as the configuration's [`crate::flat::BufferSync`] says (a collective).
    pub(super) fn sync_buffers(&mut self) -> Result<(), TrainError> {
        let policy = self.cfg.buffer_sync;
        if !self.has_buffers || policy == BufferSync::Local || self.pg.world() == 1 {
            return Ok(());
        }
        let model = self.model.as_ref().expect("model present between steps");
        let read_back = |reason| crate::optim::OptimError::ReadBack {
            what: "the module's running state".into(),
            reason,
        };
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
}
