"""``batchgate bench``: a load generator for any KServe v2 gRPC server that measures honestly.

Closed loop (a concurrency sweep) and open loop (constant, Poisson or bursty arrivals), with
latency measured from each request's *intended* send time, so a server that stalls cannot hide
its queueing (coordinated omission). Requests are serialized once, before the run; responses
are never decoded. The modules, in the order a run uses them:

- ``workload``: the models' inputs from ModelMetadata / ModelConfig (or an ``.npz``), turned
  into a few pre-serialized request variants;
- ``arrivals``: intended send times for the open loop;
- ``plan``: the steps of a run (warm-up, measured slices, ``--compare`` alternation) and their
  split across worker processes;
- ``driver``: the asyncio engine that sends, on a thread or in spawned worker processes;
- ``stats``: counts, percentiles, goodput and SLO attainment from the records;
- ``scrape``: the server's ``/metrics`` before, during and after each step;
- ``report``: the JSON layout (``SCHEMA_VERSION``) and the rich tables; ``plots``: PNGs;
- ``cli``: the command line, and ``main`` that ties them together.

Only grpcio, protobuf, numpy, prometheus_client and rich are needed (matplotlib for
``--plot``): no torch, nothing of ``server/`` or ``batcher/``.
"""
