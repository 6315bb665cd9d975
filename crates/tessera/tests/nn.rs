//! nn modules, losses and the parameter store, against numpy values from
//! `scripts/nn_reference.py` (inputs are `sin(a·i + b)` sequences).

use tessera::nn::{
    cross_entropy, join_name, mse, try_cross_entropy, Dropout, Embedding, LayerNorm, Linear, Mlp,
    MultiHeadAttention, ParamStore, RMSNorm, TransformerConfig, TransformerLM,
};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

const LINEAR_OUT: &[f64] = &[
    -0.1358076184648578,
    -0.1650370845226154,
    0.4206257899412895,
    -0.06552392566363427,
    0.012074256292633812,
    -0.37074236005857464,
    -0.13184785153187079,
    -0.16207884360485042,
];
const LAYER_NORM_OUT: &[f64] = &[
    -0.1610491330147135,
    1.0959516441931012,
    1.077019945478638,
    -0.16870380147938557,
    -0.9640668107187806,
    -1.1332324847890172,
    -0.797023133113464,
    0.23249366553765044,
    0.808271529287561,
    0.44587220411381484,
];
const RMS_NORM_OUT: &[f64] = &[
    0.25843909397869896,
    1.3576926747655418,
    1.3689425092623668,
    0.2990315809013369,
    -0.48760553433527726,
    -1.0744586667894418,
    -0.7943853210656301,
    0.2675196423963457,
    0.9278561367008403,
    0.5938858630868281,
];
const ATTENTION_CAUSAL_OUT: &[f64] = &[
    0.43977994556143546,
    0.2517132300104911,
    -0.323104564973647,
    -0.3713802913240548,
    0.2707115006666472,
    0.3005130894541578,
    -0.13744737471171203,
    -0.35706890639230626,
    0.13468686284680215,
    0.22683464201464584,
    -0.026468567301105965,
    -0.24566495731668073,
    0.12972648646481777,
    -0.03047310714260676,
    -0.10897591685982197,
    -0.016404285104961128,
    0.28686645430754365,
    0.07843065211569918,
    -0.22909576307808788,
    -0.166140898497937,
    0.26231115751476874,
    0.1717819336776487,
    -0.17280716505899185,
    -0.24035775569355464,
];
const ATTENTION_FULL_OUT: &[f64] = &[
    0.13870314522861846,
    0.2349020973917522,
    -0.02774244500107836,
    -0.2541654473999243,
    0.12441222593131002,
    0.23117241325142499,
    -0.01471937321827343,
    -0.24600877465418095,
    0.13468686284680215,
    0.22683464201464584,
    -0.026468567301105965,
    -0.24566495731668073,
    0.2688692362161914,
    0.16822768993875215,
    -0.1805734530673572,
    -0.23944353952210257,
    0.26694752479802886,
    0.17048758843322487,
    -0.1778835246684945,
    -0.24078903912745347,
    0.26231115751476874,
    0.1717819336776487,
    -0.17280716505899185,
    -0.24035775569355464,
];
const CE_ALL_LOSS: &[f64] = &[0.7194408997728536];
const CE_ALL_GRAD: &[f64] = &[
    0.03044268500244885,
    0.14055845396894712,
    -0.17100113897139596,
    -0.1215891557841825,
    0.03549597438023156,
    0.08609318140395093,
    0.0544258280402913,
    -0.10061978970040528,
    0.04619396166011397,
    0.07033287128342953,
    0.034640555323326536,
    -0.10497342660675607,
];
const CE_IGNORE_LOSS: &[f64] = &[0.7875991613244567];
const CE_IGNORE_GRAD: &[f64] = &[
    0.0405902466699318,
    0.18741127195859617,
    -0.22800151862852794,
    -0.16211887437891,
    0.047327965840308746,
    0.11479090853860124,
    0.0,
    -0.0,
    0.0,
    0.09377716171123938,
    0.046187407097768717,
    -0.1399645688090081,
];

fn seq(n: usize, a: f64, b: f64) -> Vec<f64> {
    (0..n).map(|i| (a * i as f64 + b).sin()).collect()
}

fn scaled(v: Vec<f64>, k: f64) -> Vec<f64> {
    v.into_iter().map(|x| x * k).collect()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w}");
    }
}

