"""XLA's CPU backend without LLVM's optimisation and without the concurrency-optimised scheduler for every test
process (pytest's workers, train.py launches, the multi-host processes, the notebooks' kernels), and in pytest's
workers also without the new fusion emitters. Compiling dominates the suite's tiny programs: measured on test_model.py
+ test_pallas.py with a cold cache, 2 workers: XLA's defaults 181 s wall (321 s user CPU), without LLVM's optimisation
134 s (235 s); the fusion-emitter and scheduler flags on top of that 177 -> 127 s wall, 318 -> 221 s user CPU (one
machine, one after the other, 2026-12-07; load average 0.89 before, 2.95 after: the two runs' own workers); a cold
10-step train.py run of configs/tiny.py 35.8 -> 23.0 s without LLVM's optimisation. The compiled code runs slower (a
60-step train.py run of configs/tiny.py: about 10% slower per step with the two flags), so a test bound by running
rather than compiling passes its own XLA_FLAGS (the README's PPO demo at 6 layers: 255 s with the default, 362 s
without LLVM's optimisation; the other float stream of test_rl_e2e.py). The computation is the same, so results
agree with the default to float rounding; processes whose numbers a test compares bitwise use the same flags. The
subprocesses keep the fusion emitters: with the older emitters two programs that differ by one op are not bitwise
equal where they compute the same thing (test_reliability.py's NaN test compares the checkpoint of a run whose step
multiplies its loss by a NaN mask with the reference run's, and fails), and a train.py run's bitwise claims are about
the programs users compile. test_multihost.py's two processes and the notebooks' kernels take the workers' flags
(their numbers are compared with the worker's within a tolerance, or not at all; cold, alone: the multi-host test
98.8 -> 62.5 s, the notebooks 97 -> 74 s)."""
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_enable_concurrency_optimized_scheduler=false")
IN_PROCESS = "--xla_cpu_use_fusion_emitters=false"  # pytest's workers, the multi-host processes, the notebooks


def xla_flags(devices: int | None = None, worker: bool = False) -> str:
    """XLA_FLAGS for a test process: the fast-compile flags (a pytest worker's if `worker`) and, if given, that many
    virtual CPU devices."""
    return " ".join([FAST_COMPILE] + [IN_PROCESS] * worker
                    + [f"--xla_force_host_platform_device_count={devices}"] * bool(devices))
