//! Parsing of the values inside a statement: attribute values, types,
//! shapes and dims.

use crate::error::Result;
use crate::ir::dtype::DType;
use crate::ir::infer::TensorType;
use crate::ir::op::Scalar;
use crate::ir::shape::{is_symbol_name, Dim, Shape};

use super::cursor::Cursor;
use super::ops::{Attr, AttrKind};

/// Shapes whose element count could pass this are refused: the size limit
/// of every tensor ([`crate::limits`]). For a symbolic shape the bound is on
/// its count with every symbol at 1, which also keeps every coefficient of
/// its polynomials (and of their sums and products in `numel` and `cat`)
/// far from overflowing.
pub(super) const MAX_ELEMENTS: u64 = crate::limits::MAX_ELEMENTS as u64;

/// Bounds the product of the term counts of a shape's dims, which is the
/// size of its expanded `numel` polynomial (`[s0+s1,s2+s3,…]` doubles it
/// per dim).
const MAX_TERMS: u64 = 1 << 10;

/// At most this many symbols in one product (`s0*s1*…`): the dim algebra
/// sorts monomials on every product, so their length must stay small.
const MAX_DEGREE: usize = 64;

/// Reads one attribute value of `kind`.
pub(super) fn attr(cur: &mut Cursor, kind: AttrKind) -> Result<Attr> {
    Ok(match kind {
        AttrKind::Usize => Attr::Usize(integer(cur, "a non-negative integer")?),
        AttrKind::I64 => Attr::I64(integer(cur, "an integer")?),
        AttrKind::Float => Attr::Float(float(cur)?),
        AttrKind::Bool => Attr::Bool(boolean(cur)?),
        AttrKind::Scalar => Attr::Scalar(scalar(cur)?),
        AttrKind::DType => Attr::DType(dtype(cur)?),
        AttrKind::Shape => Attr::Shape(shape(cur)?),
        AttrKind::Dim => Attr::Dim(dim(cur)?.dim),
        AttrKind::Dims => Attr::Dims(list(cur, |c| integer(c, "a dim index"))?),
        AttrKind::Str => match cur.string()? {
            Some(text) => Attr::Str(text),
            None => return Err(cur.expected("a string")),
        },
        AttrKind::Data => match cur.peek() {
            Some('[') => Attr::Data {
                values: list(cur, scalar)?,
                list: true,
            },
            _ => Attr::Data {
                values: vec![scalar(cur)?],
                list: false,
            },
        },
    })
}

/// `[item, item, …]`, possibly empty.
fn list<T>(cur: &mut Cursor, mut item: impl FnMut(&mut Cursor) -> Result<T>) -> Result<Vec<T>> {
    cur.expect('[', "opening a list")?;
    let mut items = Vec::new();
    if cur.eat(']') {
        return Ok(items);
    }
    loop {
        items.push(item(cur)?);
        if cur.eat(']') {
            return Ok(items);
        }
        if !cur.eat(',') {
            return Err(cur.expected("`,` or `]` (unterminated list)"));
        }
    }
}

/// An integer of type `T`; `what` names the range in the message.
pub(super) fn integer<T: std::str::FromStr>(cur: &mut Cursor, what: &str) -> Result<T> {
    let start = cur.start();
    match cur.number().map(|text| (text, text.parse::<T>())) {
        Some((_, Ok(v))) => Ok(v),
        Some((text, Err(_))) => {
            Err(cur.error_at(start, format!("expected {what}, found `{text}`")))
        }
        None => Err(cur.expected(what)),
    }
}

/// A float; an integer is accepted too (`1` reads as `1.0`).
fn float(cur: &mut Cursor) -> Result<f64> {
    match cur.number().map(str::parse::<f64>) {
        Some(Ok(v)) => Ok(v),
        _ => Err(cur.expected("a number")),
    }
}

fn boolean(cur: &mut Cursor) -> Result<bool> {
    if cur.keyword("true") {
        Ok(true)
    } else if cur.keyword("false") {
        Ok(false)
    } else {
        Err(cur.expected("`true` or `false`"))
    }
}

