//! The eager Tensor API: views, errors that point at the user's line, and the
//! laws that must hold (property tests).

use proptest::prelude::*;
use tessera::tensor::Generator;
use tessera::{DType, ErrorKind, Tensor};

fn iota(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec((0..n).map(|i| i as f32).collect::<Vec<_>>(), shape)
}

#[test]
fn views_share_storage() {
    let x = iota(&[4, 6]);
    assert!(x.transpose(0, 1).shares_storage(&x));
    assert!(x.slice(1, 1, 5, 2).shares_storage(&x));
    assert!(x.unsqueeze(0).expand(&[3, 4, 6]).shares_storage(&x));
    assert!(x.reshape(&[2, 12]).shares_storage(&x));
    assert!(x.flatten(0, 1).shares_storage(&x));
    let parts = x.tensor_split(3, 1);
    assert!(parts.iter().all(|p| p.shares_storage(&x)));
    // Reshaping a transposed tensor must copy, and `view` refuses to.
    let t = x.t();
    assert!(!t.reshape(&[24]).shares_storage(&x));
    let err = t.try_view(&[24]).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Argument);
    assert!(err.message.contains("use reshape"), "{err}");
}

#[test]
fn errors_name_op_shapes_and_line() {
    let a = iota(&[2, 3]);
    let b = iota(&[4, 5]);
    let line = line!() + 1;
    let err = a.try_matmul(&b).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("matmul: inner dims differ: f32[2,3] and f32[4,5]"),
        "{text}"
    );
    let loc = err.location.expect("location");
    assert_eq!(loc.line, line);
    assert!(loc.file.ends_with("tensor_api.rs"), "{}", loc.file);

    let err = a.try_add(&b).unwrap_err();
    assert!(
        err.to_string()
            .contains("add: shapes f32[2,3], f32[4,5] cannot be broadcast"),
        "{err}"
    );
    let err = a.try_add(a.cast(DType::F64)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::DType);
    let err = a.try_transpose(0, 2).unwrap_err();
    assert!(
        err.to_string().contains("transpose: dim 2 is out of range"),
        "{err}"
    );
    let err = a.try_tensor_split(0, 0).unwrap_err();
    assert!(err.to_string().starts_with("tensor_split:"), "{err}");
    let err = a.try_reshape(&[4, -1]).unwrap_err();
    assert!(
        err.to_string()
            .contains("cannot reshape f32[2,3] (6 elements) to [4, -1]"),
        "{err}"
    );
    let err = Tensor::try_cat(&[&a, &b], 0).unwrap_err();
    assert!(
        err.to_string()
            .contains("cat: inputs must match in every dim but 0"),
        "{err}"
    );
}

#[test]
fn panicking_form_reports_the_callers_line() {
    let a = iota(&[2, 3]);
    let line = line!() + 1;
    let caught = std::panic::catch_unwind(|| a.matmul(&a));
    let payload = caught.unwrap_err();
    let msg = payload.downcast_ref::<String>().unwrap();
    assert!(msg.contains(&format!("tensor_api.rs:{line}:")), "{msg}");
}

#[test]
fn scalars_and_operators() {
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]);
    let y = (&x * 2.0 + 1.0) / 2.0 - &x;
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![0.5, 0.5, 0.5]);
    assert_eq!((2.0 - &x).to_vec::<f32>().unwrap(), vec![1.0, 0.0, -1.0]);
    assert_eq!((-&x).to_vec::<f32>().unwrap(), vec![-1.0, -2.0, -3.0]);
    assert_eq!(x.sum(&[], false).item(), 6.0);
}

#[test]
fn random_is_seeded() {
    let a = Tensor::randn(&[1000], DType::F32, &mut Generator::new(7));
    let b = Tensor::randn(&[1000], DType::F32, &mut Generator::new(7));
    let c = Tensor::randn(&[1000], DType::F32, &mut Generator::new(8));
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_ne!(a.to_vec::<f32>().unwrap(), c.to_vec::<f32>().unwrap());
    let u = Tensor::rand(&[1000], DType::F64, &mut Generator::new(1)).to_f64_vec();
    assert!(u.iter().all(|v| (0.0..1.0).contains(v)));
}

