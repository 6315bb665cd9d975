//! The cache of a compiled function: its entries (one executable per key),
//! what the cache did ([`CompileStats`]), and the key itself — a hash of the
//! traced graph's structure with the inputs' guards, computed on every call.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::dynamic::DynamicDims;
use super::guards::needs_grad;
use super::recompile::Seen;
use super::{Executable, InputGuard};
use crate::hints::HintMap;
use crate::ir::{DType, Graph};
use crate::tensor::{autocast, Tensor};

/// Counters of what the cache did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompileStats {
    /// Seconds spent building executables (passes, AOT autograd, fusion).
    pub compile_seconds: f64,
    /// Seconds spent tracing (every call traces; see the module doc).
    pub trace_seconds: f64,
    /// Executables built (the first compile and every recompile).
    pub compiles: usize,
    pub recompiles: usize,
    pub cache_hits: usize,
    pub graph_breaks: usize,
    /// Calls run eagerly (after the recompile limit, or a graph break with
    /// inputs that require grad).
    pub eager_calls: usize,
    /// Runs started before the trace (see [`super::Compiled::speculate`]),
    /// and those whose trace then differed (their outputs were dropped).
    pub speculations: usize,
    pub speculation_misses: usize,
}

/// One cached executable and what it was built for.
pub(super) struct Entry {
    pub key: u64,
    pub guards: Vec<InputGuard>,
    /// The guards of the tensors the trace lifted (parameters, captured
    /// state), for the reason of a later miss.
    pub lifted: Vec<InputGuard>,
    /// The (input, dim) pairs the executable has symbolic.
    pub dynamic: DynamicDims,
    /// Whether the trace had graph breaks (then it is always re-traced).
    pub had_breaks: bool,
    /// The autocast scope the trace ran in: its casts are in the graph, so
    /// an untraced run needs the same scope (the state PyTorch's Dynamo
    /// guards on alongside the inputs).
    pub autocast: Option<DType>,
    pub exe: Arc<Executable>,
}

impl Entry {
    /// Whether the entry can run from the guards alone, before (or
    /// without) a trace: it needs no lifted tensors or graph-break values,
    /// and the autocast scope is the one it was traced in.
    fn runs_untraced(&self, guards: &[InputGuard]) -> bool {
        !self.had_breaks
            && !self.exe.has_lifted()
            && !self.exe.writes_state()
            && self.guards == guards
            && self.autocast == autocast::current()
    }
}

/// Everything a compiled function remembers between calls.
#[derive(Default)]
pub(super) struct CacheState {
    pub entries: Vec<Entry>,
    pub stats: CompileStats,
    /// Past the recompile limit: every call runs eagerly.
    pub fell_back: bool,
    /// Why each recompile happened, in order.
    pub recompile_reasons: Vec<String>,
    /// The (input, dim) pairs made symbolic so far (automatic mode).
    pub dynamic_dims: DynamicDims,
    /// Keys of generalised graphs whose symbolic build failed: calls with
    /// them use their concrete graph (see `Compiled::generalised`).
    pub symbolic_failed: Vec<u64>,
    /// The key of the entry that served the last call.
    pub last_key: Option<u64>,
}

impl CacheState {
    /// The executable cached under `key`: a hit, which then serves as the
    /// last call's entry.
    pub fn lookup(&mut self, key: u64) -> Option<Arc<Executable>> {
        let exe = self
            .entries
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.exe.clone())?;
        self.stats.cache_hits += 1;
        self.last_key = Some(key);
        Some(exe)
    }

    /// `mode=reduce-overhead`: the first executable these guards pass that
    /// needs nothing from a trace (a hit without tracing).
    pub fn lookup_by_guards(&mut self, guards: &[InputGuard]) -> Option<Arc<Executable>> {
        let exe = self
            .entries
            .iter()
            .find(|e| e.runs_untraced(guards))
            .map(|e| e.exe.clone())?;
        self.stats.cache_hits += 1;
        Some(exe)
    }

    /// The key and executable to start before tracing (see
    /// [`super::Compiled::speculate`]): the last call's entry, when these
    /// guards pass it and it needs nothing from the trace.
    pub fn speculation(&mut self, guards: &[InputGuard]) -> Option<(u64, Arc<Executable>)> {
        let key = self.last_key?;
        let exe = self
            .entries
            .iter()
            .find(|e| e.key == key && e.runs_untraced(guards))
            .map(|e| e.exe.clone())?;
        self.stats.speculations += 1;
        Some((key, exe))
    }

    /// Caches a new executable; it serves the current call.
    pub fn insert(&mut self, entry: Entry) {
        self.last_key = Some(entry.key);
        self.entries.push(entry);
    }

    /// The guards of the executable built last (what automatic dynamic
    /// dims compare a miss with), `None` before the first compile.
    pub fn last_guards(&self) -> Option<&[InputGuard]> {
        self.entries.last().map(|e| e.guards.as_slice())
    }

    /// What every cached executable was built for, oldest first.
    pub fn seen(&self) -> Vec<Seen<'_>> {
        self.entries
            .iter()
            .map(|e| Seen {
                inputs: &e.guards,
                lifted: &e.lifted,
                dynamic: &e.dynamic,
            })
            .collect()
    }
}

