//! `--plot`: TTFT and E2E latency CDFs per arm, side by side, as SVG; the policy lab draws
//! its policies' the same way ([`write_latency_cdfs`]), and its sweeps and engine timelines as
//! line charts ([`write_line_charts`]).

use std::ops::Range;
use std::path::Path;

use plotters::prelude::*;

use super::BenchReport;
use super::workload::Arm;

/// One chart's size; charts are drawn side by side.
const CHART_SIZE: (u32, u32) = (600, 500);

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
    /// Empty for all series: no TPOT panel.
    pub tpot_ms: Vec<f64>,
    pub e2e_ms: Vec<f64>,
}

/// A chart of named lines through `(x, y)` points.
#[derive(Debug, Clone, PartialEq)]
pub struct LineChart {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    /// `None`: from 0 to a little above the highest point.
    pub y_range: Option<Range<f64>>,
    pub legend: Corner,
    pub lines: Vec<Line>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Where a chart's legend goes: where its lines leave room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corner {
    LowerRight,
    UpperRight,
}

/// Writes the CDFs of the report's successful requests to `path`.
pub fn write_cdfs(path: &Path, report: &BenchReport) -> Result<(), PlotError> {
    write_latency_cdfs(path, collect_series(report))
}

/// Writes the TTFT, TPOT (when any series has one) and end-to-end latency CDFs of each series
/// to `path`, side by side.
pub fn write_latency_cdfs(path: &Path, series: Vec<LatencySeries>) -> Result<(), PlotError> {
    let mut charts = vec![cdf_chart("Time to first token", &series, |s| &s.ttft_ms)];
    if series.iter().any(|s| !s.tpot_ms.is_empty()) {
        charts.push(cdf_chart("Time per output token", &series, |s| &s.tpot_ms));
    }
    charts.push(cdf_chart("End-to-end latency", &series, |s| &s.e2e_ms));
    write_line_charts(path, &charts)
}

/// Each series' samples of one latency as a CDF: a line through (value, share at or below it).
fn cdf_chart(
    title: &str,
    series: &[LatencySeries],
    values: impl Fn(&LatencySeries) -> &Vec<f64>,
) -> LineChart {
    let lines = series
        .iter()
        .map(|s| {
            let mut sorted = values(s).clone();
            sorted.sort_by(f64::total_cmp);
            let n = sorted.len() as f64;
            Line {
                name: format!("{} (n={})", s.name, sorted.len()),
                points: sorted
                    .iter()
                    .enumerate()
                    .map(|(rank, &v)| (v, (rank + 1) as f64 / n))
                    .collect(),
            }
        })
        .collect();
    LineChart {
        title: title.to_owned(),
        x_desc: "latency (ms)".into(),
        y_desc: "fraction of requests".into(),
        y_range: Some(0.0..1.0),
        legend: Corner::LowerRight,
        lines,
    }
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
                tpot_ms: Vec::new(),
                e2e_ms,
            }
        })
        .collect()
}

/// Writes `charts` side by side to `path`, as SVG.
pub fn write_line_charts(path: &Path, charts: &[LineChart]) -> Result<(), PlotError> {
    let width = CHART_SIZE.0 * charts.len().max(1) as u32;
    let root = SVGBackend::new(path, (width, CHART_SIZE.1)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let panels = root.split_evenly((1, charts.len().max(1)));
    for (panel, chart) in panels.iter().zip(charts) {
        draw_chart(panel, chart)?;
    }
    root.present().map_err(draw_err)
}

/// From 0 to a little above the largest of `values` (a sliver when there is none).
fn upto(values: impl Iterator<Item = f64>) -> Range<f64> {
    0.0..values
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05
}

fn draw_chart(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    chart: &LineChart,
) -> Result<(), PlotError> {
    let points = || chart.lines.iter().flat_map(|l| l.points.iter());
    let x_range = upto(points().map(|p| p.0));
    let y_range = chart
        .y_range
        .clone()
        .unwrap_or_else(|| upto(points().map(|p| p.1)));
    let mut ctx = ChartBuilder::on(area)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(x_range, y_range)
        .map_err(draw_err)?;
    ctx.configure_mesh()
        .x_desc(&chart.x_desc)
        .y_desc(&chart.y_desc)
        .draw()
        .map_err(draw_err)?;
    for (i, line) in chart.lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        ctx.draw_series(LineSeries::new(
            line.points.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(draw_err)?
        .label(line.name.clone())
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    let position = match chart.legend {
        Corner::LowerRight => SeriesLabelPosition::LowerRight,
        Corner::UpperRight => SeriesLabelPosition::UpperRight,
    };
    ctx.configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err)
}
