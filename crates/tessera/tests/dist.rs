//! Collectives on the CPU (`tessera::dist`): a group of threads of this
//! process, each rank in its own rayon pool, checked against the values
//! computed by hand; eager, traced and compiled calls agree; and a
//! data-parallel compiled training step on 2 ranks with half batches gives
//! the losses and parameters of 1 rank with the whole batch, with and
//! without a sharded optimizer (ZeRO-1).

use tessera::compile::{compile, train_step, DataParallel, TrainStep};
use tessera::dist::{self, Kind, ProcessGroup, ReduceOp};
use tessera::hints::{self, Hint};
use tessera::nn::{mse, Linear, ParamStore};
use tessera::optim::{AdamW, AdamWConfig, TraceableOptimizer};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// Rank r's tensor: `[r·10 + i]` for i in 0..n, as f32.
fn ranked(rank: usize, n: usize) -> Tensor {
    let v: Vec<f32> = (0..n).map(|i| (rank * 10 + i) as f32).collect();
    Tensor::from_vec(v, &[n])
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

#[test]
fn collectives_compute_their_definitions_on_three_threads() {
    let world = 3;
    let out = dist::spawn(world, 1, |g: ProcessGroup| {
        let r = g.rank();
        let (x, y) = (
            ranked(r, 6),
            Tensor::full(&[2, 2], r as f64 + 1.0, DType::F64),
        );
        let sum = g.all_reduce(&[&x, &y], ReduceOp::Sum).unwrap();
        let avg = g.all_reduce(&[&x], ReduceOp::Avg).unwrap();
        let scattered = g.reduce_scatter(&[&x], ReduceOp::Sum).unwrap();
        let gathered = g.all_gather(&[&x]).unwrap();
        let root = g.broadcast(&[&x], 2).unwrap();
        let to_one = g.reduce(&[&x], ReduceOp::Avg, 1).unwrap();
        (
            values(&sum[0]),
            sum[1].to_vec::<f64>().unwrap(),
            values(&avg[0]),
            values(&scattered[0]),
            values(&gathered[0]),
            values(&root[0]),
            values(&to_one[0]),
        )
    })
    .unwrap();
    // Σ_r (10r + i) = 30 + 3i; the f64 tensor: 1 + 2 + 3.
    let sum: Vec<f32> = (0..6).map(|i| 30.0 + 3.0 * i as f32).collect();
    for (r, (s, s64, avg, scattered, gathered, root, to_one)) in out.into_iter().enumerate() {
        assert_eq!(s, sum, "rank {r}");
        assert_eq!(s64, vec![6.0; 4]);
        assert_eq!(avg, sum.iter().map(|v| v / 3.0).collect::<Vec<_>>());
        assert_eq!(scattered, sum[2 * r..2 * r + 2].to_vec());
        let all: Vec<f32> = (0..3).flat_map(|q| values(&ranked(q, 6))).collect();
        assert_eq!(gathered, all);
        assert_eq!(root, values(&ranked(2, 6)));
        // The mean on rank 1 only; the others keep their own.
        let want = match r {
            1 => sum.iter().map(|v| v / 3.0).collect(),
            _ => values(&ranked(r, 6)),
        };
        assert_eq!(to_one, want, "rank {r}: reduce to rank 1");
    }
}

#[test]
fn mismatched_calls_fail_on_every_rank_and_name_the_op() {
    let out = dist::spawn(2, 1, |g: ProcessGroup| {
        let x = ranked(g.rank(), 2 + g.rank());
        g.all_reduce(&[&x], ReduceOp::Sum).map(|_| ()).unwrap_err()
    })
    .unwrap();
    for e in out {
        assert_eq!(e.op.as_deref(), Some("tessera::all_reduce"), "{e}");
        assert!(e.to_string().contains("another rank"), "{e}");
    }
    let e = ProcessGroup::threads(2).unwrap()[0]
        .reduce_scatter(&[&ranked(0, 3)], ReduceOp::Sum)
        .unwrap_err();
    assert!(
        e.to_string().contains("divisible by the group's size 2"),
        "{e}"
    );
}

#[test]
fn a_panicking_rank_stops_the_others() {
    let caught = std::panic::catch_unwind(|| {
        dist::spawn(2, 1, |g: ProcessGroup| {
            if g.rank() == 1 {
                panic!("rank 1 fails");
            }
            g.all_reduce(&[&ranked(0, 2)], ReduceOp::Sum).unwrap_err()
        })
    });
    assert!(caught.is_err());
}

#[test]
fn compiled_collectives_equal_eager_ones_and_differentiate() {
    let out = dist::spawn(2, 2, |g: ProcessGroup| {
        let x = ranked(g.rank(), 4);
        let f = |a: &[Tensor]| {
            let s = g.all_reduce(&[&a[0].mul(2.0)], ReduceOp::Avg).unwrap();
            let gathered = g.collective(Kind::AllGather, 5, &[&s[0]]).unwrap();
            vec![gathered[0].add(1.0)]
        };
        let eager = f(std::slice::from_ref(&x));
        let compiled = compile(f);
        let out = compiled.call(std::slice::from_ref(&x));
        // d/dx_r Σ_k(all_reduce avg of 2·x_k) summed over both ranks' outputs.
        let leaf = x.detach().set_requires_grad(true);
        let y = g.all_reduce(&[&leaf], ReduceOp::Sum).unwrap();
        y[0].sum(&[], false).backward();
        (
            values(&eager[0]),
            values(&out[0]),
            values(&leaf.grad().unwrap()),
        )
    })
    .unwrap();
    for (eager, compiled, grad) in out {
        let avg: Vec<f32> = (0..4).map(|i| (10 + 2 * i) as f32).collect();
        let want: Vec<f32> = avg.iter().chain(&avg).map(|v| v + 1.0).collect();
        assert_eq!(eager, want);
        assert_eq!(compiled, want);
        // Each rank's x feeds both ranks' sums: gradient 2 per element.
        assert_eq!(grad, vec![2.0; 4]);
    }
}

/// The model of the data-parallel tests: a 2-layer MLP in f64.
struct Mlp {
    a: Linear,
    b: Linear,
}

impl Mlp {
    fn new(store: &mut ParamStore, seed: u64) -> Mlp {
        let mut g = Generator::new(seed);
        let a = Linear::new(store, "a", 6, 16, true, &mut g);
        let b = Linear::new(store, "b", 16, 3, true, &mut g);
        Mlp { a, b }
    }

    fn loss(&self, batch: &[Tensor]) -> Tensor {
        mse(
            &self.b.forward(&self.a.forward(&batch[0]).tanh()),
            &batch[1],
        )
    }
}

/// The global batch of step `i`: 8 rows.
fn global_batch(i: usize) -> (Tensor, Tensor) {
    let mut g = Generator::new(100 + i as u64);
    (
        Tensor::randn(&[8, 6], DType::F64, &mut g),
        Tensor::randn(&[8, 3], DType::F64, &mut g),
    )
}

const STEPS: usize = 4;
/// f64 arithmetic, the mean of two half-batch means against one
/// whole-batch mean: equal up to rounding.
const TOL: f64 = 1e-12;

fn adamw(store: &ParamStore) -> AdamW {
    let config = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        ..AdamWConfig::default()
    };
    AdamW::new(store.parameters(), config)
}

