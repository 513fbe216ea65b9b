"""GPU busy fraction: sampled off the training loop's thread, averaged per log window and overall."""

import threading
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


def test_busy_meter_reads_off_the_callers_thread():
    """A window with no sample of its own repeats the latest one and reads nothing on the caller's
    thread (a read can take tens of milliseconds: the training loop would wait for it)."""
    caller = threading.get_ident()
    readers: list[int] = []
    readings = iter([0.0, 70.0, 80.0] + [90.0] * 1000)

    def read():
        readers.append(threading.get_ident())
        return next(readings)

    meter = BusyMeter(read, interval=0.05)
    assert meter.start()  # the probe, read here, is no sample
    assert meter.window() is None  # nothing sampled yet
    _wait_for(lambda: len(readers) >= 2)
    first = meter.window()
    assert first is not None and first >= 70.0
    assert meter.window() == meter._latest  # no new sample: the latest repeated
    meter.stop()
    assert readers[0] == caller and caller not in readers[1:]
    assert meter.window() is None
