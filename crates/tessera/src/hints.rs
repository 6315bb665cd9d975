//! Context hints: JSON objects the user attaches to a region of code, as in
//! Gaudi's `hinted_context(fn, *args, hint='{"order": "strict", "group_id": 0}')`.
//!
//! Every op created inside [`scope`] (traced nodes and the origins of eager
//! autograd nodes, both through `trace::node_meta`) carries the merged hints
//! of the scopes in force in `meta.hints`; backward ops inherit the hints of
//! the forward op they come from, with `backward_group_id` (when given) as
//! their `group_id`. The scheduler reads them (see `crate::schedule`).
//!
//! | key | type | meaning |
//! |---|---|---|
//! | `order` (alias `schedule_policy`) | `"strict"` \| `"dfs"` \| `"bfs"` \| `"auto"` | how the region's kernels are ordered |
//! | `group_id` | integer | the group's kernels run as one contiguous block |
//! | `backward_group_id` | integer | the `group_id` of the region's backward ops |
//! | `memory_budget_mb` | number ≥ 0 | the most memory the region's steps may use |
//! | `recompute` | boolean (default: `true` under `order: "strict"`, else `false`) | the backward recomputes the region's forward values instead of saving them (activation checkpointing, matmuls included): AOT autograd (the default and `aot_eager` backends), and the eager tape (plain eager and the `eager` backend), which keeps only the region's inputs and replays its recorded ops, like PyTorch's `torch.utils.checkpoint` (`crate::tensor::recompute`) |
//! | `max_width` | integer ≥ 1 | at most this many of the region's kernels run in one step: at most K independent chains in flight (the middle ground between `bfs`, unbounded, and `dfs`, one) |
//! | `slice` | `{"dim": D, "parts": P}` (D ≥ 0, P ≥ 1) | the compiler splits the region along dim D of its results into P slices computed one after another (`crate::passes::slice`) |
//! | `offload` | boolean | the activations the region saves for the backward wait in host memory between their last forward use and their first backward use (a strict region that offloads does not recompute by default); honoured by compile's memory plan, by the `aot_eager` backend (moved op by op), and by the eager tape, like PyTorch's `save_on_cpu` (`crate::tensor::offload`) |
//! | `stream` | integer ≥ 0 | the region's kernels go on a stream of their own (CUDA; events between streams, `crate::schedule::streams`); logged as ignored where a backend has no streams |
//!
//! `order: "strict"` says "memory over speed", so by default such a region
//! is checkpointed: its backward recomputes what it needs from the region's
//! inputs, slice by slice, with the backward's hints (see
//! `crate::autograd::aot`); `"recompute": false` keeps its activations.
//!
//! An unknown key is a warning and is otherwise ignored; a wrong type or
//! malformed JSON is an error ([`ErrorKind::Parse`]) naming the key.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};

use crate::error::{Error, ErrorKind, Result};
use crate::logging::log;

/// The JSON object form of hints, as stored in `NodeMeta::hints`.
pub type HintMap = Map<String, Value>;

/// How kernels are ordered: the values of the `order` hint and the
/// scheduler's strategies (`crate::schedule::Strategy` is this type; see
/// `crate::schedule` for what each does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Strategy {
    #[default]
    Bfs,
    Dfs,
    Strict,
    Auto,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Bfs => "bfs",
            Strategy::Dfs => "dfs",
            Strategy::Strict => "strict",
            Strategy::Auto => "auto",
        }
    }

    pub fn from_name(name: &str) -> Option<Strategy> {
        [
            Strategy::Bfs,
            Strategy::Dfs,
            Strategy::Strict,
            Strategy::Auto,
        ]
        .into_iter()
        .find(|s| s.name() == name)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `order` hint's name for [`Strategy`].
pub use Strategy as Order;

const KNOWN_KEYS: &str = "order, schedule_policy, group_id, backward_group_id, memory_budget_mb, \
     recompute, max_width, slice, offload, stream";

/// The `slice` hint: split the region along `dim` into `parts` slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SliceHint {
    pub dim: usize,
    pub parts: usize,
}

