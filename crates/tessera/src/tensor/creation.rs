//! Creating tensors. (being written)
