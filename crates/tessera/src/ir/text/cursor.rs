//! The lexer: a cursor over one line of the text form with the token-level
//! primitives the parser needs. Statements never span lines, so a line is
//! the unit of lexing and every position is a line and a column.

use std::cell::Cell;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result, SourceLoc};

/// Blanks between tokens: spaces and tabs only (a `\r` or any other control
/// character is junk, which keeps printed names and files unambiguous).
pub(super) fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// Characters of a bare word: names, op names, dtypes, keywords.
fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '.'
}

/// A name that can be written bare (`x`, `layer1.weight`, `_t`); any other
/// name is written as a JSON string.
pub(super) fn is_plain_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(is_word_char)
}

/// Messages quote at most this many characters of the token found.
const FOUND_MAX_CHARS: usize = 32;

/// A parse error at `loc`.
pub(super) fn parse_error(loc: SourceLoc, message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Parse, message).at(loc)
}

pub(super) struct Cursor<'a> {
    text: &'a str,
    /// Byte offset of the next character; always on a character boundary.
    pos: usize,
    line: u32,
    file: Arc<str>,
    /// A char boundary and its column, where the last column count ended:
    /// counting on from there keeps a run of locations on a long line
    /// linear rather than quadratic.
    counted: Cell<(usize, u32)>,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(text: &'a str, line: u32, file: Arc<str>) -> Cursor<'a> {
        Cursor {
            text,
            pos: 0,
            line,
            file,
            counted: Cell::new((0, 1)),
        }
    }

    /// The unread rest of the line.
    pub(super) fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    /// Skips blanks and returns the position of the next token.
    pub(super) fn start(&mut self) -> usize {
        self.skip_blanks();
        self.pos
    }

    /// Moves past `len` bytes of [`Cursor::rest`] (a char boundary).
    pub(super) fn advance(&mut self, len: usize) {
        self.pos += len;
    }

    /// The location of byte offset `pos` (1-based column, in characters;
    /// `pos` need not be a char boundary).
    pub(super) fn loc_at(&self, pos: usize) -> SourceLoc {
        let (mut at, mut column) = match self.counted.get() {
            (at, column) if at <= pos => (at, column),
            _ => (0, 1),
        };
        for c in self.text[at..].chars() {
            if at >= pos {
                break;
            }
            at += c.len_utf8();
            column = column.saturating_add(1);
        }
        self.counted.set((at, column));
        SourceLoc {
            file: self.file.clone(),
            line: self.line,
            column,
        }
    }

    /// The location of the next token.
    pub(super) fn loc(&mut self) -> SourceLoc {
        self.skip_blanks();
        self.loc_at(self.pos)
    }

    pub(super) fn error_at(&self, pos: usize, message: impl Into<String>) -> Error {
        parse_error(self.loc_at(pos), message)
    }

    /// "expected {what}, found {the next token}" at the next token.
    pub(super) fn expected(&mut self, what: &str) -> Error {
        self.skip_blanks();
        let message = format!("expected {what}, found {}", self.found());
        self.error_at(self.pos, message)
    }

    /// The next token, for messages: `` `word` ``, `` `(` `` or `end of line`.
    pub(super) fn found(&self) -> String {
        let rest = self.rest();
        let Some(first) = rest.chars().next() else {
            return "end of line".to_string();
        };
        let len = if is_word_char(first) || first == '-' {
            let tail = rest[first.len_utf8()..]
                .find(|c: char| !is_word_char(c))
                .unwrap_or(rest.len() - first.len_utf8());
            first.len_utf8() + tail
        } else {
            first.len_utf8()
        };
        let token = &rest[..len];
        match token.char_indices().nth(FOUND_MAX_CHARS) {
            Some((cut, _)) => format!("`{}…`", token[..cut].escape_debug()),
            None => format!("`{}`", token.escape_debug()),
        }
    }

    pub(super) fn skip_blanks(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start_matches(is_blank).len();
    }

    /// The next character after blanks, not consumed.
    pub(super) fn peek(&mut self) -> Option<char> {
        self.skip_blanks();
        self.rest().chars().next()
    }

    /// Consumes `c` if it comes next.
    pub(super) fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += c.len_utf8();
            true
        } else {
            false
        }
    }

    pub(super) fn expect(&mut self, c: char, context: &str) -> Result<()> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.expected(&format!("`{c}` {context}")))
        }
    }

    pub(super) fn expect_end(&mut self) -> Result<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.expected("end of line")),
        }
    }

    /// A bare word (`[A-Za-z0-9_.]+`), if one comes next.
    pub(super) fn word(&mut self) -> Option<&'a str> {
        self.skip_blanks();
        let rest = self.rest();
        let len = rest.find(|c: char| !is_word_char(c)).unwrap_or(rest.len());
        (len > 0).then(|| {
            self.pos += len;
            &rest[..len]
        })
    }

    /// Consumes the keyword `kw` if it is the next word.
    pub(super) fn keyword(&mut self, kw: &str) -> bool {
        let start = self.pos;
        match self.word() {
            Some(w) if w == kw => true,
            _ => {
                self.pos = start;
                false
            }
        }
    }

    /// A word that must be a plain name (an op, attribute or dtype name).
    pub(super) fn expect_word(&mut self, what: &str) -> Result<&'a str> {
        let start = self.pos;
        match self.word() {
            Some(w) if is_plain_name(w) => Ok(w),
            _ => {
                self.pos = start;
                Err(self.expected(what))
            }
        }
    }

    /// The text of a number, if one comes next: `-`? then digits with an
    /// optional fraction and exponent, or `inf`/`nan`. Its meaning is the
    /// caller's (which integer type, or a float).
    pub(super) fn number(&mut self) -> Option<&'a str> {
        self.skip_blanks();
        let rest = self.rest();
        let sign = usize::from(rest.starts_with('-'));
        let body = &rest[sign..];
        let len = if body.starts_with("inf") || body.starts_with("nan") {
            3
        } else {
            decimal_len(body)
        };
        let end = sign + len;
        let word_follows = rest[end..].starts_with(|c: char| c.is_ascii_alphanumeric());
        if len == 0 || word_follows {
            return None;
        }
        self.pos += end;
        Some(&rest[..end])
    }

    /// A JSON string (`"a \"b\""`), if one comes next.
    pub(super) fn string(&mut self) -> Result<Option<String>> {
        if self.peek() != Some('"') {
            return Ok(None);
        }
        let start = self.pos;
        let len = string_len(self.rest())
            .ok_or_else(|| self.error_at(start, "unterminated string: no closing `\"`"))?;
        let literal = &self.rest()[..len];
        let value = serde_json::from_str::<String>(literal)
            .map_err(|e| self.error_at(start, format!("bad string {literal}: {e}")))?;
        self.pos += len;
        Ok(Some(value))
    }

    /// A name: a bare word or a JSON string.
    pub(super) fn name(&mut self, what: &str) -> Result<String> {
        match self.string()? {
            Some(s) => Ok(s),
            None => self.expect_word(what).map(str::to_string),
        }
    }

    /// A value reference `%x` or `%3`: the label without its `%`.
    pub(super) fn label(&mut self) -> Result<&'a str> {
        self.expect('%', "starting a value name like `%x`")?;
        let rest = self.rest();
        let len = match rest.chars().next() {
            Some(c) if c.is_ascii_digit() => rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len()),
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {
                rest.find(|c: char| !is_word_char(c)).unwrap_or(rest.len())
            }
            _ => return Err(self.expected("a value name after `%`")),
        };
        self.pos += len;
        Ok(&rest[..len])
    }
}