/// A parsed hint; `None` fields are not set (an inner scope leaves them to
/// the outer one).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hint {
    pub order: Option<Order>,
    pub group_id: Option<i64>,
    pub backward_group_id: Option<i64>,
    pub memory_budget_mb: Option<f64>,
    /// Recompute the region's forward values in the backward (see
    /// [`Hint::recomputes`] for the default).
    pub recompute: Option<bool>,
    /// At most this many of the region's kernels per step.
    pub max_width: Option<usize>,
    /// Split the region into slices (a graph pass, before AOT autograd).
    pub slice: Option<SliceHint>,
    /// Saved activations wait in host memory between forward and backward.
    pub offload: Option<bool>,
    /// The stream of the region's kernels (CUDA).
    pub stream: Option<i64>,
}

impl Hint {
    /// Parses a JSON object, printing a warning for each unknown key.
    pub fn parse(json: &str) -> Result<Hint> {
        let (hint, unknown) = Hint::parse_with_warnings(json)?;
        for w in unknown {
            warn(&w);
        }
        Ok(hint)
    }

    /// Parses a JSON object; also returns one warning per unknown key.
    pub fn parse_with_warnings(json: &str) -> Result<(Hint, Vec<String>)> {
        let value: Value = serde_json::from_str(json).map_err(|e| {
            Error::new(
                ErrorKind::Parse,
                format!(
                    "hint: malformed JSON at line {} column {}: {e}",
                    e.line(),
                    e.column()
                ),
            )
        })?;
        match value {
            Value::Object(map) => Hint::from_map(&map),
            other => Err(parse_error(format!(
                "hint: expected a JSON object, got {other}"
            ))),
        }
    }

    /// Reads a JSON object (e.g. a node's `meta.hints`); unknown keys are
    /// returned as warnings, not printed.
    pub fn from_map(map: &HintMap) -> Result<(Hint, Vec<String>)> {
        let mut hint = Hint::default();
        let mut warnings = Vec::new();
        for (key, value) in map {
            match key.as_str() {
                "order" | "schedule_policy" => {
                    let order = parse_order(key, value)?;
                    if hint.order.is_some_and(|o| o != order) {
                        return Err(parse_error(format!(
                            "hint: \"order\" and its alias \"schedule_policy\" disagree ({} vs {})",
                            hint.order.expect("checked").name(),
                            order.name()
                        )));
                    }
                    hint.order = Some(order);
                }
                "group_id" => hint.group_id = Some(integer(key, value)?),
                "backward_group_id" => hint.backward_group_id = Some(integer(key, value)?),
                "memory_budget_mb" => hint.memory_budget_mb = Some(megabytes(key, value)?),
                "recompute" => hint.recompute = Some(boolean(key, value)?),
                "max_width" => hint.max_width = Some(positive(key, value)?),
                "slice" => hint.slice = Some(slice(key, value)?),
                "offload" => hint.offload = Some(boolean(key, value)?),
                "stream" => hint.stream = Some(stream(key, value)?),
                _ => warnings.push(format!(
                    "hint key \"{key}\" is not known (known: {KNOWN_KEYS}); ignored"
                )),
            }
        }
        Ok((hint, warnings))
    }

    /// `{"order": "strict"}`: program order, one kernel at a time.
    pub fn strict() -> Hint {
        Hint::order(Order::Strict)
    }

    pub fn dfs() -> Hint {
        Hint::order(Order::Dfs)
    }

    pub fn bfs() -> Hint {
        Hint::order(Order::Bfs)
    }

    pub fn auto() -> Hint {
        Hint::order(Order::Auto)
    }

    pub fn order(order: Order) -> Hint {
        Hint {
            order: Some(order),
            ..Hint::default()
        }
    }

    pub fn group(mut self, id: i64) -> Hint {
        self.group_id = Some(id);
        self
    }

    /// The `group_id` the region's backward ops get.
    pub fn backward_group(mut self, id: i64) -> Hint {
        self.backward_group_id = Some(id);
        self
    }

    pub fn memory_budget_mb(mut self, mb: f64) -> Hint {
        self.memory_budget_mb = Some(mb);
        self
    }

