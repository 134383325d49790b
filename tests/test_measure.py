"""The measuring worker: torch baselines, kernels checked then timed, timeouts that do not kill
the tuner, and a short real tuning run end to end."""
import pytest

from maco import ConvSpec, MacoError, Target
from maco.tune.measure import MeasureConfig, Measurer

TINY = ConvSpec.parse("n1_c8_h10_w10_k16_r3_p1")
BIG = ConvSpec.parse("n8_c256_h56_w56_k256_r3_p1")  # ~60 GFLOP: seconds on 2 cores


@pytest.fixture(scope="module")
def measurer():
    with Measurer(Target.host(), MeasureConfig(repeats=2, min_run_time=1e-4, timeout=60)) as m:
        yield m


def test_torch_baseline_in_both_layouts(measurer):
    for layout in ("NCHW", "NHWC"):
        timing, error = measurer.baseline(TINY, layout)
        assert error is None and timing.median > 0 and timing.repeats == 2 * 3  # per round x rounds
        # beside the FMA loop doing the same flops, in the same rounds (maco.core.timing)
        assert timing.referenced and timing.reference > 0 and timing.ratio > 0


def test_a_hung_job_times_out_and_the_worker_comes_back():
    with Measurer(Target.host(), MeasureConfig(repeats=50, min_run_time=1.0, timeout=1.0)) as m:
        timing, error = m.baseline(BIG, "NCHW")
        assert timing is None and "timed out after 1 s" in error
        m.config = MeasureConfig(repeats=1, min_run_time=1e-4, timeout=60)
        timing, error = m.baseline(TINY, "NCHW")
        assert error is None and timing.median > 0


def test_kernels_are_checked_and_timed(measurer):
    kernels = pytest.importorskip("maco.kernels")
    if not hasattr(kernels, "build_many"):
        pytest.skip("the CPU kernel backend is not installed in this checkout")
    host = Target.host()
    schedules = [kernels.default_schedule(TINY, host, layout) for layout in ("NCHW", "NHWC")]
    results = measurer(TINY, schedules, host)
    assert [e for _, e in results] == [None, None]
    assert all(t.median > 0 for t, _ in results)


def test_measurer_refuses_another_target(measurer):
    from maco import MacoError

    with pytest.raises(MacoError, match="h100"):
        measurer(TINY, [], Target.h100())


def test_measuring_on_a_gpu_target_without_a_gpu_fails_at_once():
    from maco.kernels.cuda import gpu_available

    if gpu_available():
        pytest.skip("a GPU is usable here: nothing to refuse")
    with pytest.raises(MacoError, match="needs an NVIDIA GPU with CuPy"):
        Measurer(Target.h100())
