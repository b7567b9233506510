//! Timing with CUDA events on the [`Gpu`]'s stream.

use super::device::Gpu;
use super::driver::check;
use crate::error::Result;
use cudarc::driver::sys;

/// A CUDA event, destroyed on drop.
struct Event(sys::CUevent);

impl Event {
    fn new() -> Result<Event> {
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: creates a timing-enabled event in the current context; writes one handle.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
        })?;
        Ok(Event(e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `Event::new`, destroyed once; a pending record completes first.
        unsafe {
            sys::cuEventDestroy_v2(self.0);
        }
    }
}

impl Gpu {
    /// Times `f` with CUDA events: `warmup` untimed calls, then `reps` calls each bracketed by its own event pair
    /// on this handle's stream. Returns the `reps` per-call times in milliseconds (GPU time between the events,
    /// so `f` must queue its work on this handle's stream; host work inside `f` between launches counts only
    /// when it delays the launches). Waits for the stream once, at the end.
    pub fn time_ms(
        &self,
        warmup: usize,
        reps: usize,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f32>> {
        self.inner.bind()?;
        for _ in 0..warmup {
            f()?;
        }
        let mut pairs = Vec::with_capacity(reps);
        for _ in 0..reps {
            pairs.push((Event::new()?, Event::new()?));
        }
        let stream = self.inner.stream;
        for (start, end) in &pairs {
            // SAFETY: live events and stream of this context.
            check("cuEventRecord", unsafe {
                sys::cuEventRecord(start.0, stream)
            })?;
            f()?;
            self.inner.bind()?; // `f` may have bound another context on this thread
                                // SAFETY: as above.
            check("cuEventRecord", unsafe {
                sys::cuEventRecord(end.0, stream)
            })?;
        }
        if let Some((_, last)) = pairs.last() {
            // SAFETY: a recorded event.
            check("cuEventSynchronize", unsafe {
                sys::cuEventSynchronize(last.0)
            })?;
        }
        pairs
            .iter()
            .map(|(start, end)| {
                let mut ms = 0f32;
                // SAFETY: both events were recorded on one stream and have completed.
                check("cuEventElapsedTime", unsafe {
                    sys::cuEventElapsedTime_v2(&mut ms, start.0, end.0)
                })?;
                Ok(ms)
            })
            .collect()
    }
}
