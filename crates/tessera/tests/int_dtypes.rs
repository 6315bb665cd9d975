//! The narrow and unsigned integer dtypes (i16, i8, u8, u16, u32, u64)
//! through the Tensor API: casts that saturate (from floats) or wrap
//! (between integers), wrapping arithmetic, bitwise ops and shifts,
//! reductions, index and view ops, each against hand-computed values, and
//! the same graph compiled against eager.

use tessera::{compile, DType, Tensor, U8};

fn u8s(v: &[u8], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.iter().map(|&b| U8(b)).collect(), shape)
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.to_vec::<U8>().unwrap().into_iter().map(|b| b.0).collect()
}

#[test]
fn floats_to_integers_truncate_and_saturate() {
    let x = Tensor::from_vec(
        vec![-1.5f32, 0.5, 2.9, 255.9, 300.0, f32::NAN, -200.0],
        &[7],
    );
    assert_eq!(bytes(&x.cast(DType::U8)), [0, 0, 2, 255, 255, 0, 0]);
    assert_eq!(
        x.cast(DType::I8).to_vec::<i8>().unwrap(),
        [-1, 0, 2, 127, 127, 0, -128]
    );
    assert_eq!(
        x.cast(DType::U16).to_vec::<u16>().unwrap(),
        [0, 0, 2, 255, 300, 0, 0]
    );
    let big = Tensor::from_vec(vec![1e30f64, -1e30], &[2]);
    assert_eq!(big.cast(DType::U64).to_vec::<u64>().unwrap(), [u64::MAX, 0]);
    assert_eq!(
        big.cast(DType::I16).to_vec::<i16>().unwrap(),
        [i16::MAX, i16::MIN]
    );
}

#[test]
fn integers_to_integers_wrap() {
    let x = Tensor::from_vec(vec![-1i64, 256, 257, 1000, 128, -129], &[6]);
    assert_eq!(bytes(&x.cast(DType::U8)), [255, 0, 1, 232, 128, 127]);
    assert_eq!(
        x.cast(DType::I8).to_vec::<i8>().unwrap(),
        [-1, 0, 1, -24, -128, 127]
    );
    assert_eq!(
        x.cast(DType::U32).to_vec::<u32>().unwrap(),
        [u32::MAX, 256, 257, 1000, 128, u32::MAX - 128]
    );
    assert_eq!(
        u8s(&[200, 1], &[2]).cast(DType::I8).to_vec::<i8>().unwrap(),
        [-56, 1]
    );
    // u64 values past i64's range survive the way through floats and back.
    let u = Tensor::from_vec(vec![u64::MAX, 1 << 63], &[2]);
    assert_eq!(
        u.cast(DType::F64).to_vec::<f64>().unwrap(),
        [18446744073709551615.0, 9223372036854775808.0]
    );
    assert_eq!(u.cast(DType::I64).to_vec::<i64>().unwrap(), [-1, i64::MIN]);
    assert_eq!(
        bytes(&u8s(&[0, 3], &[2]).cast(DType::Bool).cast(DType::U8)),
        [0, 1]
    );
}

