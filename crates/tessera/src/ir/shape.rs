//! Dimensions and shapes, concrete or symbolic.
//!
//! A [`Dim`] is either a constant or a polynomial with integer coefficients
//! over named symbols (`s0`, `2*s0`, `s0*s1+4`). That small algebra is what
//! reshape, flatten and concat need on symbolic shapes: sums and products.
//! Polynomials are kept in a canonical form so that structural equality is
//! mathematical equality.
//!
//! The algebra is checked: a sum or product whose coefficients (or constant
//! value) would overflow is `None` from [`Dim::checked_add`] and
//! [`Dim::checked_mul`], and evaluating a dim at symbol values that make it
//! overflow is an error ([`Dim::eval`]), never a wrapped size. The `+` and
//! `*` operators panic on overflow; code whose operands are not bounded
//! (type inference) uses the checked forms.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

/// A product of symbols, sorted (`["s0", "s0", "s1"]` is `s0*s0*s1`).
type Monomial = Vec<Arc<str>>;

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    Const(usize),
    /// A polynomial with at least one symbolic term (never a bare constant).
    Sym(Arc<Poly>),
}

/// Canonical polynomial: monomial -> non-zero coefficient. The empty monomial
/// is the constant term.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Poly {
    terms: BTreeMap<Monomial, i64>,
}

impl Poly {
    fn constant(c: i64) -> Poly {
        let mut terms = BTreeMap::new();
        if c != 0 {
            terms.insert(Vec::new(), c);
        }
        Poly { terms }
    }

    fn into_dim(self) -> Dim {
        match self.terms.len() {
            0 => Dim::Const(0),
            1 if self.terms.contains_key(&Vec::new()) => {
                let c = self.terms[&Vec::new()];
                Dim::Const(c.max(0) as usize)
            }
            _ => Dim::Sym(Arc::new(self)),
        }
    }

    /// `self + other`, or `None` when a coefficient overflows.
    fn add(&self, other: &Poly) -> Option<Poly> {
        let mut terms = self.terms.clone();
        for (m, c) in &other.terms {
            let e = terms.entry(m.clone()).or_insert(0);
            *e = e.checked_add(*c)?;
            if *e == 0 {
                terms.remove(m);
            }
        }
        Some(Poly { terms })
    }

    /// `self * other`, or `None` when a coefficient overflows.
    fn mul(&self, other: &Poly) -> Option<Poly> {
        let mut out = Poly::constant(0);
        for (ma, ca) in &self.terms {
            for (mb, cb) in &other.terms {
                let mut m: Monomial = ma.iter().chain(mb.iter()).cloned().collect();
                m.sort();
                out = out.add(&Poly {
                    terms: BTreeMap::from([(m, ca.checked_mul(*cb)?)]),
                })?;
            }
        }
        Some(out)
    }
}

/// Why a dim has no value at given symbol values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EvalError {
    /// A symbol has no value.
    Unbound(Arc<str>),
    /// The value is negative.
    Negative,
    /// The value (or a step of computing it) overflows.
    Overflow,
}

impl fmt::Display for EvalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvalError::Unbound(s) => write!(f, "`{s}` has no value"),
            EvalError::Negative => f.write_str("it is negative"),
            EvalError::Overflow => f.write_str("it overflows"),
        }
    }
}

impl Dim {
    /// A symbolic dimension named `name` (e.g. `s0`).
    pub fn sym(name: &str) -> Dim {
        Dim::Sym(Arc::new(Poly {
            terms: BTreeMap::from([(vec![Arc::from(name)], 1)]),
        }))
    }

    pub fn as_const(&self) -> Option<usize> {
        match self {
            Dim::Const(c) => Some(*c),
            Dim::Sym(_) => None,
        }
    }

    pub fn is_const(&self) -> bool {
        matches!(self, Dim::Const(_))
    }

    /// The dim as a polynomial; `None` for a constant past `i64::MAX`.
    fn poly(&self) -> Option<Poly> {
        match self {
            Dim::Const(c) => Some(Poly::constant(i64::try_from(*c).ok()?)),
            Dim::Sym(p) => Some((**p).clone()),
        }
    }

    /// `self + rhs`, or `None` on overflow.
    pub fn checked_add(&self, rhs: &Dim) -> Option<Dim> {
        match (self, rhs) {
            (Dim::Const(a), Dim::Const(b)) => a.checked_add(*b).map(Dim::Const),
            _ => Some(self.poly()?.add(&rhs.poly()?)?.into_dim()),
        }
    }

    /// `self - rhs` (a polynomial that may be negative for some symbol
    /// values: evaluating it then fails), or `None` on overflow or when
    /// both are constants and `rhs` is larger.
    pub fn checked_sub(&self, rhs: &Dim) -> Option<Dim> {
        match (self, rhs) {
            (Dim::Const(a), Dim::Const(b)) => a.checked_sub(*b).map(Dim::Const),
            _ => {
                let negated = rhs.poly()?.mul(&Poly::constant(-1))?;
                Some(self.poly()?.add(&negated)?.into_dim())
            }
        }
    }

