//! The router's CPU time and peak memory, read from Linux `/proc`.

use std::time::Duration;

/// Why the router process could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} has no {what}")]
    Parse { path: String, what: &'static str },
}

/// CPU time a process has used so far (user + system).
pub fn cpu_time(pid: u32) -> Result<Duration, ProcError> {
    let path = format!("/proc/{pid}/stat");
    let stat = read(&path)?;
    let ticks = parse_cpu_ticks(&stat).ok_or(ProcError::Parse {
        path,
        what: "utime/stime fields",
    })?;
    Ok(ticks_to_duration(ticks, clock_ticks_per_second()))
}

/// The process's peak resident set size in KiB (`VmHWM`).
pub fn peak_rss_kib(pid: u32) -> Result<u64, ProcError> {
    let path = format!("/proc/{pid}/status");
    let status = read(&path)?;
    parse_status_kib(&status, "VmHWM").ok_or(ProcError::Parse {
        path,
        what: "VmHWM",
    })
}

fn read(path: &str) -> Result<String, ProcError> {
    std::fs::read_to_string(path).map_err(|source| ProcError::Read {
        path: path.to_owned(),
        source,
    })
}

/// utime + stime in clock ticks. The command name (field 2) is in parentheses and may hold
/// spaces or parentheses itself, so fields are counted from the last `)`: after it come
/// state (field 3) … utime (14) and stime (15).
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// A `Key:   123 kB` line of `/proc/<pid>/status`.
pub fn parse_status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let value = line.strip_prefix(key)?.strip_prefix(':')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

fn ticks_to_duration(ticks: u64, per_second: u64) -> Duration {
    let per_second = per_second.max(1);
    Duration::from_secs(ticks / per_second)
        + Duration::from_nanos((ticks % per_second) * 1_000_000_000 / per_second)
}

/// `sysconf(_SC_CLK_TCK)`, the unit of `/proc/<pid>/stat` times; 100 if it fails.
#[expect(unsafe_code, reason = "libc::sysconf is an FFI call")]
fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf takes an integer name and reads process-wide constants; it touches no
    // memory of ours and is thread-safe.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&t| t > 0).unwrap_or(100)
}