/// A number or bool whose spelling gives its kind: `1` is an int, `1.0`,
/// `1e3`, `inf` and `nan` are floats.
fn scalar(cur: &mut Cursor) -> Result<Scalar> {
    let start = cur.start();
    if let Some(text) = cur.number() {
        let is_float = text.contains(['.', 'e', 'E', 'i', 'n']);
        let value = match is_float {
            true => text.parse::<f64>().ok().map(Scalar::Float),
            false => text.parse::<i64>().ok().map(Scalar::Int),
        };
        return value
            .ok_or_else(|| cur.error_at(start, format!("number `{text}` is out of range")));
    }
    if cur.keyword("true") {
        Ok(Scalar::Bool(true))
    } else if cur.keyword("false") {
        Ok(Scalar::Bool(false))
    } else {
        Err(cur.expected("a number, `true` or `false`"))
    }
}

pub(super) fn dtype(cur: &mut Cursor) -> Result<DType> {
    let start = cur.start();
    let word = cur.expect_word("a dtype (f32, f64, f16, bf16, i64, i32, bool)")?;
    word.parse::<DType>().map_err(|e| cur.error_at(start, e))
}

/// A type: `f32[4,s0]`, `i64[]`.
pub(super) fn tensor_type(cur: &mut Cursor) -> Result<TensorType> {
    let dtype = dtype(cur)?;
    let shape = shape(cur)?;
    Ok(TensorType { dtype, shape })
}

/// A dim while it is parsed, with what the limits need.
struct DimBounds {
    dim: Dim,
    /// The sum of its coefficients: its value with every symbol at 1, and an
    /// upper bound of every coefficient its products can have.
    coefficient_sum: u64,
    terms: u64,
}

/// `[d, d, …]` whose element count stays within [`MAX_ELEMENTS`].
pub(super) fn shape(cur: &mut Cursor) -> Result<Shape> {
    let start = cur.start();
    let dims = list(cur, dim)?;
    let product = |f: fn(&DimBounds) -> u64| {
        dims.iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(f(d).max(1)))
    };
    let elements = product(|d| d.coefficient_sum).filter(|&n| n <= MAX_ELEMENTS);
    let terms = product(|d| d.terms).filter(|&n| n <= MAX_TERMS);
    if elements.is_none() || terms.is_none() {
        let msg = "shape is too large (more than 2^46 elements, or too many symbolic terms)";
        return Err(cur.error_at(start, msg));
    }
    Ok(Shape(dims.into_iter().map(|d| d.dim).collect()))
}

/// A dim: a sum of products of non-negative integers and symbols, such as
/// `8`, `s0`, `2*s0`, `s0*s1+4`.
fn dim(cur: &mut Cursor) -> Result<DimBounds> {
    let start = cur.start();
    let too_large = |cur: &Cursor| cur.error_at(start, "dim is too large (more than 2^46)");
    let mut sum = DimBounds {
        dim: Dim::Const(0),
        coefficient_sum: 0,
        terms: 0,
    };
    loop {
        let (term, coefficient) = dim_term(cur, start)?;
        sum.coefficient_sum = sum
            .coefficient_sum
            .checked_add(coefficient)
            .filter(|&n| n <= MAX_ELEMENTS)
            .ok_or_else(|| too_large(cur))?;
        sum.terms += 1;
        if sum.terms > MAX_TERMS {
            return Err(cur.error_at(start, "dim has too many terms"));
        }
        sum.dim = &sum.dim + &term;
        if !cur.eat('+') {
            return Ok(sum);
        }
    }
}