fn error_of(r: tessera::Result<Tensor>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn linear_matches_numpy_over_leading_dims() {
    let mut store = ParamStore::with_dtype(DType::F64);
    let lin = Linear::new(&mut store, "fc", 3, 2, true, &mut Generator::new(0));
    lin.weight
        .set(&Tensor::from_vec(scaled(seq(6, 1.3, 0.5), 0.5), &[3, 2]));
    lin.bias
        .as_ref()
        .unwrap()
        .set(&Tensor::from_vec(vec![0.1, -0.2], &[2]));
    let y = lin.forward(&Tensor::from_vec(seq(12, 0.7, 0.1), &[2, 2, 3]));
    assert_eq!(y.shape(), &[2, 2, 2]);
    assert_close(&y.to_f64_vec(), LINEAR_OUT, 1e-12);
}

#[test]
fn linear_init_is_uniform_within_torch_bound() {
    let mut store = ParamStore::new();
    let lin = Linear::new(&mut store, "fc", 16, 300, true, &mut Generator::new(1));
    let bound = 1.0 / 4.0;
    let w = lin.weight.get().to_f64_vec();
    assert!(w.iter().all(|v| v.abs() <= bound), "weights outside ±1/√16");
    // 4800 uniform draws: both ends of the range are reached closely.
    let (lo, hi) = w
        .iter()
        .fold((1.0f64, -1.0f64), |(l, h), &v| (l.min(v), h.max(v)));
    assert!(lo < -0.24 && hi > 0.24, "range [{lo}, {hi}] is not ±0.25");
    assert_eq!(store.get("fc.bias").unwrap().ty().to_string(), "f32[300]");
    assert_eq!(lin.weight.ty().to_string(), "f32[16,300]");
}

#[test]
fn linear_names_itself_and_shapes_on_a_wrong_input() {
    let mut store = ParamStore::new();
    let lin = Linear::new(
        &mut store,
        "blocks.0.mlp.fc1",
        3,
        2,
        false,
        &mut Generator::new(0),
    );
    let msg = error_of(lin.try_forward(&Tensor::zeros(&[5, 4], DType::F32)));
    assert!(msg.contains("Linear `blocks.0.mlp.fc1`"), "{msg}");
    assert!(
        msg.contains("f32[5,4]") && msg.contains("3 features"),
        "{msg}"
    );
    assert!(
        msg.contains("tests/nn.rs"),
        "the error points at the caller: {msg}"
    );
}

#[test]
fn layer_norm_matches_numpy() {
    let mut store = ParamStore::with_dtype(DType::F64);
    let ln = LayerNorm::new(&mut store, "ln", 5, 1e-5, true);
    let (w, b) = ln.affine.as_ref().unwrap();
    assert_eq!(w.get().to_f64_vec(), vec![1.0; 5], "weight starts at ones");
    assert_eq!(b.get().to_f64_vec(), vec![0.0; 5], "bias starts at zeros");
    w.set(&Tensor::from_vec(seq(5, 0.4, 1.0), &[5]));
    b.set(&Tensor::from_vec(scaled(seq(5, 1.1, 0.3), 0.1), &[5]));
    let y = ln.forward(&Tensor::from_vec(scaled(seq(10, 0.9, 0.2), 2.0), &[2, 5]));
    assert_close(&y.to_f64_vec(), LAYER_NORM_OUT, 1e-12);
}

#[test]
fn layer_norm_without_affine_has_zero_mean_unit_variance() {
    let mut store = ParamStore::with_dtype(DType::F64);
    let ln = LayerNorm::new(&mut store, "ln", 8, 0.0, false);
    assert!(store.is_empty());
    let y = ln.forward(&Tensor::from_vec(scaled(seq(24, 0.3, 0.0), 5.0), &[3, 8]));
    for row in y.to_f64_vec().chunks(8) {
        let mean = row.iter().sum::<f64>() / 8.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 8.0;
        assert!(
            mean.abs() < 1e-12 && (var - 1.0).abs() < 1e-12,
            "{mean} {var}"
        );
    }
    let msg = error_of(ln.try_forward(&Tensor::zeros(&[3, 7], DType::F64)));
    assert!(
        msg.contains("LayerNorm `ln`") && msg.contains("f64[3,7]"),
        "{msg}"
    );
}

#[test]
fn rms_norm_matches_numpy() {
    let mut store = ParamStore::with_dtype(DType::F64);
    let norm = RMSNorm::new(&mut store, "norm", 5, 1e-6);
    norm.weight.set(&Tensor::from_vec(seq(5, 0.4, 1.0), &[5]));
    let y = norm.forward(&Tensor::from_vec(scaled(seq(10, 0.9, 0.2), 2.0), &[2, 5]));
    assert_close(&y.to_f64_vec(), RMS_NORM_OUT, 1e-12);
}

#[test]
fn embedding_returns_rows_and_names_itself_on_a_bad_id() {
    let mut store = ParamStore::with_dtype(DType::F64);
    let emb = Embedding::new(&mut store, "tok", 4, 3, &mut Generator::new(0));
    emb.weight.set(&Tensor::from_vec(
        (0..12).map(f64::from).collect::<Vec<_>>(),
        &[4, 3],
    ));
    let y = emb.forward(&Tensor::from_vec(vec![3i64, 0, 1, 3], &[2, 2]));
    assert_eq!(y.shape(), &[2, 2, 3]);
    let want = [9., 10., 11., 0., 1., 2., 3., 4., 5., 9., 10., 11.];
    assert_eq!(y.to_f64_vec(), want);
    let msg = error_of(emb.try_forward(&Tensor::from_vec(vec![4i64], &[1])));
    assert!(
        msg.contains("out of bounds") && msg.contains("Embedding `tok`"),
        "{msg}"
    );
    let msg = error_of(emb.try_forward(&Tensor::zeros(&[2], DType::F32)));
    assert!(msg.contains("i64 or i32"), "{msg}");
}

#[test]
fn dropout_zeroes_about_p_scales_the_rest_and_replays_from_its_seed() {
    let x = Tensor::ones(&[100, 100], DType::F32);
    let drop = Dropout::new(0.25, &mut Generator::new(7));
    assert_eq!(drop.forward(&x, false).to_f64_vec(), x.to_f64_vec());
    let y = drop.forward(&x, true).to_f64_vec();
    let zeros = y.iter().filter(|&&v| v == 0.0).count();
    assert!(
        (2300..2700).contains(&zeros),
        "{zeros} of 10000 dropped at p=0.25"
    );
    let scale = 1.0 / 0.75;
    assert!(y.iter().all(|&v| v == 0.0 || (v - scale).abs() < 1e-6));
    // A second call draws a new mask; a module from the same seed replays both.
    let y2 = drop.forward(&x, true).to_f64_vec();
    assert_ne!(y, y2);
    let again = Dropout::new(0.25, &mut Generator::new(7));
    assert_eq!(again.forward(&x, true).to_f64_vec(), y);
    assert_eq!(again.forward(&x, true).to_f64_vec(), y2);
}

fn attention(causal: bool) -> (ParamStore, MultiHeadAttention) {
    let mut store = ParamStore::with_dtype(DType::F64);
    let attn = MultiHeadAttention::new(&mut store, "attn", 4, 2, causal, &mut Generator::new(0));
    let projections = [&attn.q, &attn.k, &attn.v, &attn.o];
    for (i, p) in projections.into_iter().enumerate() {
        let i = i as f64;
        let w = scaled(seq(16, 0.5 + 0.3 * i, 0.2 * i), 0.5);
        p.weight.set(&Tensor::from_vec(w, &[4, 4]));
        let b = scaled(seq(4, 0.9 + 0.1 * i, 1.0), 0.1);
        p.bias.as_ref().unwrap().set(&Tensor::from_vec(b, &[4]));
    }
    (store, attn)
}

#[test]
fn attention_matches_numpy_causal_and_full() {
    let x = Tensor::from_vec(seq(24, 0.37, 0.0), &[2, 3, 4]);
    let (_, causal) = attention(true);
    let y = causal.forward(&x);
    assert_eq!(y.shape(), &[2, 3, 4]);
    assert_close(&y.to_f64_vec(), ATTENTION_CAUSAL_OUT, 1e-12);
    let (_, full) = attention(false);
    assert_close(&full.forward(&x).to_f64_vec(), ATTENTION_FULL_OUT, 1e-12);
}

#[test]
fn causal_attention_at_position_0_sees_only_token_0() {
    let x = Tensor::from_vec(seq(24, 0.37, 0.0), &[2, 3, 4]);
    // Same token 0, different later tokens.
    let mut changed = seq(24, 0.37, 0.0);
    for b in 0..2 {
        for v in &mut changed[b * 12 + 4..b * 12 + 12] {
            *v += 1.5;
        }
    }
    let x2 = Tensor::from_vec(changed, &[2, 3, 4]);
    let first = |y: Tensor| y.narrow(1, 0, 1).to_f64_vec();
    let (_, causal) = attention(true);
    assert_eq!(first(causal.forward(&x)), first(causal.forward(&x2)));
    let second = |y: Tensor| y.narrow(1, 1, 1).to_f64_vec();
    assert_ne!(second(causal.forward(&x)), second(causal.forward(&x2)));
    let (_, full) = attention(false);
    assert_ne!(first(full.forward(&x)), first(full.forward(&x2)));
}

#[test]
fn attention_rejects_a_wrong_model_dim() {
    let (_, attn) = attention(true);
    let msg = error_of(attn.try_forward(&Tensor::zeros(&[2, 3, 5], DType::F64)));
    assert!(
        msg.contains("MultiHeadAttention `attn`") && msg.contains("f64[2,3,5]"),
        "{msg}"
    );
}

#[test]
fn mlp_keeps_the_shape_and_registers_fc1_fc2() {
    let mut store = ParamStore::new();
    let mlp = Mlp::new(&mut store, "mlp", 8, 32, &mut Generator::new(0));
    let y = mlp.forward(&Tensor::randn(
        &[2, 5, 8],
        DType::F32,
        &mut Generator::new(1),
    ));
    assert_eq!(y.shape(), &[2, 5, 8]);
    let names: Vec<&str> = store.iter().map(|p| p.name()).collect();
    assert_eq!(
        names,
        [
            "mlp.fc1.weight",
            "mlp.fc1.bias",
            "mlp.fc2.weight",
            "mlp.fc2.bias"
        ]
    );
}

#[test]
fn cross_entropy_matches_numpy_with_and_without_ignore_index() {
    let logits_v = scaled(seq(12, 1.1, 0.2), 2.0);
    let targets = Tensor::from_vec(vec![2i64, 0, 1, 2], &[4]);
    for (ignore, want_loss, want_grad) in [
        (None, CE_ALL_LOSS, CE_ALL_GRAD),
        (Some(1), CE_IGNORE_LOSS, CE_IGNORE_GRAD),
    ] {
        let logits = Tensor::from_vec(logits_v.clone(), &[4, 3]).set_requires_grad(true);
        let loss = cross_entropy(&logits, &targets, ignore);
        assert_eq!(loss.shape(), &[] as &[usize]);
        assert_close(&[loss.item()], want_loss, 1e-12);
        loss.backward();
        assert_close(&logits.grad().unwrap().to_f64_vec(), want_grad, 1e-12);
    }
}

#[test]
fn cross_entropy_of_only_ignored_rows_is_zero_with_zero_gradient() {
    let logits = Tensor::from_vec(seq(6, 1.0, 0.0), &[2, 3]).set_requires_grad(true);
    let targets = Tensor::from_vec(vec![-100i64, -100], &[2]);
    let loss = cross_entropy(&logits, &targets, Some(-100));
    assert_eq!(loss.item(), 0.0);
    loss.backward();
    assert_eq!(logits.grad().unwrap().to_f64_vec(), vec![0.0; 6]);
}

#[test]
fn cross_entropy_rejects_bad_shapes_and_targets() {
    let logits = Tensor::zeros(&[4, 3], DType::F32);
    let msg = error_of(try_cross_entropy(
        &logits,
        &Tensor::zeros(&[5], DType::I64),
        None,
    ));
    assert!(
        msg.contains("cross_entropy") && msg.contains("i64[5]"),
        "{msg}"
    );
    let msg = error_of(try_cross_entropy(
        &logits,
        &Tensor::zeros(&[4], DType::F32),
        None,
    ));
    assert!(msg.contains("f32[4]"), "{msg}");
    let bad = Tensor::from_vec(vec![0i64, 3, 1, 2], &[4]);
    let msg = error_of(try_cross_entropy(&logits, &bad, None));
    assert!(
        msg.contains("cross_entropy") && msg.contains("target 3 is out of range for 3 classes"),
        "{msg}"
    );
}

#[test]
fn mse_is_the_mean_square_and_refuses_broadcasting() {
    let p = Tensor::from_vec(vec![1.0, 2.0, 4.0], &[3]);
    let t = Tensor::from_vec(vec![0.0, 2.0, 1.0], &[3]);
    assert_eq!(mse(&p, &t).item(), (1.0 + 0.0 + 9.0) / 3.0);
    let msg = error_of(tessera::nn::try_mse(&p, &t.reshape(&[3, 1])));
    assert!(msg.contains("f64[3]") && msg.contains("f64[3,1]"), "{msg}");
}

fn tiny_config() -> TransformerConfig {
    TransformerConfig {
        vocab: 11,
        d_model: 8,
        n_heads: 2,
        n_layers: 2,
        d_ff: 16,
        max_len: 6,
        dropout: 0.1,
    }
}

#[test]
fn transformer_registers_stable_hierarchical_names() {
    let mut store = ParamStore::new();
    let c = tiny_config();
    TransformerLM::new(&mut store, "lm", c.clone(), &mut Generator::new(0));
    let names: Vec<&str> = store.iter().map(|p| p.name()).collect();
    assert_eq!(
        names[..3],
        [
            "lm.tok_emb.weight",
            "lm.pos_emb.weight",
            "lm.blocks.0.ln1.weight"
        ]
    );
    assert!(names.contains(&"lm.blocks.1.attn.q.weight"));
    assert_eq!(
        names[names.len() - 3..],
        ["lm.ln_f.weight", "lm.ln_f.bias", "lm.head.weight"]
    );
    let (d, f, v) = (c.d_model, c.d_ff, c.vocab);
    let block = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d);
    let expected = v * d + c.max_len * d + c.n_layers * block + 2 * d + d * v;
    assert_eq!(store.num_parameters(), expected);
    assert_eq!(store.len(), 2 + 2 * 16 + 3);
}

