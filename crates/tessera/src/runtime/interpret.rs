//! Runs a graph node by node on the CPU. (stub: being written)
