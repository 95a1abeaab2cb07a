"""A use-after-free in torch's compiler on a CUDA build of torch without a CUDA device, kept from happening.

When ``torch.compile`` traces a function and no CUDA device is visible, its fake tensors install a stand-in CUDA
device guard (``torch._C._ensureCUDADeviceGuardSet``) that is owned by the *calling thread* (a C++
``thread_local``) but registered for the whole process. When that thread exits, the registry keeps a pointer to the
freed guard, and the next trace in any other thread calls through it: a segmentation fault. torch 2.11 (PyPI's
wheels are CUDA builds) does this (upstream: pytorch/pytorch#178950, "Fix use after free in
ensureCUDADeviceGuardSet"). The engine meets it on a machine without a GPU: its lanes are threads that build kernels
(the landing, the window's sum) and end when the engine closes, so the next engine's first kernel build, or any later
``torch.compile`` in the process, crashed.

:func:`keep_cuda_guard` installs the stand-in once, from a thread that lives as long as the process (the main
thread, or else a thread of its own that waits forever), before the engine builds anything: later traces find a
guard that is never freed and install none. A CPU build of torch has no CUDA guard to stand in for, and with a CUDA
device visible nothing is installed; then this does nothing.
"""

from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_DONE = False


def keep_cuda_guard() -> None:
    """Install torch's stand-in CUDA device guard from a thread that never exits (once per process)."""
    global _DONE
    with _LOCK:
        if _DONE:
            return
        _DONE = True
        ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
        if ensure is None or torch.version.cuda is None or torch.cuda.is_available():
            return
        if threading.current_thread() is threading.main_thread():
            ensure()
            return
        installed = threading.Event()

        def hold() -> None:
            ensure()
            installed.set()
            threading.Event().wait()  # the guard lives as long as this thread: the process's lifetime

        threading.Thread(target=hold, name="zenflow-cuda-guard", daemon=True).start()
        installed.wait()
