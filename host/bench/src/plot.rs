//! `--plot`: TTFT and E2E latency CDFs per arm, side by side, as SVG; the policy lab draws
//! its policies' the same way ([`write_latency_cdfs`]).

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

/// One set of requests' latencies in ms (an arm, a policy), drawn as one line per panel.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencySeries {
    pub name: String,
    pub ttft_ms: Vec<f64>,
    pub e2e_ms: Vec<f64>,
}

/// Writes the CDFs of the report's successful requests to `path`.
pub fn write_cdfs(path: &Path, report: &BenchReport) -> Result<(), PlotError> {
    write_latency_cdfs(path, collect_series(report))
}

/// Writes the TTFT and end-to-end latency CDFs of each series to `path`, side by side.
pub fn write_latency_cdfs(path: &Path, mut series: Vec<LatencySeries>) -> Result<(), PlotError> {
    for s in &mut series {
        s.ttft_ms.sort_by(f64::total_cmp);
        s.e2e_ms.sort_by(f64::total_cmp);
    }
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let panels = root.split_evenly((1, 2));
    draw_panel(&panels[0], "Time to first token", &series, |s| &s.ttft_ms)?;
    draw_panel(&panels[1], "End-to-end latency", &series, |s| &s.e2e_ms)?;
    root.present().map_err(draw_err)
}

fn collect_series(report: &BenchReport) -> Vec<LatencySeries> {
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
            let (ttft_ms, e2e_ms) = timings
                .map(|t| (t.ttft.as_secs_f64() * 1e3, t.e2e.as_secs_f64() * 1e3))
                .unzip();
            LatencySeries {
                name: arm.name().to_owned(),
                ttft_ms,
                e2e_ms,
            }
        })
        .collect()
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    series: &[LatencySeries],
    values: impl Fn(&LatencySeries) -> &Vec<f64>,
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
            .label(format!("{} (n={})", s.name, sorted.len()))
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
