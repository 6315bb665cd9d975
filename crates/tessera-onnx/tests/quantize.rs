//! QuantizeLinear → DequantizeLinear, per tensor and per axis, to uint8,
//! int8, uint16 and int16, against an f64 reference of the ONNX formula
//! (round half to even, saturation), interpreted and compiled.

use tessera::compile::{compile_graph, CompileOptions};
use tessera::tensor::interpret::run_graph;
use tessera::{DType, Tensor};
use tessera_onnx::build::{attr_int, f32_tensor, model, node, value, D};
use tessera_onnx::proto::data_type as dt;
use tessera_onnx::proto::TensorProto;
use tessera_onnx::{import, ImportOptions, Model};

/// A zero-point initializer of ONNX type `elem` in the typed field
/// (int32_data holds the 8- and 16-bit types).
fn zero_points(name: &str, elem: i32, dims: &[i64], v: &[i64]) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: elem,
        int32_data: v.iter().map(|&x| x as i32).collect(),
        ..TensorProto::default()
    }
}

/// The reference: q = clamp(rint(x / s) + zp), then (q − zp) · s, in f64
/// but for the f32 division and product the formula's types make.
fn reference(x: f32, s: f32, zp: i64, lo: i64, hi: i64) -> (i64, f32) {
    let d = (x / s) as f64;
    let r = d.round_ties_even() as i64;
    let q = (r + zp).clamp(lo, hi);
    (q, ((q - zp) as f32) * s)
}

#[test]
fn quantize_round_trip_matches_the_f64_reference() {
    // Ties (0.5, 1.5, 2.5 …), negatives, values that saturate, per axis
    // along dim 1 of [2, 3, 4].
    let xs: Vec<f32> = (0..24).map(|i| (i as f32 - 11.0) * 0.75 + 0.25).collect();
    let scales = [0.5f32, 1.5, 0.125];
    for (elem, dtype, zps) in [
        (dt::UINT8, DType::U8, [128i64, 3, 250]),
        (dt::INT8, DType::I8, [0, -100, 5]),
        (dt::UINT16, DType::U16, [0, 65530, 7]),
        (dt::INT16, DType::I16, [-32760, 0, 9]),
    ] {
        let (lo, hi) = dtype.int_range().unwrap();
        let (lo, hi) = (lo as i64, hi as i64);
        for per_axis in [false, true] {
            let n = if per_axis { 3 } else { 1 };
            let bytes = model(
                21,
                vec![
                    node(
                        "QuantizeLinear",
                        &["x", "s", "z"],
                        &["q"],
                        vec![attr_int("axis", 1)],
                    ),
                    node(
                        "DequantizeLinear",
                        &["q", "s", "z"],
                        &["y"],
                        vec![attr_int("axis", 1)],
                    ),
                ],
                vec![value("x", dt::FLOAT, &[D::Size(2), D::Size(3), D::Size(4)])],
                vec![
                    value("q", elem, &[D::Size(2), D::Size(3), D::Size(4)]),
                    value("y", dt::FLOAT, &[D::Size(2), D::Size(3), D::Size(4)]),
                ],
                vec![
                    f32_tensor("s", &[n as i64], &scales[..n]),
                    zero_points("z", elem, &[n as i64], &zps[..n]),
                ],
            );
            let m = Model::from_bytes(&bytes, "q.onnx").unwrap();
            let g = import(&m, &ImportOptions::default()).unwrap().graph;
            let x = Tensor::from_vec(xs.clone(), &[2, 3, 4]);
            let interpreted = run_graph(&g, std::slice::from_ref(&x)).unwrap();
            let exe = compile_graph(g.clone(), CompileOptions::default()).unwrap();
            let compiled = exe.try_call(std::slice::from_ref(&x)).unwrap();
            let interpreted: Vec<Tensor> = interpreted.into_iter().map(|(_, t)| t).collect();
            for out in [&interpreted, &compiled] {
                let (q, y) = (&out[0], &out[1]);
                assert_eq!(q.dtype(), dtype);
                let q = q.cast(DType::I64).to_vec::<i64>().unwrap();
                let y = y.to_vec::<f32>().unwrap();
                for (i, &xv) in xs.iter().enumerate() {
                    let c = if per_axis { (i / 4) % 3 } else { 0 };
                    let (wq, wy) = reference(xv, scales[c], zps[c], lo, hi);
                    assert_eq!(q[i], wq, "{dtype} per_axis={per_axis} x={xv}");
                    assert_eq!(y[i], wy, "{dtype} per_axis={per_axis} x={xv}");
                }
            }
        }
    }
}