    /// Whether the backward recomputes the region's forward values.
    pub fn recompute(mut self, on: bool) -> Hint {
        self.recompute = Some(on);
        self
    }

    /// At most `k` of the region's kernels per step.
    pub fn max_width(mut self, k: usize) -> Hint {
        self.max_width = Some(k);
        self
    }

    /// Split the region along `dim` into `parts` slices.
    pub fn slice(mut self, dim: usize, parts: usize) -> Hint {
        self.slice = Some(SliceHint { dim, parts });
        self
    }

    /// Keep the region's saved activations in host memory.
    pub fn offload(mut self, on: bool) -> Hint {
        self.offload = Some(on);
        self
    }

    /// Run the region's kernels on stream `n`.
    pub fn stream(mut self, n: i64) -> Hint {
        self.stream = Some(n);
        self
    }

    /// Whether AOT autograd recomputes this region's forward values in the
    /// backward: the `recompute` key, by default on under `order: "strict"`
    /// (a region that asks for memory over speed) unless the region asks
    /// to offload what it saves instead, and off otherwise.
    pub fn recomputes(&self) -> bool {
        let strict = self.order == Some(Order::Strict);
        self.recompute
            .unwrap_or(strict && self.offload != Some(true))
    }

    pub fn is_empty(&self) -> bool {
        *self == Hint::default()
    }

    /// `self` with the fields `inner` sets replaced (the inner scope wins).
    pub fn merged(&self, inner: &Hint) -> Hint {
        Hint {
            order: inner.order.or(self.order),
            group_id: inner.group_id.or(self.group_id),
            backward_group_id: inner.backward_group_id.or(self.backward_group_id),
            memory_budget_mb: inner.memory_budget_mb.or(self.memory_budget_mb),
            recompute: inner.recompute.or(self.recompute),
            max_width: inner.max_width.or(self.max_width),
            slice: inner.slice.or(self.slice),
            offload: inner.offload.or(self.offload),
            stream: inner.stream.or(self.stream),
        }
    }

    /// The canonical JSON object (alias spelled `order`).
    pub fn to_map(&self) -> HintMap {
        let mut map = Map::new();
        if let Some(o) = self.order {
            map.insert("order".into(), Value::from(o.name()));
        }
        if let Some(g) = self.group_id {
            map.insert("group_id".into(), Value::from(g));
        }
        if let Some(g) = self.backward_group_id {
            map.insert("backward_group_id".into(), Value::from(g));
        }
        if let Some(mb) = self.memory_budget_mb {
            map.insert("memory_budget_mb".into(), Value::from(mb));
        }
        if let Some(r) = self.recompute {
            map.insert("recompute".into(), Value::from(r));
        }
        if let Some(k) = self.max_width {
            map.insert("max_width".into(), Value::from(k));
        }
        if let Some(s) = self.slice {
            let mut m = Map::new();
            m.insert("dim".into(), Value::from(s.dim));
            m.insert("parts".into(), Value::from(s.parts));
            map.insert("slice".into(), Value::Object(m));
        }
        if let Some(o) = self.offload {
            map.insert("offload".into(), Value::from(o));
        }
        if let Some(n) = self.stream {
            map.insert("stream".into(), Value::from(n));
        }
        map
    }

    pub fn to_json(&self) -> String {
        Value::Object(self.to_map()).to_string()
    }

    /// The budget in bytes, if one is set.
    pub fn memory_budget_bytes(&self) -> Option<usize> {
        self.memory_budget_mb
            .map(|mb| (mb * 1024.0 * 1024.0) as usize)
    }
}

fn parse_error(message: String) -> Error {
    Error::new(ErrorKind::Parse, message)
}

/// Prints a warning once per process (a compiled function re-traces, and
/// so re-parses its hints, on every call).
fn warn(message: &str) {
    static SEEN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let first = match SEEN.lock() {
        Ok(mut seen) => seen.insert(message.to_string()),
        Err(_) => true,
    };
    if first {
        eprintln!("tessera: warning: {message}");
    }
    log("schedule", || message.to_string());
}

