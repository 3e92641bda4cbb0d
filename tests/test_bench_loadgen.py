"""Load-generator processes: started, ready, their import heap exempt from the garbage collector."""
import json
from pathlib import Path

from servekit.benchmarks.bench.loadgen import LoadGenerator


def test_load_processes_freeze_their_import_heap(tmp_path: Path) -> None:
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text('{"text": "x"}\n')
    gen = LoadGenerator(tmp_path / "lg", "http://127.0.0.1:9", "/predictions/m", bodies, "application/json",
                        {}, timeout_s=5, max_inflight=10)
    try:
        gen.ensure(2)
        ready = [json.loads((d / "ready").read_text()) for d in gen.dirs]
        assert len({r["pid"] for r in ready}) == 2
        # locust + gevent + numpy: tens of thousands of objects no full collection walks again
        assert all(r["gc_frozen_objects"] > 20_000 for r in ready), ready
    finally:
        gen.close()


def test_host_cpu_counts_the_load_generator_and_the_host() -> None:
    """A process spinning on one core for 1.5 s: ~1 load-generator core, the host at least that busy."""
    import os
    import subprocess
    import sys
    import time

    from servekit.benchmarks.bench.server_metrics import HostCPU

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        time.sleep(0.3)
        host = HostCPU()
        host.start([spin.pid, 999_999_999])  # a pid that does not exist adds nothing
        time.sleep(1.5)
        fig = host.stop()
    finally:
        spin.kill()
        spin.wait()
    assert fig["cpu_count"] == os.cpu_count()
    # ~1 core; the lower bound leaves room for a shared VM's stolen time
    assert 0.4 <= fig["loadgen_cores"] <= 1.1, fig
    assert 100 * 0.4 / os.cpu_count() <= fig["busy_pct"] <= 100, fig
    assert HostCPU().stop() == {}  # never started: no figures
