//! sparse_bwd reference (work in progress).
