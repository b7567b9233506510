//! sparse_bwd (work in progress).
