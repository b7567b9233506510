//! What the GPU's clocks and power do while a benchmark runs, read through NVML (`libnvidia-ml`, loaded at run
//! time; without it every reading is simply absent).
//!
//! Why the bench needs it: an H100 that is busy for more than ~100 ms at full tensor load reaches its power cap and
//! lowers the SM clock (1980 MHz down to ~1250-1600 MHz on our card), so the same kernel times ~10% apart depending on
//! how long the card has been busy. Each record therefore carries the SM clock the run actually had.

use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

type NvmlDevice = *mut c_void;
type NvmlReturn = c_int;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_CLOCK_SM: c_int = 1;
/// `nvmlClocksEventReason*` bits and the names the records use. GPU idle (bit 0) is left out: between launches the
/// card is idle by definition.
const REASONS: [(u64, &str); 8] = [
    (0x2, "applications_clocks"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
];
/// How often the sampler reads the clock while a run is being timed.
const SAMPLE_PERIOD: Duration = Duration::from_millis(5);

type InitFn = unsafe extern "C" fn() -> NvmlReturn;
type ByBusIdFn = unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> NvmlReturn;
type ClockFn = unsafe extern "C" fn(NvmlDevice, c_int, *mut c_uint) -> NvmlReturn;
type UintFn = unsafe extern "C" fn(NvmlDevice, *mut c_uint) -> NvmlReturn;
type ReasonsFn = unsafe extern "C" fn(NvmlDevice, *mut c_ulonglong) -> NvmlReturn;
type EnergyFn = unsafe extern "C" fn(NvmlDevice, *mut c_ulonglong) -> NvmlReturn;

/// One device as NVML sees it. NVML is initialised for as long as this lives (its shutdown is reference-counted).
pub struct Nvml {
    _lib: Library,
    shutdown: InitFn,
    device: NvmlDevice,
    clock: ClockFn,
    power: UintFn,
    power_limit: UintFn,
    reasons: Option<ReasonsFn>,
    energy: Option<EnergyFn>,
}

// SAFETY: NVML's entry points are thread-safe; the device handle is an opaque identifier valid until shutdown,
// which only `Drop` calls.
unsafe impl Send for Nvml {}
// SAFETY: as above.
unsafe impl Sync for Nvml {}

impl Nvml {
    /// NVML's view of a CUDA device (matched by PCI bus id), or `None` without NVML or a bus id.
    pub fn for_device(info: &flashmla::cuda::DeviceInfo) -> Option<Nvml> {
        Self::for_bus_id(info.pci_bus_id.as_deref()?)
    }

    /// NVML's handle of the device with this PCI bus id (as the CUDA driver writes it), or `None` when NVML is
    /// missing or does not know the device.
    fn for_bus_id(bus_id: &str) -> Option<Nvml> {
        // SAFETY: loading the system's NVML runs its initialisers, which have no preconditions.
        let lib = unsafe { Library::new("libnvidia-ml.so.1") }.ok()?;
        // SAFETY: each symbol is looked up with its documented C signature (nvml.h).
        unsafe {
            let init: InitFn = *lib.get::<InitFn>(b"nvmlInit_v2\0").ok()?;
            let shutdown: InitFn = *lib.get::<InitFn>(b"nvmlShutdown\0").ok()?;
            let by_bus: ByBusIdFn = *lib
                .get::<ByBusIdFn>(b"nvmlDeviceGetHandleByPciBusId_v2\0")
                .ok()?;
            let clock: ClockFn = *lib.get::<ClockFn>(b"nvmlDeviceGetClockInfo\0").ok()?;
            let power: UintFn = *lib.get::<UintFn>(b"nvmlDeviceGetPowerUsage\0").ok()?;
            let power_limit: UintFn = *lib
                .get::<UintFn>(b"nvmlDeviceGetEnforcedPowerLimit\0")
                .ok()?;
            let reasons = lib
                .get::<ReasonsFn>(b"nvmlDeviceGetCurrentClocksEventReasons\0")
                .or_else(|_| lib.get::<ReasonsFn>(b"nvmlDeviceGetCurrentClocksThrottleReasons\0"))
                .ok()
                .map(|f| *f);
            let energy = lib
                .get::<EnergyFn>(b"nvmlDeviceGetTotalEnergyConsumption\0")
                .ok()
                .map(|f| *f);
            if init() != NVML_SUCCESS {
                return None;
            }
            // The CUDA driver writes a 4-digit PCI domain, NVML an 8-digit one; try both spellings.
            let mut device: NvmlDevice = std::ptr::null_mut();
            let found = [bus_id.to_string(), format!("0000{bus_id}")]
                .iter()
                .any(|id| {
                    CString::new(id.as_str())
                        .is_ok_and(|c| by_bus(c.as_ptr(), &mut device) == NVML_SUCCESS)
                });
            if !found || device.is_null() {
                shutdown();
                return None;
            }
            Some(Nvml {
                _lib: lib,
                shutdown,
                device,
                clock,
                power,
                power_limit,
                reasons,
                energy,
            })
        }
    }

    /// The SM clock now, MHz.
    pub fn sm_clock_mhz(&self) -> Option<u32> {
        let mut v: c_uint = 0;
        // SAFETY: valid handle (see `for_bus_id`), one output value.
        (unsafe { (self.clock)(self.device, NVML_CLOCK_SM, &mut v) } == NVML_SUCCESS).then_some(v)
    }

    /// Board power, watts, as NVML reports it (on H100 an average over up to a second).
    pub fn power_w(&self) -> Option<f64> {
        let mut mw: c_uint = 0;
        // SAFETY: as above.
        (unsafe { (self.power)(self.device, &mut mw) } == NVML_SUCCESS).then_some(mw as f64 / 1e3)
    }

    /// The power limit the driver enforces, watts.
    pub fn power_limit_w(&self) -> Option<f64> {
        let mut mw: c_uint = 0;
        // SAFETY: as above.
        (unsafe { (self.power_limit)(self.device, &mut mw) } == NVML_SUCCESS)
            .then_some(mw as f64 / 1e3)
    }

    /// Energy the board used since the driver loaded, joules (millijoule resolution).
    pub fn energy_j(&self) -> Option<f64> {
        let f = self.energy?;
        let mut mj: c_ulonglong = 0;
        // SAFETY: as above.
        (unsafe { f(self.device, &mut mj) } == NVML_SUCCESS).then_some(mj as f64 / 1e3)
    }

    /// Why the clocks are below their maximum now (`nvmlClocksEventReason*` bits).
    fn reasons(&self) -> u64 {
        let Some(f) = self.reasons else { return 0 };
        let mut v: c_ulonglong = 0;
        // SAFETY: as above.
        if unsafe { f(self.device, &mut v) } == NVML_SUCCESS {
            v
        } else {
            0
        }
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: balances the successful nvmlInit_v2 of `for_bus_id`.
        unsafe { (self.shutdown)() };
    }
}

/// The SM clock and power seen while a run was timed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClockStats {
    /// Mean and lowest SM clock over the samples, MHz.
    pub mean_mhz: f64,
    pub min_mhz: u32,
    /// Highest board power seen, watts.
    pub max_power_w: f64,
    /// Names of the clock-lowering reasons seen (see `REASONS`).
    pub reasons: Vec<String>,
    /// Board energy over the sampled interval, joules, and the number of op calls it covered (0: not measured).
    pub energy_j: f64,
    pub calls: usize,
    /// Number of samples.
    pub samples: usize,
}

