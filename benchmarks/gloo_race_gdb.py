"""A gdb script (``gdb -p PID -iex "set non-stop on" -x benchmarks/gloo_race_gdb.py``) that pauses each gloo worker
thread for 2 ms inside the window where torch 2.13.0's ``ProcessGroupGloo::runLoop`` updates the group's status
without a lock: after it has read ``pgStatus_->lastCompletedWorkName``'s buffer pointer and before it replaces it
(``runLoop(int)+507`` in the CPU wheel's ``libtorch_cpu.so``; ``--at`` chooses another point). In non-stop mode only
the paused thread waits, as if the scheduler had preempted it there; the rank's other worker runs on.
``benchmarks/repro_gloo_heap_corruption.py --gdb-pause`` attaches it to rank 0. Prints how many pauses, and on a
crash the signal and the crashing thread's stack."""

import os
import time

import gdb  # noqa: F401 - provided by gdb

AT = os.environ.get("GLOO_RACE_AT", "*('c10d::ProcessGroupGloo::runLoop(int)'+507)")
PAUSE_S = float(os.environ.get("GLOO_RACE_PAUSE_S", "0.002"))


class Pause(gdb.Breakpoint):
    hits = 0

    def stop(self):
        Pause.hits += 1
        time.sleep(PAUSE_S)
        return False  # go on: only this thread waited


def on_stop(event):
    sig = getattr(event, "stop_signal", None)
    if sig in ("SIGABRT", "SIGSEGV", "SIGBUS"):
        print(f"gdb: {sig} after {Pause.hits} pauses", flush=True)
        gdb.execute("bt 20")


gdb.execute("set pagination off")
Pause(AT)
gdb.events.stop.connect(on_stop)
gdb.events.exited.connect(lambda event: print(f"gdb: rank exited after {Pause.hits} pauses", flush=True))
deadline = time.time() + float(os.environ.get("GLOO_RACE_SECONDS", "600"))
while time.time() < deadline:
    try:
        gdb.execute("continue -a")
    except gdb.error as e:
        if "not being run" in str(e) or "No process" in str(e):
            break
        time.sleep(0.01)