    /// `self * rhs`, or `None` on overflow.
    pub fn checked_mul(&self, rhs: &Dim) -> Option<Dim> {
        match (self, rhs) {
            (Dim::Const(a), Dim::Const(b)) => a.checked_mul(*b).map(Dim::Const),
            _ => Some(self.poly()?.mul(&rhs.poly()?)?.into_dim()),
        }
    }

    /// The names of the symbols this dim mentions.
    pub fn symbols(&self) -> Vec<Arc<str>> {
        let mut out: Vec<Arc<str>> = match self {
            Dim::Const(_) => Vec::new(),
            Dim::Sym(p) => p.terms.keys().flatten().cloned().collect(),
        };
        out.sort();
        out.dedup();
        out
    }

    /// Evaluates the dim with symbol values from `env`, in checked
    /// arithmetic: an unbound symbol, a negative value or an overflow
    /// (`s0*s0+1` at s0 = 2^62) is an error, never a wrapped size.
    pub fn eval(&self, env: &HashMap<Arc<str>, usize>) -> Result<usize, EvalError> {
        match self {
            Dim::Const(c) => Ok(*c),
            Dim::Sym(p) => {
                let mut total: i128 = 0;
                for (m, c) in &p.terms {
                    let mut v = i128::from(*c);
                    for s in m {
                        let x = *env.get(s).ok_or_else(|| EvalError::Unbound(s.clone()))?;
                        v = v.checked_mul(x as i128).ok_or(EvalError::Overflow)?;
                    }
                    total = total.checked_add(v).ok_or(EvalError::Overflow)?;
                }
                if total < 0 {
                    return Err(EvalError::Negative);
                }
                usize::try_from(total).map_err(|_| EvalError::Overflow)
            }
        }
    }

    /// `self / d` when the division is exact term by term (a constant divisor
    /// dividing every coefficient, or equal dims).
    pub fn div_exact(&self, d: &Dim) -> Option<Dim> {
        if self == d {
            return Some(Dim::Const(1));
        }
        let divisor = i64::try_from(d.as_const()?).ok()?;
        if divisor == 0 {
            return None;
        }
        let p = self.poly()?;
        if p.terms.values().any(|c| c % divisor != 0) {
            return None;
        }
        Some(
            Poly {
                terms: p.terms.into_iter().map(|(m, c)| (m, c / divisor)).collect(),
            }
            .into_dim(),
        )
    }

    /// Parses `8`, `s0`, `2*s0`, `s0*s1+4` (non-negative integers and
    /// symbols; a coefficient that overflows is an error).
    pub fn parse(text: &str) -> Result<Dim, String> {
        let text = text.trim();
        let overflow = || format!("bad dimension `{text}`: it overflows");
        let mut sum = Dim::Const(0);
        for term in text.split('+') {
            let mut prod = Dim::Const(1);
            for factor in term.split('*') {
                let factor = factor.trim();
                let d = if factor.bytes().all(|b| b.is_ascii_digit()) && !factor.is_empty() {
                    Dim::Const(factor.parse::<usize>().map_err(|_| overflow())?)
                } else if is_symbol_name(factor) {
                    Dim::sym(factor)
                } else {
                    return Err(format!("bad dimension `{text}`: `{factor}` is neither a non-negative integer nor a symbol name"));
                };
                prod = prod.checked_mul(&d).ok_or_else(overflow)?;
            }
            sum = sum.checked_add(&prod).ok_or_else(overflow)?;
        }
        Ok(sum)
    }
}

/// Symbol names are identifiers that start with a letter.
pub fn is_symbol_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl From<usize> for Dim {
    fn from(c: usize) -> Dim {
        Dim::Const(c)
    }
}

/// Panics on overflow (see [`Dim::checked_add`]).
impl std::ops::Add for &Dim {
    type Output = Dim;
    fn add(self, rhs: &Dim) -> Dim {
        self.checked_add(rhs)
            .unwrap_or_else(|| panic!("dim arithmetic overflows: {self} + {rhs}"))
    }
}

/// Panics on overflow (see [`Dim::checked_mul`]).
impl std::ops::Mul for &Dim {
    type Output = Dim;
    fn mul(self, rhs: &Dim) -> Dim {
        self.checked_mul(rhs)
            .unwrap_or_else(|| panic!("dim arithmetic overflows: {self} * {rhs}"))
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Const(c) => write!(f, "{c}"),
            Dim::Sym(p) => {
                // Highest-degree terms first, constant last: `s0*s1+2*s0+4`.
                let mut terms: Vec<_> = p.terms.iter().collect();
                terms.sort_by(|(ma, _), (mb, _)| mb.len().cmp(&ma.len()).then(ma.cmp(mb)));
                for (i, (m, c)) in terms.into_iter().enumerate() {
                    if i > 0 {
                        f.write_str("+")?;
                    }
                    let mut factors: Vec<String> = Vec::new();
                    if *c != 1 || m.is_empty() {
                        factors.push(c.to_string());
                    }
                    factors.extend(m.iter().map(|s| s.to_string()));
                    f.write_str(&factors.join("*"))?;
                }
                Ok(())
            }
        }
    }
}

