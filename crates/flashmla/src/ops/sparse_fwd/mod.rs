//! sparse_fwd (work in progress).