/// The messages [`not_honoured`] has given in this process.
static NOT_HONOURED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Says that `stage` (a backend, a pass) does not honour hint `key` of the
/// region whose hints are `region`, and why: logged under
/// `TESSERA_LOGS=hints`, once per process for each message (a compiled
/// function re-traces on every call; an eager region runs every step).
pub fn not_honoured(stage: &str, region: &HintMap, key: &str, reason: &str) {
    let json = Value::Object(region.clone()).to_string();
    let message = format!("{stage}: hint \"{key}\" of region {json} not honoured: {reason}");
    let first = match NOT_HONOURED.lock() {
        Ok(mut seen) if !seen.contains(&message) => {
            seen.push(message.clone());
            true
        }
        Ok(_) => false,
        Err(_) => true,
    };
    if first {
        log("hints", || message);
    }
}

/// Every message [`not_honoured`] has given so far in this process, in
/// order (for tests and tools that report what became of hints).
pub fn not_honoured_messages() -> Vec<String> {
    NOT_HONOURED.lock().map(|m| m.clone()).unwrap_or_default()
}

/// The keys of `hint` that plain eager execution (ops run as they are
/// called, outside `compile`) does not honour, with the reasons: all but
/// `order: "strict"`, which is what eager does anyway, and `offload` and
/// `recompute`, which the tape honours (the saved values of the region's
/// ops wait in host memory, `crate::tensor::offload`, or are recomputed in
/// the backward, `crate::tensor::recompute`; an op that records nothing
/// says so there).
pub fn eager_ignores(hint: &Hint) -> Vec<(&'static str, &'static str)> {
    let mut out = Vec::new();
    let mut say = |on: bool, key: &'static str, why: &'static str| {
        if on {
            out.push((key, why));
        }
    };
    say(
        hint.order.is_some_and(|o| o != Order::Strict),
        "order",
        "eager runs each op as it is called (program order)",
    );
    say(
        hint.group_id.is_some(),
        "group_id",
        "eager runs each op as it is called: a group is one block only as written",
    );
    say(
        hint.backward_group_id.is_some(),
        "backward_group_id",
        "eager's backward runs the tape in reverse, one op at a time",
    );
    say(
        hint.memory_budget_mb.is_some(),
        "memory_budget_mb",
        "eager plans no memory: each op allocates its output when it runs",
    );
    say(
        hint.max_width.is_some(),
        "max_width",
        "eager runs one op at a time",
    );
    say(
        hint.slice.is_some(),
        "slice",
        "slicing is a graph pass of compile; eager runs the code as written",
    );
    say(
        hint.stream.is_some(),
        "stream",
        "eager queues every op on the device's own stream (compile places regions on streams)",
    );
    out
}

/// Says, for the region whose hints are `region`, what plain eager
/// execution does not honour ([`eager_ignores`]), through
/// [`not_honoured`]: called by eager dispatch for each op run inside a
/// [`scope`]; a region already said on this thread costs a pointer
/// comparison.
pub fn eager_op_in(region: &Arc<HintMap>) {
    thread_local! {
        static LAST: RefCell<Option<Arc<HintMap>>> = const { RefCell::new(None) };
    }
    let seen = LAST.with(|l| {
        let mut last = l.borrow_mut();
        let same = last.as_ref().is_some_and(|x| Arc::ptr_eq(x, region));
        if !same {
            *last = Some(region.clone());
        }
        same
    });
    if seen {
        return;
    }
    let Ok((hint, _)) = Hint::from_map(region) else {
        return;
    };
    for (key, reason) in eager_ignores(&hint) {
        not_honoured("eager", region, key, reason);
    }
}

/// `map` without `key` (`None` when nothing is left).
pub fn without_key(map: &HintMap, key: &str) -> Option<Arc<HintMap>> {
    let mut map = map.clone();
    map.remove(key);
    (!map.is_empty()).then(|| Arc::new(map))
}

