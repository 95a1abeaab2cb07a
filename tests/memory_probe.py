"""What an engine holds against what its processes really hold: the engine's own counts, ``engine/budget.py``'s
formulas from the shapes alone, the ``/dev/shm`` segments the process maps and the host worker's resident shared
memory. Used in one process (``test_budget.py``) and in every rank of the data-parallel and FSDP2 fits
(``ddp_script.py``)."""

from __future__ import annotations

import os

from lightning_zenflow.engine.budget import MatrixShape, VectorShape, device_bytes, host_bytes


def shared_segments() -> dict[str, int]:
    """The shared-memory segments mapped into this process (from /proc/self/maps, unlinked ones too): name -> bytes."""
    segments: dict[str, int] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) > 5 and fields[5].startswith("/dev/shm/"):
                start, stop = (int(x, 16) for x in fields[0].split("-"))
                segments[fields[5]] = segments.get(fields[5], 0) + stop - start
    return segments


def shared_rows(engine) -> list:  # noqa: ANN001
    """Every shared host row the engine counts."""
    rows = [
        row
        for host in engine.host_buffers
        for row in (host.exp_avg, host.exp_avg_sq, host.step_shared, *host.windows, host.master)
        if row is not None
    ]
    return rows + list(engine.unselected_shared)


def shapes(engine) -> tuple[list[MatrixShape], list[VectorShape]]:  # noqa: ANN001
    """The shapes of the engine's parameters as one rank sees them (FSDP2: the local shards, with the whole rows
    the strategy told the interim moves)."""
    shard_rows = engine.interim.shard_rows if engine.interim is not None else {}
    matrices = [
        MatrixShape(
            slot.rows,
            slot.cols,
            slot.host_rows,
            slot.param.element_size(),
            group.index,
            shard_rows[slot.name][1] if slot.name in shard_rows else None,
        )
        for group in engine.layout
        for slot in group.matrices
    ]
    vectors = [
        VectorShape(s.param.numel(), s.param.element_size()) for group in engine.layout for s in group.device_only
    ]
    return matrices, vectors


def page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def resident_shared(pid: int) -> int | None:
    """A process's resident shared memory (``RssShmem``), in bytes; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def probe(engine, before: set[str]) -> dict[str, int | None]:  # noqa: ANN001
    """The counts, the formulas and what the processes hold, for a started engine after its first selection.
    ``before``: the segments this process mapped before the engine started (left out of ``mapped``)."""
    matrices, vectors = shapes(engine)
    page = page_size()
    rows = shared_rows(engine)
    return {
        "counted_host": engine.host_bytes(),
        "budget_host": host_bytes(matrices, engine.config, engine.host_format, groups=len(engine.layout)),
        "counted_device": engine.device_bytes(),
        "budget_device": device_bytes(
            matrices, vectors, engine.config, engine.host_format, engine.device.type, engine.interim is not None
        ),
        "rows": sum(row.nbytes for row in rows),
        "rows_in_pages": sum(-(-row.nbytes // page) * page for row in rows),
        "mapped": sum(size for name, size in shared_segments().items() if name not in before),
        "worker_resident_shared": resident_shared(engine.worker_pid),
        "elements": sum(m.host_numel for m in matrices),
        "page": page,
    }


def assert_holds_what_it_counts(held: dict[str, int | None]) -> None:
    """One process's :func:`probe`: the counts equal the formulas byte for byte, every counted host byte is a
    shared row, the process maps those rows and one page more (the worker's heartbeat), and the host worker holds
    them resident (it has run an update over every row) and no more than that."""
    assert held["counted_host"] == held["budget_host"], held
    assert held["counted_device"] == held["budget_device"], held
    assert held["rows"] == held["counted_host"], held
    assert held["rows_in_pages"] <= held["mapped"] <= held["rows_in_pages"] + held["page"], held
    resident = held["worker_resident_shared"]
    if resident is not None:
        # the worker need not touch the tiny rows (the step count, the column lists): a few pages less
        assert held["rows_in_pages"] - 4 * held["page"] <= resident <= held["mapped"] + 64 * held["page"], held