impl ClockStats {
    /// Board energy per op call, joules, when it was measured.
    pub fn joules_per_call(&self) -> Option<f64> {
        (self.calls > 0 && self.energy_j > 0.0).then(|| self.energy_j / self.calls as f64)
    }

    /// Merges another run's samples into these (rounds of an `--ab` comparison).
    pub fn merge(&mut self, o: &ClockStats) {
        let n = self.samples + o.samples;
        if n == 0 {
            return;
        }
        self.mean_mhz =
            (self.mean_mhz * self.samples as f64 + o.mean_mhz * o.samples as f64) / n as f64;
        self.min_mhz = if self.samples == 0 {
            o.min_mhz
        } else if o.samples == 0 {
            self.min_mhz
        } else {
            self.min_mhz.min(o.min_mhz)
        };
        self.max_power_w = self.max_power_w.max(o.max_power_w);
        self.energy_j += o.energy_j;
        self.calls += o.calls;
        for r in &o.reasons {
            if !self.reasons.contains(r) {
                self.reasons.push(r.clone());
            }
        }
        self.samples = n;
    }
}

#[derive(Default)]
struct Acc {
    sum_mhz: f64,
    min_mhz: u32,
    max_power_w: f64,
    reasons: u64,
    samples: usize,
}

impl Acc {
    fn sample(&mut self, nvml: &Nvml) {
        if let Some(mhz) = nvml.sm_clock_mhz() {
            self.min_mhz = if self.samples == 0 {
                mhz
            } else {
                self.min_mhz.min(mhz)
            };
            self.sum_mhz += mhz as f64;
            self.samples += 1;
        }
        if let Some(w) = nvml.power_w() {
            self.max_power_w = self.max_power_w.max(w);
        }
        self.reasons |= nvml.reasons();
    }

