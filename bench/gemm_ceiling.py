"""The card's bf16 matrix-product ceiling at full clock and at the power cap.

The ceiling docs/benchmarking.md quotes (~800 TFLOPS, 8192^3 bf16 through PyTorch) is the rate of a short run on an
idle card. Under long full load an H100 reaches its board power cap and lowers its SM clock, so the same product runs
slower. This script times the product both ways on the card it finds, so that kernel figures taken in either regime
can be set against the ceiling of the same regime:

* full clock: idle ``--cooldown`` seconds, then ``--warmup`` + ``--reps`` products (about 15 ms of load), for
  ``--rounds`` rounds; the median of every round's timed products;
* sustained: ``--load`` seconds of back-to-back products first (the card reaches its cap), then ``--sustained-reps``
  timed products; their median.

It reads the SM clock, power and energy counter through NVML (``libnvidia-ml.so.1``, by ctypes) around each timed
block and prints one JSON record per regime (``--json FILE`` writes the list). Needs PyTorch with CUDA.
"""

import argparse
import ctypes
import datetime
import json
import statistics
import threading
import time

import torch


class Nvml:
    """The few NVML calls used here; every method returns None when NVML is missing."""

    def __init__(self, index):
        self.lib = None
        self.handle = ctypes.c_void_p()
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) == 0:
                self.lib = lib
        except OSError:
            pass

    def sm_clock_mhz(self):
        value = ctypes.c_uint()
        if self.lib is None or self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(value)) != 0:
            return None
        return value.value

    def power_w(self):
        value = ctypes.c_uint()
        if self.lib is None or self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(value)) != 0:
            return None
        return value.value / 1000.0

    def energy_j(self):
        value = ctypes.c_ulonglong()
        if self.lib is None or self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)) != 0:
            return None
        return value.value / 1000.0


class Sampler:
    """Samples the SM clock and power every 20 ms while a timed block runs."""

    def __init__(self, nvml):
        self.nvml = nvml
        self.clocks = []
        self.powers = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            clock, power = self.nvml.sm_clock_mhz(), self.nvml.power_w()
            if clock is not None:
                self.clocks.append(clock)
            if power is not None:
                self.powers.append(power)
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def summary(self):
        def mean(values):
            return round(statistics.fmean(values), 1) if values else None

        return {
            "sm_clock_mhz_mean": mean(self.clocks),
            "sm_clock_mhz_min": min(self.clocks) if self.clocks else None,
            "power_w_mean": mean(self.powers),
        }


def time_products(a, b, out, reps):
    """Per-product times in milliseconds (one event pair around each product)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        torch.matmul(a, b, out=out)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8192, help="the product is n x n x n")
    parser.add_argument("--cooldown", type=float, default=1.5, help="idle seconds before each full-clock round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10, help="timed products per full-clock round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", type=float, default=3.0, help="seconds of load before the sustained block")
    parser.add_argument("--sustained-reps", type=int, default=200)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()

    device = torch.cuda.current_device()
    nvml = Nvml(device)
    n = args.n
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    flop = 2.0 * n * n * n
    base = {
        "op": "gemm_bf16",
        "m": n,
        "n": n,
        "k": n,
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }

    def record(timing, times_ms, sampler, joules=None):
        median = statistics.median(times_ms)
        rec = dict(base, timing=timing, time_us=round(median * 1000.0, 1), tflops=round(flop / median / 1e9, 1))
        rec.update(sampler.summary())
        if joules is not None:
            rec["joules_per_product"] = round(joules / len(times_ms), 4)
        return rec

    records = []

    # Full clock: short blocks after idle.
    times = []
    with Sampler(nvml) as sampler:
        for _ in range(args.rounds):
            time.sleep(args.cooldown)
            for _ in range(args.warmup):
                torch.matmul(a, b, out=out)
            times += time_products(a, b, out, args.reps)
    rec = record("full-clock", times, sampler)
    rec.update(warmup=args.warmup, reps=args.reps, rounds=args.rounds, cooldown_s=args.cooldown)
    records.append(rec)

    # Sustained: load the card until it sits at its power cap, then time.
    deadline = time.perf_counter() + args.load
    while time.perf_counter() < deadline:
        for _ in range(20):
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize()
    with Sampler(nvml) as sampler:
        e0 = nvml.energy_j()
        times = time_products(a, b, out, args.sustained_reps)
        e1 = nvml.energy_j()
    joules = e1 - e0 if e0 is not None and e1 is not None else None
    rec = record("sustained", times, sampler, joules)
    rec.update(load_s=args.load, reps=args.sustained_reps)
    records.append(rec)

    for rec in records:
        print(json.dumps(rec))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
