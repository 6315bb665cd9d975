//! Errors unwound through a compiled function: the traced function returns
//! tensors, not results, so an error inside it (the training step's, a
//! compiled graph's interpreter) is [`raise`]d and turned back into an
//! error by [`catching`] around the call.

use std::panic::{self, AssertUnwindSafe};

use crate::error::{Error, Result};

/// The payload of a [`raise`]d error.
struct Raised(Error);

/// Unwinds with `e` to the nearest [`catching`].
pub(super) fn raise(e: Error) -> ! {
    panic::resume_unwind(Box::new(Raised(e)))
}

/// Runs `f`, returning an error [`raise`]d inside it as its error; any
/// other panic (the user's own code) passes on.
pub(super) fn catching<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => match payload.downcast::<Raised>() {
            Ok(raised) => Err(raised.0),
            Err(other) => panic::resume_unwind(other),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn a_raised_error_is_caught_and_other_panics_pass_on() {
        let e = catching(|| -> Result<()> {
            raise(Error::new(ErrorKind::Shape, "train_step: raised"))
        })
        .unwrap_err();
        assert_eq!(
            (e.kind, e.message.as_str()),
            (ErrorKind::Shape, "train_step: raised")
        );
        assert_eq!(catching(|| Ok(3)).unwrap(), 3);
        let other = panic::catch_unwind(|| catching(|| -> Result<()> { panic!("the user's") }));
        assert!(other.is_err());
    }
}
