//! GPU plumbing.