#[test]
fn chunk_and_split_follow_torch() {
    let x = iota(&[7]);
    let sizes = |v: Vec<Tensor>| v.iter().map(|t| t.shape()[0]).collect::<Vec<_>>();
    assert_eq!(sizes(x.tensor_split(3, 0)), vec![3, 2, 2]);
    assert_eq!(sizes(x.chunk(3, 0)), vec![3, 3, 1]);
    assert_eq!(sizes(x.split(2, 0)), vec![2, 2, 2, 1]);
    assert_eq!(sizes(x.split_sizes(&[1, 6], 0)), vec![1, 6]);
    assert!(x.try_split_sizes(&[1, 2], 0).is_err());
}

fn shape_strategy() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..5, 1..5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn split_then_cat_is_identity(shape in shape_strategy(), parts in 1usize..6, dim_seed in 0usize..8) {
        let x = iota(&shape);
        let dim = (dim_seed % shape.len()) as isize;
        let pieces = x.tensor_split(parts, dim);
        let refs: Vec<&Tensor> = pieces.iter().collect();
        let y = Tensor::cat(&refs, dim);
        prop_assert_eq!(y.shape(), x.shape());
        prop_assert_eq!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
    }

    #[test]
    fn permute_round_trip(shape in shape_strategy(), seed in any::<u64>()) {
        let x = iota(&shape);
        let mut perm: Vec<usize> = (0..shape.len()).collect();
        // A seeded shuffle (Fisher–Yates with a simple LCG).
        let mut s = seed;
        for i in (1..perm.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            perm.swap(i, (s >> 33) as usize % (i + 1));
        }
        let mut inverse = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() { inverse[p] = i; }
        let p: Vec<isize> = perm.iter().map(|&d| d as isize).collect();
        let inv: Vec<isize> = inverse.iter().map(|&d| d as isize).collect();
        let y = x.permute(&p).contiguous().permute(&inv);
        prop_assert_eq!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
    }

    #[test]
    fn reshape_round_trip(shape in shape_strategy()) {
        let x = iota(&shape);
        let n = x.numel() as isize;
        let back: Vec<isize> = shape.iter().map(|&d| d as isize).collect();
        let y = x.reshape(&[n]).reshape(&back);
        prop_assert_eq!(y.shape(), x.shape());
        prop_assert_eq!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
        // Through a transpose (non-contiguous, so reshape copies) values survive too.
        let t = x.t().contiguous().t();
        prop_assert_eq!(t.reshape(&[n]).to_vec::<f32>().unwrap(), x.reshape(&[n]).to_vec::<f32>().unwrap());
    }

    #[test]
    fn broadcasting_matches_the_rule(a in shape_strategy(), b in shape_strategy()) {
        // Make some dims 1 so broadcasting has work to do.
        let b: Vec<usize> = b.iter().enumerate().map(|(i, &d)| if i % 2 == 0 { 1 } else { d }).collect();
        let (x, y) = (iota(&a), iota(&b));
        let rank = a.len().max(b.len());
        let dim = |s: &[usize], i: usize| (i + s.len()).checked_sub(rank).map(|j| s[j]).unwrap_or(1);
        let compatible = (0..rank).all(|i| dim(&a, i) == dim(&b, i) || dim(&a, i) == 1 || dim(&b, i) == 1);
        match x.try_add(&y) {
            Ok(z) => {
                prop_assert!(compatible);
                let want: Vec<usize> = (0..rank).map(|i| dim(&a, i).max(dim(&b, i))).collect();
                prop_assert_eq!(z.shape(), want.as_slice());
                // Adding zeros broadcast from y keeps x's values, expanded.
                let zero = y.mul(0.0);
                let xz = x.add(&zero);
                let xe = x.broadcast_to(&want).contiguous();
                prop_assert_eq!(xz.to_vec::<f32>().unwrap(), xe.to_vec::<f32>().unwrap());
            }
            Err(e) => {
                prop_assert!(!compatible);
                prop_assert_eq!(e.kind, ErrorKind::Shape);
            }
        }
    }
}