/// Length of `digits[.digits][(e|E)[+|-]digits]` at the start of `s`.
fn decimal_len(s: &str) -> usize {
    let digits = |from: usize| {
        s[from..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(s.len() - from)
    };
    let mut len = digits(0);
    if len == 0 {
        return 0;
    }
    if s[len..].starts_with('.') {
        len += 1 + digits(len + 1);
    }
    if s[len..].starts_with(['e', 'E']) {
        let sign = usize::from(s[len + 1..].starts_with(['+', '-']));
        let exp = digits(len + 1 + sign);
        if exp > 0 {
            len += 1 + sign + exp;
        }
    }
    len
}

/// Length of the JSON string at the start of `s` (quotes included).
fn string_len(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i + 1),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cursor(text: &str) -> Cursor<'_> {
        Cursor::new(text, 1, Arc::from("<t>"))
    }

    #[test]
    fn numbers() {
        for (text, lexeme) in [
            ("12,", "12"),
            ("-3.5e-7]", "-3.5e-7"),
            ("1e20 ", "1e20"),
            ("-inf", "-inf"),
            ("nan}", "nan"),
            ("2.", "2."),
        ] {
            assert_eq!(cursor(text).number(), Some(lexeme), "{text}");
        }
        for text in ["infinity", "x1", "-", "12abc", ".5"] {
            assert_eq!(cursor(text).number(), None, "{text}");
        }
    }

    #[test]
    fn strings_and_names() {
        let mut c = cursor(r#" "a \"b\" c" rest"#);
        assert_eq!(c.string().unwrap().as_deref(), Some("a \"b\" c"));
        assert_eq!(c.name("a name").unwrap(), "rest");
        let err = cursor(r#""open \""#).string().unwrap_err();
        assert!(err.to_string().contains("unterminated string"), "{err}");
        assert!(is_plain_name("layer1.weight"));
        assert!(!is_plain_name("3x") && !is_plain_name("") && !is_plain_name("a b"));
    }

    #[test]
    fn columns_count_characters() {
        let mut c = cursor("é  x");
        c.skip_blanks();
        assert_eq!(c.word(), None);
        c.advance('é'.len_utf8());
        assert_eq!(
            c.expected("`y`").to_string(),
            "expected `y`, found `x` (at <t>:1:4)"
        );
    }

    #[test]
    fn long_tokens_are_cut_in_messages() {
        let long = format!("{} ", "w".repeat(40));
        let err = cursor(&long).expected("`y`").to_string();
        assert!(
            err.contains(&format!("found `{}…`", "w".repeat(32))),
            "{err}"
        );
    }
}
