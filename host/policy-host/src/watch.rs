//! The plugins-directory watcher: a change to `<name>.wasm` or `<name>.json` (created, written,
//! renamed into place, deleted) reloads policy `name` once the directory has been quiet for the
//! debounce period.
//!
//! Deploy a policy with write-then-rename (`cp new.wasm plugins/.x.tmp && mv plugins/.x.tmp
//! plugins/x.wasm`): the rename is atomic, so the watcher only ever sees complete files.
//! Writing in place also works: the reload reads the file only when its size and mtime did not
//! change during the read, and a half-written component fails to compile; either way the old
//! version keeps serving and the writer's next change event reloads the finished file.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use notify_debouncer_full::notify::{EventKind, RecommendedWatcher, RecursiveMode};
use notify_debouncer_full::{DebounceEventResult, DebouncedEvent, Debouncer, RecommendedCache};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::registry::{PolicyRegistry, policy_name};

/// How long a file must be quiet before it is reloaded. Short, because write-then-rename is a
/// single event; in-place writers that pause longer are caught by the completeness check.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(5);

/// Why the directory cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot watch the plugins directory {}: {reason}", dir.display())]
    Watch {
        dir: std::path::PathBuf,
        reason: String,
    },
}

/// A running watcher; dropping it stops watching.
pub struct PluginWatcher {
    _debouncer: Debouncer<RecommendedWatcher, RecommendedCache>,
    task: JoinHandle<()>,
}

impl Drop for PluginWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Watch `registry`'s plugins directory and reload policies as their files change. Must be
/// called inside a Tokio runtime.
pub fn watch(
    registry: Arc<PolicyRegistry>,
    debounce: Duration,
) -> Result<PluginWatcher, WatchError> {
    let dir = registry.plugins_dir().to_owned();
    let watch_error = |e: notify_debouncer_full::notify::Error| WatchError::Watch {
        dir: dir.clone(),
        reason: e.to_string(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    // The debouncer's thread wakes every tick, idle or not. Its default tick, a quarter of the
    // debounce, made those wake-ups almost all of an idle router's: 400 a second with a 10 ms
    // debounce. One tick per 5 ms debounce halves them, and a reload still starts 5-10 ms after
    // the last change (a cached Rust policy serves 10.0 ms after the rename, was 12.7).
    let tick = Some(debounce);
    let mut debouncer =
        notify_debouncer_full::new_debouncer(debounce, tick, move |result: DebounceEventResult| {
            match result {
                Ok(events) => {
                    let changed = changed_policies(&events);
                    if !changed.is_empty() {
                        // The receiver only goes away when the watcher is dropped.
                        let _ = tx.send(changed);
                    }
                }
                Err(errors) => {
                    for error in errors {
                        tracing::warn!(%error, "plugins directory watcher error");
                    }
                }
            }
        })
        .map_err(watch_error)?;
    debouncer
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(watch_error)?;
    tracing::info!(dir = %dir.display(), ?debounce, "watching the plugins directory");
    let task = tokio::spawn(reload_changed(registry, rx));
    Ok(PluginWatcher {
        _debouncer: debouncer,
        task,
    })
}

/// Reload each changed policy in turn; outcomes and errors are recorded by the registry.
async fn reload_changed(
    registry: Arc<PolicyRegistry>,
    mut changes: mpsc::UnboundedReceiver<BTreeMap<String, Instant>>,
) {
    while let Some(changed) = changes.recv().await {
        for (name, since) in changed {
            if let Err(error) = registry.reload(&name, since, false).await {
                tracing::debug!(policy = %name, %error, "reload after a file change failed");
            }
        }
    }
}

/// Policy name → when its first change in this batch happened (the reload latency counts from
/// there). Reads and metadata-only events are ignored.
fn changed_policies(events: &[DebouncedEvent]) -> BTreeMap<String, Instant> {
    let mut changed = BTreeMap::new();
    for event in events {
        if matches!(event.kind, EventKind::Access(_)) {
            continue;
        }
        for path in &event.paths {
            if let Some(name) = changed_policy(path) {
                changed
                    .entry(name)
                    .and_modify(|at: &mut Instant| *at = (*at).min(event.time))
                    .or_insert(event.time);
            }
        }
    }
    changed
}

fn changed_policy(path: &Path) -> Option<String> {
    policy_name(path, "wasm").or_else(|| policy_name(path, "json"))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use notify_debouncer_full::notify::event::{AccessKind, CreateKind, ModifyKind, RenameMode};
    use notify_debouncer_full::notify::{Event, EventKind};

    use super::*;

    fn event(kind: EventKind, paths: &[&str], time: Instant) -> DebouncedEvent {
        let mut event = Event::new(kind);
        event.paths = paths.iter().map(PathBuf::from).collect();
        DebouncedEvent::new(event, time)
    }

    #[test]
    fn policy_files_map_to_names_and_others_are_ignored() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(3);
        let events = [
            event(
                EventKind::Modify(ModifyKind::Name(RenameMode::Both)),
                &["/p/.disagg.wasm.tmp", "/p/disagg.wasm"],
                t1,
            ),
            event(EventKind::Create(CreateKind::File), &["/p/disagg.json"], t0),
            event(EventKind::Create(CreateKind::File), &["/p/notes.txt"], t0),
            event(
                EventKind::Create(CreateKind::File),
                &["/p/.hidden.wasm"],
                t0,
            ),
            event(EventKind::Access(AccessKind::Any), &["/p/rr.wasm"], t0),
        ];
        let changed = changed_policies(&events);
        assert_eq!(
            changed.into_iter().collect::<Vec<_>>(),
            [("disagg".to_owned(), t0)]
        );
    }
}
