//! The hint parser: JSON objects with the known keys (and unknown ones)
//! holding values of every JSON type, numbers spelled every way, nested and
//! non-object values, and malformed text.
//!
//! Properties, for any text:
//! - `Hint::parse_with_warnings` returns; its verdict is the documented one
//!   (an oracle below, written from the table in `hints.rs`): malformed JSON
//!   and non-objects are `Parse` errors; a known key with a value of the
//!   wrong type is an error naming a wrong key; every unknown key gives one
//!   warning naming it; the accepted values are the ones written;
//! - an accepted hint prints to JSON that parses back to itself, and a
//!   scope opened with it records exactly that hint;
//! - a small function compiled under the hint computes what it computes
//!   eagerly (one case in four).

use serde_json::{Map, Value};
use tessera::hints::{self, Hint, Order};
use tessera::tensor::Generator;
use tessera::{DType, ErrorKind, Tensor};

use super::support::{Rng, Target};

pub fn target() -> Target<String> {
    Target {
        test: "hint_parser",
        ci_cases: 200_000,
        generate,
        check: |json| check(json),
        show: |json| json.clone(),
    }
}

const KEYS: &[&str] = &[
    "order",
    "schedule_policy",
    "group_id",
    "backward_group_id",
    "memory_budget_mb",
    "recompute",
    "max_width",
    "slice",
    "offload",
    "stream",
];

const ODD_KEYS: &[&str] = &[
    "",
    "streams",
    "Order",
    "order ",
    "group",
    "é",
    "\\u0000",
    "\\\"",
    "memory_budget",
    "__proto__",
];

const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "3",
    "0.5",
    "1.0",
    "1e2",
    "1E2",
    "-1e-2",
    "1.5",
    "2147483648",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "123456789012345678901234567890",
    "1e308",
    "1e309",
    "-1e309",
    "4.9e-324",
    "1e-400",
    "1.7976931348623157e308",
    "17592186044416",
    "0.000001",
    "01",
    "1.",
    ".5",
    "+1",
    "NaN",
    "Infinity",
    "0x10",
];

const STRINGS: &[&str] = &[
    "strict", "dfs", "bfs", "auto", "Strict", "", "fast", "strict ", "\\u0000", "\\ud800", "é",
    "64", "true",
];

fn random_value(rng: &mut Rng, depth: usize) -> String {
    let kinds = if depth > 3 { 5 } else { 7 };
    match rng.below(kinds) {
        0 => rng.pick(NUMBERS).to_string(),
        1 => format!("\"{}\"", rng.pick(STRINGS)),
        2 => rng.pick(&["true", "false", "null"]).to_string(),
        3 => rng.between(-5, 1 << 20).to_string(),
        4 => format!("{}", rng.f64() * 1e4),
        5 => {
            let n = rng.below(4);
            let items: Vec<String> = (0..n).map(|_| random_value(rng, depth + 1)).collect();
            format!("[{}]", items.join(","))
        }
        _ => random_object(rng, depth + 1),
    }
}

fn random_object(rng: &mut Rng, depth: usize) -> String {
    let n = rng.below(7);
    let mut entries = Vec::new();
    for _ in 0..n {
        let key = match rng.below(5) {
            0 => rng.pick(ODD_KEYS),
            _ => rng.pick(KEYS),
        };
        let value = match (rng.below(3), *key) {
            // Mostly values of the right type, to get past the first key.
            (0 | 1, "order" | "schedule_policy") => format!("\"{}\"", rng.pick(&STRINGS[..5])),
            (0 | 1, "group_id" | "backward_group_id") => rng.between(-3, 1 << 40).to_string(),
            (0 | 1, "memory_budget_mb") => rng.pick(NUMBERS).to_string(),
            (0 | 1, "recompute" | "offload") => rng.pick(&["true", "false"]).to_string(),
            (0 | 1, "max_width" | "stream") => rng.between(-2, 9).to_string(),
            (0 | 1, "slice") => format!(
                "{{\"dim\": {}, \"parts\": {}}}",
                rng.between(-1, 4),
                rng.between(-1, 9)
            ),
            _ => random_value(rng, depth),
        };
        let blank = |rng: &mut Rng| *rng.pick(&["", "", " ", "\n", "\t", "  \r\n"]);
        let (a, b, c) = (blank(rng), blank(rng), blank(rng));
        entries.push(format!("{a}\"{key}\"{b}:{c}{value}"));
    }
    format!("{{{}}}", entries.join(","))
}

