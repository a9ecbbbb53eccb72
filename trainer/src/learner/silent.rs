//! The renderer of ranks other than 0: Burn's renderer traits, showing nothing.

use burn_train::Interrupter;

/// The renderer for a rank: Burn's default on rank 0, a silent one elsewhere.
pub fn renderer_for(rank: usize) -> Box<dyn burn_train::renderer::MetricsRenderer> {
    if rank == 0 {
        burn_train::renderer::default_renderer(Interrupter::new(), None)
    } else {
        Box::new(Silent)
    }
}

/// A renderer that shows nothing (ranks other than 0).
pub(super) struct Silent;

impl burn_train::renderer::MetricsRendererTraining for Silent {
    fn update_train(&mut self, _: burn_train::renderer::MetricState) {}
    fn update_valid(&mut self, _: burn_train::renderer::MetricState) {}
    fn on_train_end(
        &mut self,
        _: Option<burn_train::LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        Ok(())
    }
}

impl burn_train::renderer::MetricsRendererEvaluation for Silent {
    fn update_test(
        &mut self,
        _: burn_train::renderer::EvaluationName,
        _: burn_train::renderer::MetricState,
    ) {
    }
    fn on_test_end(
        &mut self,
        _: Option<burn_train::LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        Ok(())
    }
}

impl burn_train::logger::TrainingProgressLogger for Silent {
    fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _: usize) {}
    fn start_split(&mut self, _: &str, _: usize) {}
    fn update_split(&mut self, _: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _: String) {}
}

impl burn_train::logger::EvaluationProgressLogger for Silent {
    fn start_global_progress(&mut self, _: usize) {}
    fn start_test(&mut self, _: &str, _: usize) {}
    fn update_test_progress(&mut self, _: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _: String) {}
}

impl burn_train::renderer::MetricsRenderer for Silent {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: burn_train::metric::MetricDefinition) {}
}