#[test]
fn transformer_forward_backward_reaches_every_parameter() {
    let mut store = ParamStore::new();
    let c = tiny_config();
    let model = TransformerLM::new(&mut store, "", c.clone(), &mut Generator::new(0));
    let ids = Tensor::from_vec(vec![1i64, 5, 2, 9, 0, 3, 7, 7, 10, 4], &[2, 5]);
    let logits = model.forward(&ids, true);
    assert_eq!(logits.shape(), &[2, 5, c.vocab]);
    let targets = Tensor::from_vec(vec![5i64, 2, 9, 0, 3, 7, 7, 10, 4, 1], &[10]);
    let loss = cross_entropy(&logits.reshape(&[-1, c.vocab as isize]), &targets, None);
    assert!(loss.item().is_finite());
    loss.backward();
    for p in store.iter() {
        let g = p
            .grad()
            .unwrap_or_else(|| panic!("{} got no gradient", p.name()));
        assert_eq!(g.ty(), p.ty(), "{}", p.name());
        assert!(
            g.to_f64_vec().iter().any(|&v| v != 0.0),
            "{} has a zero gradient",
            p.name()
        );
    }
    store.zero_grad();
    assert!(store.iter().all(|p| p.grad().is_none()));
}

#[test]
fn transformer_eval_is_deterministic_and_causal() {
    let mut store = ParamStore::new();
    let model = TransformerLM::new(&mut store, "", tiny_config(), &mut Generator::new(3));
    let a = Tensor::from_vec(vec![1i64, 2, 3, 4], &[1, 4]);
    let b = Tensor::from_vec(vec![1i64, 2, 9, 9], &[1, 4]);
    let (la, lb) = (model.forward(&a, false), model.forward(&b, false));
    assert_eq!(la.to_f64_vec(), model.forward(&a, false).to_f64_vec());
    let prefix = |t: &Tensor| t.narrow(1, 0, 2).to_f64_vec();
    assert_close(&prefix(&la), &prefix(&lb), 1e-6);
    assert_ne!(
        la.narrow(1, 2, 1).to_f64_vec(),
        lb.narrow(1, 2, 1).to_f64_vec()
    );
    // Dropout makes training passes differ.
    assert_ne!(model.forward(&a, true).to_f64_vec(), la.to_f64_vec());
}