#[test]
fn arithmetic_wraps_and_division_by_zero_is_an_error() {
    let a = u8s(&[250, 3, 7, 255], &[4]);
    let b = u8s(&[10, 5, 2, 255], &[4]);
    assert_eq!(bytes(&(&a + &b)), [4, 8, 9, 254]);
    assert_eq!(bytes(&(&a - &b)), [240, 254, 5, 0]);
    assert_eq!(bytes(&(&a * &b)), [196, 15, 14, 1]);
    assert_eq!(bytes(&(&a / &b)), [25, 0, 3, 1]);
    assert_eq!(bytes(&a.maximum(&b)), [250, 5, 7, 255]);
    assert_eq!(bytes(&a.neg()), [6, 253, 249, 1]);
    let i = Tensor::from_vec(vec![127i8, -128, -128], &[3]);
    let j = Tensor::from_vec(vec![1i8, -1, 2], &[3]);
    assert_eq!((&i + &j).to_vec::<i8>().unwrap(), [-128, 127, -126]);
    assert_eq!((&i / &j).to_vec::<i8>().unwrap(), [127, -128, -64]);
    assert_eq!(i.abs().to_vec::<i8>().unwrap(), [127, -128, -128]);
    let zero = u8s(&[1, 0, 1, 1], &[4]);
    let e = a.try_div(&zero).unwrap_err().to_string();
    assert!(e.contains("integer division by zero"), "{e}");
    // Order is unsigned: u64::MAX is the largest, not -1.
    let u = Tensor::from_vec(vec![u64::MAX, 1], &[2]);
    let v = Tensor::from_vec(vec![2u64, 2], &[2]);
    assert_eq!(u.gt(&v).to_vec::<u8>().unwrap(), [1, 0]);
    assert_eq!((&u / &v).to_vec::<u64>().unwrap(), [u64::MAX / 2, 0]);
    assert_eq!(u.max(&[0], false).to_vec::<u64>().unwrap(), [u64::MAX]);
    assert_eq!(u.min(&[0], false).to_vec::<u64>().unwrap(), [1]);
}

#[test]
fn bitwise_ops_and_shifts() {
    let a = u8s(&[0b1100_1010, 0xff, 1], &[3]);
    let b = u8s(&[0b1010_0110, 0x0f, 3], &[3]);
    assert_eq!(bytes(&a.bitwise_and(&b)), [0b1000_0010, 0x0f, 1]);
    assert_eq!(bytes(&a.bitwise_or(&b)), [0b1110_1110, 0xff, 3]);
    assert_eq!(bytes(&a.bitwise_xor(&b)), [0b0110_1100, 0xf0, 2]);
    assert_eq!(bytes(&a.bitwise_not()), [0b0011_0101, 0, 0xfe]);
    // Shifts by the width or more give 0 (numpy's rule), right shifts of
    // unsigned values are logical, of signed ones arithmetic.
    let s = u8s(&[7, 8, 9], &[3]);
    assert_eq!(bytes(&u8s(&[1, 1, 0xff], &[3]).shift_left(&s)), [128, 0, 0]);
    assert_eq!(
        bytes(&u8s(&[0x80, 0xff, 0xff], &[3]).shift_right(&s)),
        [1, 0, 0]
    );
    let i = Tensor::from_vec(vec![-128i8, -128, 64, -1], &[4]);
    let n = Tensor::from_vec(vec![7i8, 9, -1, 1], &[4]);
    assert_eq!(i.shift_right(&n).to_vec::<i8>().unwrap(), [-1, -1, 0, -1]);
    assert_eq!(i.shift_left(&n).to_vec::<i8>().unwrap(), [0, 0, 0, -2]);
    let w = Tensor::from_vec(vec![0x8000u16, 1], &[2]);
    let k = Tensor::from_vec(vec![15u16, 16], &[2]);
    assert_eq!(w.shift_right(&k).to_vec::<u16>().unwrap(), [1, 0]);
    assert_eq!(
        w.bitcast(DType::I16).to_vec::<i16>().unwrap(),
        [i16::MIN, 1]
    );
    let f = Tensor::from_vec(vec![1.0f32, -2.0], &[2]);
    assert_eq!(
        f.bitcast(DType::U32).to_vec::<u32>().unwrap(),
        [0x3f80_0000, 0xc000_0000]
    );
    let e = f.try_bitwise_and(&f).unwrap_err().to_string();
    assert!(e.contains("bitwise_and: is not defined for f32"), "{e}");
    let e = f.try_bitcast(DType::I64).unwrap_err().to_string();
    assert!(e.contains("bitcast"), "{e}");
}

