//! The text form of the IR (printer and parser).
