//! What each compile backend does with the hints it is given: every key a
//! backend does not honour is said, with the reason, once per region
//! (`TESSERA_LOGS=hints`, through [`hints::not_honoured`]). The default
//! backend honours the rest where they are read (the slice pass, AOT
//! autograd's recompute and offload, the scheduler's order, group, width,
//! budget and streams (on a device with several), the memory planner's
//! offloads). `aot_eager` honours recompute (the AOT partition) and
//! offload (its interpreter moves the saved values, op by op); `eager`
//! honours both on its tape (saved values kept in host memory, or
//! recomputed in the backward from the region's inputs); the scheduler's own notes
//! (`TESSERA_LOGS=schedule`) say when a hint it reads cannot be met.

use std::collections::BTreeMap;

use super::Backend;
use crate::hints::{self, Hint, HintMap, Order};
use crate::ir::Graph;
use crate::runtime::device::Device;

/// Says, for each region of `graph` (nodes with the same hints), which of
/// its hint keys `backend` ignores and why. `has_backward`: the compiled
/// function has a backward (something requires grad).
pub(super) fn report(graph: &Graph, backend: Backend, has_backward: bool, on: Device) {
    let mut regions: BTreeMap<String, &HintMap> = BTreeMap::new();
    for node in &graph.nodes {
        if let Some(map) = &node.meta.hints {
            let json = serde_json::Value::Object((**map).clone()).to_string();
            regions.entry(json).or_insert(map);
        }
    }
    for map in regions.into_values() {
        let Ok((hint, _)) = Hint::from_map(map) else {
            // The scheduler (or the eager run) reports a malformed hint.
            continue;
        };
        for (key, reason) in ignored(&hint, backend, has_backward, on) {
            hints::not_honoured(stage(backend), map, key, &reason);
        }
    }
}

fn stage(backend: Backend) -> &'static str {
    match backend {
        Backend::Eager => "eager backend",
        Backend::AotEager => "aot_eager backend",
        Backend::Default => "compiled backend",
    }
}

/// The keys of `hint` that `backend` ignores, with the reasons.
fn ignored(
    hint: &Hint,
    backend: Backend,
    has_backward: bool,
    on: Device,
) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = Vec::new();
    let lanes = crate::runtime::device::backend(on).map_or(1, |b| b.lanes());
    let no_streams = match (on, backend) {
        (Device::Cpu, _) => Some("the CPU has no streams: its kernels run on host threads".to_string()),
        (d, Backend::Eager | Backend::AotEager) => Some(format!(
            "this backend runs op by op on {d}'s own stream (the default backend places regions on streams)"
        )),
        (d, Backend::Default) if lanes < 2 => Some(format!(
            "{d} runs one stream here (TESSERA_CUDA_LANES={lanes})"
        )),
        (_, Backend::Default) => None,
    };
    match backend {
        Backend::Eager | Backend::AotEager => {
            let runner = match backend {
                Backend::Eager => "eager runs the captured ops one at a time as called",
                _ => "aot_eager runs the AOT graphs op by op in program order",
            };
            if let Some(o) = hint.order.filter(|&o| o != Order::Strict) {
                out.push(("order", format!("{runner}, not in {o} order")));
            }
            if hint.group_id.is_some() {
                out.push((
                    "group_id",
                    format!("{runner}: a group is one block only as written"),
                ));
            }
            if hint.memory_budget_mb.is_some() {
                out.push(("memory_budget_mb", format!("{runner} and plans no memory")));
            }
            if hint.slice.is_some() {
                out.push((
                    "slice",
                    "slicing is a graph pass of the default backend; this backend runs the code as written".into(),
                ));
            }
        }
        Backend::Default => {}
    }
    // Every backend moves saved values to host memory (the default one's
    // memory plan, aot_eager's interpreter, eager's tape) and recomputes
    // them (AOT autograd, eager's tape), where there is a backward.
    for (key, on) in [
        ("offload", hint.offload == Some(true)),
        ("recompute", hint.recompute == Some(true)),
    ] {
        if on && !has_backward {
            out.push((
                key,
                "nothing requires grad: the forward saves nothing for a backward".into(),
            ));
        }
    }
    if let (Some(_), Some(why)) = (hint.stream, no_streams) {
        out.push(("stream", why));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_backend_names_what_it_ignores() {
        let hint = Hint::dfs()
            .group(1)
            .slice(0, 2)
            .offload(true)
            .recompute(true)
            .stream(1);
        let keys = |b, grad| -> Vec<&str> {
            ignored(&hint, b, grad, Device::Cpu)
                .into_iter()
                .map(|(k, _)| k)
                .collect()
        };
        // Offload is honoured wherever there is a backward; recompute by
        // AOT autograd and by the eager tape.
        for b in [Backend::Eager, Backend::AotEager] {
            assert_eq!(keys(b, true), ["order", "group_id", "slice", "stream"]);
            assert_eq!(
                keys(b, false),
                [
                    "order",
                    "group_id",
                    "slice",
                    "offload",
                    "recompute",
                    "stream"
                ]
            );
        }
        assert_eq!(keys(Backend::Default, true), ["stream"]);
        assert_eq!(
            keys(Backend::Default, false),
            ["offload", "recompute", "stream"]
        );
        // Strict is what eager does anyway.
        assert!(ignored(&Hint::strict(), Backend::Eager, true, Device::Cpu).is_empty());
    }
}