/// A random hint object as JSON text (for the IR text target's `hints=`).
pub fn random_hint_json(rng: &mut Rng) -> String {
    random_object(rng, 0)
}

fn generate(rng: &mut Rng) -> String {
    match rng.below(12) {
        0 => random_value(rng, 0),
        1 => {
            // Deep nesting: serde_json's recursion limit is 128.
            let depth = 100 + rng.below(100);
            let open = if rng.chance(0.5) { "[" } else { "{\"a\":" };
            let close = if open == "[" { "]" } else { "}" };
            format!(
                "{{\"order\":{}1{}}}",
                open.repeat(depth),
                close.repeat(depth)
            )
        }
        2 | 3 => {
            // Character-level damage to a hint.
            let mut text = random_object(rng, 0);
            for _ in 0..1 + rng.below(3) {
                let mut chars: Vec<char> = text.chars().collect();
                let at = rng.below(chars.len() + 1);
                match rng.below(3) {
                    0 if at < chars.len() => {
                        chars.remove(at);
                    }
                    1 => chars.insert(at, *rng.pick(&['{', '}', '"', ',', ':', '\\', '\0', 'é'])),
                    _ => chars.truncate(at),
                }
                text = chars.into_iter().collect();
            }
            text
        }
        _ => random_object(rng, 0),
    }
}

// ----------------------------------------------------------------- oracle

/// What the documented rules say `map` gives: the hint and the unknown
/// keys, or the keys whose values are wrong.
fn expected(map: &Map<String, Value>) -> Result<(Hint, Vec<String>), Vec<String>> {
    let mut hint = Hint::default();
    let mut unknown = Vec::new();
    let mut wrong = Vec::new();
    let mut orders = Vec::new();
    for (key, value) in map {
        match key.as_str() {
            "order" | "schedule_policy" => match value.as_str().and_then(Order::from_name) {
                Some(o) => orders.push(o),
                None => wrong.push(key.clone()),
            },
            "group_id" | "backward_group_id" => match value.as_i64() {
                Some(g) if key == "group_id" => hint.group_id = Some(g),
                Some(g) => hint.backward_group_id = Some(g),
                None => wrong.push(key.clone()),
            },
            "memory_budget_mb" => match value.as_f64() {
                Some(mb) if mb >= 0.0 && mb.is_finite() => hint.memory_budget_mb = Some(mb),
                _ => wrong.push(key.clone()),
            },
            "recompute" => match value.as_bool() {
                Some(r) => hint.recompute = Some(r),
                None => wrong.push(key.clone()),
            },
            "offload" => match value.as_bool() {
                Some(o) => hint.offload = Some(o),
                None => wrong.push(key.clone()),
            },
            "max_width" => match value.as_u64() {
                Some(k) if k >= 1 => hint.max_width = Some(k as usize),
                _ => wrong.push(key.clone()),
            },
            "stream" => match value.as_i64() {
                Some(n) if n >= 0 => hint.stream = Some(n),
                _ => wrong.push(key.clone()),
            },
            "slice" => {
                let obj = value.as_object();
                let field = |f: &str| obj.and_then(|o| o.get(f)).and_then(Value::as_u64);
                let only_known = obj.is_some_and(|o| o.keys().all(|k| k == "dim" || k == "parts"));
                match (field("dim"), field("parts")) {
                    (Some(dim), Some(parts)) if parts >= 1 && only_known => {
                        hint.slice = Some(tessera::hints::SliceHint {
                            dim: dim as usize,
                            parts: parts as usize,
                        })
                    }
                    _ => wrong.push(key.clone()),
                }
            }
            _ => unknown.push(key.clone()),
        }
    }
    if orders.len() == 2 && orders[0] != orders[1] {
        wrong.push("disagree".into());
    }
    hint.order = orders.first().copied();
    match wrong.is_empty() {
        true => Ok((hint, unknown)),
        false => Err(wrong),
    }
}

