//! A PNG of a training run: loss and throughput by step, drawn with plotters.
//!
//! The text uses DejaVu Sans Mono, compiled into the binary (`trainer/assets/`, free
//! licence), so the plot looks the same on every machine and needs no system fonts.

use crate::fit::PlotPoint;
use plotters::prelude::*;
use std::path::Path;

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

/// A stacked bar per rank: mean milliseconds per step in each part of the step (compute,
/// exposed communication, optimizer, data, other), into a PNG at `path`.
pub fn plot_split(path: &Path, title: &str, ranks: &[(usize, [f64; 5])]) -> Result<(), PlotError> {
    let err = |msg: String| PlotError {
        path: path.display().to_string(),
        msg,
    };
    if ranks.is_empty() || ranks.iter().any(|r| r.1.iter().any(|v| !v.is_finite())) {
        return Err(err("no finite per-rank figures to draw".into()));
    }
    register_font().map_err(err)?;
    draw_split(path, title, ranks).map_err(|e| err(e.to_string()))
}

const PARTS: [(&str, RGBColor); 5] = [
    ("compute", RGBColor(46, 134, 193)),
    ("communication (exposed)", RGBColor(231, 76, 60)),
    ("optimizer", RGBColor(39, 174, 96)),
    ("data", RGBColor(243, 156, 18)),
    ("other", RGBColor(149, 165, 166)),
];

fn draw_split(
    path: &Path,
    title: &str,
    ranks: &[(usize, [f64; 5])],
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let top = ranks
        .iter()
        .map(|r| r.1.iter().sum::<f64>())
        .fold(0.0, f64::max)
        .max(1e-6)
        * 1.6;
    let n = ranks.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(ranks.len().min(32))
        .x_label_formatter(&|x| format!("rank {}", x.round() as i64))
        .x_desc("rank")
        .y_desc("ms per step")
        .label_style(("sans-serif", 14))
        .draw()?;
    for (k, (name, color)) in PARTS.iter().enumerate() {
        let bars = ranks.iter().enumerate().map(|(i, (_, v))| {
            let lo: f64 = v[..k].iter().sum();
            let x = i as f64;
            Rectangle::new([(x - 0.35, lo), (x + 0.35, lo + v[k])], color.filled())
        });
        chart
            .draw_series(bars)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    root.present()?;
    Ok(())
}

/// Throughput against link rate, one line per strategy (the wiring lab): `series` holds
/// (strategy, [(Mbit/s, samples/s)]), the x axis is logarithmic; an unshaped link is drawn at
/// `unshaped_at` Mbit/s and labelled "none".
pub fn plot_lab(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
    unshaped_at: f64,
) -> Result<(), PlotError> {
    let err = |msg: String| PlotError {
        path: path.display().to_string(),
        msg,
    };
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|p| p.0 > 0.0 && p.0.is_finite() && p.1.is_finite())
        .collect();
    if pts.is_empty() {
        return Err(err("no lab points to draw".into()));
    }
    register_font().map_err(err)?;
    (|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 22))?;
        let xr = range(pts.iter().map(|p| p.0.log10()));
        let top = pts.iter().map(|p| p.1).fold(0.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70)
            .build_cartesian_2d(xr, 0.0..top.max(1e-9))?;
        let fmt = move |x: &f64| {
            let v = 10f64.powf(*x);
            if (v - unshaped_at).abs() / unshaped_at < 0.01 {
                "none".to_string()
            } else {
                format!("{v:.0}")
            }
        };
        chart
            .configure_mesh()
            .x_desc("link rate (Mbit/s, log scale)")
            .y_desc("samples/s")
            .x_label_formatter(&fmt)
            .label_style(("sans-serif", 14))
            .draw()?;
        for (i, (name, v)) in series.iter().enumerate() {
            let color = PARTS[i % PARTS.len()].1;
            let mut v: Vec<(f64, f64)> = v.iter().map(|p| (p.0.log10(), p.1)).collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(v.iter().copied(), color.stroke_width(2)))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2))
                });
            chart.draw_series(v.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
        root.present()?;
        Ok(())
    })()
    .map_err(|e| err(e.to_string()))
}

/// Bus bandwidth (GB/s) over time (s), one line per collective kind, into a PNG at `path`.
pub fn plot_busbw(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), PlotError> {
    let err = |msg: String| PlotError {
        path: path.display().to_string(),
        msg,
    };
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    if pts.is_empty() {
        return Err(err("no collectives to draw".into()));
    }
    register_font().map_err(err)?;
    (|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let root = BitMapBackend::new(path, (1000, 500)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 22))?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70)
            .build_cartesian_2d(
                range(pts.iter().map(|p| p.0)),
                range(pts.iter().map(|p| p.1)),
            )?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc("busbw (GB/s)")
            .label_style(("sans-serif", 14))
            .draw()?;
        for (i, (name, v)) in series.iter().enumerate() {
            let color = PARTS[i % PARTS.len()].1;
            chart
                .draw_series(LineSeries::new(v.iter().copied(), color.stroke_width(2)))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
        root.present()?;
        Ok(())
    })()
    .map_err(|e| err(e.to_string()))
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