#[test]
fn transformer_rejects_bad_ids() {
    let mut store = ParamStore::new();
    let model = TransformerLM::new(&mut store, "lm", tiny_config(), &mut Generator::new(0));
    let long = Tensor::zeros(&[1, 7], DType::I64);
    let msg = model.try_forward(&long, false).err().unwrap().to_string();
    assert!(
        msg.contains("TransformerLM `lm`") && msg.contains("max_len 6"),
        "{msg}"
    );
    let floats = Tensor::zeros(&[1, 3], DType::F32);
    assert!(model.try_forward(&floats, false).is_err());
    let out_of_vocab = Tensor::from_vec(vec![0i64, 11], &[1, 2]);
    let msg = model
        .try_forward(&out_of_vocab, false)
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("out of bounds") && msg.contains("Embedding `lm.tok_emb`"),
        "{msg}"
    );
}

fn small_store(prefix: &str, inner: usize) -> ParamStore {
    let mut store = ParamStore::new();
    let g = &mut Generator::new(5);
    Linear::new(&mut store, &join_name(prefix, "q"), 4, inner, true, g);
    LayerNorm::new(&mut store, &join_name(prefix, "ln"), inner, 1e-5, true);
    store
}

#[test]
fn param_store_save_load_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("params.safetensors");
    let saved = small_store("blocks.0.attn", 3);
    saved.save_safetensors(&path).unwrap();
    let before: Vec<Vec<f64>> = saved.iter().map(|p| p.get().to_f64_vec()).collect();
    // Overwrite every value, then load them back.
    for p in saved.iter() {
        p.set(&(p.get() + 1.0));
    }
    saved.load_safetensors(&path).unwrap();
    let after: Vec<Vec<f64>> = saved.iter().map(|p| p.get().to_f64_vec()).collect();
    assert_eq!(before, after);
    assert!(
        saved.iter().all(|p| p.get().requires_grad()),
        "loaded values are leaves"
    );
}