fn parse_order(key: &str, value: &Value) -> Result<Order> {
    let expected = "one of \"strict\", \"dfs\", \"bfs\", \"auto\"";
    let name = value.as_str().ok_or_else(|| {
        parse_error(format!(
            "hint key \"{key}\": expected {expected}, got {value}"
        ))
    })?;
    Order::from_name(name).ok_or_else(|| {
        parse_error(format!(
            "hint key \"{key}\": expected {expected}, got {value}"
        ))
    })
}

fn integer(key: &str, value: &Value) -> Result<i64> {
    value.as_i64().ok_or_else(|| {
        parse_error(format!(
            "hint key \"{key}\": expected an integer, got {value}"
        ))
    })
}

fn boolean(key: &str, value: &Value) -> Result<bool> {
    value.as_bool().ok_or_else(|| {
        parse_error(format!(
            "hint key \"{key}\": expected a boolean (true or false), got {value}"
        ))
    })
}

fn positive(key: &str, value: &Value) -> Result<usize> {
    match value.as_u64() {
        Some(k) if k >= 1 => Ok(k as usize),
        _ => Err(parse_error(format!(
            "hint key \"{key}\": expected an integer ≥ 1, got {value}"
        ))),
    }
}

fn stream(key: &str, value: &Value) -> Result<i64> {
    match value.as_i64() {
        Some(n) if n >= 0 => Ok(n),
        _ => Err(parse_error(format!(
            "hint key \"{key}\": expected an integer ≥ 0 (a stream number), got {value}"
        ))),
    }
}

/// `{"dim": D, "parts": P}`, nothing else.
fn slice(key: &str, value: &Value) -> Result<SliceHint> {
    let expected = "an object {\"dim\": D ≥ 0, \"parts\": P ≥ 1}";
    let bad = || {
        parse_error(format!(
            "hint key \"{key}\": expected {expected}, got {value}"
        ))
    };
    let map = value.as_object().ok_or_else(bad)?;
    if let Some(other) = map.keys().find(|k| *k != "dim" && *k != "parts") {
        return Err(parse_error(format!(
            "hint key \"{key}\": unknown field \"{other}\" (expected {expected})"
        )));
    }
    let dim = map.get("dim").and_then(Value::as_u64).ok_or_else(bad)?;
    let parts = map.get("parts").and_then(Value::as_u64).ok_or_else(bad)?;
    if parts == 0 {
        return Err(bad());
    }
    Ok(SliceHint {
        dim: dim as usize,
        parts: parts as usize,
    })
}

fn megabytes(key: &str, value: &Value) -> Result<f64> {
    match value.as_f64() {
        Some(mb) if mb >= 0.0 && mb.is_finite() => Ok(mb),
        _ => Err(parse_error(format!(
            "hint key \"{key}\": expected a non-negative number (megabytes), got {value}"
        ))),
    }
}

/// What [`scope`] and [`hinted_context`] accept: a [`Hint`] or its JSON text.
pub trait IntoHint {
    fn into_hint(self) -> Result<Hint>;
}

impl IntoHint for Hint {
    fn into_hint(self) -> Result<Hint> {
        Ok(self)
    }
}

impl IntoHint for &Hint {
    fn into_hint(self) -> Result<Hint> {
        Ok(self.clone())
    }
}

impl IntoHint for &str {
    fn into_hint(self) -> Result<Hint> {
        Hint::parse(self)
    }
}

impl IntoHint for &String {
    fn into_hint(self) -> Result<Hint> {
        Hint::parse(self)
    }
}

/// One open scope: its merged hint, and that hint as the JSON object every
/// node made inside it shares (built once per scope, not once per op).
struct Open {
    hint: Hint,
    map: Option<Arc<HintMap>>,
}

thread_local! {
    /// The scopes open on this thread, innermost last.
    static STACK: RefCell<Vec<Open>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `hint` merged into the hints in force (the inner value of a
/// key wins); every op `f` creates on this thread carries them. Errors only
/// for a bad hint (then `f` does not run).
pub fn scope<R>(hint: impl IntoHint, f: impl FnOnce() -> R) -> Result<R> {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            STACK.with(|s| s.borrow_mut().pop());
        }
    }
    let hint = hint.into_hint()?;
    STACK.with(|s| {
        let mut stack = s.borrow_mut();
        let merged = stack
            .last()
            .map_or(hint.clone(), |outer| outer.hint.merged(&hint));
        let map = (!merged.is_empty()).then(|| Arc::new(merged.to_map()));
        stack.push(Open { hint: merged, map });
    });
    let _pop = Pop;
    Ok(f())
}