impl fmt::Debug for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A shape: one [`Dim`] per axis.
#[derive(Clone, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    pub fn new(dims: Vec<Dim>) -> Shape {
        Shape(dims)
    }

    pub fn from_concrete(dims: &[usize]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::Const(d)).collect())
    }

    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn dims(&self) -> &[Dim] {
        &self.0
    }

    /// The concrete sizes, or `None` if any dim is symbolic.
    pub fn as_concrete(&self) -> Option<Vec<usize>> {
        self.0.iter().map(Dim::as_const).collect()
    }

    /// The number of elements, as a dim. Panics on overflow; see
    /// [`Shape::checked_numel`].
    pub fn numel(&self) -> Dim {
        self.checked_numel()
            .unwrap_or_else(|| panic!("the element count of {self} overflows"))
    }

    /// The number of elements, as a dim, or `None` on overflow.
    pub fn checked_numel(&self) -> Option<Dim> {
        self.0
            .iter()
            .try_fold(Dim::Const(1), |acc, d| acc.checked_mul(d))
    }

    /// The concrete sizes at the symbol values of `env` (see [`Dim::eval`]).
    pub fn eval(&self, env: &HashMap<Arc<str>, usize>) -> Result<Vec<usize>, EvalError> {
        self.0.iter().map(|d| d.eval(env)).collect()
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Shape {
        Shape::from_concrete(dims)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Shape {
        Shape::from_concrete(&dims)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algebra_is_canonical() {
        let s0 = Dim::sym("s0");
        let s1 = Dim::sym("s1");
        let two_s0 = &s0 + &s0;
        assert_eq!(two_s0, &Dim::Const(2) * &s0);
        assert_eq!(two_s0.to_string(), "2*s0");
        let e = &(&s0 * &s1) + &Dim::Const(4);
        assert_eq!(e.to_string(), "s0*s1+4");
        assert_eq!(Dim::parse("s0*s1+4").unwrap(), e);
        assert_eq!(Dim::parse("4+s1*s0").unwrap(), e);
        assert_eq!(Dim::parse("6").unwrap(), Dim::Const(6));
        assert_eq!(two_s0.div_exact(&Dim::Const(2)).unwrap(), s0);
        assert!(s0.div_exact(&Dim::Const(2)).is_none());
        let env = HashMap::from([(Arc::from("s0"), 3usize), (Arc::from("s1"), 5usize)]);
        assert_eq!(e.eval(&env), Ok(19));
        assert!(Dim::parse("s0*-").is_err());
        assert!(Dim::parse("-5").is_err());
    }

    #[test]
    fn algebra_and_evaluation_are_checked() {
        let s0 = Dim::sym("s0");
        let big = Dim::Const(1 << 62);
        // Coefficients past i64: no wrapped polynomial.
        assert!(big.checked_mul(&Dim::Const(4)).is_none());
        assert!(big
            .checked_mul(&s0)
            .unwrap()
            .checked_mul(&Dim::Const(2))
            .is_none());
        assert!(Dim::Const(usize::MAX).checked_add(&s0).is_none());
        assert!(Dim::parse("99999999999999999999*s0").is_err());
        assert!(Dim::parse("4611686018427387904*s0*4").is_err());
        // s0*s0+1 at s0 = 2^62 overflows: an error, not f32[1].
        let d = Dim::parse("s0*s0+1").unwrap();
        let env = HashMap::from([(Arc::from("s0"), 1usize << 62)]);
        assert_eq!(d.eval(&env), Err(EvalError::Overflow));
        let env = HashMap::from([(Arc::from("s0"), 1usize << 31)]);
        assert_eq!(d.eval(&env), Ok((1 << 62) + 1));
        assert_eq!(
            Dim::parse("s1").unwrap().eval(&env),
            Err(EvalError::Unbound(Arc::from("s1")))
        );
        let shape = Shape(vec![Dim::Const(1 << 40), Dim::Const(1 << 40)]);
        assert!(shape.checked_numel().is_none());
        let r = std::panic::catch_unwind(|| shape.numel());
        assert!(r.is_err(), "numel panics rather than wrapping");
    }

    #[test]
    fn numel_of_mixed_shape() {
        let s = Shape(vec![Dim::Const(4), Dim::sym("s0"), Dim::Const(2)]);
        assert_eq!(s.numel().to_string(), "8*s0");
        assert_eq!(s.to_string(), "[4,s0,2]");
    }
}
