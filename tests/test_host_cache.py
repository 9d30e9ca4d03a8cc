"""partita's caching host allocator (partita.platform.host_cache): reuse, its memory bound,
fallbacks.

Allocation counters are process-wide, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from partita.testing import run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def run_py(body: str, **env: str) -> dict:
    """Runs ``body`` in a fresh interpreter; it prints one JSON object on its last line."""
    code = (
        "import json, resource, torch\nfrom partita.platform import host_cache as hc\n"
        + textwrap.dedent(body)
    )
    out = run_python(code, timeout=240, **env)
    return json.loads(out.splitlines()[-1])


def test_freed_block_is_reused_and_small_ones_bypass() -> None:
    out = run_py(
        """
        assert hc.install_host_cache(), hc.why_not()
        a = torch.empty(3 << 20)  # 12 MiB
        ptr = a.data_ptr()
        del a
        before = hc.host_cache_stats()
        b = torch.ones(3 << 20)
        small = torch.ones(1000)  # 4 KB: glibc's heap
        after = hc.host_cache_stats()
        print(json.dumps({"same": b.data_ptr() == ptr, "hits": after.hits - before.hits,
                          "misses": after.misses - before.misses,
                          "live": after.live_bytes - before.live_bytes,
                          "sum": float(b.sum()), "small": float(small.sum())}))
        """
    )
    assert out["same"] and out["hits"] == 1 and out["misses"] == 0
    assert out["live"] == 12 << 20  # the small tensor is not counted
    assert out["sum"] == 3 << 20 and out["small"] == 1000.0


def test_mapped_total_stays_within_headroom_of_live_peak() -> None:
    # Sizes that never fit each other's blocks (more than 1/8 apart), freed in shifting orders.
    out = run_py(
        """
        assert hc.install_host_cache(), hc.why_not()
        sizes = [1 << 18, 3 << 18, 5 << 18, 9 << 18, 17 << 18]  # floats: 1-17 MiB
        for step in range(40):
            live = [torch.empty(sizes[(step + i) % 5]) for i in range(step % 4 + 1)]
            del live
        s = hc.host_cache_stats()
        hc.empty_host_cache()
        e = hc.host_cache_stats()
        print(json.dumps({"peak_mapped": s.peak_mapped_bytes, "released": e.released_bytes,
                          "idle_after_empty": e.idle_bytes, "hits": s.hits,
                          "misses": s.misses}))
        """,
        PARTITA_HOST_CACHE_HEADROOM="0",
    )
    # With headroom 0 nothing is mapped beyond the largest live set: four blocks at most,
    # the four largest sizes (floats, 4 bytes each).
    largest_live = 4 * ((17 + 9 + 5 + 3) << 18)
    assert out["peak_mapped"] <= largest_live
    assert out["released"] > 0 and out["idle_after_empty"] == 0
    assert out["hits"] > 0 and out["misses"] > 0


def test_mapped_total_within_headroom_when_blocks_serve_smaller_requests() -> None:
    """Idle 8 MiB blocks serve 7.2 MiB requests (within the 1/8 reuse slack); new 1.2 MiB
    requests then raise the peak with no idle block left to unmap. The slack of the blocks in
    use must not push the mapped total past 1.05x the peak requested (it reached 1.096x)."""
    out = run_py(
        """
        assert hc.install_host_cache(), hc.why_not()
        floats = lambda mib: round(mib * (1 << 20)) // 4
        first = [torch.empty(floats(8)) for _ in range(10)]
        del first
        second = [torch.ones(floats(7.2)) for _ in range(10)]
        second += [torch.ones(floats(1.2)) for _ in range(10)]
        s = hc.host_cache_stats()
        # Every element still reads back (a trimmed block keeps what its tensor uses).
        ok = all(float(t.sum()) == t.numel() for t in second)
        total = sum(t.numel() * 4 for t in second)
        del second
        # Then random churn: sizes of 1-20 MiB (most not page multiples), up to 12 live.
        gen = torch.Generator().manual_seed(0)
        live = []
        for _ in range(400):
            if len(live) == 12 or (live and torch.rand(1, generator=gen).item() < 0.45):
                live.pop(int(torch.randint(len(live), (1,), generator=gen)))
            else:
                live.append(torch.empty(int(torch.randint(1 << 18, 5 << 20, (1,), generator=gen))))
        e = hc.host_cache_stats()
        print(json.dumps({"peak_mapped": s.peak_mapped_bytes, "ok": ok, "hits": s.hits,
                          "peak_requested": s.peak_requested_bytes, "total": total,
                          "churn": [e.peak_mapped_bytes, e.peak_requested_bytes, e.hits,
                                    e.released_bytes - s.released_bytes]}))
        """
    )
    assert out["hits"] == 10  # the 8 MiB blocks did serve the 7.2 MiB requests
    assert out["ok"] and out["peak_requested"] == out["total"]
    assert out["peak_mapped"] <= 1.05 * out["peak_requested"], out["peak_mapped"] / out["total"]
    peak_mapped, peak_requested, hits, released = out["churn"]
    assert hits > out["hits"] and released > 0, out["churn"]  # reuse and unmapping both ran
    assert peak_mapped <= 1.05 * peak_requested, peak_mapped / peak_requested


def test_repeated_step_does_not_page_fault_again() -> None:
    body = """
        hc.install_host_cache()
        import partita.platform.accelerator as acc
        acc.configure_host_allocator()
        def step():
            a = torch.ones(16 << 20)  # 64 MiB, written: every page touched
            b = torch.ones(4 << 20)
            return float(a[-1] + b[-1])
        step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        print(json.dumps({"faults": faults, "installed": hc.host_cache_stats() is not None}))
        """
    cached = run_py(body)
    plain = run_py(body, PARTITA_HOST_CACHE="0")
    pages = 5 * (80 << 20) // 4096  # what 5 fresh mappings of both tensors fault in
    assert cached["installed"] and not plain["installed"]
    assert plain["faults"] >= pages // 2, plain  # glibc maps (and faults) them every time
    assert cached["faults"] < pages // 50, cached


def test_disabled_by_environment() -> None:
    out = run_py(
        """
        ok = hc.install_host_cache()
        print(json.dumps({"ok": ok, "why": hc.why_not(), "stats": hc.host_cache_stats()}))
        """,
        PARTITA_HOST_CACHE="0",
    )
    assert not out["ok"] and "PARTITA_HOST_CACHE=0" in out["why"] and out["stats"] is None


def test_no_compiler_falls_back(tmp_path: os.PathLike) -> None:
    out = run_py(
        """
        ok = hc.install_host_cache()
        print(json.dumps({"ok": ok, "why": hc.why_not()}))
        """,
        PATH=str(tmp_path),
        CXX="",
        PARTITA_CACHE_DIR=str(tmp_path),
    )
    assert not out["ok"] and "compiler" in out["why"]


def test_forked_child_allocates() -> None:
    out = run_py(
        """
        import os, threading
        hc.install_host_cache()
        # Every torch call the threads make, once, before any fork: the first call of a torch
        # function initialises its C++ argument parser (a static) and registers its destructor
        # with glibc's atexit, under glibc's __exit_funcs_lock. A fork while the churning thread
        # held that lock left the child waiting on it forever in its first torch.ones (gdb,
        # 1 run in ~20 under load, 2026-12-07): glibc's hazard, not the cache's, and not what
        # this test is about. Small sizes keep the parent off OpenMP (serial kernels).
        torch.empty(1 << 10)
        float(torch.ones(1 << 10).sum())
        stop = False
        def churn():  # another thread allocating while the main thread forks
            while not stop:
                torch.empty(1 << 20)
        t = threading.Thread(target=churn)
        t.start()
        codes = []
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                x = torch.ones(2 << 20)
                os._exit(0 if float(x.sum()) == 2 << 20 else 1)
            codes.append(os.waitpid(pid, 0)[1])
        stop = True
        t.join()
        print(json.dumps({"codes": codes}))
        """
    )
    assert out["codes"] == [0] * 20
