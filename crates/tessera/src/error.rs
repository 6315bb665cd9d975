//! The one error type of tessera.
//!
//! Every error names the op (where there is one), the shapes/dtypes involved
//! and, where known, the user's source line (captured with `#[track_caller]`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::panic::Location;
use std::sync::Arc;

/// A position in the user's source: the call site of an op, or a line and
/// column of a graph file.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SourceLoc {
    pub file: Arc<str>,
    pub line: u32,
    pub column: u32,
}

impl SourceLoc {
    pub fn from_location(loc: &Location<'_>) -> SourceLoc {
        SourceLoc {
            file: Arc::from(loc.file()),
            line: loc.line(),
            column: loc.column(),
        }
    }

    /// Like [`SourceLoc::from_location`], with the file name shared with the
    /// earlier locations of the same file on this thread: a trace records a
    /// location per op, thousands per call of a compiled function.
    pub fn from_static(loc: &'static Location<'static>) -> SourceLoc {
        thread_local! {
            static FILES: RefCell<HashMap<(usize, usize), Arc<str>>> = RefCell::new(HashMap::new());
        }
        let name = loc.file();
        // A `'static` file name never moves, so its address and length
        // identify it.
        let file = FILES.with(|f| {
            f.borrow_mut()
                .entry((name.as_ptr() as usize, name.len()))
                .or_insert_with(|| Arc::from(name))
                .clone()
        });
        SourceLoc {
            file,
            line: loc.line(),
            column: loc.column(),
        }
    }

    /// The call site of the innermost caller not marked `#[track_caller]`.
    #[track_caller]
    pub fn caller() -> SourceLoc {
        SourceLoc::from_location(Location::caller())
    }
}

thread_local! {
    static DISPATCHING: std::cell::Cell<Option<&'static Location<'static>>> =
        const { std::cell::Cell::new(None) };
}

/// Runs `f`, the dispatch of one eager op, with `caller` noted as the
/// user's line of that op: a backend that finds the op's error only later
/// (a CUDA kernel's bad index, reported at the next synchronisation) asks
/// [`dispatch_site`] while it queues the op, so the late error can still
/// name the line.
pub fn dispatching<T>(caller: &'static Location<'static>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<&'static Location<'static>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            DISPATCHING.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(DISPATCHING.with(|d| d.replace(Some(caller))));
    f()
}

thread_local! {
    static NODE_SITE: std::cell::RefCell<Option<SourceLoc>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f`, the interpreter's dispatch of one graph node, with the node's
/// own location (`at`: the user's line it was traced from, the model file's
/// node) as the line [`dispatch_site`] names, over the interpreter's line
/// that the dispatch itself notes.
pub fn dispatching_node<T>(at: Option<&SourceLoc>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<SourceLoc>);
    impl Drop for Restore {
        fn drop(&mut self) {
            NODE_SITE.with(|d| *d.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(NODE_SITE.with(|d| d.replace(at.cloned())));
    f()
}

/// The user's line of the eager op being dispatched on this thread (see
/// [`dispatching`], [`dispatching_node`]); `None` outside an eager dispatch
/// (a compiled run).
pub fn dispatch_site() -> Option<SourceLoc> {
    NODE_SITE
        .with(|d| d.borrow().clone())
        .or_else(|| DISPATCHING.with(|d| d.get().map(SourceLoc::from_static)))
}

impl fmt::Display for SourceLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.column)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Shapes that do not fit the op (broadcast, matmul, reshape, cat …).
    Shape,
    /// A dtype the op does not accept, or mismatched dtypes.
    DType,
    /// A bad argument: dim out of range, bad split, bad permutation …
    Argument,
    /// A malformed graph file or hint (the location is the line and column).
    Parse,
    /// A graph that breaks an IR invariant.
    Verify,
    /// File-system or format errors.
    Io,
    /// Something valid that is not supported (yet) — said plainly.
    Unsupported,
    /// A device failed: no driver, out of device memory, a kernel that did
    /// not compile or launch.
    Device,
    /// Host memory ran out: an allocation within the size limit (see
    /// [`crate::limits`]) that the system refused. The message names the
    /// bytes asked for.
    OutOfMemory,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Error {
    pub kind: ErrorKind,
    /// The op the error is about (`matmul`, `cat` …), if any.
    pub op: Option<String>,
    pub message: String,
    pub location: Option<SourceLoc>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            op: None,
            message: message.into(),
            location: None,
        }
    }

    /// An error about `op`.
    pub fn op(kind: ErrorKind, op: impl Into<String>, message: impl Into<String>) -> Error {
        Error {
            kind,
            op: Some(op.into()),
            message: message.into(),
            location: None,
        }
    }

    /// Attaches a location unless one is already set (the innermost wins).
    pub fn at(mut self, loc: SourceLoc) -> Error {
        if self.location.is_none() {
            self.location = Some(loc);
        }
        self
    }

    pub fn io(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Io, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(op) = &self.op {
            write!(f, "{op}: ")?;
        }
        f.write_str(&self.message)?;
        if let Some(loc) = &self.location {
            write!(f, " (at {loc})")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

/// Shorthand for returning an op error: `bail!(Shape, "matmul", "…")`.
macro_rules! op_err {
    ($kind:ident, $op:expr, $($fmt:tt)*) => {
        $crate::error::Error::op($crate::error::ErrorKind::$kind, $op, format!($($fmt)*))
    };
}
pub(crate) use op_err;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_locations_share_their_file_name() {
        let a = Location::caller();
        let b = Location::caller();
        let (x, y) = (SourceLoc::from_static(a), SourceLoc::from_static(b));
        assert!(
            Arc::ptr_eq(&x.file, &y.file),
            "one file name, one allocation"
        );
        assert_eq!(x, SourceLoc::from_location(a));
        assert_eq!(y, SourceLoc::from_location(b));
        assert_eq!(x.line + 1, y.line);
    }

    #[test]
    fn a_graph_nodes_location_is_the_dispatch_site_over_the_interpreters() {
        let node = SourceLoc {
            file: Arc::from("model.onnx"),
            line: 7,
            column: 0,
        };
        let inner = Location::caller();
        assert_eq!(dispatch_site(), None);
        let seen = dispatching_node(Some(&node), || dispatching(inner, dispatch_site));
        assert_eq!(seen, Some(node));
        assert_eq!(
            dispatching(inner, dispatch_site),
            Some(SourceLoc::from_static(inner))
        );
        assert_eq!(dispatch_site(), None, "restored");
    }
}
