"""The server's log stays one JSON object per line whatever writes it, from any thread."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Every kind of writer a server process has, from many threads at once, with a switch
# interval short enough that a thread is often preempted in the middle of a line.
WRITERS = textwrap.dedent("""
    import io, logging, sys, threading
    import structlog
    from batchgate.server.supervisor.child_logs import ChildLogs
    from batchgate.server.logs import announce, configure_logging

    sys.setswitchinterval(1e-6)
    configure_logging("debug", "json")
    children = ChildLogs("debug", "json")
    children.open()
    PAD = "x" * 3000
    ROUNDS = 200

    def structured(i):
        log = structlog.get_logger()
        for n in range(ROUNDS):
            log.info("structured", thread=i, n=n, pad=PAD)

    def stdlib(i):
        for n in range(ROUNDS):
            logging.getLogger("library").warning("stdlib %d %d %s", i, n, PAD)

    def ready(i):
        for n in range(ROUNDS):
            announce("ready_line", thread=i, n=n, pad=PAD)

    def child(i):
        lines = b"".join(b'{"event": "child", "n": %d, "pad": "%s"}\\n' % (n, PAD.encode())
                         for n in range(ROUNDS))
        children.read(io.BytesIO(lines), "never", lambda event: None)

    threads = [threading.Thread(target=f, args=(i,)) for i in range(2)
               for f in (structured, stdlib, ready, child)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
""")


def test_lines_from_every_writer_and_thread_never_interleave():
    result = subprocess.run([sys.executable, "-c", WRITERS], cwd=ROOT, capture_output=True,
                            timeout=120, check=True)
    lines = result.stderr.splitlines()
    broken = [line[:200] for line in lines if not _is_object(line)]
    assert not broken, f"{len(broken)} of {len(lines)} lines are not one JSON object"
    events = [json.loads(line)["event"] for line in lines]
    # 2 threads of each writer, 200 lines each.
    assert events.count("structured") == events.count("ready_line") == 400
    assert events.count("child") == 400
    assert sum(e.startswith("stdlib") for e in events) == 400


def _is_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
