//! `aot_autograd` against eager autograd: for each function, the forward
//! graph (run with `run_graph`) must give eager's outputs, and the backward
//! graph (fed the saved values and random tangents) eager's gradients, under
//! `Partition::SaveAll` and `Partition::MinCut` at several budgets. The
//! saved bytes must shrink (weakly) with the budget and, at 1.0, equal
//! SaveAll's; the printed graphs must point each op at the user's line, the
//! backward ops at the line of the forward op they differentiate.

mod common;

use std::collections::HashSet;

use common::{fixtures, max_error, model, sdpa_sliced};
use tessera::autograd::{aot_autograd, grad, AotGraphs, Partition};
use tessera::ir::{Graph, Op};
use tessera::tensor::interpret::run_graph;
use tessera::tensor::trace::trace;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// The forward and backward graphs run the same kernels as eager mode, on
/// the same values, in an order that can differ only in where a value is
/// recomputed: the results agree to rounding. 1e-12 (absolute + relative).
const TOL: f64 = 1e-12;

const BUDGETS: [f64; 5] = [1.0, 0.75, 0.5, 0.25, 0.0];

type Fun = Box<dyn Fn(&[Tensor]) -> Vec<Tensor>>;

struct Case {
    name: String,
    inputs: Vec<(String, Tensor)>,
    /// Positions of the inputs differentiated.
    wrt: Vec<usize>,
    f: Fun,
}

fn case(
    name: &str,
    inputs: Vec<(&str, Tensor)>,
    wrt: &[usize],
    f: impl Fn(&[Tensor]) -> Vec<Tensor> + 'static,
) -> Case {
    Case {
        name: name.to_string(),
        inputs: inputs
            .into_iter()
            .map(|(n, t)| (n.to_string(), t))
            .collect(),
        wrt: wrt.to_vec(),
        f: Box::new(f),
    }
}

fn randn(shape: &[usize], g: &mut Generator) -> Tensor {
    Tensor::randn(shape, DType::F64, g)
}

