//! PNGs of a training run, drawn with plotters: loss and throughput by step, the step's
//! split per rank, bus bandwidth over time, and the wiring lab's throughput by link rate.
//!
//! The text uses DejaVu Sans Mono, compiled into the binary (`trainer/assets/`, free
//! licence), so the plot looks the same on every machine and needs no system fonts.

use crate::fit::PlotPoint;
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use std::path::Path;

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
#[error("plot {path}: {msg}")]
pub struct PlotError {
    path: String,
    msg: String,
}

type Drawn = Result<(), Box<dyn std::error::Error + Send + Sync>>;
type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;
type Lines<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");

fn register_font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the built-in font does not parse".to_string())
    })
    .clone()
}

/// Draws with `draw` into `path` once the font is registered; `nothing` is the error when
/// there is nothing to draw (an empty picture is never written).
fn render(
    path: &Path,
    nothing: Option<&str>,
    draw: impl FnOnce() -> Drawn,
) -> Result<(), PlotError> {
    let err = |msg: String| PlotError {
        path: path.display().to_string(),
        msg,
    };
    if let Some(why) = nothing {
        return Err(err(why.into()));
    }
    register_font().map_err(err)?;
    draw().map_err(|e| err(e.to_string()))
}

/// A white `size` picture at `path` under `title`.
fn canvas<'a>(
    path: &'a Path,
    size: (u32, u32),
    title: &str,
) -> Result<Area<'a>, Box<dyn std::error::Error + Send + Sync>> {
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    Ok(root.titled(title, ("sans-serif", 22))?)
}

/// A chart on `area` with the house margins and axis label room.
fn chart_on<'a, 'b>(area: &'a Area<'b>) -> ChartBuilder<'a, 'b, BitMapBackend<'b>> {
    let mut b = ChartBuilder::on(area);
    b.margin(12).x_label_area_size(36).y_label_area_size(70);
    b
}

/// The series' legend at `pos`.
fn legend<'b, CT: CoordTranslate>(
    chart: &mut ChartContext<'b, BitMapBackend<'b>, CT>,
    pos: SeriesLabelPosition,
) -> Drawn {
    chart
        .configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}

/// One labelled line of the `i`-th colour.
fn line(chart: &mut Lines<'_, '_>, i: usize, name: &str, v: &[(f64, f64)]) -> Drawn {
    let color = PARTS[i % PARTS.len()].1;
    chart
        .draw_series(LineSeries::new(v.iter().copied(), color.stroke_width(2)))?
        .label(name)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2)));
    Ok(())
}

/// Draws loss (top) and samples/s (bottom) against the step into a 1000×700 PNG at `path`.
/// Non-finite values are left out; an empty series gives an error, not an empty picture.
pub fn plot_run(path: &Path, title: &str, points: &[PlotPoint]) -> Result<(), PlotError> {
    let pts: Vec<PlotPoint> = points
        .iter()
        .copied()
        .filter(|p| p.loss.is_finite() && p.samples_per_s.is_finite())
        .collect();
    let nothing = pts.is_empty().then_some("no finite points to draw");
    render(path, nothing, || draw(path, title, &pts))
}

fn range(v: impl Iterator<Item = f64> + Clone) -> std::ops::Range<f64> {
    let lo = v.clone().fold(f64::INFINITY, f64::min);
    let hi = v.fold(f64::NEG_INFINITY, f64::max);
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-9);
    lo - pad..hi + pad
}

fn draw(path: &Path, title: &str, pts: &[PlotPoint]) -> Drawn {
    let root = canvas(path, (1000, 700), title)?;
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
        let mut chart =
            chart_on(area).build_cartesian_2d(steps.clone(), range(pts.iter().map(get)))?;
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
    let bad = ranks.is_empty() || ranks.iter().any(|r| r.1.iter().any(|v| !v.is_finite()));
    let nothing = bad.then_some("no finite per-rank figures to draw");
    render(path, nothing, || draw_split(path, title, ranks))
}

const PARTS: [(&str, RGBColor); 5] = [
    ("compute", RGBColor(46, 134, 193)),
    ("communication (exposed)", RGBColor(231, 76, 60)),
    ("optimizer", RGBColor(39, 174, 96)),
    ("data", RGBColor(243, 156, 18)),
    ("other", RGBColor(149, 165, 166)),
];

fn draw_split(path: &Path, title: &str, ranks: &[(usize, [f64; 5])]) -> Drawn {
    let root = canvas(path, (1000, 600), title)?;
    let top = ranks
        .iter()
        .map(|r| r.1.iter().sum::<f64>())
        .fold(0.0, f64::max)
        .max(1e-6)
        * 1.6;
    let n = ranks.len() as f64;
    let mut chart = chart_on(&root).build_cartesian_2d(-0.5..n - 0.5, 0.0..top)?;
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
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
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
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|p| p.0 > 0.0 && p.0.is_finite() && p.1.is_finite())
        .collect();
    let nothing = pts.is_empty().then_some("no lab points to draw");
    render(path, nothing, || {
        let root = canvas(path, (1000, 600), title)?;
        let xr = range(pts.iter().map(|p| p.0.log10()));
        let top = pts.iter().map(|p| p.1).fold(0.0, f64::max) * 1.15;
        let mut chart = chart_on(&root).build_cartesian_2d(xr, 0.0..top.max(1e-9))?;
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
            let mut v: Vec<(f64, f64)> = v.iter().map(|p| (p.0.log10(), p.1)).collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            line(&mut chart, i, name, &v)?;
            let color = PARTS[i % PARTS.len()].1;
            chart.draw_series(v.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        root.present()?;
        Ok(())
    })
}

/// Bus bandwidth (GB/s) over time (s), one line per collective kind, into a PNG at `path`.
pub fn plot_busbw(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), PlotError> {
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    let nothing = pts.is_empty().then_some("no collectives to draw");
    render(path, nothing, || {
        let root = canvas(path, (1000, 500), title)?;
        let (xr, yr) = (
            range(pts.iter().map(|p| p.0)),
            range(pts.iter().map(|p| p.1)),
        );
        let mut chart = chart_on(&root).build_cartesian_2d(xr, yr)?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc("busbw (GB/s)")
            .label_style(("sans-serif", 14))
            .draw()?;
        for (i, (name, v)) in series.iter().enumerate() {
            line(&mut chart, i, name, v)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present()?;
        Ok(())
    })
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
