"""The native kernels behind the eager functions' signatures: check what is passed, hand pointers to the library.

Each method takes what its eager function takes (``engine/host_step.py``, ``engine/kernels.py``, ``engine/device.py``)
and gives its bits (``row_col_sums``: its sums to float rounding, the same bits for every thread count), plus a
keyword-only ``threads`` (default ``torch.get_num_threads()``). What the library cannot take is refused by name with
the fix, before any memory is touched: a tensor that is not on the CPU, rows that are not contiguous, a dtype other
than fp32 and bf16 for the matrices (bool too for ``host_mask``), tables of another dtype or length, column indices
that are not int64.

The library runs with the GIL released (``ctypes``), so lane threads overlap their calls; a call whose region is small
runs on the calling thread alone, a larger one on a pool of the library's own (``zenflow_cpu.cpp``, "Threads").
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

_FP32 = torch.float32
_BF16 = torch.bfloat16
_MATRIX_DTYPES = (_FP32, _BF16)
_POINTER = ctypes.c_void_p
_INT = ctypes.c_int
_I64 = ctypes.c_int64
_F32 = ctypes.c_float
SIGNATURES = {
    "zf_variant_supported": (_INT,),
    "zf_set_limits": (_I64, _I64, _I64, _I64),
    "zf_adam_step": (_INT, _INT, _I64, _I64, _POINTER, _I64, _POINTER, _INT, _I64, _POINTER, _I64, _POINTER, _I64, _INT)
    + (_POINTER, _POINTER, _POINTER, _INT),
    "zf_moves": (_INT, _INT, _I64, _I64, _POINTER, _INT, _I64, _POINTER, _INT, _I64, _POINTER, _POINTER, _POINTER)
    + (_F32, _F32, _POINTER, _INT, _I64, _I64),
    "zf_landing": (_INT, _INT, _I64, _I64, _POINTER, _INT, _I64, _POINTER, _INT, _I64, _F32, _I64, _I64),
    "zf_accumulate": (
        _INT,
        _INT,
        _I64,
        _I64,
        _POINTER,
        _INT,
        _I64,
        _POINTER,
        _INT,
        _I64,
        _POINTER,
        _POINTER,
        _I64,
        _INT,
    ),
    "zf_row_col_sums": (_INT, _INT, _I64, _I64, _POINTER, _INT, _I64, _POINTER, _POINTER, _POINTER),
    "zf_columns": (_INT, _INT, _INT, _I64, _I64, _POINTER, _INT, _I64, _POINTER, _I64, _POINTER, _I64),
}
"""The library's C functions and their argument types (``zenflow_cpu.cpp``, the API section)."""


class NativeArgumentError(ValueError):
    """An argument the native kernels cannot take; the message names it and the fix."""


def declare(library: ctypes.CDLL) -> None:
    """Set the argument types of the library's functions (ctypes then converts Python ints and floats itself)."""
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int if name != "zf_set_limits" else None