/// A hash of the graph's structure (ops, attributes, wiring, types, hints —
/// not names or call sites), the inputs' guards and which lifted tensors
/// require grad.
///
/// It runs on every call (the cache lookup), so it allocates nothing per
/// node: ops hash their attributes directly ([`crate::ir::Op::hash_structure`]),
/// and each distinct hint object (shared by the nodes of its scope) is
/// spelled once. The hasher is foldhash's quality one with a fixed seed
/// (keys stay in the process): the standard library's SipHash took a
/// millisecond per call over a training step's 4,800 nodes, mostly in its
/// handling of the many small writes; foldhash folds them into 128-bit
/// words.
pub(super) fn structure_key(graph: &Graph, guards: &[InputGuard], lifted: &[Tensor]) -> u64 {
    let mut h = key_hasher();
    let mut hint_digests: Vec<(*const HintMap, u64)> = Vec::new();
    for node in &graph.nodes {
        node.op.hash_structure(&mut h);
        node.inputs.hash(&mut h);
        node.ty.hash(&mut h);
        node.meta
            .hints
            .as_ref()
            .map(|m| hint_digest(m, &mut hint_digests))
            .hash(&mut h);
    }
    for out in &graph.outputs {
        out.node.hash(&mut h);
    }
    guards.hash(&mut h);
    lifted.len().hash(&mut h);
    for t in lifted {
        (needs_grad(t), (!t.is_contiguous()).then(|| t.strides())).hash(&mut h);
    }
    h.finish()
}

/// The hasher of cache keys ([`structure_key`]).
fn key_hasher() -> impl Hasher {
    use std::hash::BuildHasher;
    foldhash::quality::FixedState::with_seed(0x7e55_e4a0_c0de_0001).build_hasher()
}