#[test]
fn reductions_index_and_view_ops() {
    let x = u8s(&[200, 100, 7, 9, 250, 3], &[2, 3]);
    assert_eq!(bytes(&x.sum(&[1], false)), [51, 6]);
    assert_eq!(bytes(&x.max(&[0], false)), [200, 250, 7]);
    assert_eq!(
        bytes(&x.prod(&[0], false)),
        [(200u32 * 9 % 256) as u8, 168, 21]
    );
    assert_eq!(x.argmax(1, false).to_vec::<i64>().unwrap(), [0, 1]);
    let idx = Tensor::from_vec(vec![2i64, 0], &[2]);
    assert_eq!(bytes(&x.index_select(1, &idx)), [7, 200, 3, 9]);
    assert_eq!(bytes(&x.t().contiguous()), [200, 9, 100, 250, 7, 3]);
    assert_eq!(
        bytes(&Tensor::cat(&[&x, &x], 0).slice(0, 1, 3, 1)),
        [9, 250, 3, 200, 100, 7]
    );
    let c = Tensor::from_vec(vec![1u8, 0, 1], &[3]);
    let y = Tensor::try_where(&c, &x, &u8s(&[0], &[1])).unwrap();
    assert_eq!(bytes(&y), [200, 0, 7, 9, 0, 3]);
    let m = Tensor::from_vec(vec![1i16, 2, 3, 4], &[2, 2]);
    assert_eq!(m.matmul(&m).to_vec::<i16>().unwrap(), [7, 10, 15, 22]);
    let big = Tensor::from_vec(vec![200i16; 4], &[2, 2]);
    // 2 · 200² = 80000 wraps to 14464 in i16.
    assert_eq!(big.matmul(&big).to_vec::<i16>().unwrap(), [14464; 4]);
}

#[test]
fn compiled_integer_graphs_match_eager() {
    let f = |x: &[Tensor]| {
        let a = &x[0];
        let b = &x[1];
        let s = (a + b).bitwise_xor(a.shift_left(b.bitwise_and(u8s(&[7], &[]))));
        vec![
            s.clone(),
            s.cast(DType::I16).sum(&[1], false),
            a.maximum(b).cast(DType::F32).atan(),
        ]
    };
    let a = u8s(
        &(0..24).map(|i| (i * 37 % 256) as u8).collect::<Vec<_>>(),
        &[4, 6],
    );
    let b = u8s(
        &(0..24).map(|i| (i * 101 % 256) as u8).collect::<Vec<_>>(),
        &[4, 6],
    );
    let inputs = [a, b];
    let eager = f(&inputs);
    let compiled = compile(f).call(&inputs);
    assert_eq!(bytes(&compiled[0]), bytes(&eager[0]));
    assert_eq!(
        compiled[1].to_vec::<i16>().unwrap(),
        eager[1].to_vec::<i16>().unwrap()
    );
    assert_eq!(
        compiled[2].to_vec::<f32>().unwrap(),
        eager[2].to_vec::<f32>().unwrap()
    );
}

#[test]
fn inverse_trigonometric_functions_and_their_gradients() {
    let v = [-0.9f64, -0.3, 0.0, 0.5, 0.99];
    let x = Tensor::from_vec(v.to_vec(), &[5]);
    let close = |t: &Tensor, want: &dyn Fn(f64) -> f64| {
        for (g, &xv) in t.to_vec::<f64>().unwrap().iter().zip(&v) {
            assert!((g - want(xv)).abs() < 1e-12, "{g} vs {}", want(xv));
        }
    };
    close(&x.atan(), &f64::atan);
    close(&x.asin(), &f64::asin);
    close(&x.acos(), &f64::acos);
    for (op, d) in [
        ("atan", (|x: f64| 1.0 / (1.0 + x * x)) as fn(f64) -> f64),
        ("asin", |x: f64| 1.0 / (1.0 - x * x).sqrt()),
        ("acos", |x: f64| -1.0 / (1.0 - x * x).sqrt()),
    ] {
        let p = Tensor::from_vec(v.to_vec(), &[5]).set_requires_grad(true);
        let y = match op {
            "atan" => p.atan(),
            "asin" => p.asin(),
            _ => p.acos(),
        };
        y.sum(&[], false).backward();
        close(&p.grad().unwrap(), &d);
    }
}
