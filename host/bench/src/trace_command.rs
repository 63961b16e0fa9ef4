//! `switchyard trace`: summarise a trace, or write a seeded synthetic one, for `bench --trace`
//! and the policy lab.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use super::config::{LenRange, parse_len_range};
use super::schedule::{Arrivals, parse_arrivals};
use super::trace::{SynthConfig, Trace, TraceSummary};
use super::{BenchError, output_error};

/// Request traces (Mooncake JSONL: `timestamp` ms, `input_length`, `output_length`, `hash_ids`
/// of 512-token blocks), as `switchyard bench --trace` replays them.
#[derive(Debug, Clone, Subcommand)]
pub enum TraceCommand {
    /// Print a trace's requests, duration, lengths and prefix-sharing ceiling (the share of
    /// prompt tokens in blocks an earlier request already had: the best hit rate any prefix
    /// cache could reach).
    Summary(SummaryArgs),
    /// Write a seeded synthetic trace: sessions arriving as a Poisson or gamma process, each of
    /// --turns requests whose prompts grow by the previous answer and a new message, first
    /// prompts optionally sharing a prefix per group. Same flags and seed, same file.
    Gen(GenArgs),
}

#[derive(Debug, Clone, Args)]
pub struct SummaryArgs {
    /// The trace file.
    pub file: PathBuf,

    /// Print the summary as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct GenArgs {
    /// Where to write the trace (JSONL).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,

    /// Requests in the trace, all turns counted.
    #[arg(long, default_value_t = 1000)]
    pub num_requests: usize,

    /// Mean requests per second, all turns counted: sessions start at RATE / TURNS per second
    /// (the last sessions' later turns stretch the end by about (TURNS - 1) x --think-time).
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,

    /// How session starts are spaced: poisson, or gamma:CV for gaps whose coefficient of
    /// variation is CV (above 1 burstier than Poisson, below 1 smoother).
    #[arg(long, value_name = "poisson|gamma:CV", value_parser = parse_arrivals,
          default_value = "poisson")]
    pub arrivals: Arrivals,

    /// Seed for arrivals and lengths.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Length in tokens of a session's first prompt, and of each later turn's new message.
    #[arg(long, default_value_t = 1024, conflicts_with = "input_len_range")]
    pub input_len: u32,

    /// The same, drawn uniformly from A..=B, e.g. 600:3000.
    #[arg(long, value_name = "A:B", value_parser = parse_len_range)]
    pub input_len_range: Option<LenRange>,

    /// Tokens each request generates (output_length).
    #[arg(long, default_value_t = 64, conflicts_with = "output_len_range")]
    pub output_len: u32,

    /// The same, drawn uniformly from A..=B.
    #[arg(long, value_name = "A:B", value_parser = parse_len_range)]
    pub output_len_range: Option<LenRange>,

    /// Groups of sessions whose first prompts share a prefix (0: none); session s is in group
    /// s mod G.
    #[arg(long, default_value_t = 0, requires = "shared_prefix_len")]
    pub shared_prefix_groups: u32,

    /// Tokens of each group's prefix: whole 512-token blocks, shorter than first prompts.
    #[arg(long, default_value_t = 0, requires = "shared_prefix_groups")]
    pub shared_prefix_len: u32,

    /// Requests per session (multi-turn conversations when above 1).
    #[arg(long, default_value_t = 1)]
    pub turns: u32,

    /// Mean seconds between two turns of a session (exponential).
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub think_time: f64,
}

impl GenArgs {
    fn config(&self) -> SynthConfig {
        SynthConfig {
            seed: self.seed,
            requests: self.num_requests,
            rate: self.rate,
            arrivals: self.arrivals,
            input_len: self
                .input_len_range
                .unwrap_or(LenRange::fixed(self.input_len)),
            output_len: self
                .output_len_range
                .unwrap_or(LenRange::fixed(self.output_len)),
            prefix_groups: self.shared_prefix_groups,
            prefix_len: self.shared_prefix_len,
            turns: self.turns,
            think_time_s: self.think_time,
        }
    }
}

/// Runs one `switchyard trace` command, printing to stdout.
pub fn run_trace_command(command: TraceCommand) -> Result<(), BenchError> {
    let mut stdout = std::io::stdout().lock();
    match command {
        TraceCommand::Summary(args) => {
            let summary = Trace::read(&args.file)?.summary();
            if args.json {
                let text = serde_json::to_string_pretty(&summary)
                    .map_err(|e| output_error(Path::new("stdout"), e))?;
                writeln!(stdout, "{text}").map_err(|e| output_error(Path::new("stdout"), e))
            } else {
                write_summary(&mut stdout, &args.file, &summary)
            }
        }
        TraceCommand::Gen(args) => {
            let trace = Trace::synthetic(&args.config())?;
            write_trace(&args.out, &trace)?;
            write_summary(&mut stdout, &args.out, &trace.summary())
        }
    }
}

fn write_trace(path: &Path, trace: &Trace) -> Result<(), BenchError> {
    let file = std::fs::File::create(path).map_err(|e| output_error(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    trace
        .write_jsonl(&mut out)
        .and_then(|()| out.flush())
        .map_err(|e| output_error(path, e))
}

fn write_summary(
    out: &mut impl Write,
    path: &Path,
    summary: &TraceSummary,
) -> Result<(), BenchError> {
    writeln!(out, "{}", path.display())
        .and_then(|()| summary.write_table(out))
        .map_err(|e| output_error(Path::new("stdout"), e))
}
