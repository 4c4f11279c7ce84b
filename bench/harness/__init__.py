"""What benchmarks and tests share to drive a real server: installed with the package (the
``server`` extra), so ``pip install 'batchgate[server]'`` runs every benchmark and a checkout
without its test tree runs ``gpu_check``.

- ``server``: the one server harness (a ``batchgate serve`` process in any mode, or the
  one-process gateway on a thread of this process), its ports, ``/proc`` pid and log;
- ``repository``: model folders written from a ``ModelConfig``;
- ``metrics``: ``/metrics`` read and parsed by prometheus_client;
- ``memory``: a process's peak resident memory over a block, from ``/proc``.

The tests use these from here too (``tests/support`` holds only what tests alone need).
"""