/// One product of a dim: its value and its coefficient (bounded by
/// [`MAX_ELEMENTS`], so that building it cannot overflow).
fn dim_term(cur: &mut Cursor, dim_start: usize) -> Result<(Dim, u64)> {
    let mut coefficient = 1u64;
    let mut symbols = Vec::new();
    loop {
        let start = cur.start();
        match cur.word() {
            Some(w) if w.bytes().all(|b| b.is_ascii_digit()) => {
                coefficient = w
                    .parse::<u64>()
                    .ok()
                    .and_then(|n| n.checked_mul(coefficient))
                    .filter(|&n| n <= MAX_ELEMENTS)
                    .ok_or_else(|| cur.error_at(dim_start, "dim is too large (more than 2^46)"))?;
            }
            Some(w) if is_symbol_name(w) && symbols.len() < MAX_DEGREE => symbols.push(Dim::sym(w)),
            Some(w) if is_symbol_name(w) => {
                let msg = format!("dim term has more than {MAX_DEGREE} symbol factors");
                return Err(cur.error_at(start, msg));
            }
            Some(w) => {
                let msg = format!("bad dim: `{w}` is neither an integer nor a symbol like `s0`");
                return Err(cur.error_at(start, msg));
            }
            None => return Err(cur.expected("a dim (an integer or a symbol like `s0`)")),
        }
        if !cur.eat('*') {
            break;
        }
    }
    let term = symbols
        .iter()
        .fold(Dim::Const(coefficient as usize), |acc, s| &acc * s);
    Ok((term, coefficient))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn parse<T>(text: &str, f: impl FnOnce(&mut Cursor) -> Result<T>) -> Result<T> {
        let mut cur = Cursor::new(text, 1, Arc::from("<t>"));
        let v = f(&mut cur)?;
        cur.expect_end()?;
        Ok(v)
    }

    #[test]
    fn dims_are_canonical() {
        let s = parse("[2*s0, 4, s1*s0+3+s0, 0*s2]", shape).unwrap();
        assert_eq!(s.to_string(), "[2*s0,4,s0*s1+s0+3,0]");
        assert_eq!(parse("f32[]", tensor_type).unwrap().to_string(), "f32[]");
    }

    #[test]
    fn huge_and_bad_dims_are_errors() {
        for text in [
            "[99999999999999999999999]",
            "[70368744177664,2]",
            "[8388608*8388608*8388608]",
            "[s0+s1,s2+s3,s4+s5,s6+s7,s8+s9,s10+s11,s12+s13,s14+s15,s16+s17,s18+s19,s20+s21]",
        ] {
            let err = parse(text, shape).unwrap_err().to_string();
            assert!(err.contains("too large"), "{text}: {err}");
        }
        let err = parse("[2,-1]", shape).unwrap_err().to_string();
        assert!(err.contains("expected a dim"), "{err}");
        let err = parse("[2,s0.x]", shape).unwrap_err().to_string();
        assert!(err.contains("bad dim: `s0.x`"), "{err}");
        let long = vec!["s0"; 65].join("*");
        let err = parse(&format!("[{long}]"), shape).unwrap_err().to_string();
        assert!(err.contains("more than 64 symbol factors"), "{err}");
        let many = vec!["s0"; 1025].join("+");
        let err = parse(&format!("[{many}]"), shape).unwrap_err().to_string();
        assert!(err.contains("too many terms"), "{err}");
        let err = parse("[2,3", shape).unwrap_err().to_string();
        assert!(err.contains("unterminated list"), "{err}");
    }

    #[test]
    fn scalars_keep_their_kind() {
        let s = |t: &str| parse(t, scalar).unwrap();
        assert_eq!(s("1"), Scalar::Int(1));
        assert_eq!(s("-1.0"), Scalar::Float(-1.0));
        assert_eq!(s("1e3"), Scalar::Float(1000.0));
        assert_eq!(s("-inf"), Scalar::Float(f64::NEG_INFINITY));
        assert!(matches!(s("nan"), Scalar::Float(x) if x.is_nan()));
        assert_eq!(s("true"), Scalar::Bool(true));
        assert!(parse("true false", scalar).is_err());
        let err = parse("99999999999999999999", scalar).unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
        assert!(parse("maybe", scalar).is_err());
    }

    #[test]
    fn integers_are_range_checked() {
        let err = parse("-1", |c| integer::<usize>(c, "a dim index"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected a dim index, found `-1`"), "{err}");
        assert_eq!(parse("-0.5", float).unwrap(), -0.5);
        assert_eq!(parse("3", float).unwrap(), 3.0);
    }
}
