//! Op methods. (being written)
