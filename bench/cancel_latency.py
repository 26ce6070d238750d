"""Cancel latency: ``workpump.cancel(id)`` -> the running handler sees ``work.cancelled``.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/workpump_bench_cancel \
        python -m bench.cancel_latency --runs 200

The database is dropped and created and migrated; one ``runworkpump`` process runs
bench/app at the default settings (so the 300 s lease keeps the renewal fallback out of
the way: what is measured is the NOTIFY path). For each run one ``bench.cancel`` row is
sent, and once its handler has marked its start this process calls ``workpump.cancel``
(autocommit: it commits on return) and waits for the handler's mark that
``work.cancelled`` turned true. Both marks and the cancel's start are CLOCK_MONOTONIC of
this machine (bench/marks.py), so the difference is the latency. Prints p50, p99 and max
in milliseconds, from the call of cancel() and from its return (the commit). The first
``--warmup`` runs (5) are not counted: they open connections and warm caches.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_marks(path: Path) -> dict[tuple[str, int], list[str]]:
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        kind, key, *rest = line.split()
        found[(kind, int(key))] = rest
    return found


def wait_for(path: Path, kind: str, key: int, timeout: float) -> list[str]:
    tick = threading.Event()
    for _ in range(int(timeout / 0.001)):
        found = read_marks(path).get((kind, key))
        if found is not None:
            return found
        tick.wait(0.001)
    raise TimeoutError(f"no {kind} mark for run {key} within {timeout} s")


def main() -> None:
    from bench.periodic_lateness import percentile, recreate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]
    recreate(url)
    marks = Path(tempfile.mkdtemp(prefix="wp-cancel-")) / "marks"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WORKPUMP_JSON": os.environ.get("WORKPUMP_JSON", "{}"),
        "BENCH_MARKS": str(marks),
    }
    django = [sys.executable, "-m", "django"]
    settings = "--settings=bench.settings"
    subprocess.run([*django, "migrate", "-v0", settings], cwd=ROOT, env=env, check=True)
    worker = subprocess.Popen(
        [*django, "runworkpump", settings, "--service-name", "cancel-bench"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    os.environ.setdefault("WORKPUMP_JSON", "{}")
    import django as django_module

    django_module.setup()
    import django_workpump as workpump
    from bench.marks import now_ns

    from_call: list[float] = []
    from_commit: list[float] = []
    reasons: set[str] = set()
    try:
        for run in range(args.warmup + args.runs):
            work_id = workpump.send("bench.cancel", {"i": run})
            wait_for(marks, "cstart", run, 60)
            called = now_ns()
            result = workpump.cancel(work_id)
            committed = now_ns()
            assert list(result) == [work_id] and result.running == [work_id], result
            seen_ns, reason = wait_for(marks, "cseen", run, 60)
            reasons.add(reason)
            if run < args.warmup:
                continue
            from_call.append((int(seen_ns) - called) / 1e6)
            from_commit.append((int(seen_ns) - committed) / 1e6)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    print(
        f"cancel_latency runs={len(from_call)} reasons={','.join(sorted(reasons))} "
        f"from_call_ms p50={percentile(from_call, 50):.2f} p99={percentile(from_call, 99):.2f} "
        f"max={max(from_call):.2f} "
        f"from_commit_ms p50={percentile(from_commit, 50):.2f} "
        f"p99={percentile(from_commit, 99):.2f} max={max(from_commit):.2f}"
    )


if __name__ == "__main__":
    main()