#[test]
fn param_store_load_names_each_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("params.safetensors");
    small_store("blocks.0.attn", 3)
        .save_safetensors(&path)
        .unwrap();
    let load = |store: ParamStore| store.load_safetensors(&path).err().unwrap().to_string();

    let msg = load(small_store("blocks.0.attn", 5));
    assert!(
        msg.contains("blocks.0.attn.q.weight: expected f32[4,5], file has f32[4,3]"),
        "{msg}"
    );
    let msg = load(small_store("blocks.1.attn", 3));
    assert!(
        msg.contains("missing tensor `blocks.1.attn.q.weight`"),
        "{msg}"
    );
    assert!(
        msg.contains("unexpected tensor `blocks.0.attn.q.weight`"),
        "{msg}"
    );

    let mut f64_store = ParamStore::with_dtype(DType::F64);
    Linear::new(
        &mut f64_store,
        "blocks.0.attn.q",
        4,
        3,
        true,
        &mut Generator::new(0),
    );
    let msg = load(f64_store);
    assert!(
        msg.contains("expected f64[4,3], file has f32[4,3]"),
        "{msg}"
    );
    assert!(
        msg.contains("unexpected tensor `blocks.0.attn.ln.bias`"),
        "{msg}"
    );

    // A failed load changes nothing.
    let store = small_store("blocks.0.attn", 3);
    let w = store
        .get("blocks.0.attn.q.bias")
        .unwrap()
        .get()
        .to_f64_vec();
    let mut extra = small_store("blocks.0.attn", 3);
    extra.constant("extra", &[1], 0.0);
    extra.save_safetensors(&path).unwrap();
    assert!(store.load_safetensors(&path).is_err());
    assert_eq!(
        store
            .get("blocks.0.attn.q.bias")
            .unwrap()
            .get()
            .to_f64_vec(),
        w
    );
}

#[test]
#[should_panic(expected = "a parameter named `fc.weight` is already registered")]
fn param_store_refuses_duplicate_names() {
    let mut store = ParamStore::new();
    let g = &mut Generator::new(0);
    Linear::new(&mut store, "fc", 2, 2, false, g);
    Linear::new(&mut store, "fc", 2, 2, false, g);
}

#[test]
fn parameter_set_keeps_the_type() {
    let mut store = ParamStore::new();
    let p = store.constant("w", &[2], 1.0);
    let msg = p
        .try_set(&Tensor::zeros(&[3], DType::F32))
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("w: expected f32[2], got f32[3]"), "{msg}");
    let leaf = p.get();
    (&leaf * 2.0).sum(&[], false).backward();
    assert_eq!(p.grad().unwrap().to_f64_vec(), vec![2.0, 2.0]);
    p.set(&Tensor::full(&[2], 5.0, DType::F32));
    assert!(p.grad().is_none(), "a new value starts without a gradient");
    assert_eq!(p.get().to_f64_vec(), vec![5.0, 5.0]);
}
