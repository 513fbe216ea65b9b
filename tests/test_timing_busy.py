"""GPU busy fraction: sampled off the training loop's thread, averaged per log window and overall."""

import time

from tigon.timing import BusyMeter


def _wait_for(condition, timeout=5.0):
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.002)


def test_busy_meter_averages_each_window_and_the_whole_run():
    readings = iter([0.0] + [100.0] * 4 + [50.0] * 1000)
    seen = []

    def read():
        value = next(readings)
        seen.append(value)
        return value

    meter = BusyMeter(read, interval=0.001)
    assert meter.window() is None and meter.start()
    _wait_for(lambda: len(seen) >= 10)
    meter.stop()
    first = meter.window()
    # the probe in start() is not a sample; after it four 100s, then 50s
    assert 50.0 < first < 100.0 and meter.window() is None
    n = len(seen) - 1
    assert meter.overall() == (400.0 + 50.0 * (n - 4)) / n


def test_busy_meter_without_nvml_never_starts():
    meter = BusyMeter(lambda: None, interval=0.001)
    assert not meter.start() and meter._thread is None
    meter.stop()  # harmless
    assert meter.window() is None and meter.overall() is None


def test_busy_meter_window_shorter_than_the_interval_reads_once_now():
    """A run shorter than the sampling interval still gets a figure: one read at the window's end."""
    readings = iter([0.0, 70.0, 80.0])
    meter = BusyMeter(lambda: next(readings), interval=60.0)
    assert meter.start()  # the probe reads 0.0; the thread's first sample is a minute away
    assert meter.window() == 70.0 and meter.window() == 80.0
    meter.stop()
    assert meter.window() is None and meter.overall() is None
