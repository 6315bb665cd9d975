use tessera::autograd::{aot_autograd, Partition};
use tessera::tensor::interpret::run_graph;
use tessera::tensor::trace::trace;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

#[test]
fn eager_backward_of_mlp_matches_finite_differences() {
    let mut g = Generator::new(0);
    let x = Tensor::randn(&[4, 3], DType::F64, &mut g);
    let w = Tensor::randn(&[3, 5], DType::F64, &mut g).set_requires_grad(true);
    let b = Tensor::randn(&[5], DType::F64, &mut g).set_requires_grad(true);
    let f = |w: &Tensor, b: &Tensor| (x.matmul(w) + b).tanh().softmax(-1).log().mean(&[], false);
    let loss = f(&w, &b);
    loss.backward();
    let gw = w.grad().unwrap().to_f64_vec();
    let eps = 1e-6;
    let wv = w.to_f64_vec();
    for i in 0..wv.len() {
        let mut plus = wv.clone();
        plus[i] += eps;
        let mut minus = wv.clone();
        minus[i] -= eps;
        let fp = f(&Tensor::from_vec(plus, &[3, 5]), &b.detach()).item();
        let fm = f(&Tensor::from_vec(minus, &[3, 5]), &b.detach()).item();
        let fd = (fp - fm) / (2.0 * eps);
        assert!((fd - gw[i]).abs() < 1e-7, "w[{i}]: fd {fd} vs {}", gw[i]);
    }
}

#[test]
fn aot_graphs_match_eager() {
    let mut g = Generator::new(1);
    let x = Tensor::randn(&[4, 3], DType::F64, &mut g);
    let w = Tensor::randn(&[3, 5], DType::F64, &mut g);
    let traced = trace("mlp", &[("x".into(), x.ty()), ("w".into(), w.ty())], |a| {
        Ok(vec![(
            "loss".into(),
            a[0].matmul(&a[1]).gelu().exp().sum(&[], false),
        )])
    })
    .unwrap();
    for partition in [
        Partition::SaveAll,
        Partition::MinCut {
            activation_memory_budget: 0.0,
        },
    ] {
        let aot = aot_autograd(&traced.graph, &[1], partition).unwrap();
        let fwd = run_graph(&aot.forward, &[x.clone(), w.clone()]).unwrap();
        let mut bwd_in: Vec<Tensor> = fwd[1..].iter().map(|(_, t)| t.clone()).collect();
        bwd_in.push(Tensor::ones(&[], DType::F64));
        let grads = run_graph(&aot.backward, &bwd_in).unwrap();
        let wr = w.set_requires_grad(true);
        let loss = x.matmul(&wr).gelu().exp().sum(&[], false);
        loss.backward();
        assert_eq!(fwd[0].1.item(), loss.item());
        let eager = wr.grad().unwrap().to_f64_vec();
        let aot_g = grads[0].1.to_f64_vec();
        for (a, e) in aot_g.iter().zip(&eager) {
            assert!((a - e).abs() < 1e-12, "{a} vs {e}");
        }
        eprintln!(
            "{partition:?}: saved {} bytes\n{}\n{}",
            aot.saved_bytes, aot.forward, aot.backward
        );
    }
}

#[test]
fn set_grad_replaces_a_leaf_gradient_and_checks_its_type() {
    let w = Tensor::from_vec(vec![1.0, 2.0], &[2]).set_requires_grad(true);
    (&w * 3.0).sum(&[], false).backward();
    w.set_grad(Some(Tensor::from_vec(vec![0.5, -0.5], &[2])))
        .unwrap();
    assert_eq!(w.grad().unwrap().to_f64_vec(), vec![0.5, -0.5]);
    w.set_grad(None).unwrap();
    assert!(w.grad().is_none());
    let msg = w
        .set_grad(Some(Tensor::zeros(&[3], DType::F64)))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("f64[3]") && msg.contains("f64[2]"), "{msg}");
    let not_leaf = &w * 2.0;
    assert!(not_leaf.set_grad(None).is_err());
    assert!(w.detach().set_grad(None).is_err());
}

#[test]
fn backward_through_an_op_without_gradient_names_it() {
    let x = Tensor::from_vec(vec![1.0f64, 3.0, 2.0], &[3]).set_requires_grad(true);
    let idx = x.argmax(0, false);
    let y = idx.cast(DType::F64) * 2.0;
    let err = y.try_backward(None).unwrap_err().to_string();
    assert!(
        err.contains("backward: f64[] does not require grad: it was computed through `argmax`"),
        "{err}"
    );
    let mask = x.gt(1.5).cast(DType::F64).sum(&[], false);
    let err = mask.try_backward(None).unwrap_err().to_string();
    assert!(err.contains("through `gt`"), "{err}");
    // Without inputs that require grad, the message says so instead.
    let plain = Tensor::from_vec(vec![1.0f64], &[1]).sum(&[], false);
    let err = plain.try_backward(None).unwrap_err().to_string();
    assert!(
        err.contains("no input of its computation requires grad"),
        "{err}"
    );
}

#[test]
fn slice_gradients_are_joined_overlapping_or_not() {
    let x = Tensor::from_vec(vec![0.0f64; 6], &[6]).set_requires_grad(true);
    let h = &x * 1.0; // a non-leaf, so the slices' pieces meet in the engine
                      // Disjoint pieces with a gap at 2..3: joined by one cat with zeros.
    let parts = h.split_sizes(&[2, 1, 3], 0);
    (parts[0].sum(&[], false) + parts[2].sum(&[], false) * 3.0).backward();
    assert_eq!(
        x.grad().unwrap().to_f64_vec(),
        vec![1.0, 1.0, 0.0, 3.0, 3.0, 3.0]
    );
    // Overlapping pieces are summed.
    let x = Tensor::from_vec(vec![0.0f64; 6], &[6]).set_requires_grad(true);
    let h = &x * 1.0;
    let y = h.slice(0, 0, 4, 1).sum(&[], false) + h.slice(0, 2, 6, 1).sum(&[], false) * 2.0;
    y.backward();
    assert_eq!(
        x.grad().unwrap().to_f64_vec(),
        vec![1.0, 1.0, 3.0, 3.0, 2.0, 2.0]
    );
}