/// Gaudi's `hinted_context(fn, *args, hint=…)`: `f(args)` inside a
/// [`scope`] of `hint`.
pub fn hinted_context<A: ?Sized, R>(
    f: impl FnOnce(&A) -> R,
    args: &A,
    hint: impl IntoHint,
) -> Result<R> {
    scope(hint, || f(args))
}

/// The hints in force on this thread as a JSON object (`None` outside any
/// scope, or when the scopes set nothing).
pub fn current() -> Option<Arc<HintMap>> {
    STACK.with(|s| s.borrow().last().and_then(|open| open.map.clone()))
}

/// The hints a backward op inherits from its forward op's `hints`: the same,
/// with `backward_group_id` (when set) as the `group_id`. Hints that do not
/// parse are inherited as they are (the scheduler reports them).
pub fn for_backward(hints: Option<Arc<HintMap>>) -> Option<Arc<HintMap>> {
    let map = hints?;
    match map.get("backward_group_id") {
        Some(g) if map.get("group_id") != Some(g) => {
            let mut map = (*map).clone();
            map.insert("group_id".into(), g.clone());
            Some(Arc::new(map))
        }
        _ => Some(map),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seeds_hint_parses() {
        let h = Hint::parse(r#"{"order": "strict", "group_id": 0}"#).unwrap();
        assert_eq!(h, Hint::strict().group(0));
        assert_eq!(h.to_json(), r#"{"group_id":0,"order":"strict"}"#);
    }

    #[test]
    fn schedule_policy_is_an_alias_of_order() {
        let h = Hint::parse(r#"{"schedule_policy": "dfs"}"#).unwrap();
        assert_eq!(h, Hint::dfs());
        let both = Hint::parse(r#"{"schedule_policy": "dfs", "order": "bfs"}"#).unwrap_err();
        assert!(both.message.contains("disagree"), "{both}");
    }

    #[test]
    fn unknown_keys_warn_and_are_ignored() {
        let (h, w) = Hint::parse_with_warnings(r#"{"order": "bfs", "streams": 2}"#).unwrap();
        assert_eq!(h, Hint::bfs());
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("\"streams\""), "{}", w[0]);
    }

    #[test]
    fn wrong_types_name_the_key_and_the_type() {
        for (json, key, expected) in [
            (r#"{"group_id": "0"}"#, "group_id", "an integer"),
            (r#"{"group_id": 1.5}"#, "group_id", "an integer"),
            (r#"{"order": "fast"}"#, "order", "one of"),
            (r#"{"schedule_policy": 3}"#, "schedule_policy", "one of"),
            (
                r#"{"memory_budget_mb": -1}"#,
                "memory_budget_mb",
                "non-negative number",
            ),
            (r#"{"recompute": 1}"#, "recompute", "a boolean"),
            (r#"{"recompute": "yes"}"#, "recompute", "a boolean"),
            (r#"{"max_width": 0}"#, "max_width", "an integer ≥ 1"),
            (r#"{"max_width": 2.5}"#, "max_width", "an integer ≥ 1"),
            (r#"{"stream": -1}"#, "stream", "an integer ≥ 0"),
            (r#"{"offload": 1}"#, "offload", "a boolean"),
            (r#"{"slice": 4}"#, "slice", "an object"),
            (r#"{"slice": {"dim": 0}}"#, "slice", "an object"),
            (r#"{"slice": {"dim": 0, "parts": 0}}"#, "slice", "an object"),
            (
                r#"{"slice": {"dim": -1, "parts": 2}}"#,
                "slice",
                "an object",
            ),
            (
                r#"{"slice": {"dim": 0, "parts": 2, "by": 1}}"#,
                "slice",
                "unknown field",
            ),
            (
                r#"{"memory_budget_mb": "64"}"#,
                "memory_budget_mb",
                "non-negative number",
            ),
        ] {
            let e = Hint::parse(json).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Parse);
            assert!(e.message.contains(&format!("\"{key}\"")), "{e}");
            assert!(e.message.contains(expected), "{e}");
        }
    }

    #[test]
    fn malformed_json_is_a_parse_error() {
        let e = Hint::parse(r#"{"order": "strict""#).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Parse);
        assert!(e.message.contains("malformed JSON"), "{e}");
        let e = Hint::parse("[1, 2]").unwrap_err();
        assert!(e.message.contains("expected a JSON object"), "{e}");
    }

    #[test]
    fn builder_round_trips_through_json() {
        let h = Hint::order(Order::Dfs)
            .group(3)
            .backward_group(4)
            .memory_budget_mb(64.0)
            .recompute(true)
            .max_width(2)
            .slice(1, 8)
            .offload(true)
            .stream(3);
        assert_eq!(Hint::parse(&h.to_json()).unwrap(), h);
    }

    #[test]
    fn strict_regions_recompute_unless_told_not_to() {
        let parsed = |json: &str| Hint::parse(json).unwrap().recomputes();
        assert!(parsed(r#"{"order": "strict"}"#));
        assert!(!parsed(r#"{"order": "strict", "recompute": false}"#));
        assert!(!parsed(r#"{"order": "bfs"}"#));
        assert!(!parsed(r#"{"group_id": 0}"#));
        assert!(parsed(r#"{"order": "dfs", "recompute": true}"#));
        // The inner scope's explicit value wins over the outer default.
        let inner = Hint::strict().merged(&Hint::default().recompute(false));
        assert!(!inner.recomputes());
    }

    #[test]
    fn nested_scopes_merge_and_the_inner_wins() {
        let seen = scope(Hint::strict().group(0), || {
            let outer = current();
            let inner = scope(r#"{"order": "bfs", "memory_budget_mb": 8}"#, current).unwrap();
            (outer, inner, current())
        })
        .unwrap();
        assert_eq!(seen.0, Some(Arc::new(Hint::strict().group(0).to_map())));
        let want = Hint::bfs().group(0).memory_budget_mb(8.0);
        assert_eq!(seen.1, Some(Arc::new(want.to_map())));
        assert_eq!(seen.2, seen.0, "the inner scope is closed");
        assert_eq!(current(), None);
    }

    #[test]
    fn a_bad_hint_does_not_run_the_region() {
        let mut ran = false;
        assert!(scope(r#"{"group_id": true}"#, || ran = true).is_err());
        assert!(!ran);
    }

    #[test]
    fn eager_says_what_it_ignores_once_per_region() {
        let region = Arc::new(
            Hint::dfs()
                .offload(true)
                .recompute(true)
                .stream(7)
                .max_width(3)
                .to_map(),
        );
        let keys: Vec<&str> = eager_ignores(&Hint::from_map(&region).unwrap().0)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        // The tape honours `offload` and `recompute`.
        assert_eq!(keys, ["order", "max_width", "stream"]);
        assert!(eager_ignores(&Hint::strict()).is_empty());
        eager_op_in(&region);
        eager_op_in(&region);
        let said: Vec<String> = not_honoured_messages()
            .into_iter()
            .filter(|m| m.starts_with("eager:") && m.contains("\"stream\":7"))
            .collect();
        assert_eq!(said.len(), 3, "{said:?}");
        assert!(said
            .iter()
            .any(|m| m.contains("hint \"stream\"") && m.contains("own stream")));
    }

    #[test]
    fn backward_hints_take_the_backward_group() {
        let fwd = Arc::new(Hint::strict().group(0).backward_group(1).to_map());
        let bwd = for_backward(Some(fwd)).unwrap();
        assert_eq!(
            Hint::from_map(&bwd).unwrap().0,
            Hint::strict().group(1).backward_group(1)
        );
        let plain = Arc::new(Hint::strict().group(0).to_map());
        assert_eq!(for_backward(Some(plain.clone())), Some(plain));
    }
}