/// The losses and final parameters of `STEPS` steps, on `world` ranks of
/// which this is `group`'s (or one without a group), each on its share of
/// the global batch. Ranks start from different seeds: the first step's
/// broadcast makes them rank 0's.
/// What a run gives back: losses, final parameters, each parameter's
/// state size, and the compiled step's graph and schedule (text).
type Run = (Vec<f64>, Vec<Vec<f64>>, Vec<usize>, String, String);

fn run(group: Option<ProcessGroup>, zero: bool, clip: Option<f64>) -> Run {
    let (rank, world) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.world()));
    let mut store = ParamStore::with_dtype(DType::F64);
    let model = Mlp::new(&mut store, 7 + rank as u64);
    let mut step: TrainStep<'_, AdamW> = train_step(|b: &[Tensor]| model.loss(b), adamw(&store));
    if let Some(max_norm) = clip {
        step = step.clip_grad_norm(max_norm);
    }
    if let Some(group) = group {
        let dp = DataParallel::new(group).zero(zero).bucket_bytes(600);
        step = step.data_parallel(dp);
    }
    let share = 8 / world;
    let mut losses = Vec::new();
    for i in 0..STEPS {
        let (x, y) = global_batch(i);
        let (x, y) = (
            x.narrow(0, rank * share, share),
            y.narrow(0, rank * share, share),
        );
        losses.push(step.step(&[x.contiguous(), y.contiguous()]).item());
    }
    let params = store
        .parameters()
        .iter()
        .map(|p| p.get().to_f64_vec())
        .collect();
    let artifact = |file: &str| {
        step.last_artifacts()
            .into_iter()
            .find(|(name, _)| name == file)
            .map(|(_, text)| text)
            .unwrap_or_default()
    };
    let (graph, schedule) = (artifact("forward.tir"), artifact("forward.schedule.txt"));
    let opt = step.optimizer();
    let state_sizes = (0..opt.params().len())
        .map(|i| opt.state(i)[0].numel())
        .collect();
    (losses, params, state_sizes, graph, schedule)
}

/// The graph's calls of collective `op`: how many, and how many of them
/// carry the stream hint.
fn calls(graph: &str, op: &str) -> (usize, usize) {
    let lines: Vec<&str> = graph.lines().filter(|l| l.contains(op)).collect();
    let on_stream = lines.iter().filter(|l| l.contains(r#""stream":1"#)).count();
    (lines.len(), on_stream)
}

/// The graph's all-reduces (R), reduces to one rank (D) and broadcasts
/// (B), in the graph's order.
fn collective_order(graph: &str) -> String {
    let letter = |l: &str| match () {
        _ if l.contains("tessera::all_reduce") => Some("R"),
        _ if l.contains("tessera::reduce\"") => Some("D"),
        _ if l.contains("tessera::broadcast") => Some("B"),
        _ => None,
    };
    graph
        .lines()
        .filter_map(letter)
        .collect::<Vec<_>>()
        .join(" ")
}

fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= TOL * x.abs().max(1.0),
            "{what}: {x} vs {y}"
        );
    }
}

