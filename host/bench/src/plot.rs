//! `--plot`: TTFT and E2E latency CDFs per arm, side by side, as SVG.

use std::path::Path;

use plotters::prelude::*;

use super::BenchReport;
use super::workload::Arm;

const SIZE: (u32, u32) = (1200, 500);

/// Why the plot could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("drawing the plot: {0}")]
pub struct PlotError(String);

fn draw_err(e: impl std::fmt::Display) -> PlotError {
    PlotError(e.to_string())
}

/// One arm's latencies in ms, sorted ascending.
struct Series {
    arm: Arm,
    ttft: Vec<f64>,
    e2e: Vec<f64>,
}

/// Writes the CDFs of the report's successful requests to `path`.
pub fn write_cdfs(path: &Path, report: &BenchReport) -> Result<(), PlotError> {
    let series = collect_series(report);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let panels = root.split_evenly((1, 2));
    draw_panel(&panels[0], "Time to first token", &series, |s| &s.ttft)?;
    draw_panel(&panels[1], "End-to-end latency", &series, |s| &s.e2e)?;
    root.present().map_err(draw_err)
}

fn collect_series(report: &BenchReport) -> Vec<Series> {
    let mut arms: Vec<Arm> = report.outcomes.iter().map(|o| o.arm).collect();
    arms.sort();
    arms.dedup();
    arms.into_iter()
        .map(|arm| {
            let timings = report
                .outcomes
                .iter()
                .filter(|o| o.arm == arm)
                .filter_map(|o| o.result.as_ref().ok());
            let (mut ttft, mut e2e): (Vec<f64>, Vec<f64>) = timings
                .map(|t| (t.ttft.as_secs_f64() * 1e3, t.e2e.as_secs_f64() * 1e3))
                .unzip();
            ttft.sort_by(f64::total_cmp);
            e2e.sort_by(f64::total_cmp);
            Series { arm, ttft, e2e }
        })
        .collect()
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    series: &[Series],
    values: impl Fn(&Series) -> &Vec<f64>,
) -> Result<(), PlotError> {
    let x_max = series
        .iter()
        .filter_map(|s| values(s).last().copied())
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..x_max, 0.0..1.0)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc("latency (ms)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(draw_err)?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let sorted = values(s);
        let n = sorted.len() as f64;
        let points = sorted
            .iter()
            .enumerate()
            .map(|(rank, &v)| (v, (rank + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(draw_err)?
            .label(format!("{} (n={})", s.arm.name(), sorted.len()))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err)
}