/// The hash of a hint object's JSON text, computed once per distinct object
/// (`seen` holds those met so far in this graph).
fn hint_digest(map: &Arc<HintMap>, seen: &mut Vec<(*const HintMap, u64)>) -> u64 {
    let ptr = Arc::as_ptr(map);
    if let Some(&(_, digest)) = seen.iter().find(|(p, _)| *p == ptr) {
        return digest;
    }
    let mut h = key_hasher();
    serde_json::to_string(&**map)
        .expect("a JSON object prints")
        .hash(&mut h);
    let digest = h.finish();
    seen.push((ptr, digest));
    digest
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::CompileOptions;
    use crate::hints::{self, Hint};
    use crate::ir::DType;
    use crate::runtime::device::Device;
    use crate::tensor::trace::{trace, Traced};

    fn traced(name: &str, shape: &[usize], f: impl FnOnce(&Tensor) -> Tensor) -> Traced {
        let x = Tensor::zeros(shape, DType::F32);
        trace(name, &[("x".into(), x.ty())], |a| {
            Ok(vec![("out".into(), f(&a[0]))])
        })
        .unwrap()
    }

    fn guards(shape: &[usize]) -> Vec<InputGuard> {
        vec![InputGuard::of(&Tensor::zeros(shape, DType::F32))]
    }

    fn key(t: &Traced, shape: &[usize]) -> u64 {
        structure_key(&t.graph, &guards(shape), &t.lifted)
    }

    #[test]
    fn names_do_not_change_the_key_structure_does() {
        let a = traced("first", &[4, 3], |x| x.exp() * 2.0);
        let b = traced("second", &[4, 3], |x| x.exp() * 2.0);
        assert_eq!(key(&a, &[4, 3]), key(&b, &[4, 3]), "only the names differ");
        // An attribute, an op, a type or a guard: another key.
        let scale = traced("first", &[4, 3], |x| x.exp() * 3.0);
        let op = traced("first", &[4, 3], |x| x.tanh() * 2.0);
        let shape = traced("first", &[5, 3], |x| x.exp() * 2.0);
        let base = key(&a, &[4, 3]);
        assert_ne!(base, key(&scale, &[4, 3]), "the constant's value");
        assert_ne!(base, key(&op, &[4, 3]), "exp vs tanh");
        assert_ne!(base, key(&shape, &[5, 3]), "the node types");
        assert_ne!(base, key(&a, &[4, 4]), "the guards alone");
    }

    #[test]
    fn lifted_tensors_requiring_grad_change_the_key() {
        let w = Tensor::ones(&[3], DType::F32);
        let t = traced("f", &[4, 3], |x| x * &w);
        assert_eq!(t.lifted.len(), 1, "w is captured, not an input");
        let g = guards(&[4, 3]);
        let frozen = structure_key(&t.graph, &g, &t.lifted);
        let trained = [t.lifted[0].set_requires_grad(true)];
        assert_ne!(frozen, structure_key(&t.graph, &g, &trained));
    }

    #[test]
    fn hints_are_part_of_the_key_by_content() {
        let with_group = |g: i64| {
            traced("f", &[4, 3], |x| {
                hints::scope(Hint::strict().group(g), || (x.exp() * 2.0).sum(&[1], false)).unwrap()
            })
        };
        let (a, b, c) = (with_group(0), with_group(0), with_group(1));
        assert_eq!(
            key(&a, &[4, 3]),
            key(&b, &[4, 3]),
            "equal hints, two objects"
        );
        assert_ne!(key(&a, &[4, 3]), key(&c, &[4, 3]));
        let plain = traced("f", &[4, 3], |x| (x.exp() * 2.0).sum(&[1], false));
        assert_ne!(key(&a, &[4, 3]), key(&plain, &[4, 3]));
    }

    #[test]
    fn a_hint_object_is_spelled_once_per_graph() {
        let t = traced("f", &[4, 3], |x| {
            hints::scope(Hint::strict().group(3), || (x.exp() * 2.0 + 1.0).tanh()).unwrap()
        });
        let maps: Vec<&Arc<HintMap>> = t
            .graph
            .nodes
            .iter()
            .filter_map(|n| n.meta.hints.as_ref())
            .collect();
        assert!(maps.len() >= 3, "every node of the scope carries the hint");
        let mut seen = Vec::new();
        let digests: Vec<u64> = maps.iter().map(|m| hint_digest(m, &mut seen)).collect();
        assert_eq!(seen.len(), 1, "one shared object, one digest");
        assert!(digests.iter().all(|&d| d == digests[0]));
    }

    fn entry(key: u64, shape: &[usize], had_breaks: bool) -> Entry {
        let t = traced("f", shape, |x| x.exp());
        let exe = Executable::build(
            &t,
            vec![],
            &CompileOptions::default(),
            Device::Cpu,
            &Default::default(),
        );
        Entry {
            key,
            guards: guards(shape),
            lifted: Vec::new(),
            dynamic: DynamicDims::new(),
            had_breaks,
            autocast: None,
            exe: Arc::new(exe.unwrap()),
        }
    }

    #[test]
    fn lookups_count_hits_and_remember_the_last_key() {
        let mut state = CacheState::default();
        assert!(state.last_guards().is_none());
        assert!(state.lookup(1).is_none());
        state.insert(entry(1, &[2], false));
        state.insert(entry(2, &[3], false));
        assert_eq!(state.last_key, Some(2), "a new entry serves its call");
        assert_eq!(state.last_guards(), Some(guards(&[3]).as_slice()));
        assert!(state.lookup(1).is_some());
        assert_eq!((state.stats.cache_hits, state.last_key), (1, Some(1)));
        assert!(state.lookup(7).is_none());
        assert_eq!((state.stats.cache_hits, state.last_key), (1, Some(1)));
        // By guards: a hit that leaves the last key alone.
        assert!(Arc::ptr_eq(
            &state.lookup_by_guards(&guards(&[3])).unwrap(),
            &state.entries[1].exe
        ));
        assert_eq!((state.stats.cache_hits, state.last_key), (2, Some(1)));
        assert!(state.lookup_by_guards(&guards(&[4])).is_none());
        assert_eq!(state.stats.cache_hits, 2);
    }

    #[test]
    fn an_entry_with_graph_breaks_is_never_run_untraced() {
        let mut state = CacheState::default();
        state.insert(entry(5, &[2], true));
        assert!(state.lookup_by_guards(&guards(&[2])).is_none());
        assert!(state.speculation(&guards(&[2])).is_none());
        assert!(state.lookup(5).is_some(), "a traced call still hits");
        assert_eq!(state.stats.speculations, 0);
    }

    #[test]
    fn speculation_starts_only_the_last_entry_when_its_guards_pass() {
        let mut state = CacheState::default();
        assert!(state.speculation(&guards(&[2])).is_none(), "no last entry");
        state.insert(entry(1, &[2], false));
        state.insert(entry(2, &[3], false));
        // The last entry is [3]: inputs of [2] pass another entry only.
        assert!(state.speculation(&guards(&[2])).is_none());
        let (key, exe) = state.speculation(&guards(&[3])).unwrap();
        assert_eq!(key, 2);
        assert!(Arc::ptr_eq(&exe, &state.entries[1].exe));
        assert_eq!(state.stats.speculations, 1);
        assert_eq!(
            state.stats.cache_hits, 0,
            "a hit only once the trace agrees"
        );
    }
}
