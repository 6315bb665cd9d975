//! One prepared plan, many runs: what an executable derives once from its
//! plan (`runtime::execute::Prepared`: each step's frees, each kernel's
//! reads, writes, places and register slots, the value lists of earlier
//! runs, the threads' register files) must carry nothing from one call to
//! the next — not between inputs, nor sizes, nor threads. Every call here
//! is compared with eager (and, for the prepared plan, bit for bit with a
//! run that prepares afresh).

mod schedule_util;

use schedule_util::{planned, traced};
use tessera::nn::{Linear, ParamStore};
use tessera::runtime::execute::{run_prepared, run_scheduled, Prepared};
use tessera::schedule::Strategy;
use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "{what}[{i}]: compiled {a} vs eager {b}"
        );
    }
}

fn bits(ts: &[Tensor]) -> Vec<Vec<u64>> {
    ts.iter()
        .map(|t| t.to_f64_vec().iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Fused chains, a softmax (a row kernel), matmuls with epilogues and a
/// reduction: every kind of kernel whose registers are prepared.
fn block(x: &Tensor, w: &Tensor) -> Vec<Tensor> {
    let h = (x.matmul(w) * 0.5 + 1.0).tanh();
    let p = h.softmax(-1);
    let y = (&p * &h).exp() - &h;
    vec![y.matmul(w).relu(), y.sum(&[1], false)]
}

#[test]
fn one_prepared_plan_runs_many_inputs_on_two_threads_as_a_fresh_run_does() {
    let (x, w) = (randn(&[24, 16], 1), randn(&[16, 16], 2));
    let graph = traced("block", &[x.clone(), w.clone()], |a| block(&a[0], &a[1]));
    for strategy in [Strategy::Bfs, Strategy::Strict] {
        let (plan, s) = planned(&graph, strategy, None);
        let prepared = Prepared::scheduled(&graph, &plan, &s.schedule, &s.memory);
        let check = |seed: u64| {
            let args = vec![randn(&[24, 16], seed), randn(&[16, 16], seed + 1000)];
            let got = run_prepared(&graph, &plan, &prepared, args.clone(), false).unwrap();
            let fresh: Vec<Tensor> = run_scheduled(&graph, &plan, &s.schedule, &s.memory, &args)
                .unwrap()
                .into_iter()
                .map(|(_, t)| t)
                .collect();
            assert_eq!(bits(&got), bits(&fresh), "{strategy:?}, seed {seed}");
            for (i, want) in block(&args[0], &args[1]).iter().enumerate() {
                assert_close(&format!("{strategy:?} seed {seed} out{i}"), &got[i], want);
            }
        };
        std::thread::scope(|scope| {
            let check = &check;
            let a = scope.spawn(move || (0..12).for_each(|i| check(10 + 2 * i)));
            let b = scope.spawn(move || (0..12).for_each(|i| check(11 + 2 * i)));
            a.join().unwrap();
            b.join().unwrap();
        });
    }
}

#[test]
fn a_prepared_plan_refuses_another_graph() {
    let x = randn(&[4, 4], 1);
    let small = traced("small", &[x.clone(), x.clone()], |a| {
        vec![(&a[0] + &a[1]).exp()]
    });
    let large = traced("large", &[x.clone(), x.clone()], |a| block(&a[0], &a[1]));
    let (plan, s) = planned(&small, Strategy::Bfs, None);
    let prepared = Prepared::scheduled(&small, &plan, &s.schedule, &s.memory);
    let (large_plan, _) = planned(&large, Strategy::Bfs, None);
    let Err(err) = run_prepared(&large, &large_plan, &prepared, vec![x.clone(), x], false) else {
        panic!("another plan's preparation is refused")
    };
    assert!(err.message.contains("preparation of another plan"), "{err}");
}

#[test]
fn one_compiled_function_called_many_times_equals_eager_each_time() {
    let f = compile(|a: &[Tensor]| block(&a[0], &a[1]));
    for seed in 0..16u64 {
        let (x, w) = (randn(&[24, 16], seed), randn(&[16, 16], seed + 100));
        let got = f.call(&[x.clone(), w.clone()]);
        for (i, want) in block(&x, &w).iter().enumerate() {
            assert_close(&format!("call {seed} out{i}"), &got[i], want);
        }
    }
    let s = f.stats();
    assert_eq!(
        (s.compiles, s.cache_hits),
        (1, 15),
        "one executable for all"
    );
}

#[test]
fn a_symbolic_executable_alternating_sizes_on_two_threads_equals_eager() {
    let mut g = Generator::new(0);
    let mut store = ParamStore::new();
    let fc1 = Linear::new(&mut store, "fc1", 12, 20, true, &mut g);
    let fc2 = Linear::new(&mut store, "fc2", 20, 4, true, &mut g);
    let mlp = |x: &Tensor| {
        let h = fc1.forward(x).gelu();
        vec![fc2.forward(&h).softmax(-1), h.sum(&[1], false)]
    };
    let f = compile(|x: &[Tensor]| mlp(&x[0]));
    let check = |batch: usize, seed: u64| {
        let x = randn(&[batch, 12], seed);
        let got = f.call(std::slice::from_ref(&x));
        for (i, want) in mlp(&x).iter().enumerate() {
            assert_close(
                &format!("batch {batch}, seed {seed}, out{i}"),
                &got[i],
                want,
            );
        }
    };
    // Two sizes make the executable symbolic; each size then has its plan.
    check(3, 0);
    check(5, 1);
    std::thread::scope(|scope| {
        let check = &check;
        let a = scope.spawn(move || {
            for (i, batch) in [3, 7, 5, 3, 7, 9].into_iter().enumerate() {
                check(batch, 10 + i as u64);
            }
        });
        let b = scope.spawn(move || {
            for (i, batch) in [7, 3, 9, 5, 5, 3].into_iter().enumerate() {
                check(batch, 20 + i as u64);
            }
        });
        a.join().unwrap();
        b.join().unwrap();
    });
    let s = f.stats();
    assert_eq!(s.compiles, 2, "{:?}", f.recompile_reasons());
}