/// With clipping every update waits for the last bucket (the global
/// norm): a sharded optimizer then broadcasts after it, not per bucket.
fn data_parallel_matches_one_rank(zero: bool, clip: Option<f64>) {
    let (losses, params, _, _, _) = run(None, false, clip);
    let ranks = dist::spawn(2, 1, |g| run(Some(g), zero, clip)).unwrap();
    let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
    // f64 parameters: the buckets' and owners' plan counts bytes.
    let byte_sizes: Vec<usize> = sizes.iter().map(|n| n * 8).collect();
    for (r, (l, p, state, graph, schedule)) in ranks.iter().enumerate() {
        // The backward never waits for the communication stream: each
        // update follows its bucket's reduction there (see train_step).
        let overlapped =
            schedule.contains("streams [0, 1]") && !schedule.contains("(stream 0) waits for");
        assert!(overlapped || clip.is_some(), "rank {r}:\n{schedule}");
        // The loss and 2 buckets (600 B: b's bias, weight and a's bias,
        // then a's weight) on stream 1; with ZeRO-1 one broadcast per
        // bucket (each bucket has one owner; with clipping one per owner
        // after the last bucket: 2 as well), on stream 1 too.
        // With ZeRO-1 and no clipping each bucket (one owner each) is
        // reduced to its owner alone.
        let to_owners = zero && clip.is_none();
        let (all_reduces, reduces) = if to_owners { (1, 2) } else { (3, 0) };
        assert_eq!(
            calls(graph, "tessera::all_reduce"),
            (all_reduces, all_reduces),
            "rank {r}:\n{graph}"
        );
        assert_eq!(
            calls(graph, "tessera::reduce\""),
            (reduces, reduces),
            "rank {r}"
        );
        let broadcasts = if zero { (2, 2) } else { (0, 0) };
        assert_eq!(calls(graph, "tessera::broadcast"), broadcasts, "rank {r}");
        // The chain of calls: each bucket's broadcast right after its
        // reduction, unless clipping makes every update wait for the last.
        let order = match (zero, clip) {
            (false, _) => "R R R",
            (true, None) => "R D B D B",
            (true, Some(_)) => "R R R B B",
        };
        assert_eq!(collective_order(graph), order, "rank {r}:\n{graph}");
        close(l, &losses, &format!("rank {r} losses"));
        for (j, (a, b)) in p.iter().zip(&params).enumerate() {
            close(a, b, &format!("rank {r} parameter {j}"));
        }
        for (j, (&s, &n)) in state.iter().zip(&sizes).enumerate() {
            let owned = dist::bucket_owners(&byte_sizes, 600, 2)[j] == r;
            let want = if zero && !owned { 0 } else { n };
            assert_eq!(s, want, "rank {r}: parameter {j}'s state");
        }
    }
}

#[test]
fn two_ranks_with_half_batches_train_as_one_with_the_whole() {
    data_parallel_matches_one_rank(false, None);
}

#[test]
fn a_sharded_optimizer_trains_the_same_and_keeps_a_share_of_the_state() {
    data_parallel_matches_one_rank(true, None);
}

#[test]
fn a_sharded_optimizer_with_clipping_trains_the_same() {
    data_parallel_matches_one_rank(true, Some(0.05));
}

#[test]
fn without_a_stream_of_its_own_the_hints_in_force_place_the_collectives() {
    let graphs = dist::spawn(2, 1, |g| {
        let mut store = ParamStore::with_dtype(DType::F64);
        let model = Mlp::new(&mut store, 7);
        let dp = DataParallel::new(g.clone()).stream(None);
        let mut step = train_step(|b: &[Tensor]| model.loss(b), adamw(&store)).data_parallel(dp);
        let (x, y) = global_batch(0);
        let (x, y) = (x.narrow(0, 4 * g.rank(), 4), y.narrow(0, 4 * g.rank(), 4));
        let hint = Hint::default().stream(2).group(5);
        hints::scope(hint, || step.step(&[x.contiguous(), y.contiguous()])).unwrap();
        let artifacts = step.last_artifacts().into_iter();
        artifacts
            .filter(|(n, _)| n == "forward.tir")
            .map(|(_, t)| t)
            .collect::<String>()
    })
    .unwrap();
    for graph in graphs {
        let reduces: Vec<&str> = graph
            .lines()
            .filter(|l| l.contains("tessera::all_reduce"))
            .collect();
        assert!(!reduces.is_empty(), "{graph}");
        for line in reduces {
            assert!(
                line.contains(r#""stream":2"#) && line.contains(r#""group_id":5"#),
                "{line}"
            );
        }
    }
}