/// The fixture functions of grads.json, then a few more.
fn cases() -> Vec<Case> {
    let mut cases: Vec<Case> = fixtures()
        .into_iter()
        .map(|fx| {
            let f = model(&fx.name);
            Case {
                name: fx.name.clone(),
                inputs: fx.inputs.clone(),
                wrt: fx.wrt.clone(),
                f: Box::new(move |a| vec![f(a)]),
            }
        })
        .collect();
    let mut g = Generator::new(7);
    let qkv = |g: &mut Generator| {
        vec![
            ("q", randn(&[2, 2, 5, 4], g)),
            ("k", randn(&[2, 2, 5, 4], g)),
            ("v", randn(&[2, 2, 5, 3], g)),
        ]
    };
    cases.push(case("sdpa_sliced", qkv(&mut g), &[0, 1, 2], |a| {
        vec![sdpa_sliced(&a[0], &a[1], &a[2], false)]
    }));
    cases.push(case("sdpa_sliced_causal", qkv(&mut g), &[0, 1, 2], |a| {
        vec![sdpa_sliced(&a[0], &a[1], &a[2], true)]
    }));
    cases.push(case("sdpa_sliced_hinted", qkv(&mut g), &[0, 1, 2], |a| {
        vec![hinted_sdpa(a, tessera_apps::seed_table::SEED_HINT)]
    }));
    cases.push(case(
        "sdpa_sliced_hinted_no_recompute",
        qkv(&mut g),
        &[0, 1, 2],
        |a| vec![hinted_sdpa(a, NO_RECOMPUTE)],
    ));
    cases.push(case(
        "broadcasting",
        vec![
            ("x", randn(&[3, 5], &mut g)),
            ("b", randn(&[5], &mut g)),
            ("s", randn(&[3, 1], &mut g)),
        ],
        &[0, 1, 2],
        |a| {
            let h = ((&a[0] + &a[1]) * &a[2]).tanh();
            vec![&h * &h.sigmoid() + a[1].exp() - &a[2] / (a[0].pow(2.0) + 1.0)]
        },
    ));
    cases.push(case(
        "reductions",
        vec![("x", randn(&[3, 4, 5], &mut g))],
        &[0],
        |a| {
            let x = &a[0];
            let r =
                x.max(&[1], true) - x.sum(&[0, 2], true) + x.prod(&[2], true) * x.min(&[-1], true);
            vec![r.mean(&[0], false) + x.mean(&[], false)]
        },
    ));
    cases.push(case(
        "softmax along a middle dim",
        vec![
            ("x", randn(&[4, 3, 5], &mut g)),
            ("w", randn(&[3, 1], &mut g)),
        ],
        &[0, 1],
        |a| vec![a[0].softmax(1) * &a[1] + a[0].log_softmax(-1).exp().log_softmax(0)],
    ));
    cases.push(case(
        "slices and cat",
        vec![("x", randn(&[4, 9], &mut g))],
        &[0],
        |a| {
            let x = &a[0];
            let (even, odd) = (x.slice(1, 0, 9, 2), x.slice(1, 1, 9, 2));
            let parts = x.tensor_split(2, 0);
            let last = (&parts[1] * 2.0).narrow(1, 2, 3);
            vec![Tensor::cat(
                &[
                    &even.exp(),
                    &odd.sin(),
                    &Tensor::cat(&[&last, &parts[0].narrow(1, 5, 3)], 0),
                ],
                1,
            )
            .tril(1)]
        },
    ));
    cases.push(case(
        "indexing",
        vec![
            ("table", randn(&[6, 4], &mut g)),
            ("base", randn(&[5, 4], &mut g)),
        ],
        &[0, 1],
        |a| {
            let ids = Tensor::from_vec(vec![1i64, 5, 1, 0], &[4]);
            let e = a[0].embedding(&ids.reshape(&[2, 2])).reshape(&[4, 4]);
            let added = a[1].index_add(0, &Tensor::from_vec(vec![0i64, 3, 3, 4], &[4]), &e.relu());
            let idx = Tensor::from_vec(vec![0i64, 3, 3, 1, 2, 2, 0, 0, 1, 3], &[5, 2]);
            vec![added.gather(1, &idx) * 3.0]
        },
    ));
    cases.push(case(
        "two outputs, one integer, one unused input",
        vec![
            ("x", randn(&[3, 4], &mut g)),
            ("w", randn(&[4, 2], &mut g)),
            ("unused", randn(&[2], &mut g)),
        ],
        &[0, 1, 2],
        |a| {
            let y = a[0].matmul(&a[1]).gelu_tanh();
            vec![
                y.clone(),
                y.argmax(-1, false),
                (&a[0] * &a[0]).sum(&[1], false),
            ]
        },
    ));
    cases.push(case(
        "an output that is an input, and one output twice",
        vec![("x", randn(&[3, 2], &mut g))],
        &[0],
        |a| {
            let y = a[0].cos();
            vec![a[0].clone(), y.clone(), y.t(), y]
        },
    ));
    cases.push(case(
        "a tensor used by many ops",
        vec![("x", randn(&[5, 3], &mut g))],
        &[0],
        |a| {
            let x = &a[0];
            let h = x.silu();
            vec![(&h * &h + h.t().matmul(&h).sum(&[], false) - h.abs().sqrt()).sum(&[0], false)]
        },
    ));
    cases
}

/// The seed's hint with the checkpointing it implies turned off.
const NO_RECOMPUTE: &str =
    r#"{"order": "strict", "group_id": 0, "backward_group_id": 1, "recompute": false}"#;

/// The seed's sliced attention (one slice per batch×head) under `hint`.
fn hinted_sdpa(a: &[Tensor], hint: &str) -> Tensor {
    tessera::hints::scope(hint, || sdpa_sliced(&a[0], &a[1], &a[2], false)).unwrap()
}

/// The traced graph; its inputs are the case's, then the host tensors the
/// function closed over (returned).
fn traced(case: &Case) -> (Graph, Vec<Tensor>) {
    let types: Vec<(String, tessera::ir::TensorType)> = case
        .inputs
        .iter()
        .map(|(n, t)| (n.clone(), t.ty()))
        .collect();
    let t = trace(&case.name.replace(' ', "_"), &types, |a| {
        Ok((case.f)(a)
            .into_iter()
            .enumerate()
            .map(|(i, t)| (format!("out{i}"), t))
            .collect())
    })
    .unwrap();
    (t.graph, t.lifted)
}