    fn stats(&self) -> ClockStats {
        ClockStats {
            mean_mhz: if self.samples > 0 {
                self.sum_mhz / self.samples as f64
            } else {
                0.0
            },
            min_mhz: self.min_mhz,
            max_power_w: self.max_power_w,
            reasons: REASONS
                .iter()
                .filter(|(bit, _)| self.reasons & bit != 0)
                .map(|(_, name)| name.to_string())
                .collect(),
            energy_j: 0.0,
            calls: 0,
            samples: self.samples,
        }
    }
}

/// A background thread that samples the clock every few milliseconds until `stop`.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Acc>,
    nvml: Arc<Nvml>,
    energy0: Option<f64>,
}

impl Sampler {
    /// Starts sampling (one sample right away, then every `SAMPLE_PERIOD`).
    pub fn start(nvml: &Arc<Nvml>) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let energy0 = nvml.energy_j();
        let (flag, dev) = (stop.clone(), nvml.clone());
        let thread = std::thread::spawn(move || {
            let mut acc = Acc::default();
            acc.sample(&dev);
            while !flag.load(Ordering::Acquire) {
                std::thread::sleep(SAMPLE_PERIOD);
                acc.sample(&dev);
            }
            acc
        });
        Sampler {
            stop,
            thread,
            nvml: nvml.clone(),
            energy0,
        }
    }

    /// Stops sampling (one last sample) and summarises the `calls` op calls made meanwhile; `None` if nothing
    /// could be read.
    pub fn stop(self, calls: usize) -> Option<ClockStats> {
        self.stop.store(true, Ordering::Release);
        let mut acc = self.thread.join().ok()?;
        acc.sample(&self.nvml);
        let mut stats = (acc.samples > 0).then(|| acc.stats())?;
        if let (Some(e0), Some(e1)) = (self.energy0, self.nvml.energy_j()) {
            if e1 > e0 {
                stats.energy_j = e1 - e0;
                stats.calls = calls;
            }
        }
        Some(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(mean: f64, min: u32, power: f64, reasons: &[&str], n: usize) -> ClockStats {
        ClockStats {
            mean_mhz: mean,
            min_mhz: min,
            max_power_w: power,
            reasons: reasons.iter().map(|s| s.to_string()).collect(),
            energy_j: n as f64,
            calls: n,
            samples: n,
        }
    }

    #[test]
    fn merging_weights_means_by_samples_and_unions_reasons() {
        let mut a = stats(1980.0, 1980, 400.0, &[], 1);
        a.merge(&stats(1600.0, 1400, 710.0, &["sw_power_cap"], 3));
        assert_eq!(a, stats(1695.0, 1400, 710.0, &["sw_power_cap"], 4));
        assert_eq!(a.joules_per_call(), Some(1.0));
        let mut empty = ClockStats::default();
        empty.merge(&a);
        assert_eq!(empty, a);
        a.merge(&ClockStats::default());
        assert_eq!(a.samples, 4);
        assert_eq!(a.min_mhz, 1400);
    }

    #[test]
    fn reasons_are_named_without_idle() {
        let acc = Acc {
            sum_mhz: 3000.0,
            min_mhz: 1400,
            max_power_w: 700.0,
            reasons: 0x1 | 0x4 | 0x40,
            samples: 2,
        };
        let s = acc.stats();
        assert_eq!(s.reasons, vec!["sw_power_cap", "hw_thermal"]);
        assert_eq!(s.mean_mhz, 1500.0);
    }
}
