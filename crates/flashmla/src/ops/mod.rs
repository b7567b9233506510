//! Public operations.