def _matrix(tensor: torch.Tensor, name: str, shape: tuple[int, int] | None, written: bool) -> tuple[int, int, int]:
    """``(pointer, row stride, is bf16)`` of a 2-D CPU tensor with contiguous rows, after the checks (a few hundred
    nanoseconds: the engine calls the kernels once per matrix per step)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cpu:
        where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise NativeArgumentError(
            f"{name} is on {where}: the native kernels take CPU tensors; run the eager or compiled kernel "
            "(engine/kernels.py) for other devices."
        )
    size = tensor.shape
    if len(size) != 2 or (shape is not None and size != shape):
        raise NativeArgumentError(f"{name} has shape {tuple(size)}; the kernel takes a 2-D {shape or 'matrix'}.")
    dtype = tensor.dtype
    if dtype is not _FP32 and dtype is not _BF16:
        raise NativeArgumentError(
            f"{name} is {dtype}; the native kernels take float32 or bfloat16 matrices: cast it, or run the eager "
            "kernel (engine/kernels.py, engine/host_step.py)."
        )
    row_stride, col_stride = tensor.stride()
    if col_stride != 1 and size[1] > 1:
        raise NativeArgumentError(
            f"{name} has strides {(row_stride, col_stride)}: its rows must be contiguous (stride 1 along a row); pass "
            ".contiguous(), or a row block of a contiguous matrix."
        )
    if written and row_stride < size[1] and size[0] > 1:
        raise NativeArgumentError(f"{name} is written but its rows overlap (strides {(row_stride, col_stride)}).")
    return tensor.data_ptr(), row_stride, int(dtype is _BF16)


def _table(tensor: torch.Tensor, name: str, length: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU vector of ``length`` values of ``dtype``, contiguous (a strided one is copied: O(rows) or O(columns))."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cpu:
        raise NativeArgumentError(f"{name} must be a CPU tensor for the native kernels.")
    if tensor.dtype is not dtype or tensor.shape != (length,):
        raise NativeArgumentError(
            f"{name} is {tensor.dtype} {tuple(tensor.shape)}; the native kernel takes a [{length}] {dtype} vector."
        )
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _mask(tensor: torch.Tensor, cols: int) -> torch.Tensor:
    """``host_mask`` as fp32: a bool mask multiplies as 0 and 1 (what eager's promotion to float does)."""
    if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool:
        tensor = tensor.float()
    return _table(tensor, "host_mask", cols, _FP32)


def _int32(value: torch.Tensor | int) -> int:
    """``value.to(torch.int32)`` as an int (mod 2**32): a 0-d tensor of any dtype, or an int."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            value = value.to(torch.int32)
        value = int(value.item())
    return int(value) & 0xFFFFFFFF


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else max(1, threads)


class NativeKernels:
    """The native library's kernels for one instruction-set variant, with the eager functions' signatures.

    ``variant``: the code path every call takes (``"avx512_bf16"``, ``"avx512"``, ``"avx2"`` or ``"portable"``);
    ``path``: the cached library; ``build_seconds``: what this process spent building it (None: found built)."""

    def __init__(self, library: ctypes.CDLL, variant: str, number: int, path: Path, build_seconds: float | None):
        self._library = library
        self._number = number
        self.variant = variant
        self.path = path
        self.build_seconds = build_seconds

    def __repr__(self) -> str:
        return f"NativeKernels(variant={self.variant!r}, path={str(self.path)!r})"

    def _done(self, code: int) -> None:
        if code == -1:
            raise RuntimeError(f"the native variant {self.variant!r} does not run on this machine.")
        if code == -2:
            raise MemoryError("the native row_col_sums could not allocate its partial sums.")
        if code == -3:
            raise IndexError("a column index is out of range for the matrix (nothing was written).")

    # ------------------------------------------------------------------------------------- engine/host_step.py
    def adam_step_(
        self,
        grad2d: torch.Tensor,
        exp_avg2d: torch.Tensor,
        exp_avg_sq2d: torch.Tensor,
        row_r: torch.Tensor,
        col_r: torch.Tensor,
        scalars: torch.Tensor,
        stochastic: bool,
        *,
        threads: int | None = None,
    ) -> None:
        """``engine/host_step.py``'s ``adam_step_``: the moments in place, the step written over ``grad2d``."""
        self._adam(None, grad2d, exp_avg2d, exp_avg_sq2d, row_r, col_r, scalars, stochastic, threads)

    def adam_master_step_(
        self,
        master2d: torch.Tensor,
        grad2d: torch.Tensor,
        exp_avg2d: torch.Tensor,
        exp_avg_sq2d: torch.Tensor,
        row_r: torch.Tensor,
        col_r: torch.Tensor,
        scalars: torch.Tensor,
        stochastic: bool,
        *,
        threads: int | None = None,
    ) -> None:
        """``engine/host_step.py``'s ``adam_master_step_``: the moments and the fp32 master in place."""
        self._adam(master2d, grad2d, exp_avg2d, exp_avg_sq2d, row_r, col_r, scalars, stochastic, threads)

    def _adam(self, master2d, grad2d, exp_avg2d, exp_avg_sq2d, row_r, col_r, scalars, stochastic, threads) -> None:
        grad, grad_stride, grad_bf16 = _matrix(grad2d, "grad2d", None, written=master2d is None)
        shape = (rows, cols) = tuple(grad2d.shape)
        m, m_stride, m_bf16 = _matrix(exp_avg2d, "exp_avg2d", shape, written=True)
        v, v_stride, v_bf16 = _matrix(exp_avg_sq2d, "exp_avg_sq2d", shape, written=True)
        if m_bf16 != v_bf16:
            raise NativeArgumentError(
                f"exp_avg2d is {exp_avg2d.dtype} and exp_avg_sq2d {exp_avg_sq2d.dtype}: the native step takes moments "
                "of one dtype (the host formats' are); run the eager adam_step_ for a mixed pair."
            )
        master, master_stride = 0, 0
        if master2d is not None:
            master, master_stride, master_bf16 = _matrix(master2d, "master2d", shape, written=True)
            if master_bf16:
                raise NativeArgumentError("master2d is bfloat16: the native step keeps fp32 masters only.")
        if not isinstance(scalars, torch.Tensor) or scalars.dtype is not _FP32:
            scalars = torch.as_tensor(scalars).to(_FP32)  # eager rounds each one to fp32 too
        scalars = _table(scalars, "scalars", 11, _FP32)
        stochastic = bool(stochastic)
        if stochastic:  # eager reads the tables only to round stochastically
            row_r, col_r = _table(row_r, "row_r", rows, torch.int32), _table(col_r, "col_r", cols, torch.int32)
        if rows == 0 or cols == 0:
            return
        self._done(
            self._library.zf_adam_step(
                self._number, _threads(threads), rows, cols, master, master_stride, grad, grad_bf16, grad_stride,
                m, m_stride, v, v_stride, m_bf16, row_r.data_ptr() if stochastic else 0,
                col_r.data_ptr() if stochastic else 0, scalars.data_ptr(), int(stochastic),
            )
        )  # fmt: skip

    # ------------------------------------------------------------------------------------- engine/kernels.py
    def moves_fp32_(
        self,
        grad2d: torch.Tensor,
        weight2d: torch.Tensor,
        row_scale: torch.Tensor,
        col_scale: torch.Tensor,
        host_mask: torch.Tensor,
        eps: float,
        coefficient: float,
        keep: torch.Tensor | None,
        *,
        threads: int | None = None,
    ) -> None:
        """``engine/kernels.py``'s ``moves_fp32_``: the move added to the weights (a bf16 weight rounded to nearest,
        as ``add_`` rounds it)."""
        self._moves(grad2d, weight2d, row_scale, col_scale, host_mask, eps, coefficient, keep, 0, None, threads)

    def moves_bf16_(
        self,
        grad2d: torch.Tensor,
        weight2d: torch.Tensor,
        row_scale: torch.Tensor,
        col_scale: torch.Tensor,
        host_mask: torch.Tensor,
        eps: float,
        coefficient: float,
        keep: torch.Tensor | None,
        row_offset: int,
        seed: torch.Tensor,
        *,
        threads: int | None = None,
    ) -> None:
        """``engine/kernels.py``'s ``moves_bf16_``: the move added with stochastic rounding."""
        self._moves(
            grad2d, weight2d, row_scale, col_scale, host_mask, eps, coefficient, keep, row_offset, seed, threads
        )

    def _moves(self, grad2d, weight2d, row_scale, col_scale, host_mask, eps, coefficient, keep, row_offset, seed,
               threads) -> None:  # fmt: skip
        grad, grad_stride, grad_bf16 = _matrix(grad2d, "grad2d", None, written=False)
        rows, cols = shape = tuple(grad2d.shape)
        weight, weight_stride, weight_bf16 = _matrix(weight2d, "weight2d", shape, written=True)
        host_mask = _mask(host_mask, cols)
        row_scale, col_scale = _table(row_scale, "row_scale", rows, _FP32), _table(col_scale, "col_scale", cols, _FP32)
        keep_pointer = 0
        if keep is not None:
            if not isinstance(keep, torch.Tensor) or not keep.is_cpu or keep.numel() != 1:
                raise NativeArgumentError("keep must be None or a one-element CPU tensor for the native kernels.")
            if keep.dtype is not _FP32:
                keep = keep.to(_FP32)  # eager multiplies by it in fp32: the same value
            keep_pointer = keep.data_ptr()
        stochastic = seed is not None
        if rows == 0 or cols == 0:
            return
        self._done(
            self._library.zf_moves(
                self._number, _threads(threads), rows, cols, grad, grad_bf16, grad_stride, weight, weight_bf16,
                weight_stride, row_scale.data_ptr(), col_scale.data_ptr(), host_mask.data_ptr(), eps, coefficient,
                keep_pointer, int(stochastic),
                int(row_offset) if stochastic else 0, _int32(seed) if stochastic else 0,
            )
        )  # fmt: skip

    def landing_add_(
        self,
        weight2d: torch.Tensor,
        step2d: torch.Tensor,
        scale: float,
        row_offset: int,
        seed: torch.Tensor,
        *,
        threads: int | None = None,
    ) -> None:
        """``engine/kernels.py``'s ``landing_add_``: ``w <- w * scale + step``, bf16 weights rounded stochastically."""
        weight, weight_stride, weight_bf16 = _matrix(weight2d, "weight2d", None, written=True)
        rows, cols = shape = tuple(weight2d.shape)
        step, step_stride, step_bf16 = _matrix(step2d, "step2d", shape, written=False)
        if rows == 0 or cols == 0:
            return
        self._done(
            self._library.zf_landing(
                self._number, _threads(threads), rows, cols, weight, weight_bf16, weight_stride, step, step_bf16,
                step_stride, scale, int(row_offset), _int32(seed) if weight_bf16 else 0,
            )
        )  # fmt: skip

    def accumulate_bf16_(
        self,
        acc2d: torch.Tensor,
        grad2d: torch.Tensor,
        row_r: torch.Tensor,
        col_r: torch.Tensor,
        offset: torch.Tensor | int,
        first: bool,
        *,
        threads: int | None = None,
    ) -> None:
        """``engine/kernels.py``'s ``accumulate_bf16_``: ``acc <- round(acc + g)`` (``first``: ``round(g)``)."""
        acc, acc_stride, acc_bf16 = _matrix(acc2d, "acc2d", None, written=True)
        rows, cols = shape = tuple(acc2d.shape)
        grad, grad_stride, grad_bf16 = _matrix(grad2d, "grad2d", shape, written=False)
        row_r, col_r = _table(row_r, "row_r", rows, torch.int32), _table(col_r, "col_r", cols, torch.int32)
        if rows == 0 or cols == 0:
            return
        self._done(
            self._library.zf_accumulate(
                self._number, _threads(threads), rows, cols, acc, acc_bf16, acc_stride, grad, grad_bf16, grad_stride,
                row_r.data_ptr(), col_r.data_ptr(), _int32(offset), int(bool(first)),
            )
        )  # fmt: skip

    def row_col_sums(
        self, grad2d: torch.Tensor, host_mask: torch.Tensor, *, threads: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``engine/kernels.py``'s ``row_col_sums``: ``([rows], [cols])`` fp32 sums of ``g**2 * host_mask``, in an
        order fixed by the shape (not ATen's: equal to float rounding), the same bits for every thread count."""
        grad, grad_stride, grad_bf16 = _matrix(grad2d, "grad2d", None, written=False)
        rows, cols = grad2d.shape
        host_mask = _mask(host_mask, cols)
        row_sums, col_sums = torch.zeros(rows, dtype=_FP32), torch.zeros(cols, dtype=_FP32)
        if rows == 0 or cols == 0:
            return row_sums, col_sums
        self._done(
            self._library.zf_row_col_sums(
                self._number, _threads(threads), rows, cols, grad, grad_bf16, grad_stride, host_mask.data_ptr(),
                row_sums.data_ptr(), col_sums.data_ptr(),
            )
        )  # fmt: skip
        return row_sums, col_sums

    # ------------------------------------------------------------------------------------- engine/device.py
    def gather_columns(
        self, grad2d: torch.Tensor, selected: torch.Tensor, out: torch.Tensor, *, threads: int | None = None
    ) -> None:
        """``engine/device.py``'s ``gather_columns``: ``out <- grad2d[:, selected]`` in fp32 (``index_select``'s
        bits: a bf16 gradient widened exactly)."""
        self._columns(grad2d, selected, out, 0, threads)

    def write_columns(
        self, weight2d: torch.Tensor, selected: torch.Tensor, master: torch.Tensor, *, threads: int | None = None
    ) -> None:
        """``engine/device.py``'s ``write_columns``: ``weight2d[:, selected] <- master`` in the weights' dtype
        (``index_copy_`` of ``master.to(dtype)``: a bf16 weight rounded to nearest even)."""
        self._columns(weight2d, selected, master, 1, threads)

    def _columns(self, matrix2d, selected, packed2d, write: int, threads) -> None:
        names = ("weight2d", "master") if write else ("grad2d", "out")
        matrix, matrix_stride, matrix_bf16 = _matrix(matrix2d, names[0], None, written=bool(write))
        rows, cols = matrix2d.shape
        if not isinstance(selected, torch.Tensor) or not selected.is_cpu or selected.dtype is not torch.int64:
            raise NativeArgumentError("selected must be a CPU int64 tensor of column indices for the native kernels.")
        if selected.dim() != 1 or (selected.numel() > 1 and selected.stride(0) != 1):
            raise NativeArgumentError(f"selected has shape {tuple(selected.shape)}; pass a contiguous 1-D tensor.")
        k = selected.numel()
        packed, packed_stride, packed_bf16 = _matrix(packed2d, names[1], (rows, k), written=not write)
        if packed_bf16:
            raise NativeArgumentError(f"{names[1]} is bfloat16: the native kernel packs the columns in fp32.")
        if rows == 0 or k == 0:
            return
        self._done(
            self._library.zf_columns(
                self._number, _threads(threads), write, rows, cols, matrix, matrix_bf16, matrix_stride,
                selected.data_ptr(), k, packed, packed_stride,
            )
        )  # fmt: skip