/// Random tangents, one per float output.
fn tangents(outputs: &[Tensor], g: &mut Generator) -> Vec<Tensor> {
    outputs
        .iter()
        .filter(|o| o.dtype().is_float())
        .map(|o| randn(o.shape(), g))
        .collect()
}

/// Eager: the outputs and the gradients (zeros where an input is unused).
fn eager(case: &Case, tangents: &[Tensor]) -> (Vec<Tensor>, Vec<Tensor>) {
    let inputs: Vec<Tensor> = case
        .inputs
        .iter()
        .enumerate()
        .map(|(i, (_, t))| {
            if case.wrt.contains(&i) {
                t.set_requires_grad(true)
            } else {
                t.clone()
            }
        })
        .collect();
    let outputs = (case.f)(&inputs);
    let float: Vec<Tensor> = outputs
        .iter()
        .filter(|o| o.dtype().is_float())
        .cloned()
        .collect();
    let wrt: Vec<Tensor> = case.wrt.iter().map(|&i| inputs[i].clone()).collect();
    let grads = grad(&float, tangents, &wrt).unwrap();
    let grads = grads
        .into_iter()
        .zip(&wrt)
        .map(|(g, x)| g.unwrap_or_else(|| Tensor::zeros(x.shape(), x.dtype())))
        .collect();
    (outputs, grads)
}

/// AOT: the forward graph, then the backward graph on its saved values.
fn run_aot(
    case: &Case,
    lifted: &[Tensor],
    aot: &AotGraphs,
    tangents: &[Tensor],
) -> (Vec<Tensor>, Vec<Tensor>) {
    let mut fwd_in: Vec<Tensor> = case.inputs.iter().map(|(_, t)| t.clone()).collect();
    fwd_in.extend(lifted.iter().cloned());
    fwd_in.extend(aot.lifted.iter().cloned());
    let fwd: Vec<Tensor> = run_graph(&aot.forward, &fwd_in)
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let (outputs, saved) = fwd.split_at(aot.num_outputs);
    let mut bwd_in = saved.to_vec();
    bwd_in.extend(tangents.iter().cloned());
    let grads = run_graph(&aot.backward, &bwd_in)
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    (outputs.to_vec(), grads)
}

/// The bytes of the forward's saved outputs that are not its inputs,
/// counted from the graph itself.
fn saved_bytes_of(aot: &AotGraphs) -> usize {
    aot.forward.outputs[aot.num_outputs..]
        .iter()
        .map(|o| aot.forward.node(o.node))
        .filter(|n| !matches!(n.op, Op::Input))
        .map(|n| {
            n.ty.shape.as_concrete().unwrap().iter().product::<usize>() * n.ty.dtype.size_bytes()
        })
        .sum()
}

/// The forward's saved outputs that are computed from no input at all
/// (constants such as the zeros or counts the VJP rules create): the
/// backward can make those itself, so saving them wastes memory.
fn saved_constants(aot: &AotGraphs) -> Vec<String> {
    let g = &aot.forward;
    let mut from_input = vec![false; g.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        from_input[i] = matches!(n.op, Op::Input) || n.inputs.iter().any(|x| from_input[x.index()]);
    }
    aot.forward.outputs[aot.num_outputs..]
        .iter()
        .filter(|o| !from_input[o.node.index()])
        .map(|o| {
            format!(
                "{} = {} : {}",
                o.name,
                g.node(o.node).op.name(),
                g.node(o.node).ty
            )
        })
        .collect()
}

fn partitions() -> Vec<Partition> {
    let mut p = vec![Partition::SaveAll];
    p.extend(BUDGETS.iter().map(|&b| Partition::MinCut {
        activation_memory_budget: b,
    }));
    p
}

