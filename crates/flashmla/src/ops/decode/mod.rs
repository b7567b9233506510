//! decode (work in progress).
