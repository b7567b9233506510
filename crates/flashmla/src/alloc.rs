//! Fallible host allocation: the CPU path sizes its buffers from user-given shapes, so a buffer that cannot be
//! allocated is an [`Error::OutOfHostMemory`] naming what it was for, never an abort of the process (which is what
//! `vec![x; n]` does when the allocator fails).

use crate::error::{Error, Result};

/// The error of a failed allocation of `n` elements of `T`.
fn out_of_memory<T>(what: &str, n: usize) -> Error {
    Error::OutOfHostMemory {
        what: what.to_string(),
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
    }
}

/// An empty vector with room for `n` elements, or [`Error::OutOfHostMemory`].
pub fn try_with_capacity<T>(what: &str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| out_of_memory::<T>(what, n))?;
    Ok(v)
}

/// Makes `v` hold exactly `n` copies of `value`, reusing its allocation (scratch buffers), or
/// [`Error::OutOfHostMemory`].
pub fn try_refill<T: Clone>(v: &mut Vec<T>, what: &str, n: usize, value: T) -> Result<()> {
    v.clear();
    v.try_reserve_exact(n)
        .map_err(|_| out_of_memory::<T>(what, n))?;
    v.resize(n, value);
    Ok(())
}

/// Empties `v` and makes room for `n` elements, reusing its allocation, or [`Error::OutOfHostMemory`].
pub fn try_clear_for<T>(v: &mut Vec<T>, what: &str, n: usize) -> Result<()> {
    v.clear();
    v.try_reserve(n).map_err(|_| out_of_memory::<T>(what, n))
}

/// `n` copies of `value`, or [`Error::OutOfHostMemory`].
pub fn try_filled<T: Clone>(what: &str, n: usize, value: T) -> Result<Vec<T>> {
    let mut v = try_with_capacity(what, n)?;
    v.resize(n, value);
    Ok(v)
}

/// `f(i)` for every `i` in `0..n`, or [`Error::OutOfHostMemory`].
pub fn try_from_fn<T>(what: &str, n: usize, f: impl FnMut(usize) -> T) -> Result<Vec<T>> {
    let mut v = try_with_capacity(what, n)?;
    v.extend((0..n).map(f));
    Ok(v)
}

/// The items of an iterator of known length `n` (at most `n` are taken), or [`Error::OutOfHostMemory`].
pub fn try_collect<T>(what: &str, n: usize, items: impl IntoIterator<Item = T>) -> Result<Vec<T>> {
    let mut v = try_with_capacity(what, n)?;
    v.extend(items.into_iter().take(n));
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_allocation_is_an_error_naming_its_purpose() {
        // 2^61 f32 = 8 EiB: more than any address space; `vec!` would abort the process.
        let n = 1usize << 61;
        let err = try_filled::<f32>("test buffer", n, 0.0).unwrap_err();
        assert_eq!(
            err,
            Error::OutOfHostMemory {
                what: "test buffer".into(),
                bytes: n * 4
            }
        );
        assert!(err.to_string().contains("test buffer"), "{err}");
        // A size whose byte count overflows usize saturates in the message instead of wrapping.
        match try_with_capacity::<u64>("huge", usize::MAX).unwrap_err() {
            Error::OutOfHostMemory { bytes, .. } => assert_eq!(bytes, usize::MAX),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn small_allocations_hold_the_requested_values() {
        assert_eq!(try_filled("v", 3, 7u8).unwrap(), vec![7, 7, 7]);
        assert_eq!(try_from_fn("v", 4, |i| i * 2).unwrap(), vec![0, 2, 4, 6]);
        assert_eq!(try_collect("v", 2, [1, 2, 3]).unwrap(), vec![1, 2]);
        assert!(try_with_capacity::<u32>("v", 5).unwrap().capacity() >= 5);
        let mut v = vec![1, 2, 3];
        try_refill(&mut v, "v", 2, 9).unwrap();
        assert_eq!(v, vec![9, 9]);
        try_clear_for(&mut v, "v", 10).unwrap();
        assert!(v.is_empty() && v.capacity() >= 10);
        assert!(matches!(
            try_refill(&mut v, "scratch", 1 << 61, 0u64),
            Err(Error::OutOfHostMemory { .. })
        ));
    }
}
