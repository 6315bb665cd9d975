//! Dimensions and shapes, concrete or symbolic.
//!
//! A [`Dim`] is either a constant or a polynomial with integer coefficients
//! over named symbols (`s0`, `2*s0`, `s0*s1+4`). That small algebra is what
//! reshape, flatten and concat need on symbolic shapes: sums and products.
//! Polynomials are kept in a canonical form so that structural equality is
//! mathematical equality.

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

    fn add(&self, other: &Poly) -> Poly {
        let mut terms = self.terms.clone();
        for (m, c) in &other.terms {
            let e = terms.entry(m.clone()).or_insert(0);
            *e += c;
            if *e == 0 {
                terms.remove(m);
            }
        }
        Poly { terms }
    }

    fn mul(&self, other: &Poly) -> Poly {
        let mut out = Poly::constant(0);
        for (ma, ca) in &self.terms {
            for (mb, cb) in &other.terms {
                let mut m: Monomial = ma.iter().chain(mb.iter()).cloned().collect();
                m.sort();
                out = out.add(&Poly {
                    terms: BTreeMap::from([(m, ca * cb)]),
                });
            }
        }
        out
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

    fn poly(&self) -> Poly {
        match self {
            Dim::Const(c) => Poly::constant(*c as i64),
            Dim::Sym(p) => (**p).clone(),
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

    /// Evaluates the dim with symbol values from `env`; `None` if a symbol is unbound.
    pub fn eval(&self, env: &HashMap<Arc<str>, usize>) -> Option<usize> {
        match self {
            Dim::Const(c) => Some(*c),
            Dim::Sym(p) => {
                let mut total: i64 = 0;
                for (m, c) in &p.terms {
                    let mut v = *c;
                    for s in m {
                        v *= *env.get(s)? as i64;
                    }
                    total += v;
                }
                usize::try_from(total).ok()
            }
        }
    }

    /// `self / d` when the division is exact term by term (a constant divisor
    /// dividing every coefficient, or equal dims).
    pub fn div_exact(&self, d: &Dim) -> Option<Dim> {
        if self == d {
            return Some(Dim::Const(1));
        }
        let divisor = d.as_const()? as i64;
        if divisor == 0 {
            return None;
        }
        let p = self.poly();
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

    /// Parses `8`, `s0`, `2*s0`, `s0*s1+4`.
    pub fn parse(text: &str) -> Result<Dim, String> {
        let text = text.trim();
        let mut sum = Poly::constant(0);
        for term in text.split('+') {
            let mut prod = Poly::constant(1);
            for factor in term.split('*') {
                let factor = factor.trim();
                let p = if let Ok(c) = factor.parse::<i64>() {
                    Poly::constant(c)
                } else if is_symbol_name(factor) {
                    Dim::sym(factor).poly()
                } else {
                    return Err(format!("bad dimension `{text}`: `{factor}` is neither an integer nor a symbol name"));
                };
                prod = prod.mul(&p);
            }
            sum = sum.add(&prod);
        }
        Ok(sum.into_dim())
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

impl std::ops::Add for &Dim {
    type Output = Dim;
    fn add(self, rhs: &Dim) -> Dim {
        match (self, rhs) {
            (Dim::Const(a), Dim::Const(b)) => Dim::Const(a + b),
            _ => self.poly().add(&rhs.poly()).into_dim(),
        }
    }
}

impl std::ops::Mul for &Dim {
    type Output = Dim;
    fn mul(self, rhs: &Dim) -> Dim {
        match (self, rhs) {
            (Dim::Const(a), Dim::Const(b)) => Dim::Const(a * b),
            _ => self.poly().mul(&rhs.poly()).into_dim(),
        }
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

    /// The number of elements, as a dim.
    pub fn numel(&self) -> Dim {
        self.0.iter().fold(Dim::Const(1), |acc, d| &acc * d)
    }

    pub fn eval(&self, env: &HashMap<Arc<str>, usize>) -> Option<Vec<usize>> {
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
        assert_eq!(e.eval(&env), Some(19));
        assert!(Dim::parse("s0*-").is_err());
    }

    #[test]
    fn numel_of_mixed_shape() {
        let s = Shape(vec![Dim::Const(4), Dim::sym("s0"), Dim::Const(2)]);
        assert_eq!(s.numel().to_string(), "8*s0");
        assert_eq!(s.to_string(), "[4,s0,2]");
    }
}
