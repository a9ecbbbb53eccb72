//! A PNG of a training run: loss and throughput by step, drawn with plotters.
//!
//! The text uses DejaVu Sans Mono, compiled into the binary (`trainer/assets/`, free
//! licence), so the plot looks the same on every machine and needs no system fonts.

use plotters::prelude::*;
use std::path::Path;

/// One step's point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlotPoint {
    pub step: usize,
    pub loss: f64,
    pub samples_per_s: f64,
}

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
#[error("plot {path}: {msg}")]
pub struct PlotError {
    path: String,
    msg: String,
}

static FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");

fn register_font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the built-in font does not parse".to_string())
    })
    .clone()
}

/// Draws loss (top) and samples/s (bottom) against the step into a 1000×700 PNG at `path`.
/// Non-finite values are left out; an empty series gives an error, not an empty picture.
pub fn plot_run(path: &Path, title: &str, points: &[PlotPoint]) -> Result<(), PlotError> {
    let err = |msg: String| PlotError {
        path: path.display().to_string(),
        msg,
    };
    let pts: Vec<PlotPoint> = points
        .iter()
        .copied()
        .filter(|p| p.loss.is_finite() && p.samples_per_s.is_finite())
        .collect();
    if pts.is_empty() {
        return Err(err("no finite points to draw".into()));
    }
    register_font().map_err(err)?;
    draw(path, title, &pts).map_err(|e| err(e.to_string()))
}

fn range(v: impl Iterator<Item = f64> + Clone) -> std::ops::Range<f64> {
    let lo = v.clone().fold(f64::INFINITY, f64::min);
    let hi = v.fold(f64::NEG_INFINITY, f64::max);
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-9);
    lo - pad..hi + pad
}

fn draw(
    path: &Path,
    title: &str,
    pts: &[PlotPoint],
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let root = BitMapBackend::new(path, (1000, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let (top, bottom) = root.split_vertically(340);
    let last = pts.last().map_or(1, |p| p.step).max(1);
    let steps = 0..last;
    for (area, name, color, get) in [
        (
            &top,
            "loss",
            RED,
            (|p: &PlotPoint| p.loss) as fn(&PlotPoint) -> f64,
        ),
        (&bottom, "samples/s", BLUE, |p: &PlotPoint| p.samples_per_s),
    ] {
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70)
            .build_cartesian_2d(steps.clone(), range(pts.iter().map(get)))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(name)
            .label_style(("sans-serif", 14))
            .draw()?;
        chart.draw_series(LineSeries::new(
            pts.iter().map(|p| (p.step, get(p))),
            color.stroke_width(2),
        ))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png_and_refuses_an_empty_run() {
        let dir = std::env::temp_dir().join(format!("wiretrain-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("run.png");
        let pts: Vec<PlotPoint> = (0..50)
            .map(|s| PlotPoint {
                step: s,
                loss: 4.0 / (1.0 + s as f64),
                samples_per_s: 1000.0 + s as f64,
            })
            .collect();
        plot_run(&p, "test run", &pts).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            bytes.len() > 5000,
            "a plot with lines and text, got {} bytes",
            bytes.len()
        );
        let nan = [PlotPoint {
            step: 0,
            loss: f64::NAN,
            samples_per_s: 1.0,
        }];
        assert!(plot_run(&dir.join("empty.png"), "x", &nan).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