#[test]
fn aot_matches_eager_under_every_partition() {
    let mut rng = Generator::new(11);
    let mut errors = Vec::new();
    for case in cases() {
        let (graph, lifted) = traced(&case);
        let mut saved = Vec::new();
        for partition in partitions() {
            let what = format!("{} {partition:?}", case.name);
            let aot = aot_autograd(&graph, &case.wrt, partition)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(aot.num_outputs, graph.outputs.len());
            assert_eq!(
                aot.backward.outputs.len(),
                case.wrt.len(),
                "{what}: one gradient per wrt input"
            );
            assert_eq!(
                saved_bytes_of(&aot),
                aot.saved_bytes,
                "{what}: saved_bytes vs the forward's saved outputs"
            );
            saved.push(aot.saved_bytes);
            let unread: Vec<String> = aot
                .backward
                .inputs
                .iter()
                .filter(|&&id| {
                    !aot.backward.nodes.iter().any(|n| n.inputs.contains(&id))
                        && !aot.backward.outputs.iter().any(|o| o.node == id)
                })
                .map(|&id| aot.backward.display_name(id))
                .collect();
            // Tangents of outputs that no wrt input depends on may go unread.
            let unread_saved: Vec<&String> =
                unread.iter().filter(|n| n.starts_with("saved")).collect();
            assert!(
                unread_saved.is_empty(),
                "{what}: the backward takes {unread_saved:?} but never reads them\n{}",
                aot.backward
            );
            let constants = saved_constants(&aot);
            assert!(
                constants.is_empty(),
                "{what}: saves constants {constants:?}\n{}",
                aot.forward
            );

            // Fresh tangents per partition: eager is recomputed with them.
            let probe = (case.f)(
                &case
                    .inputs
                    .iter()
                    .map(|(_, t)| t.clone())
                    .collect::<Vec<_>>(),
            );
            let tangents = tangents(&probe, &mut rng);
            let (want_out, want_grads) = eager(&case, &tangents);
            let (got_out, got_grads) = run_aot(&case, &lifted, &aot, &tangents);
            for (i, (got, want)) in got_out.iter().zip(&want_out).enumerate() {
                let e = max_error(got, want);
                if e > TOL || got.dtype() != want.dtype() {
                    errors.push(format!(
                        "{what}: output {i} off by {e:e} ({:?} vs {:?})",
                        got.ty(),
                        want.ty()
                    ));
                }
            }
            for (k, (got, want)) in got_grads.iter().zip(&want_grads).enumerate() {
                let e = max_error(got, want);
                if e > TOL {
                    errors.push(format!(
                        "{what}: gradient of {} off by {e:e}",
                        case.inputs[case.wrt[k]].0
                    ));
                }
            }
        }
        // saved[0] is SaveAll, then the budgets from 1.0 down to 0.0.
        assert_eq!(
            saved[1], saved[0],
            "{}: MinCut at 1.0 must save what SaveAll saves: {saved:?}",
            case.name
        );
        assert!(
            saved[1..].windows(2).all(|w| w[1] <= w[0]),
            "{}: saved bytes grow as the budget falls: {saved:?}",
            case.name
        );
        eprintln!(
            "{:<45} saved bytes: SaveAll {} / MinCut 1.0→0.0 {:?}",
            case.name,
            saved[0],
            &saved[1..]
        );
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Min-cut must trade memory for recomputation where the graph allows it:
/// in the MLP the gelu input and output are cheap to recompute from the
/// matmul result, in layer norm everything but the inputs is pointwise or a
/// reduction.
#[test]
fn min_cut_saves_less_than_save_all() {
    for case in cases()
        .into_iter()
        .filter(|c| ["mlp", "layer_norm", "broadcasting"].contains(&c.name.as_str()))
    {
        let (graph, _) = traced(&case);
        let all = aot_autograd(&graph, &case.wrt, Partition::SaveAll)
            .unwrap()
            .saved_bytes;
        let least = aot_autograd(
            &graph,
            &case.wrt,
            Partition::MinCut {
                activation_memory_budget: 0.0,
            },
        )
        .unwrap()
        .saved_bytes;
        assert!(
            least < all,
            "{}: MinCut(0.0) saves {least} bytes, SaveAll {all}",
            case.name
        );
    }
}

/// Every op of the forward and backward graphs carries the line of the user
/// code it comes from: forward ops their own, backward ops the line of the
/// forward op they differentiate. The printed graphs show them as comments.
#[test]
fn printed_graphs_point_at_the_user_code() {
    for case in cases() {
        let (graph, _) = traced(&case);
        let forward_lines: HashSet<(String, u32)> = graph
            .nodes
            .iter()
            .filter_map(|n| n.meta.location.as_ref())
            .map(|l| (l.file.to_string(), l.line))
            .collect();
        for partition in [
            Partition::SaveAll,
            Partition::MinCut {
                activation_memory_budget: 0.0,
            },
        ] {
            let aot = aot_autograd(&graph, &case.wrt, partition).unwrap();
            for (part, g) in [("forward", &aot.forward), ("backward", &aot.backward)] {
                let text = g.to_string();
                // The zeros returned for an input the outputs do not use come
                // from no user code: they alone have no location.
                let unused_zeros: HashSet<usize> = g
                    .outputs
                    .iter()
                    .filter(|o| {
                        matches!(g.node(o.node).op, Op::Full { .. })
                            && g.node(o.node).inputs.is_empty()
                    })
                    .map(|o| o.node.index())
                    .collect();
                for (i, node) in g
                    .nodes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| !matches!(n.op, Op::Input))
                {
                    let what = format!(
                        "{} {partition:?} {part}: {} node",
                        case.name,
                        node.op.name()
                    );
                    if unused_zeros.contains(&i) && node.meta.location.is_none() {
                        continue;
                    }
                    let loc = node
                        .meta
                        .location
                        .as_ref()
                        .unwrap_or_else(|| panic!("{what} has no location:\n{text}"));
                    let at = (loc.file.to_string(), loc.line);
                    assert!(
                        forward_lines.contains(&at),
                        "{what} points at {loc}, not at a line of the traced function:\n{text}"
                    );
                    let shown = format!("# {loc}");
                    assert!(
                        text.contains(&shown),
                        "{what}: `{shown}` is not printed:\n{text}"
                    );
                }
            }
            // The functions written in this file point here.
            if !fixtures().iter().any(|f| f.name == case.name) && !case.name.starts_with("sdpa") {
                assert!(
                    aot.backward.to_string().contains("tests/aot.rs:"),
                    "{}: {}",
                    case.name,
                    aot.backward
                );
            }
        }
    }
}

/// `order: strict` checkpoints the region: the forward saves nothing but
/// its inputs (the unhinted and `"recompute": false` graphs save every
/// slice's scores), the backward recomputes them with the backward's group,
/// one slice at a time (each softmax is read before the next is made), and
/// the gradients are those of eager mode (checked for every case by
/// `aot_matches_eager_under_every_partition`).
#[test]
fn a_strict_hint_recomputes_the_region_in_the_backward() {
    let by_name = |name: &str| cases().into_iter().find(|c| c.name == name).unwrap();
    for partition in partitions() {
        let saved = |name: &str| {
            let (graph, _) = traced(&by_name(name));
            aot_autograd(&graph, &[0, 1, 2], partition).unwrap()
        };
        let plain = saved("sdpa_sliced");
        let kept = saved("sdpa_sliced_hinted_no_recompute");
        let hinted = saved("sdpa_sliced_hinted");
        assert!(plain.saved_bytes > 0, "{partition:?}");
        assert_eq!(kept.saved_bytes, plain.saved_bytes, "{partition:?}");
        assert_eq!(hinted.saved_bytes, 0, "{partition:?}\n{}", hinted.forward);
        let bwd = &hinted.backward;
        let mut softmaxes = Vec::new();
        for (i, node) in bwd.nodes.iter().enumerate() {
            if matches!(node.op, Op::Input) {
                continue;
            }
            let hint = tessera::hints::Hint::from_map(node.meta.hints.as_ref().unwrap())
                .unwrap()
                .0;
            assert_eq!(
                hint.group_id,
                Some(1),
                "{} in the backward:\n{bwd}",
                node.op.name()
            );
            if matches!(node.op, Op::Softmax { .. }) {
                softmaxes.push(i);
            }
        }
        assert_eq!(
            softmaxes.len(),
            4,
            "one recomputed softmax per slice:\n{bwd}"
        );
        for pair in softmaxes.windows(2) {
            let read_before_next = bwd.nodes[pair[0] + 1..pair[1]]
                .iter()
                .any(|n| n.inputs.iter().any(|x| x.index() == pair[0]));
            assert!(
                read_before_next,
                "softmaxes recomputed ahead of use:\n{bwd}"
            );
        }
    }
}

/// A saved view (reshape, permute, expand, slice) of another saved value or
/// of an input shares that value's buffer: the backward makes it again from
/// its base instead, so that every saved activation is a buffer of its own
/// and an `offload` hint can move each one (the seed's sliced attention
/// used to save each slice's probabilities and their transpose, and
/// offloaded neither).
#[test]
fn no_saved_value_is_a_view_of_another_and_offload_moves_every_one() {
    let offload = tessera_apps::seed_table::offload_hint();
    let mut g = Generator::new(11);
    let inputs = vec![
        ("q", randn(&[2, 2, 5, 4], &mut g)),
        ("k", randn(&[2, 2, 5, 4], &mut g)),
        ("v", randn(&[2, 2, 5, 3], &mut g)),
    ];
    let offloaded = case("sdpa_sliced_offload", inputs, &[0, 1, 2], move |a| {
        vec![hinted_sdpa(a, &offload)]
    });
    let by_name = |name: &str| cases().into_iter().find(|c| c.name == name).unwrap();
    for partition in partitions() {
        for case in [by_name("sdpa_sliced"), by_name("sdpa_sliced_causal")]
            .iter()
            .chain([&offloaded])
        {
            let (graph, _) = traced(case);
            let aot = aot_autograd(&graph, &[0, 1, 2], partition).unwrap();
            let fwd = &aot.forward;
            let saved = &fwd.outputs[aot.num_outputs..];
            let leaves: HashSet<_> = saved
                .iter()
                .map(|o| o.node)
                .chain(fwd.inputs.iter().copied())
                .collect();
            for o in saved {
                let node = fwd.node(o.node);
                let view = matches!(
                    node.op,
                    Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. }
                );
                assert!(
                    !(view && leaves.contains(&node.inputs[0])),
                    "{} ({partition:?}): {} is saved, a view of a saved value or input:\n{fwd}",
                    case.name,
                    o.name
                );
            }
            if case.name == "sdpa_sliced_offload" {
                assert!(!aot.offloadable.is_empty(), "{fwd}");
                assert_eq!(
                    aot.offloaded, aot.offloadable,
                    "({partition:?}) every saved activation of the region goes to host memory:\n{fwd}"
                );
            }
        }
    }
}

