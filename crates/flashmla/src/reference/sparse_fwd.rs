//! sparse_fwd reference (work in progress).
