//! decode reference (work in progress).