/// Slices of an input itself (the `slice` hint's pass slices the function's
/// inputs): their gradients are joined by one `cat`, as slices of an inner
/// value are, not padded with zeros to full size each and summed — with
/// 256 slices that was 256 full-size adds in the backward. Eager `backward`
/// and `grad` give the same gradient.
#[test]
fn slices_of_an_input_get_one_cat_in_the_backward() {
    let mut g = Generator::new(5);
    let x = randn(&[8, 3], &mut g);
    let w = randn(&[8, 3], &mut g);
    let f = |x: &Tensor, w: &Tensor| -> Tensor {
        let pieces: Vec<Tensor> = x
            .tensor_split(4, 0)
            .iter()
            .enumerate()
            .map(|(i, p)| (p * (i as f64 + 1.0)).tanh())
            .collect();
        let refs: Vec<&Tensor> = pieces.iter().collect();
        (Tensor::cat(&refs, 0) * w).sum(&[], false)
    };
    let wc = w.clone();
    let sliced = case("input_slices", vec![("x", x.clone())], &[0], move |a| {
        vec![f(&a[0], &wc)]
    });
    let (graph, _) = traced(&sliced);
    let aot = aot_autograd(&graph, &[0], Partition::SaveAll).unwrap();
    let bwd = &aot.backward;
    let count = |name: &str| bwd.nodes.iter().filter(|n| n.op.name() == name).count();
    assert_eq!(
        count("cat"),
        1,
        "one cat joins the slices' gradients:\n{bwd}"
    );
    assert_eq!(count("add"), 0, "no padded gradients summed:\n{bwd}");
    // The same gradient eagerly, through `backward` (leaves) and `grad`.
    let leaf = x.clone().set_requires_grad(true);
    let y = f(&leaf, &w);
    let by_grad = grad(
        std::slice::from_ref(&y),
        &[Tensor::ones(&[], DType::F64)],
        std::slice::from_ref(&leaf),
    )
    .unwrap()
    .remove(0)
    .unwrap();
    y.backward();
    let by_backward = leaf.grad().unwrap();
    let xs = x.to_f64_vec();
    let ws = w.to_f64_vec();
    let want: Vec<f64> = (0..24)
        .map(|i| {
            let k = (i / 6) as f64 + 1.0;
            let t = (xs[i] * k).tanh();
            ws[i] * k * (1.0 - t * t)
        })
        .collect();
    for got in [by_grad.to_f64_vec(), by_backward.to_f64_vec()] {
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= TOL * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