fn check(json: &str) -> Result<(), String> {
    let got = Hint::parse_with_warnings(json);
    if let Err(e) = &got {
        if e.kind != ErrorKind::Parse || !e.message.starts_with("hint") {
            return Err(format!(
                "a {:?} error not starting with `hint`: {e}",
                e.kind
            ));
        }
    }
    let map = match serde_json::from_str::<Value>(json) {
        Err(_) => {
            return match got {
                Err(e) if e.message.contains("malformed JSON") => Ok(()),
                Err(e) => Err(format!("malformed JSON, but the error says: {e}")),
                Ok(h) => Err(format!("malformed JSON accepted as {h:?}")),
            }
        }
        Ok(Value::Object(map)) => map,
        Ok(other) => {
            return match got {
                Err(e) if e.message.contains("expected a JSON object") => Ok(()),
                other_result => Err(format!("{other} (not an object) gave {other_result:?}")),
            }
        }
    };
    match (expected(&map), got) {
        (Err(wrong), Ok(h)) => Err(format!("accepted as {h:?}; wrong values at {wrong:?}")),
        (Err(wrong), Err(e)) => match wrong.iter().any(|k| match k.as_str() {
            "disagree" => e.message.contains("disagree"),
            k => e.message.contains(&format!("\"{k}\"")),
        }) {
            true => Ok(()),
            false => Err(format!("the error names none of {wrong:?}: {e}")),
        },
        (Ok(want), Err(e)) => Err(format!("refused ({e}); expected {want:?}")),
        (Ok((want, unknown)), Ok((hint, warnings))) => {
            if hint != want {
                return Err(format!("parsed as {hint:?}, expected {want:?}"));
            }
            if warnings.len() != unknown.len()
                || unknown
                    .iter()
                    .zip(&warnings)
                    .any(|(k, w)| !w.contains(&format!("\"{k}\"")))
            {
                return Err(format!(
                    "warnings {warnings:?} for unknown keys {unknown:?}"
                ));
            }
            accepted(json, &hint)
        }
    }
}

/// The properties of an accepted hint.
fn accepted(json: &str, hint: &Hint) -> Result<(), String> {
    let back = Hint::parse(&hint.to_json()).map_err(|e| format!("to_json does not parse: {e}"))?;
    if back != *hint {
        return Err(format!("to_json {} parses as {back:?}", hint.to_json()));
    }
    let _ = hint.memory_budget_bytes();
    let _ = hint.recomputes();
    let in_scope = hints::scope(json, hints::current)
        .map_err(|e| format!("scope refuses what parse accepted: {e}"))?;
    let want = (!hint.is_empty()).then(|| hint.to_map());
    if in_scope.as_deref() != want.as_ref() {
        return Err(format!("the scope records {in_scope:?}, expected {want:?}"));
    }
    if json.len().is_multiple_of(4) {
        compiled_matches_eager(json)?;
    }
    Ok(())
}

/// A small function with one hinted region, compiled, against eager.
fn compiled_matches_eager(json: &str) -> Result<(), String> {
    let mut generator = Generator::new(json.len() as u64);
    let json = json.to_string();
    let f = move |a: &[Tensor]| -> Vec<Tensor> {
        let h = a[0].matmul(&a[1]).relu();
        let (s, m) = hints::scope(json.as_str(), || {
            let s = h.add(&a[2]).tanh();
            (s.sum(&[1], false), s.mul(&h).softmax(-1))
        })
        .expect("the hint parsed before");
        vec![s.add(1.0), m.reshape(&[-1])]
    };
    let inputs: Vec<Tensor> = [[4usize, 3], [3, 5], [1, 5]]
        .iter()
        .map(|s| Tensor::randn(s, DType::F32, &mut generator))
        .collect();
    let eager = f(&inputs);
    let compiled = tessera::compile(f)
        .try_call(&inputs)
        .map_err(|e| format!("the compiled function fails: {e}"))?;
    for (i, (e, c)) in eager.iter().zip(&compiled).enumerate() {
        let (e, c) = (e.to_f64_vec(), c.to_f64_vec());
        let close = e.len() == c.len()
            && e.iter()
                .zip(&c)
                .all(|(x, y)| (x - y).abs() <= 1e-4 * (1.0 + x.abs()));
        if !close {
            return Err(format!("output {i}: compiled {c:?}, eager {e:?}"));
        }
    }
    Ok(())
}
