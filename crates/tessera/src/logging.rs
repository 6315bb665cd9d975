//! `TESSERA_LOGS=graph,aot_graphs,…`: which artifacts to print (stderr).
//!
//! Topics are read once from the environment. A message is built only when
//! its topic is on, so logging costs nothing otherwise.

use std::collections::HashSet;
use std::sync::OnceLock;

fn topics() -> &'static HashSet<String> {
    static TOPICS: OnceLock<HashSet<String>> = OnceLock::new();
    TOPICS.get_or_init(|| {
        std::env::var("TESSERA_LOGS")
            .unwrap_or_default()
            .split(',')
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect()
    })
}

/// Whether `topic` (or `all`) is listed in `TESSERA_LOGS`.
pub fn enabled(topic: &str) -> bool {
    let t = topics();
    t.contains(topic) || t.contains("all")
}

/// Prints `message()` under `[tessera:<topic>]` when the topic is on.
pub fn log(topic: &str, message: impl FnOnce() -> String) {
    if enabled(topic) {
        eprintln!("[tessera:{topic}] {}", message());
    }
}
