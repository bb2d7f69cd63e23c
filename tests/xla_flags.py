"""XLA's CPU backend without LLVM's optimisation for every test process (pytest's workers, train.py launches, the
multi-host processes, the notebooks' kernels). Compiling dominates the suite's tiny programs: measured on
test_model.py + test_pallas.py with a cold cache, 2 workers, 181 -> 134 s wall (321 -> 235 s user CPU); a cold
10-step train.py run of configs/tiny.py 35.8 -> 23.0 s. The compiled code runs slower, so a test bound by running
rather than compiling passes its own XLA_FLAGS (test_documented_demo_learns: 255 s with the default, 362 s with
these; the other float stream of test_rl_e2e.py). The HLO passes are unchanged, so results agree with the default to
float rounding (a train.py run's losses to 6 digits); processes whose numbers a test compares use the same flags."""
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process: the fast-compile flags and, if given, that many virtual CPU devices."""
    return FAST_COMPILE + (f" --xla_force_host_platform_device_count={devices}" if devices else "")
